"""Metrics logged to MLflow while a job trains (its carbon: energy, emissions, emissions rate).

They go to a run of their own in the model's experiment, ``<job id>-live``, tagged with the job id
(``trainyard.live_job_id``): the registration run is made only once a model exists, and a job that
fails or is stopped still leaves its live record, with its training curves once training ended.
"""

from __future__ import annotations

import time

from trainyard.registry import _experiment
from trainyard.spec import TrainingJob
from trainyard.status import primary_status
from trainyard.tracking_store import tracking_uri

LIVE_JOB_TAG = "trainyard.live_job_id"


_RUN_STATUS = {"Completed": "FINISHED", "Stopped": "KILLED", "Failed": "FAILED"}


def live_status(outcome) -> str:
    """The MLflow status a job's live run ends with, by the job's status (``status.primary_status``): FINISHED
    for a completed training (a target or patience reached included), KILLED for one stopped (by a person, its
    runtime or carbon budget), FAILED for one that diverged or raised (no ``outcome``)."""
    return "FAILED" if outcome is None else _RUN_STATUS[primary_status(outcome.stop_reason)[0]]


class LiveRun:
    """An MLflow run for one job's live metrics."""

    def __init__(self, job: TrainingJob, job_id: str):
        from mlflow import MlflowClient

        uri = tracking_uri()
        self.client = MlflowClient(uri)
        # the job's experiment, where registration puts the version's run (job.name, as registry.py does)
        experiment = _experiment(self.client, job.name, uri)
        # an earlier run of the job id killed outright (SIGKILL, OOM) left its live run RUNNING for good
        earlier = self.client.search_runs(
            [experiment], filter_string=f"tags.`{LIVE_JOB_TAG}` = '{job_id}' and attributes.status = 'RUNNING'"
        )
        for stale in earlier:
            self.client.set_terminated(stale.info.run_id, "KILLED")
        run = self.client.create_run(experiment, run_name=f"{job_id}-live", tags={LIVE_JOB_TAG: job_id})
        self.run_id = run.info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_file(self, path) -> None:
        """Attach a file (the training curves) to the run."""
        self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)
