"""The ``train-replica`` flow: one replica group of a job, run by a worker of a (GPU) work pool.

The launch stage submits one run of this flow per group (``tasks/pool_launcher.py``) and watches
it; the train stage's supervisor reads the group's heartbeat, progress and result from the job's
folder as it does for a local group, and resubmits a crashed or failed run (the elastic retry:
Prefect's own flow retries never cover a Crashed run). Inside, it is the same entrypoint a local
group runs (``trainyard.training.replica``): it waits for the plan, trains under torchft, and heals
from a live peer when it is a restart. A group of a CPU job (``gpus_per_replica`` 0) sees no GPU, as a
local one does (``launch._start_process``): on a GPU pool's worker it cannot take one by accident, and
its carbon share counts none of the worker's GPUs. SIGTERM (a cancelled run, a scale-down) is a graceful leave
at a step boundary once the group is in its first quorum, and ends it at once before.

The job's folder must be reachable from the worker at the same path (a process pool on the train
stage's machine, or a shared volume).
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.states import Failed, State

from trainyard import progress
from trainyard.errors import TrainingError
from trainyard.training import replica as entrypoint
from trainyard.training.failures import failure_record

# Nothing here imports torch or torchft: the group (replica.main) sets RUST_LOG before torchft starts its
# logger, whose INFO is several lines per step (10 MB a minute in a worker's log).
from trainyard.training.plan import LAUNCH_ENV, LIGHTHOUSE_ENV, attempt_dir


@flow(name="train-replica", log_prints=True)
def train_replica(
    job_dir: str,
    replica: int,
    attempt: int = 0,
    resume: bool = False,
    lighthouse_addr: str = "",
    gpus_per_replica: int | None = None,
    launch_id: str = "",
) -> int | State:
    """Run replica group ``replica`` (attempt ``attempt``) of the job in ``job_dir``; fail if it does.
    ``gpus_per_replica`` 0 hides the worker's GPUs from the group; None leaves them as the pool gives them."""
    progress.outlive_closed_output()  # a worker that shut down: the group goes on (its run's logs reach the API)
    logger = get_run_logger()
    if gpus_per_replica == 0:
        # Before the group's meter and torch start: codecarbon and CUDA read it when they first look.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if lighthouse_addr:
        os.environ[LIGHTHOUSE_ENV] = lighthouse_addr  # the trainer's torchft Manager finds its peers there
    if launch_id:
        os.environ[LAUNCH_ENV] = launch_id  # the group takes only its own launch's plan
    logger.info("replica group %d, attempt %d, lighthouse %s", replica, attempt, lighthouse_addr or "from the plan")
    argv = ["--job-dir", job_dir, "--replica", str(replica), "--attempt", str(attempt)]
    argv += ["--resume"] if resume else []
    code = entrypoint.main(argv)
    if code != 0:
        # What the group wrote of its failure (error.json), not "see its error.json" on a worker the user may
        # not reach. Returned, not raised: the run still ends Failed (the launcher resubmits it), without
        # Prefect's traceback of this line; a bug's own traceback the group has printed to the run's log.
        failure = failure_record(attempt_dir(Path(job_dir), replica, attempt), replica, attempt, code)
        message = f"replica group {replica} attempt {attempt} failed at step {failure['step']}: {failure['message']}"
        return Failed(message=message, data=TrainingError(message))
    return code
