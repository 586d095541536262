"""What a job has said of itself as Prefect events (``trainyard.job.*``, sent by the pipeline as each secondary
status begins and once the job has ended, and ``trainyard.progress`` while it trains; ``tasks._events.emit``),
read back for ``flows.client.status``: those of one flow run of the job id."""

from __future__ import annotations

from trainyard.status import PROGRESS_EVENT

FINAL = {"Completed": "Completed", "Failed": "Failed", "Stopped": "Stopped", "MaxRuntimeExceeded": "Stopped"}
"""The secondary statuses that end a job, and the primary status each is."""
STATUS_EVENTS = [
    f"trainyard.job.{status.lower()}" for status in ("Starting", "Downloading", "Training", "Uploading", *FINAL)
] + ["trainyard.job.ended"]
"""The events ``read`` reads: each secondary status as it begins, and the job's end. By name, not by the prefix
``trainyard.job.``, which the job's other events share (``job.scaled``, one per change of size): a job that scaled
often pushed its first transitions out of the newest page."""


def _events(api, job_id: str, run_id, since, names: dict, limit: int) -> list:
    """The events of the job that flow run ``run_id`` sent since ``since`` whose names match ``names``
    (``EventNameFilter``'s fields), oldest first."""
    from prefect.events.filters import (
        EventFilter,
        EventNameFilter,
        EventOccurredFilter,
        EventRelatedFilter,
        EventResourceFilter,
    )

    page = api.read_events(
        EventFilter(
            occurred=EventOccurredFilter(since=since),
            event=EventNameFilter(**names),
            resource=EventResourceFilter(id=[f"trainyard.job.{job_id}"]),
            related=EventRelatedFilter(id=[f"prefect.flow-run.{run_id}"]),
        ),
        limit=limit,
    )
    return sorted(page.events, key=lambda e: e.occurred)


def progress(api, job_id: str, run_id, since) -> dict | None:
    """The job's last ``trainyard.progress`` event's payload (the train stage's, at most once a second)."""
    events = _events(api, job_id, run_id, since, {"name": [PROGRESS_EVENT]}, limit=5)
    return dict(events[-1].payload) if events else None


def read(api, job_id: str, run_id, since) -> tuple[list[dict], dict | None]:
    """The job's secondary status transitions as flow run ``run_id`` ran it, each closed by the next (an event
    is sent as a status begins, its end time not yet known), and its outcome (the ``trainyard.job.ended``
    event's; None before)."""
    # the API's most per page; a job has under ten transitions a try
    events = _events(api, job_id, run_id, since, {"name": STATUS_EVENTS}, limit=50)
    # A retried run (the same run id) starts the job again: only what its last try said is the job's now
    starts = [i for i, e in enumerate(events) if e.payload.get("status") == "Starting"]
    events = events[starts[-1] :] if starts else events
    transitions: list[dict] = []
    for payload in (dict(e.payload) for e in events if "status" in e.payload):
        if transitions and transitions[-1]["status"] == payload["status"]:  # told again, further on: its message
            transitions[-1]["message"] = payload["message"]
            continue
        transitions.append(payload)
    for this, following in zip(transitions, transitions[1:], strict=False):
        this["end_time"] = this["end_time"] or following["start_time"]
    if transitions and transitions[-1]["status"] in FINAL:  # as the job's summary has it: ended as it began
        transitions[-1]["end_time"] = transitions[-1]["end_time"] or transitions[-1]["start_time"]
    ended = [e.payload["ended"] for e in events if "ended" in e.payload]
    return transitions, (dict(ended[-1]) if ended else None)
