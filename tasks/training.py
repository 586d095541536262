"""Training task: release the replica groups, supervise them, upload the model."""

from __future__ import annotations

import logging

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from tasks._metering import stage_meter
from trainyard import progress
from trainyard.launch import LaunchHandle
from trainyard.spec import TrainingJob
from trainyard.training import supervisor
from trainyard.training.plan import TrainingPlan


@task(name="training", cache_policy=NO_CACHE)
def train(job: TrainingJob, handle: LaunchHandle, plan: TrainingPlan) -> dict:
    """Run the replica groups to the job's stopping condition; return the outcome (model path, history)."""
    logger = get_run_logger()
    with stage_meter("training", job) as record, progress.bar("training epochs", job.hyperparameters.epochs) as advance:
        done = [0]

        def on_progress(epochs: int, metrics: dict | None) -> None:
            advance(epochs - done[0])
            done[0] = epochs
            logger.info("epoch %d: %s", epochs, {k: round(v, 5) for k, v in (metrics or {}).items()})

        def on_event(kind: str, payload: dict) -> None:
            # One Prefect event per failure, restart, recovery, arrival and departure of a replica
            # group (its resource), and per change of size (the job's).
            if "replica" in payload:
                resource = {
                    "prefect.resource.id": f"trainyard.job.{plan.job_id}.replica.{payload['replica']}",
                    "prefect.resource.name": f"{plan.job_id} replica group {payload['replica']}",
                }
            else:
                resource = {"prefect.resource.id": f"trainyard.job.{plan.job_id}", "prefect.resource.name": plan.job_id}
            emit_event(event=f"trainyard.{kind}", resource=resource, payload=payload)
            level = logging.WARNING if kind == "replica.failed" else logging.INFO
            logger.log(level, "%s: %s", kind, payload)

        record["outcome"] = supervisor.train(handle, plan, job, on_progress, on_event)
    outcome = record["outcome"]
    logger.info(
        "training stopped (%s) after %d steps, %d failure(s)", outcome.stop_reason, outcome.steps, len(outcome.failures)
    )
    return record
