"""Submit and follow training jobs from another service: ``submit``, ``status``, ``wait``, ``logs``, ``stop``,
``jobs``.

This is the client side of the orchestrator, so it lives with the flows, not in the engine: it talks to the
Prefect API named by ``PREFECT_API_URL`` (Prefect is imported inside each function, so ``trainyard jobs
--help`` never loads it). A job is a run of a ``training-pipeline`` deployment; its run is
named after its job id. Statuses are SageMaker's: primary ``Scheduled`` (a schedule's run, not started) ``|
InProgress | Completed | Failed | Stopped`` and the secondary status transitions the pipeline publishes as
``trainyard.job.*`` events.

    from flows import client
    run_id = client.submit({"name": "churn", ...})          # or a TrainingJob
    print(client.wait(run_id)["status"])                     # Completed
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from flows import job_events
from flows.job_events import FINAL
from flows.job_runs import group_runs as _group_runs
from flows.job_runs import logs  # noqa: F401 - the client's, as submit, status and stop
from flows.prefect_api import (  # noqa: F401 - ApiNotSet, ApiUnreachable, RunNotFound: the client's errors too
    PIPELINE_FLOW,
    ApiNotSet,
    ApiUnreachable,
    RunNotFound,
    check_is_an_api,
    job_id_of,
    reaching_api,
)
from flows.prefect_api import api as _api
from flows.prefect_api import api_url as _api_url
from flows.prefect_api import read_run as _read_run
from trainyard.errors import SpecError, TrainyardError
from trainyard.home import new_job_id
from trainyard.spec import TrainingJob, parse_job
from trainyard.status import JOB_TAG


class DeploymentNotFound(TrainyardError, LookupError):
    """The deployment named is not ``FLOW/DEPLOYMENT``, or the API has none by that name."""


class WaitTimeout(TrainyardError, TimeoutError):
    """``wait``'s ``timeout_seconds`` passed before the job ended (the job goes on)."""


class IdempotencyKeyReused(TrainyardError, ValueError):
    """The key already started a run for another job spec."""


class DeploymentOutdated(TrainyardError, ValueError):
    """The deployment's parameter schema (an older Trainyard's) refused a field the spec sets."""


DEFAULT_DEPLOYMENT = "training-pipeline/on-demand"
API_OUTAGE_SECONDS = 300.0  # how long wait rides out an API that does not answer (the job goes on meanwhile)
_PRIMARY = {
    "COMPLETED": "Completed",
    "FAILED": "Failed",
    "CRASHED": "Failed",
    "CANCELLED": "Stopped",
    "CANCELLING": "Stopping",  # cancelled, its processes being stopped (SageMaker's Stopping)
    "SCHEDULED": "Scheduled",  # a schedule's future run: not started, not in progress
}


