"""Launch task: start the job's lighthouse and replica groups."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks._metering import stage_meter
from tasks.pool_launcher import WorkPoolLauncher
from trainyard import launch
from trainyard.spec import TrainingJob


@task(name="launch", cache_policy=NO_CACHE)
def launch_groups(job: TrainingJob, job_id: str, job_dir: str) -> dict:
    """Start ``resources.replicas`` replica groups on the job's work pool; return their handle."""
    logger = get_run_logger()
    pool = job.resources.work_pool
    if pool != "local":  # each group a run of the pool's train-replica deployment
        launch.register(pool, WorkPoolLauncher(pool, job.resources))
    with stage_meter("launch", job) as record:
        record["handle"] = launch.launch(job_id, Path(job_dir), job.resources)
    runs = [r.run_id for r in record["handle"].replicas if r.run_id]
    logger.info(
        "launched %d replica group(s) on %s%s, lighthouse %s",
        job.resources.replicas,
        pool,
        f" (flow runs {', '.join(runs)})" if runs else "",
        record["handle"].lighthouse_addr,
    )
    return record
