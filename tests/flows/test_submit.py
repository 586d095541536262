"""Submitting to a deployment through ``flows.client``: the spec goes as written, so a deployment an older
Trainyard made takes it, and one whose schema lacks a field the spec sets is named as outdated; a pool with no
group deployment is refused before anything is queued; a group's run is not taken for a job's; a job stopped while
queued ends Stopped at once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from trainyard.errors import SpecError
from trainyard.spec import parse_job
from trainyard.status import JOB_TAG, REPLICA_TAG


@contextmanager
def _pipeline_deployment(api, name: str, **options) -> Iterator:
    """A training-pipeline deployment ``name`` that no worker polls, deleted (its runs with it) at the end."""
    deployment = api.create_deployment(
        flow_id=api.create_flow_from_name("training-pipeline"),
        name=name,
        entrypoint="flows/training_pipeline.py:training_pipeline",
        **options,
    )
    try:
        yield deployment
    finally:
        api.delete_deployment(deployment)


def test_a_spec_is_sent_as_written_so_a_deployment_of_an_older_trainyard_takes_it(prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.utilities.callables import parameter_schema

    from flows import client
    from flows.training_pipeline import training_pipeline
    from tests.unit.specs import minimal

    schema = parameter_schema(training_pipeline).model_dump_for_openapi()
    del schema["definitions"]["Stopping"]["properties"]["restore_best"]  # as deployed before it existed
    with (
        get_client(sync_client=True) as api,
        _pipeline_deployment(
            api, "older", parameter_openapi_schema=schema, enforce_parameter_schema=True
        ) as deployment,
    ):
        run_id = client.submit(minimal(), deployment="training-pipeline/older")
        sent = api.read_flow_run(run_id).parameters["job"]
        assert sent == parse_job(minimal()).model_dump(mode="json", exclude_unset=True) and "stopping" not in sent
        api.delete_flow_run(run_id)  # no worker runs it
        # sifting's defaults (resolved for the train channel) are the deployed code's to fill in, too
        sifted = client.submit(minimal() | {"sifting": {"enabled": True}}, deployment="training-pipeline/older")
        assert api.read_flow_run(sifted).parameters["job"]["sifting"] == {"enabled": True}
        api.delete_flow_run(sifted)
        newer = minimal() | {"stopping": {"restore_best": False}}
        with pytest.raises(client.DeploymentOutdated, match=r"restore_best.*prefect deploy --all"):
            client.submit(newer, deployment="training-pipeline/older")
        # a pool this API has no train-replica deployment for: refused here, before anything is queued
        elsewhere = minimal() | {"resources": {"work_pool": "trainyard-gpuu"}}
        with pytest.raises(SpecError, match=r"resources.work_pool: 'trainyard-gpuu' has no train-replica/"):
            client.submit(elsewhere, deployment="training-pipeline/older")
        assert api.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment]))) == []
        # a group's run (a pool job's) asked after as if it were a job: named as what it is
        group = api.create_flow_run_from_deployment(
            deployment,
            parameters={"job": sent},
            name="j-7-g0-a0",
            tags=[f"{JOB_TAG}j-7", REPLICA_TAG],
        )
        for ask in (client.status, client.logs, client.stop):
            with pytest.raises(client.RunNotFound, match="is j-7-g0-a0, a replica group's run of job j-7, not"):
                ask(str(group.id))
        api.delete_flow_run(group.id)


def test_a_job_stopped_before_any_worker_started_it_ends_stopped_at_once(prefect_api, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.utilities.callables import parameter_schema

    from flows import client
    from flows.training_pipeline import training_pipeline
    from tests.unit.specs import minimal

    with (
        get_client(sync_client=True) as api,
        _pipeline_deployment(
            api, "unpolled", parameter_openapi_schema=parameter_schema(training_pipeline).model_dump_for_openapi()
        ),
    ):
        run_id = client.submit(minimal(), deployment="training-pipeline/unpolled")
        queued = client.status(run_id)
        assert (queued["status"], queued["secondary_status"]) == ("Scheduled", "Starting")
        assert client.stop(run_id) == [run_id]
        # no job ever ran, so there is no last status event to wait for: wait answers without sleeping
        # (the client's time alone: Prefect's own client sleeps between its retries of a busy API)
        clock = SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: pytest.fail(f"wait slept {s} s"))
        with monkeypatch.context() as patched:
            patched.setattr(client, "time", clock)
            ended = client.wait(run_id)
        assert (ended["status"], ended["secondary_status"]) == ("Stopped", "Stopped")
        assert ended["secondary_status_transitions"] == [] and ended["metrics"] is None


def test_what_is_no_job_is_refused_by_type_and_a_url_without_api_is_named(prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings
    from prefect.utilities.callables import parameter_schema

    from flows import client
    from flows.training_pipeline import training_pipeline
    from tests.unit.specs import minimal

    # a TrainingJob changed without validation (model_copy) is validated again here
    job = parse_job(minimal())
    broken = job.model_copy(update={"hyperparameters": job.hyperparameters.model_copy(update={"epochs": 0})})
    with pytest.raises(SpecError, match="hyperparameters.epochs"):
        client.submit(broken)
    with pytest.raises(client.DeploymentNotFound, match="not one of the training-pipeline flow"):
        client.submit(minimal(), deployment="train-replica/trainyard-gpu")
    with get_client(sync_client=True) as api:
        schema = parameter_schema(training_pipeline).model_dump_for_openapi()
        with _pipeline_deployment(api, "keyed", parameter_openapi_schema=schema) as deployment:
            other = api.create_flow_run(flow=_flow("other-teams-etl"), name="nightly-etl")
            # a key a REST caller first used with a spec the schema took and Trainyard refuses
            bad = minimal(resources={"replicas": 1, "min_replicas": 3})
            api.create_flow_run_from_deployment(deployment, parameters={"job": bad}, idempotency_key="k-rest")
            with pytest.raises(client.IdempotencyKeyReused, match="k-rest"):  # was SpecError, for a valid spec
                client.submit(minimal(), deployment="training-pipeline/keyed", idempotency_key="k-rest")
            # another flow's run is no job to describe, follow or stop (stop cancelled it)
            for ask in (client.status, client.logs, client.stop):
                with pytest.raises(client.RunNotFound, match="a run of flow 'other-teams-etl', not a training job"):
                    ask(str(other.id))
            assert api.read_flow_run(other.id).state.type.value != "CANCELLING"
    root = get_current_settings().api.url.removesuffix("/api")
    with temporary_settings({PREFECT_API_URL: root}), pytest.raises(client.ApiNotSet, match="is not a Prefect API"):
        client.jobs()


def _flow(name: str):
    from prefect import flow

    @flow(name=name)
    def etl() -> None:
        """Another team's flow."""

    return etl


