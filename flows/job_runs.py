"""A job's flow runs as the Prefect API has them: its replica groups' runs on a work pool, and the log lines of all
of them (``flows.client.logs``)."""

from __future__ import annotations

import logging
from typing import Any

from flows.prefect_api import api as _api
from flows.prefect_api import job_id_of, reaching_api
from flows.prefect_api import read_run as _read_run
from trainyard.status import JOB_TAG, REPLICA_TAG


@reaching_api
def logs(run_id: str, groups: bool = True) -> list[dict[str, Any]]:
    """The job's log lines, oldest first: its pipeline run's and, with ``groups``, those of its replica groups
    that ran as flow runs on a work pool (a ``local`` job's groups log to files in its job folder).
    Each: ``time`` (ISO), ``level`` (``INFO``), ``run`` (the flow run's name), ``task`` (the task run's, a stage's;
    "" for the flow's own lines) and ``message``."""
    with _api() as api:
        run = _read_run(api, run_id)
        names = {run.id: run.name} | ({r.id: r.name for r in group_runs(api, run)} if groups else {})
        lines = log_lines(api, list(names))
        tasks = task_names(api, list(names))
    return [
        {
            "time": line.timestamp.isoformat(),
            "level": logging.getLevelName(line.level),
            "run": names.get(line.flow_run_id, ""),
            # the stage that logged it, where a task did ("staging-953"): Prefect's "Finished in state
            # Completed()" of each stage says no more
            "task": tasks.get(line.task_run_id, "") if line.task_run_id else "",
            "message": line.message,
        }
        for line in lines
    ]


PAGE = 200  # the API's most log lines a request


def log_lines(api, run_ids: list) -> list:
    """The log lines of the flow runs ``run_ids``, oldest first, each once. Paged by time, not by offset: the API
    sorts by timestamp alone, so lines of one instant may come in another order from one request to the next, and
    a group's batch of lines landing between two requests shifts every offset after it; by offset a line at a page's
    edge came twice or not at all. Each page starts at the last one's latest instant (the API's ``after_`` includes
    it), its lines already read left out by id; a whole page of one instant is stepped through by offset."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    lines: dict = {}
    since, skip = None, 0
    while True:
        log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=run_ids), timestamp=LogFilterTimestamp(after_=since))
        page = api.read_logs(log_filter=log_filter, limit=PAGE, offset=skip, sort=LogSort.TIMESTAMP_ASC)
        lines |= {line.id: line for line in page if line.id not in lines}
        if len(page) < PAGE:  # (sorted is stable: within an instant, the order read)
            return sorted(lines.values(), key=lambda line: line.timestamp)
        latest = page[-1].timestamp
        since, skip = (since, skip + len(page)) if latest == since else (latest, 0)


def task_names(api, run_ids: list) -> dict:
    """The names of the task runs of the flow runs ``run_ids``, by id."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    found: dict = {}
    while True:
        page = api.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=run_ids)), limit=200, offset=len(found)
        )
        found |= {task.id: task.name for task in page}
        if len(page) < 200:
            return found


def group_runs(api, run) -> list:
    """The replica group flow runs of the job whose pipeline run is ``run`` (none for a ``local`` job)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    tags = FlowRunFilterTags(all_=[f"{JOB_TAG}{job_id_of(run)}", REPLICA_TAG])
    found: list = []
    while True:  # in pages: the API gives 200 at most a call, and an elastic job's attempts may be more
        page = api.read_flow_runs(flow_run_filter=FlowRunFilter(tags=tags), limit=200, offset=len(found))
        found += page
        if len(page) < 200:
            return found
