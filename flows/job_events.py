"""What a job has said of itself as Prefect events (``trainyard.job.*``, sent by the pipeline as each secondary
status begins and once the job has ended, and ``trainyard.progress`` while it trains; ``tasks._events.emit``),
read back for ``flows.client.status``: those of one flow run of the job id; and, where Prefect no longer keeps them
(``PREFECT_EVENTS_RETENTION_PERIOD``, 7 days by default), what the run's summary artifact says."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from trainyard.status import PROGRESS_EVENT

SUMMARY_ARTIFACT = "job-summary-"
"""The key of a run's summary artifact: ``job-summary-<job name>``, its markdown ending in the summary as JSON."""

CLOCK_SKEW = timedelta(hours=1)  # how far the clock of the job's worker may be from the API's and a caller's

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

    # An event's time is its sender's clock (the pipeline's worker): Prefect's own ``until`` is this caller's now,
    # which hid the events of a worker whose clock is ahead (the job's end, and ``wait`` read a job over without it)
    page = api.read_events(
        EventFilter(
            occurred=EventOccurredFilter(since=since, until=datetime.now(UTC) + CLOCK_SKEW),
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
    # ``since``: the run's creation, by the API's clock; its events are by the worker's (the ids filter them)
    events = _events(api, job_id, run_id, since - CLOCK_SKEW, {"name": STATUS_EVENTS}, limit=50)
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


def outcome(summary: dict) -> dict:
    """The job's outcome as the ``trainyard.job.ended`` event carries it: from its summary."""
    ended = {key: summary.get(key) for key in ("status", "failure_reason", "metrics", "summary_uri")}
    model = summary.get("model")
    ended["model"] = {key: model.get(key) for key in ("name", "version", "uri", "aliases")} if model else None
    return ended


def from_summary_artifact(api, run_id) -> tuple[list[dict], dict | None]:
    """``read``'s answer from flow run ``run_id``'s summary artifact (its last try's): for a run whose events
    Prefect has let go (kept 7 days by default), or whose ended event never went (its process killed as it
    published); ``([], None)`` where it has none (the job never ended, or the artifact failed)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    found = api.read_artifacts(
        artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), key=ArtifactFilterKey(like_=SUMMARY_ARTIFACT)
        ),
        sort=ArtifactSort.CREATED_DESC,
        limit=1,
    )
    markdown = found[0].data if found and isinstance(found[0].data, str) else ""
    start, end = markdown.find("```json\n"), markdown.rfind("\n```")
    if start < 0 or end <= start:
        return [], None
    try:
        summary = json.loads(markdown[start + len("```json\n") : end])
    except ValueError:
        return [], None
    return list(summary.get("secondary_status_transitions") or []), outcome(summary)
