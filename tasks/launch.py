"""Launch task: start the job's lighthouse and replica groups."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks._metering import stage_meter
from trainyard import launch
from trainyard.spec import TrainingJob


@task(name="launch", cache_policy=NO_CACHE)
def launch_groups(job: TrainingJob, job_id: str, job_dir: str) -> dict:
    """Start ``resources.replicas`` replica groups on the job's work pool; return their handle."""
    logger = get_run_logger()
    with stage_meter("launch", job) as record:
        record["handle"] = launch.launch(job_id, Path(job_dir), job.resources)
    logger.info("launched %d replica group(s), lighthouse %s", job.resources.replicas, record["handle"].lighthouse_addr)
    return record
