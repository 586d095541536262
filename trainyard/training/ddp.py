"""torchft's DistributedDataParallel, with its gradient hook safe when a peer dies mid-allreduce.

In torchft 0.2.0 the hook asserts on the managed future's inner future, which is only set once the
collective completes. When a peer's death breaks the collective first (gloo: "Connection reset by
peer"), the manager has already recorded the error and will not commit the step, but the assert
kills the survivor: the one group the job needed to heal from. Here that case returns this group's
own gradients instead; they are discarded with the step, and the next quorum goes on without the
dead peer.
"""

# No ``from __future__ import annotations``: torch checks the hook's annotations as objects.
import torch
import torch.distributed as dist
from torchft import DistributedDataParallel, Manager


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
