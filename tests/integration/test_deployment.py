"""The deployed path, as a platform team runs it: a real ``prefect server`` on 127.0.0.1, the pools from
``trainyard infra apply``, the deployments from ``prefect.yaml``, one process worker for the pipeline and
two for the replica groups. Jobs come in as another service would send them: ``run_deployment``,
``trainyard.client.submit`` and Prefect's REST API; replica groups run as ``train-replica`` flow runs."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest
from typer.testing import CliRunner

from tests.conftest import job_dict, upload_dataset
from tests.integration.conftest import PREFECT, REPO
from trainyard import client
from trainyard.cli import app

pytestmark = pytest.mark.integration
GPU_POOL = "trainyard-gpu"


@pytest.fixture(scope="module")
def deployed(prefect_server, tmp_path_factory):
    """Pools applied, two deployments deployed, three workers running; yields (url, mlflow uri, home)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url, env, home = prefect_server
    mlflow_uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    # Workers look for runs every second (default 10): groups start as soon as they are submitted.
    env = {**env, "MLFLOW_TRACKING_URI": mlflow_uri, "PREFECT_WORKER_QUERY_SECONDS": "1", "TRAINYARD_STEP_LOG": "1"}
    applied = CliRunner().invoke(app, ["infra", "apply", "--api-url", url, "--gpus-per-pool", "4"])
    assert applied.exit_code == 0, applied.output
    for name in ("on-demand", GPU_POOL):
        subprocess.run([PREFECT, "--no-prompt", "deploy", "--name", name], env=env, cwd=REPO, check=True)
    workers = []
    for pool, n in (("trainyard-process", 1), (GPU_POOL, 2)):
        for i in range(n):
            log = open(home / f"worker-{pool}-{i}.log", "wb")  # noqa: SIM115 - closed with the worker
            command = [PREFECT, "worker", "start", "--pool", pool]
            workers.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=log))
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            yield url, mlflow_uri, home
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=30)


def _summary(job_id: str) -> dict:
    return json.loads((Path(os.environ["TRAINYARD_HOME"]) / "jobs" / job_id / "summary.json").read_text())


def _replica_runs(job_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as api:
        tags = FlowRunFilterTags(all_=[f"trainyard-job:{job_id}", "trainyard-replica"])
        return api.read_flow_runs(flow_run_filter=FlowRunFilter(tags=tags))


def _logs(home: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(home.glob("worker-*.log")))


def test_run_deployment_runs_the_pipeline(deployed, bucket):
    from prefect.deployments import run_deployment

    url, mlflow_uri, home = deployed
    spec = job_dict(upload_dataset(bucket, rows=400))
    spec["name"] = "deployed-job"
    run = run_deployment("training-pipeline/on-demand", parameters={"job": spec}, timeout=300)
    assert run.state.is_completed(), (run.state, _logs(home))
    summary = _summary(run.name)  # a run started without a job id is named after the one it made
    assert summary["status"] == "Completed"
    assert summary["prefect_flow_run_id"] == str(run.id)
    assert mlflow.MlflowClient(mlflow_uri).get_registered_model("deployed-job").name == "deployed-job"


def test_groups_run_as_flow_runs_and_a_killed_one_is_resubmitted_and_heals(deployed, bucket):
    url, _, home = deployed
    spec = job_dict(upload_dataset(bucket, rows=800), resources={"replicas": 2, "work_pool": GPU_POOL})
    # 10 ms steps, 3,000 of them: the survivor is still training when the resubmitted run starts (~15 s)
    spec["algorithm"] = {"entrypoint": "tests.unit.test_training:slow_build"}
    spec["hyperparameters"]["epochs"] = 300
    spec["elastic"] = {"fault_injection": [{"replica": 1, "at_step": 30, "kind": "kill"}]}
    submitted = time.time()
    run_id = client.submit(spec)
    final = client.wait(run_id, timeout_seconds=400)
    assert final["status"] == "Completed", (final, _logs(home))
    assert [t["status"] for t in final["secondary_status_transitions"]][-1] == "Completed"
    summary = _summary(final["job_id"])
    runs = _replica_runs(final["job_id"])
    # groups 0 and 1, then group 1's resubmission after its process was killed (Crashed)
    assert sorted((r.parameters["replica"], r.parameters["attempt"]) for r in runs) == [(0, 0), (1, 0), (1, 1)]
    states = {(r.parameters["replica"], r.parameters["attempt"]): r.state.type.value for r in runs}
    assert states[(1, 0)] == "CRASHED" and states[(1, 1)] == "COMPLETED" and states[(0, 0)] == "COMPLETED"
    (recovery,) = summary["elastic"]["recoveries"]
    assert recovery["source"] == "peer" and recovery["failed_at_step"] == 30
    assert summary["training"]["replicas_finished"] == [0, 1]
    # The launch overhead, for the record (not a test target): submit to the first step of a group.
    beats = Path(os.environ["TRAINYARD_HOME"]).glob(f"jobs/{final['job_id']}/replicas/*/attempt-0/steps.jsonl")
    first_step = min(json.loads(p.read_text().splitlines()[0])["unix"] for p in beats)
    print(f"launch overhead: {first_step - submitted:.1f} s from submit to the first committed step")


def test_a_job_submitted_through_the_rest_api_completes(deployed, bucket):
    url, _, home = deployed
    spec = job_dict(upload_dataset(bucket, rows=400))
    spec["name"] = "rest-job"
    with urllib.request.urlopen(f"{url}/deployments/name/training-pipeline/on-demand") as response:
        deployment = json.load(response)
    request = urllib.request.Request(
        f"{url}/deployments/{deployment['id']}/create_flow_run",
        data=json.dumps({"parameters": {"job": spec}}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request) as response:
        run_id = json.load(response)["id"]
    final = client.wait(run_id, timeout_seconds=300)
    assert final["status"] == "Completed", (final, _logs(home))
    assert _summary(final["job_id"])["status"] == "Completed"


def test_stop_cancels_the_pipeline_and_every_group(deployed, bucket):
    url, _, home = deployed
    spec = job_dict(upload_dataset(bucket, rows=400), resources={"replicas": 2, "work_pool": GPU_POOL})
    spec["hyperparameters"]["epochs"] = 100_000
    run_id = client.submit(spec)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        job_id = client.status(run_id)["job_id"]
        if len([r for r in _replica_runs(job_id) if r.state and r.state.is_running()]) == 2:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the groups never ran: {_logs(home)}")
    result = CliRunner().invoke(app, ["jobs", "stop", run_id])
    assert result.exit_code == 0 and "cancelled 3 run(s)" in result.output, result.output
    final = client.wait(run_id, timeout_seconds=120)
    assert final["status"] == "Stopped"
    deadline = time.monotonic() + 60
    while any(not r.state.is_final() for r in _replica_runs(job_id)) and time.monotonic() < deadline:
        time.sleep(1)
    assert all(r.state.type.value == "CANCELLED" for r in _replica_runs(job_id))