@reaching_api
def submit(job: TrainingJob | dict, deployment: str = DEFAULT_DEPLOYMENT, idempotency_key: str | None = None) -> str:
    """Validate the job here (a bad spec fails before anything is queued) and start it; returns the
    flow run id. The same ``idempotency_key`` twice starts one run."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

    _api_url()
    # a TrainingJob too: one changed by model_copy(update=...) was never validated
    spec = parse_job(job.model_dump(mode="json", exclude_unset=True) if isinstance(job, TrainingJob) else job)
    flow_name, _, deployment_name = deployment.partition("/")
    if not flow_name or not deployment_name or "/" in deployment_name:
        raise DeploymentNotFound(
            f"deployment {deployment!r} is not FLOW/DEPLOYMENT; Trainyard's is {DEFAULT_DEPLOYMENT!r}, and "
            "`prefect deployment ls` lists the API's"
        )
    if flow_name != PIPELINE_FLOW:  # another flow's (train-replica's runs one group, not a job)
        raise DeploymentNotFound(
            f"deployment {deployment!r} is not one of the {PIPELINE_FLOW} flow, which runs jobs: use "
            f"{PIPELINE_FLOW}/DEPLOYMENT, such as {DEFAULT_DEPLOYMENT!r}"
        )
    if spec.resources.work_pool != "local":  # its groups' pool: a name this API has no deployment for is the spec's
        from tasks.pool_launcher import check_deployment

        check_deployment(spec.resources.work_pool, spec.resources.gpus_per_replica)
    job_id = new_job_id(spec.name)
    # As written (its defaults are the deployed code's): a deployment made by an older Trainyard than this client
    # refuses any field its job spec lacks, and would refuse every default this client's spec added since.
    written = spec.model_dump(mode="json", exclude_unset=True)
    try:
        run = run_deployment(
            deployment,
            parameters={"job": written, "job_id": job_id},
            timeout=0,
            idempotency_key=idempotency_key,
            flow_run_name=job_id,
            tags=[f"{JOB_TAG}{job_id}"],
            as_subflow=False,
        )
    except ObjectNotFound:
        with _api() as api:
            check_is_an_api(api)
        raise DeploymentNotFound(
            f"no deployment {deployment!r} on the Prefect API at PREFECT_API_URL; `prefect deployment ls` lists "
            "them, and `prefect deploy --all` in Trainyard's folder makes prefect.yaml's"
        ) from None
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code != 409 or "Validation failed" not in exc.response.text:
            raise
        # what the deployment's parameter schema refused, in the API's words: a spec this client took, so the
        # deployment was made by another Trainyard (an older one lacks fields; jsonschema: "... was unexpected")
        detail = exc.response.json().get("detail", exc.response.text) if _is_json(exc.response) else exc.response.text
        fix = ", or leave out the fields it does not know" if "unexpected" in str(detail) else ""
        raise DeploymentOutdated(
            f"deployment {deployment!r} refused the job spec, which this client's Trainyard takes: {detail}. Its "
            f"schema is another Trainyard's: run `prefect deploy --all` in Trainyard's folder with this version{fix}"
        ) from None
    earlier = run.parameters.get("job")  # type: ignore[union-attr]
    if idempotency_key is not None and not _same_job(earlier, spec):
        # Prefect hands back the run the key first started, whatever was asked this time: a key reused for
        # another job would silently report on the old one
        raise IdempotencyKeyReused(
            f"idempotency key {idempotency_key!r} already started run {run.id} "  # type: ignore[union-attr]
            f"({run.parameters.get('job_id')}) for another job spec; use a new key for a new job"  # type: ignore[union-attr]
        )
    return str(run.id)  # type: ignore[union-attr]  # called sync, it returns the run (typed: run or coroutine)


def _same_job(earlier: Any, spec: TrainingJob) -> bool:
    """Whether the spec a run was started with (one REST may have sent wrong) is ``spec``, defaults resolved."""
    try:
        return parse_job(earlier).model_dump(mode="json") == spec.model_dump(mode="json")
    except SpecError:
        return False


def _is_json(response) -> bool:
    return response.headers.get("content-type", "").startswith("application/json")


@reaching_api
def status(run_id: str) -> dict[str, Any]:
    """The job's primary status, its secondary status transitions (each with its start and end time) and,
    once it ended, its outcome: ``failure_reason``, final ``metrics``, the registered ``model`` and the
    ``summary_uri`` of the whole summary (None until the job has said them; a run that never started the
    job, such as one whose parameters the API refused, has its state's message as ``failure_reason``).
    While it trains, ``progress``: the epochs done, of how many, and the last one's ``metrics`` (None before
    the first epoch ends, and outside training)."""
    with _api() as api:
        run = _read_run(api, run_id)
        job_id = job_id_of(run)  # None: a run from the UI or REST that no worker has started (it names the job)
        transitions, ended = _said(api, job_id, run)
        training = bool(transitions) and transitions[-1]["status"] == "Training"
        # since this try's start: a retried run's first try had epochs of its own
        since = datetime.fromisoformat(transitions[0]["start_time"]) if training else None
        progress = job_events.progress(api, job_id, run.id, since) if training and job_id else None
    state = run.state.type.value if run.state else "PENDING"
    primary = _job_status(run.state, transitions)
    if transitions:
        secondary = transitions[-1]["status"]
    else:  # the job has said nothing yet; a run that ended before it started (cancelled while queued) ended so
        secondary = "Starting" if primary in ("Scheduled", "InProgress") else primary
    reason = (ended or {}).get("failure_reason")
    if reason is None and ended is None and state in ("FAILED", "CRASHED") and run.state.message:
        reason = run.state.message
    return {
        "flow_run_id": str(run.id),
        "job_id": job_id,
        "status": primary,
        "secondary_status": secondary,
        "started": bool(getattr(run, "run_count", 0)),  # a worker started the run (False: it ended, or waits, unrun)
        "secondary_status_transitions": transitions,
        "prefect_state": run.state.name if run.state else None,
        "failure_reason": reason,
        "metrics": (ended or {}).get("metrics"),
        "model": (ended or {}).get("model"),
        "summary_uri": (ended or {}).get("summary_uri"),
        "progress": progress,
    }


def wait(
    run_id: str,
    timeout_seconds: float | None = None,
    poll_seconds: float = 2.0,
    on_transition: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Block until the job ends (or ``timeout_seconds`` pass: ``WaitTimeout``); returns ``status``.
    ``on_transition`` is called with each secondary status transition once, in order, as it is seen."""
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    # Told by status and start, not by count: a run Prefect runs again reads as its new try's transitions alone,
    # fewer than were told, and counting skipped the new try's first ones.
    told: set[tuple[str, str]] = set()

    def read() -> dict[str, Any]:
        current = _status_through_outages(run_id, poll_seconds, deadline)
        for transition in current["secondary_status_transitions"]:
            key = (transition["status"], transition["start_time"])
            if on_transition is not None and key not in told:
                on_transition(transition)
            told.add(key)
        return current

    while True:
        current = read()
        if current["status"] not in ("InProgress", "Scheduled", "Stopping"):
            # The run's state can land before the job's last status event (the API stores events every few
            # seconds): give the events a moment. A run no worker started (cancelled while queued) has none to come.
            settle = time.monotonic() + (10 if current["secondary_status_transitions"] or current["started"] else 0)
            # (metrics: None until the job's outcome event, which follows its last status)
            while (current["secondary_status"] not in FINAL or current["metrics"] is None) and (
                time.monotonic() < settle
            ):
                time.sleep(0.5)
                current = read()
            return current
        if deadline is not None and time.monotonic() > deadline:
            where = (
                "Scheduled: no worker has picked it up (is one polling the deployment's work pool?)"
                if current["status"] == "Scheduled"
                else current["secondary_status"]
            )
            raise WaitTimeout(f"job run {run_id} still {where} after {timeout_seconds:g} s")
        time.sleep(poll_seconds)


