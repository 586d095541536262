"""Filtering task: choose the training samples worth their compute."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks._metering import stage_meter
from trainyard import filtering
from trainyard.datasets import StagedData
from trainyard.spec import TrainingJob


@task(name="filtering", cache_policy=NO_CACHE)
def filter_samples(job: TrainingJob, staged: StagedData) -> dict:
    """Filter the staged training set; return the report and the data the groups will train on."""
    logger = get_run_logger()
    with stage_meter("filtering", job) as record:
        record["report"] = filtering.filter_samples(staged, job.sifting, job.algorithm.task)
    report = record["report"]
    logger.info(
        "filtering kept %d of %d samples (%.1f%%); dropped %s",
        report.kept,
        report.total,
        100 * report.kept_fraction,
        report.dropped or "nothing",
    )
    return record
