"""A running job stopped on request, keeping what it learnt (``trainyard stop JOB_ID``; ``trainyard jobs stop
RUN_ID --graceful`` asks through the Prefect API, and the training stage makes the same request).

The request is the one a carbon budget or ``max_runtime_seconds`` makes (``plan.request_stop``): every group
stops within a few steps, at one step they agree on, the model as trained so far is uploaded with the job's
outputs, and the job ends Stopped (not registered: only a completed job is). A cancelled run (``trainyard jobs
stop`` without ``--graceful``) ends at once instead, and uploads nothing.
"""

from __future__ import annotations

from pathlib import Path

from trainyard.training.plan import request_stop, stop_requested
from trainyard.training.scaling import training_folder

REASON = "Stopped"  # the training stop reason: the job ends Stopped (status.primary_status)
# A pipeline run's tag that asks it to stop so (``trainyard jobs stop --graceful``); its training stage looks
# for it every few seconds, and at its start.
RUN_TAG = "trainyard.stop"


def request(job_id: str) -> str:
    """Ask job ``job_id``, training on this machine, to stop; returns what was asked, in words. Refused,
    with the reason, when the job is unknown or not training (any more)."""
    return request_in(training_folder(job_id, "stops"))


def request_in(job_dir: Path) -> str:
    """Ask the job in ``job_dir`` to stop within a few steps (a stop already asked for stands)."""
    earlier = stop_requested(job_dir)
    if earlier is not None:
        return f"job {job_dir.name}: already stopping ({earlier['reason']})"
    request_stop(job_dir, REASON, "stopped on request")
    return (
        f"job {job_dir.name}: asked to stop within a few steps; the model trained so far is uploaded "
        "with its outputs and the job ends Stopped (not registered)"
    )