def _status_through_outages(run_id: str, poll_seconds: float, deadline: float | None) -> dict[str, Any]:
    """``status``, asked again while the API does not answer (a restart, a network blip: the job goes on), for
    up to ``API_OUTAGE_SECONDS`` at a time and not past ``deadline``."""
    since = time.monotonic()
    while True:
        try:
            return status(run_id)
        except ApiUnreachable as exc:
            now = time.monotonic()
            if deadline is not None and now > deadline:  # the wait's own timeout, as README's exit 124 says
                raise WaitTimeout(
                    f"{exc}; the wait for job run {run_id} timed out meanwhile (the job goes on)"
                ) from None
            if now - since > API_OUTAGE_SECONDS:
                raise ApiUnreachable(f"{exc}; stopped waiting for job run {run_id}, which goes on") from None
            time.sleep(poll_seconds)


@reaching_api
def stop(run_id: str, graceful: bool = False) -> list[str]:
    """Cancel the job's pipeline run and every replica group run of the job; returns the runs cancelled.

    Groups get SIGTERM from their workers and leave at a step boundary; the job ends Stopped, with nothing
    uploaded. ``graceful``: the pipeline run is tagged instead (``user_stop.RUN_TAG``), and its training
    stage stops every group at its next step boundary, uploads the model trained so far, and ends the job
    Stopped; returns the run asked (none when the job has ended)."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    from trainyard.training import user_stop

    with _api() as api:
        run = _read_run(api, run_id)
        if graceful:
            if run.state is None or run.state.is_final():
                return []
            api.update_flow_run(run.id, tags=sorted({*run.tags, user_stop.RUN_TAG}))
            return [str(run.id)]
        cancelled = []
        for target in [run, *_group_runs(api, run)]:
            if target.state is not None and not target.state.is_final():
                # not forced: Prefect's rules then refuse it for a run that has ended since it was read (forced, a
                # Completed job became Cancelling, for good), and cancel at once one that never started
                asked = api.set_flow_run_state(target.id, Cancelling(message="trainyard stop"))
                if asked.state is not None and asked.state.type in (StateType.CANCELLING, StateType.CANCELLED):
                    cancelled.append(str(target.id))
    return cancelled


@reaching_api
def jobs(limit: int = 20) -> list[dict[str, Any]]:
    """The most recent training-pipeline runs, newest first, a schedule's next ones (not started) among them
    (``limit``: at least 1; read in pages of the API's 200)."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    if limit < 1:
        raise TrainyardError(f"limit must be at least 1, not {limit}")
    with _api() as api:
        runs: list = []
        offset = 0
        while len(runs) < limit:
            want = min(200, limit - len(runs))
            page = api.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[PIPELINE_FLOW])),
                sort=FlowRunSort.START_TIME_DESC,
                limit=want,
                offset=offset,
            )
            offset += len(page)
            runs += [r for r in page if r.id not in {seen.id for seen in runs}]  # (a run started between pages moves)
            if len(page) < want:
                break
        # A Crashed run's job may have ended Stopped (a worker shut down, a reclaim: SIGTERM): its events say so,
        # as status() reads them. Asked for those runs alone (one read each; the rest's state says it all).
        said = {}
        for r in runs:
            job_id = job_id_of(r)
            if job_id and r.state and r.state.type.value == "CRASHED":
                said[r.id] = _said(api, job_id, r)
    rows = []
    for r in runs:
        transitions, ended = said.get(r.id, ([], None))
        status_ = _job_status(r.state, transitions)
        # why a Failed or Stopped job ended: as the job said, or as its run's state says
        reason = (ended or {}).get("failure_reason") or (r.state.message if r.state else None)
        rows.append(
            {
                "flow_run_id": str(r.id),
                # a run from the UI, a schedule or REST makes its job id as it starts (before, its name is Prefect's)
                "job_id": job_id_of(r),
                "job_name": (r.parameters.get("job") or {}).get("name"),
                "status": status_,
                "prefect_state": r.state.name if r.state else None,
                "started": r.start_time.isoformat() if r.start_time else None,
                # a scheduled run's: when it is due
                "expected_start": r.expected_start_time.isoformat() if r.expected_start_time else None,
                "reason": reason if status_ in ("Failed", "Stopped") else None,
            }
        )
    return rows