def test_a_run_started_without_a_job_id_keeps_the_id_its_first_try_made(prefect_api):
    # Prefect runs a run again (rescheduled on SIGTERM, a retry): a new id each try made it a second job, tagged
    # twice, registered again, and the first try's status was what callers read
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    from flows import training_pipeline

    @flow
    def tries() -> tuple[str, str, str]:
        first = training_pipeline._run_job_id("churn")
        return first, training_pipeline._run_job_id("churn"), flow_run.get_id()  # the second try's look

    first, second, run_id = tries()
    assert first == second and first.startswith("churn-")
    with get_client(sync_client=True) as api:
        run = api.read_flow_run(run_id)
    assert run.name == first and [t for t in run.tags if t.startswith("trainyard-job:")] == [f"trainyard-job:{first}"]


def test_a_jobs_group_runs_are_all_found_past_the_apis_page_of_200(prefect_api):
    # an elastic job's group attempts (up to 64 groups x 100 attempts): logs and stop saw the API's first 200
    from prefect import flow
    from prefect.client.orchestration import get_client

    from flows import client
    from trainyard.status import JOB_TAG, REPLICA_TAG

    @flow
    def replica() -> None:
        pass

    with get_client(sync_client=True) as api:
        tags = [f"{JOB_TAG}many-1", REPLICA_TAG]
        made = {api.create_flow_run(replica, name=f"group-{i}", tags=tags).id for i in range(205)}
        other = api.create_flow_run(replica, name="another-jobs", tags=[f"{JOB_TAG}many-2", REPLICA_TAG]).id
        try:
            pipeline = SimpleNamespace(parameters={"job_id": "many-1"}, tags=[])
            assert {run.id for run in client._group_runs(api, pipeline)} == made
        finally:  # the harness is the package's: the other flow tests' unfiltered reads would page past theirs
            for run_id in [*made, other]:
                api.delete_flow_run(run_id)


def test_a_stop_landing_as_the_job_ends_leaves_it_ended(prefect_api, monkeypatch):
    # stop reads the run, then asks: a job that ended between the two became Cancelling for good (forced)
    import copy

    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Running

    from flows import client

    with get_client(sync_client=True) as api, _pipeline_deployment(api, "ending") as deployment:
        run = api.create_flow_run_from_deployment(deployment)
        api.set_flow_run_state(run.id, Running(), force=True)
        seen = api.read_flow_run(run.id)  # running, as stop reads it
        api.set_flow_run_state(run.id, Completed(), force=True)  # ...and the job ends
        monkeypatch.setattr(client, "_read_run", lambda _api, _run_id: copy.deepcopy(seen))
        assert client.stop(str(run.id)) == []
        assert api.read_flow_run(run.id).state.type.value == "COMPLETED"


def test_jobs_lists_past_the_apis_page(prefect_api):
    # a limit over 200 was the API's 422, as a traceback-like error (a schedule's runs to come are listed too, as
    # not started: tests/integration/test_deployment.py)
    from datetime import UTC, datetime, timedelta

    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    from flows import client

    with get_client(sync_client=True) as api, _pipeline_deployment(api, "nightly") as deployment:
        ran = api.create_flow_run_from_deployment(deployment)
        tomorrow = api.create_flow_run_from_deployment(
            deployment, state=Scheduled(scheduled_time=datetime.now(UTC) + timedelta(days=1))
        )
        listed = [row["flow_run_id"] for row in client.jobs(250)]
        assert str(ran.id) in listed and str(tomorrow.id) in listed
