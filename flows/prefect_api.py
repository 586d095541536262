"""The Prefect API ``flows.client`` talks to: which one (``PREFECT_API_URL``), reading a job's run from it, and its
failures said as ``TrainyardError``s a service can tell apart by type (an API that does not answer, a URL that
is not a Prefect API's, a run that is no job's)."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from trainyard.errors import TrainyardError
from trainyard.status import JOB_TAG, REPLICA_TAG

PIPELINE_FLOW = "training-pipeline"


class ApiNotSet(TrainyardError):
    """No ``PREFECT_API_URL``, or one that is not a Prefect API's: nothing to submit to or ask."""


class ApiUnreachable(TrainyardError, ConnectionError):
    """The Prefect API did not answer (refused, timed out, a server error): a job goes on meanwhile."""


class RunNotFound(TrainyardError, LookupError):
    """The run id is not one (a UUID), or the API has no such run, or the run is not a job's."""


def api_url() -> str:
    """The API this client talks to; a ``TrainyardError`` when none is set. Without one, Prefect's client
    would start a temporary server of its own, with no deployments and no runs: a job list would come back
    empty after seconds, and a submit would find no deployment, both as if the user's server had none."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        raise ApiNotSet(
            "PREFECT_API_URL is not set: point it at the Prefect server that runs Trainyard's deployments "
            "(for example http://127.0.0.1:4200/api); `trainyard run` runs a job in this process without one"
        )
    return url


def api():
    """Prefect's synchronous client for the API at PREFECT_API_URL (``api_url``)."""
    from prefect.client.orchestration import get_client

    api_url()
    return get_client(sync_client=True)


def check_is_an_api(client) -> None:
    """Raise ``ApiNotSet`` when PREFECT_API_URL answers but is not a Prefect API (a server's root without
    its ``/api``, where every path is "not found"): asked before a "not found" is taken for the object's."""
    failed = client.api_healthcheck()
    if failed is not None:
        raise ApiNotSet(
            f"PREFECT_API_URL {api_url()} is not a Prefect API ({failed}); it is the server's address with /api, "
            "for example http://127.0.0.1:4200/api"
        )


P = ParamSpec("P")
R = TypeVar("R")


def reaching_api(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with an API that does not answer (refused, timed out, a server error) raised as ``ApiUnreachable``,
    and a "not found" from a URL that is no Prefect API's said as such, not as a traceback of the HTTP client."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import httpx
        from prefect.exceptions import PrefectHTTPStatusError

        try:
            return fn(*args, **kwargs)
        except httpx.TransportError as exc:
            raise ApiUnreachable(f"the Prefect API at {api_url()} did not answer ({exc}); is it up?") from None
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code >= 500:
                raise ApiUnreachable(
                    f"the Prefect API at {api_url()} failed ({exc.response.status_code}); try again"
                ) from None
            if exc.response.status_code == 404:
                with api() as client:
                    check_is_an_api(client)
            raise

    return wrapper


def job_id_of(run) -> str | None:
    """The job id a pipeline run runs: its ``job_id`` parameter, or the tag the pipeline gives itself once it
    starts (a run from the UI, a schedule or REST makes its id then), or, for a run an earlier Trainyard
    started (it named its run after the id, untagged), its name once it ran; None before."""
    if run.parameters.get("job_id"):
        return run.parameters["job_id"]
    tagged = next((t.removeprefix(JOB_TAG) for t in run.tags or [] if t.startswith(JOB_TAG)), None)
    return tagged or (run.name if getattr(run, "run_count", 0) else None)


_flow_names: dict[Any, str] = {}  # flow id -> name: a run's flow, asked once per process


def read_run(client, run_id: str):
    """The pipeline run ``run_id`` names; a ``RunNotFound`` saying so when it is not a run id, the API has
    none, or it is another flow's run (a replica group's, or no Trainyard flow's at all)."""
    from prefect.exceptions import ObjectNotFound

    try:
        uuid.UUID(run_id)
    except ValueError:
        raise RunNotFound(f"{run_id!r} is not a flow run id (a UUID); `trainyard jobs list` shows them") from None
    try:
        run = client.read_flow_run(run_id)
    except ObjectNotFound:
        check_is_an_api(client)
        raise RunNotFound(
            f"no flow run {run_id} on the Prefect API at PREFECT_API_URL; `trainyard jobs list` shows them"
        ) from None
    if REPLICA_TAG in (run.tags or []):  # one of a job's groups: what it says of itself is no job's status
        job_id = job_id_of(run) or ""
        raise RunNotFound(
            f"{run_id} is {run.name}, a replica group's run of job {job_id}, not a job's: its pipeline run is "
            f"{pipeline_run_id(client, job_id) or 'the one `trainyard jobs list` shows for it'}"
        )
    if run.flow_id not in _flow_names:
        _flow_names[run.flow_id] = client.read_flow(run.flow_id).name
    if _flow_names[run.flow_id] != PIPELINE_FLOW:  # not to be described, or stopped, as a job
        raise RunNotFound(
            f"{run_id} is {run.name}, a run of flow {_flow_names[run.flow_id]!r}, not a training job's "
            f"({PIPELINE_FLOW}); `trainyard jobs list` shows those"
        )
    return run


def pipeline_run_id(client, job_id: str) -> str | None:
    """The id of the pipeline run that runs job ``job_id`` (named after it once it starts)."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterName

    runs = client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[PIPELINE_FLOW])),
        flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[job_id])),
        limit=1,
    )
    return str(runs[0].id) if runs else None
