"""Running a whole job as the ``training-pipeline`` flow, in this process, for the flow tests; and its run's state."""

from __future__ import annotations

import contextlib
import json

import numpy as np

from flows.training_pipeline import JobFailed, training_pipeline
from trainyard.home import job_dir
from trainyard.spec import parse_job


def run_pipeline(spec: dict) -> tuple[dict, str]:
    """Run the job ``spec`` describes under a new job id; its summary (whatever its end) and the job id."""
    job = parse_job(spec)
    job_id = f"{job.name}-{np.random.default_rng().integers(1e9)}"
    with contextlib.suppress(JobFailed):
        training_pipeline(job, job_id=job_id)
    return json.loads((job_dir(job_id) / "summary.json").read_text()), job_id


def flow_run_state(run_id: str):
    """A flow run's state, as the Prefect API has it."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as api:
        return api.read_flow_run(run_id).state
