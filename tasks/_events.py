"""A job's Prefect events (``trainyard.job.*``, ``trainyard.progress``, a replica group's), which automations, the UI's
event feed and ``flows.client.status`` (``flows.job_events``) read."""

from __future__ import annotations

from prefect.events import emit_event
from prefect.runtime import flow_run


def emit(event: str, job_id: str, payload: dict, replica: int | None = None) -> None:
    """Send one of the job's events (of a replica group, with ``replica``), related to the flow run sending it:
    a second run of the job id (refused while the first runs, or a rerun) is told apart by its run."""
    if replica is None:
        resource = {"prefect.resource.id": f"trainyard.job.{job_id}", "prefect.resource.name": job_id}
    else:
        resource = {
            "prefect.resource.id": f"trainyard.job.{job_id}.replica.{replica}",
            "prefect.resource.name": f"{job_id} replica group {replica}",
        }
    run_id = flow_run.get_id()
    related = [{"prefect.resource.id": f"prefect.flow-run.{run_id}", "prefect.resource.role": "flow-run"}]
    emit_event(event=event, resource=resource, payload=payload, related=related if run_id else None)
