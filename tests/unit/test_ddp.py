"""A peer that dies mid-allreduce must not take the survivor with it (torchft 0.2.0's gradient hook
asserts in that case; ``training.ddp`` guards it); the buffers replica groups average."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torchft import DistributedDataParallel
from torchft.manager import _ManagedWork

from trainyard import algorithms
from trainyard.spec import Algorithm, Hyperparameters
from trainyard.training.ddp import BufferSync, SafeDistributedDataParallel


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


class Averaging:
    """A quorum's allreduce of one group: the average is the group's own."""

    def __init__(self):
        self.reduced = []

    def allreduce(self, tensor):
        self.reduced.append(tensor.clone())
        return self

    def wait(self):  # (torchft's managed work: whether the collective succeeded)
        return True


def test_only_buffers_a_forward_pass_can_change_are_averaged():
    x, y = torch.randn(32, 4).numpy(), torch.randint(0, 3, (32,)).numpy()
    builtin, _ = algorithms.build(Algorithm(builtin="mlp-classifier"), Hyperparameters(hidden_sizes=[8]), x, y, 3)
    manager = Averaging()
    sync = BufferSync(manager, builtin)
    sync.reduce()
    assert len(list(builtin.buffers())) == 2  # its fixed input scaling
    assert not sync.buffers and not manager.reduced  # averaged by no allreduce
    with_batch_norm = torch.nn.Sequential(builtin, torch.nn.BatchNorm1d(3))
    sync = BufferSync(manager, with_batch_norm)
    norm = with_batch_norm[1]
    assert [b.data_ptr() for b in sync.buffers] == [norm.running_mean.data_ptr(), norm.running_var.data_ptr()]
    sync.reduce()
    assert len(manager.reduced) == 1 and manager.reduced[0].numel() == 6
