"""torchft's DistributedDataParallel, with its gradient hook safe when a peer dies mid-allreduce, and
the step's collectives left out while a group is its quorum's only member.

In torchft 0.2.0 the hook asserts on the managed future's inner future, which is only set once the
collective completes. When a peer's death breaks the collective first (gloo: "Connection reset by
peer"), the manager has already recorded the error and will not commit the step, but the assert
kills the survivor: the one group the job needed to heal from. Here that case returns this group's
own gradients instead; they are discarded with the step, and the next quorum goes on without the
dead peer.

A group alone in its step's quorum (a one-group job, or the last live group) has nobody to average with:
torchft sums over a process group of one and divides by one, which returns every value as it was. So such a
step runs no collective (``alone``): its forward goes through the model itself, not DDP (``StepForward``), and
the buffers and the stop vote are this group's own. On CPU the collectives and DDP's bookkeeping (its search for
unused parameters, gradients copied into buckets and back) took about 0.5 ms of a 2.4 ms step of the built-in
classifier in one process (``benchmarks/sifting.py``'s digits); the next step with a peer in the quorum goes
through DDP again.
"""

# No ``from __future__ import annotations``: torch checks the hook's annotations as objects.
import torch
import torch.distributed as dist
from torchft import DistributedDataParallel, Manager


def alone(manager: Manager) -> bool:
    """Whether this group is the whole of the step's quorum. With the trainer's Manager (a synchronous quorum that
    heals a behind member before the step, torchft's default world size mode with no spares) every member of the
    quorum takes part in the step, so one participant is a process group of one. (With ``use_async_quorum``, a
    start_quorum that does not heal, or spares, a quorum can hold members that do not take part: this would be
    wrong there.)"""
    return manager.num_participants() == 1 and manager.is_participating()


class SafeDistributedDataParallel(DistributedDataParallel):
    """``torchft.DistributedDataParallel`` that survives a collective broken by a dying peer."""

    @staticmethod
    def _comm_hook(state: Manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        work = state.allreduce(bucket.buffer())
        work.wait()  # reports a failure to the manager rather than raising
        inner = getattr(work.get_future(), "_fut", None)
        if inner is not None:
            return inner
        if not state.errored():  # not the case this guards: keep torchft's own failure
            raise RuntimeError("torchft allreduce returned no future, and the manager recorded no error")
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


class StepForward:
    """What a step's forward runs through: the model itself while the group is alone in the step's quorum (its
    gradients are then its own), else DDP (``SafeDistributedDataParallel``), which averages them over the quorum.

    The DDP wrapper is dropped while the group is alone and made afresh when a peer joins: its reducer's autograd
    hooks sit on the parameters and mark the ones a backward used even for a backward through the bare model, and
    only a backward through DDP clears those marks. A step through an old wrapper after lone steps then found a
    parameter marked used with no gradient (an error, for a model that leaves some parameter unused in a step:
    a conditional head, an expert no row went to). A dropped wrapper's reducer takes its hooks with it."""

    def __init__(self, manager: Manager, model: torch.nn.Module):
        self.manager, self.model = manager, model
        self._ddp: SafeDistributedDataParallel | None = None

    def __call__(self) -> torch.nn.Module:
        if alone(self.manager):
            self._ddp = None
            return self.model
        if self._ddp is None:
            self._ddp = SafeDistributedDataParallel(self.manager, self.model)
        return self._ddp


class BufferSync:
    """A model's floating-point buffers (BatchNorm's running statistics) averaged over the step's quorum.

    torchft's DDP averages gradients only: buffers a forward pass updates drifted apart between groups, each
    from its own batches, so the groups validated different models (and could stop at different epochs) and
    ended with different states. As DDP's ``broadcast_buffers`` keeps them equal within a group, this keeps
    them equal across groups: each step a copy is averaged before the step's vote (a reduction that failed
    fails the step) and applied once the step commits. Integer buffers (``num_batches_tracked``) are left:
    they count this group's forward passes, redone steps included. So are the buffers of a module that
    declares ``buffers_fixed = True`` (a hook a user's module may set too): no forward pass changes them, as
    the built-ins' fixed scaling (``algorithms.Affine``). A model with no others (the built-ins) costs nothing:
    no allreduce a step. (Averaged, such a buffer also drifted: torchft sums and then divides, and three
    equal float32 values summed and divided by 3 differ from the value in its last bit about one time in six.)
    """

    def __init__(self, manager: Manager, model: torch.nn.Module):
        self.manager = manager
        fixed = {id(b) for m in model.modules() if getattr(m, "buffers_fixed", False) for b in m.buffers(recurse=False)}
        self.buffers = [b for b in model.buffers() if b.is_floating_point() and id(b) not in fixed]
        self._flat: torch.Tensor | None = None

    def reduce(self) -> None:
        """Average this step's buffers over the quorum (after its forward passes, before its vote: a failure is
        reported to the manager, and the step does not commit)."""
        self._flat = None
        if self.buffers and not alone(self.manager):  # alone: the average is this group's own values
            flat = torch.cat([b.detach().reshape(-1) for b in self.buffers])
            if self.manager.allreduce(flat).wait():
                self._flat = flat

    def apply(self) -> None:
        """Take the quorum's average, once the step has committed."""
        if self._flat is None:
            return
        offset = 0
        with torch.no_grad():
            for buffer in self.buffers:
                buffer.copy_(self._flat[offset : offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()
        self._flat = None


def any_group(manager: Manager, mine: bool, device: torch.device) -> bool:
    """Whether any group of the step's quorum says yes (a sum over the quorum: every group gets the same
    answer, which a file each reads at its own moment cannot give). A step whose collective fails is not
    committed, and its answer is not used."""
    if alone(manager):
        return mine
    flag = torch.full((1,), float(mine), device=device)
    manager.allreduce(flag, reduce_op=dist.ReduceOp.SUM).wait()
    return bool(flag.item() > 0)
