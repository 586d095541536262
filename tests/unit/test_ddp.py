"""A peer that dies mid-allreduce must not take the survivor with it (torchft 0.2.0's gradient hook
asserts in that case; ``training.ddp`` guards it)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torchft import DistributedDataParallel
from torchft.manager import _ManagedWork

from trainyard.training.ddp import SafeDistributedDataParallel


class ResetByPeer(dist._Work):
    """A gloo allreduce whose peer died: waiting on it raises, as gloo does."""

    def wait(self, timeout=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")

    def get_future(self):
        return torch.futures.Future()


class Manager:
    """What the hook and torchft's managed work use of a Manager, with a real ``_ManagedWork``."""

    def __init__(self):
        self._logger = logging.getLogger("test-manager")
        self.error = None

    def report_error(self, e):
        self.error = e

    def errored(self):
        return self.error

    def wrap_future(self, fut, default):
        return fut

    def allreduce(self, tensor):
        work = _ManagedWork(self, ResetByPeer(), tensor)
        work.get_future().then(lambda fut: fut.value())  # as torchft chains its averaging callback
        return work


class Bucket:
    def __init__(self, grads):
        self.grads = grads

    def buffer(self):
        return self.grads


def test_torchft_hook_dies_when_a_peer_breaks_the_allreduce():
    # The bug the guard is for; if a torchft release fixes it, this fails and the guard can go.
    with pytest.raises(AssertionError):
        DistributedDataParallel._comm_hook(Manager(), Bucket(torch.ones(3)))


def test_the_safe_hook_skips_the_step_and_lives():
    manager, grads = Manager(), torch.arange(3.0)
    fut = SafeDistributedDataParallel._comm_hook(manager, Bucket(grads))
    assert torch.equal(fut.wait(), grads)  # its own gradients; the step is not committed
    assert "Connection reset by peer" in str(manager.errored())
