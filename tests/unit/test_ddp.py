"""A peer that dies mid-allreduce must not take the survivor with it (torchft 0.2.0's gradient hook
asserts in that case; ``training.ddp`` guards it); the buffers replica groups average; a group alone in its
quorum runs no collective."""

from __future__ import annotations

import copy
import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torchft import DistributedDataParallel, ProcessGroupGloo
from torchft import Manager as TorchftManager
from torchft.manager import _ManagedWork

from trainyard import algorithms, servers
from trainyard.lighthouse import start_lighthouse
from trainyard.spec import Algorithm, Hyperparameters
from trainyard.training.ddp import BufferSync, SafeDistributedDataParallel, StepForward, any_group
from trainyard.training.heal_transport import HealTransport, confine_manager_server, group_store


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


class Done:
    """torchft's managed work for an allreduce that completed: what the hook and ``BufferSync`` read of it."""

    def __init__(self, tensor):
        self._fut = torch.futures.Future()
        self._fut.set_result(tensor)  # (the average of equal values)

    def wait(self):  # whether the collective succeeded
        return True

    def get_future(self):
        return self


class Quorum:
    """A manager whose step's quorum has ``participants`` groups (this one among them), its allreduces recorded."""

    def __init__(self, participants: int = 2):
        self.reduced = []
        self.participants = participants

    def num_participants(self):
        return self.participants

    def is_participating(self):
        return True

    def errored(self):
        return None

    def allreduce(self, tensor, **_):
        self.reduced.append(tensor.clone())
        return Done(tensor)


def test_only_buffers_a_forward_pass_can_change_are_averaged():
    x, y = torch.randn(32, 4).numpy(), torch.randint(0, 3, (32,)).numpy()
    builtin, _ = algorithms.build(Algorithm(builtin="mlp-classifier"), Hyperparameters(hidden_sizes=[8]), x, y, 3)
    manager = Quorum()
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
    alone = Quorum(participants=1)
    BufferSync(alone, with_batch_norm).reduce()
    assert not alone.reduced  # a quorum of one: the average is its own


@pytest.fixture
def lone_manager(tmp_path):
    """A real torchft Manager whose group is the only one in its lighthouse's quorum, made as the trainer makes
    its own (synchronous quorum, gloo, the store and manager server on 127.0.0.1)."""
    lighthouse, addr = start_lighthouse(tmp_path, 1)
    confine_manager_server()
    store = group_store()  # (kept: its server closes with it)
    manager = TorchftManager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=lambda state: None,
        state_dict=dict,
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=addr,
        replica_id="lone-g0",
        hostname="127.0.0.1",
        checkpoint_transport=HealTransport(timeout=timedelta(seconds=30)),
    )
    try:
        yield manager
    finally:
        manager.shutdown(wait=False)
        servers.stop_process(lighthouse)


def test_a_group_alone_in_its_quorum_trains_as_through_ddp_with_no_collective(lone_manager, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    twin = copy.deepcopy(model)
    through_ddp = SafeDistributedDataParallel(lone_manager, model)
    alone = StepForward(lone_manager, twin)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, twin)]
    reduced = []
    allreduce = lone_manager.allreduce
    monkeypatch.setattr(lone_manager, "allreduce", lambda t, **kw: reduced.append(t.numel()) or allreduce(t, **kw))
    loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    for _ in range(3):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        lone_manager.start_quorum()
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss_fn(through_ddp(x), y).sum().backward()
        assert reduced, "the DDP path averages its gradients over the quorum (of one)"
        reduced.clear()
        assert alone() is twin
        loss_fn(alone()(x), y).sum().backward()
        assert any_group(lone_manager, True, torch.device("cpu")) is True
        assert any_group(lone_manager, False, torch.device("cpu")) is False
        assert not reduced  # no collective: neither the gradients nor the vote
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)  # averaged over one group: its own, to the bit
        assert lone_manager.should_commit()
        for optimizer in optimizers:
            optimizer.step()
    assert lone_manager.current_step() == 3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


class SometimesHead(torch.nn.Module):
    """A model whose second layer only some steps use (a conditional head, an expert no row was routed to)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(3, 3)

    def forward(self, x, use_b=True):
        out = self.a(x)
        return self.b(out) if use_b else out


def test_a_group_that_was_alone_goes_through_ddp_again_when_a_peer_joins():
    manager, model = Quorum(), SometimesHead()
    forward = StepForward(manager, model)
    x = torch.randn(5, 4)
    for peers, use_b in ((0, True), (1, False), (0, True), (1, True), (1, False), (0, False), (1, True)):
        manager.participants = 1 + peers
        manager.reduced.clear()
        model.zero_grad(set_to_none=True)
        module = forward()
        assert (module is model) == (peers == 0)
        module(x, use_b).sum().backward()  # a parameter a lone step used and this one does not: no error
        assert bool(manager.reduced) == (peers > 0)  # gradients averaged only with a peer
        assert (model.b.weight.grad is not None) == use_b
        assert model.a.weight.grad is not None