EVENTS_SETTLE = timedelta(minutes=5)  # a run's events are in this long after its end (they take a second or two)


def _said(api, job_id: str | None, run) -> tuple[list[dict], dict | None]:
    """What the job of ``run`` said of itself (``job_events.read``); for a run that ended without its ended event
    in reach (Prefect keeps events 7 days by default; or its process was killed as it published), what its summary
    artifact says, which Prefect keeps. A job that finished a week ago read without its metrics or model."""
    if not job_id:  # a run from the UI or REST that no worker has started (it names the job)
        return [], None
    transitions, ended = job_events.read(api, job_id, run.id, run.created)
    # (not in the moments after the run's end, before its events are in: a rerun's artifact is the first run's)
    settled = run.end_time is not None and datetime.now(UTC) - run.end_time > EVENTS_SETTLE
    if ended is None and settled and run.state is not None and run.state.is_final():
        kept, outcome = job_events.from_summary_artifact(api, run.id)
        # the last try's, where its events are in reach: a retried run's artifact may be an earlier try's
        if not transitions or (kept and kept[0].get("start_time") == transitions[0].get("start_time")):
            transitions, ended = kept, outcome  # (the whole of them: its events may be partly let go)
    return transitions, ended


def _job_status(state, transitions: list[dict]) -> str:
    """A pipeline run's job status: its state's (``_run_status``), or, for a run that ended Completed or Crashed,
    how the job itself said it ended (a Stopped job's run completes, and one told to stop by something else, a
    worker shut down, is Crashed)."""
    primary = _run_status(state)
    if state is not None and state.type.value in ("COMPLETED", "CRASHED") and transitions:
        primary = FINAL.get(transitions[-1]["status"], primary)
    return primary


def _run_status(state) -> str:
    """A pipeline run's job status from its state alone: a Stopped job's run is Completed, named Stopped."""
    if state is None:
        return "InProgress"
    if state.type.value == "COMPLETED" and state.name == "Stopped":
        return "Stopped"
    return _PRIMARY.get(state.type.value, "InProgress")
