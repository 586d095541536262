"""Staging task: fetch and verify the job's channels, then read them into arrays."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks._metering import retry_transient, stage_meter
from trainyard import cache, datasets, staging
from trainyard.home import write_json_atomic
from trainyard.spec import TrainingJob


@task(name="staging", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_transient, cache_policy=NO_CACHE)
def stage_inputs(job: TrainingJob, job_dir: str) -> dict:
    """Stage every input channel from S3 into the local cache and prepare the training arrays.

    Returns the channel manifests' summaries, the prepared data, and the stage's time and energy.
    """
    logger = get_run_logger()
    # The pin keeps the cached objects from other jobs' eviction until prepare has read them.
    with stage_meter("staging", job) as record, cache.Pin() as pin:
        manifests = staging.stage_channels(job.channels(), Path(job_dir) / "staging", pin)
        staged = datasets.prepare(manifests, job.channels(), job.algorithm.task, Path(job_dir) / "data")
    for warning in staged.warnings:
        logger.warning(warning)
    for uri in (uri for m in manifests.values() for uri in m.cache_mismatches):
        logger.warning("%s: the cached copy no longer matched what was checked when it was fetched; fetched again", uri)
    if unverifiable := [uri for m in manifests.values() for uri in m.cache_unverifiable]:
        logger.warning(
            "%d cached object(s) had no checksum kept to verify them by (cached by an older Trainyard, or the "
            "cache's file system keeps no extended attributes, in which case every staging fetches them again); "
            "fetched again: %s",
            len(unverifiable),
            ", ".join(unverifiable[:5]) + (" ..." if len(unverifiable) > 5 else ""),
        )
    record["channels"] = {name: m.summary() for name, m in manifests.items()}
    record["staged"] = staged
    # each channel's objects, for the registered version's run: its data lineage outlives the job folder
    record["lineage_files"] = {}
    for name, manifest in manifests.items():
        path = Path(job_dir) / "staging" / f"{name}.objects.json"
        write_json_atomic(path, manifest.lineage())
        record["lineage_files"][f"{name}_objects"] = str(path)
    moved = sum(m.bytes_downloaded for m in manifests.values())
    logger.info("staged %s: %d rows for training, %d bytes downloaded", list(manifests), staged.rows["train"], moved)
    return record
