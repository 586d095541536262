"""The deployed path: a real ``prefect server`` and process worker on 127.0.0.1 run the pipeline from
``prefect.yaml``, submitted programmatically with ``run_deployment`` (as another service would)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest

from tests.conftest import job_dict, upload_dataset
from trainyard.servers import free_port

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
pytestmark = pytest.mark.integration


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_seconds: float = 90) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, "prefect server exited at start"
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"prefect server not healthy at {url}")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory, s3_server):
    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_UI_ENABLED": "false",
    }
    with open(home / "server.log", "wb") as log:
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_healthy(url, server)
        yield url, env, home
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_process_worker_runs_the_deployed_pipeline(prefect_server, bucket, tmp_path):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url, env, home = prefect_server
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**env, "MLFLOW_TRACKING_URI": mlflow_uri}
    subprocess.run(
        [
            PREFECT,
            "work-pool",
            "create",
            "trainyard-process",
            "--type",
            "process",
            "--base-job-template",
            str(REPO / "infra/process-pool.json"),
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [PREFECT, "--no-prompt", "deploy", "--name", "on-demand"], env=env, cwd=REPO, check=True, capture_output=True
    )
    with open(home / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", "trainyard-process", "--limit", "1"],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        uris = upload_dataset(bucket, rows=400)
        spec = job_dict(uris)
        spec["name"] = "deployed-job"
        with temporary_settings({PREFECT_API_URL: url}):
            run = run_deployment("training-pipeline/on-demand", parameters={"job": spec}, timeout=300)
        assert run.state.is_completed(), (run.state, (home / "worker.log").read_text()[-3000:])
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    summaries = list(Path(os.environ["TRAINYARD_HOME"]).glob("jobs/deployed-job-*/summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["status"] == "Completed"
    assert summary["prefect_flow_run_id"] == str(run.id)
    assert summary["model"]["name"] == "deployed-job"
    assert mlflow.MlflowClient(mlflow_uri).get_registered_model("deployed-job").name == "deployed-job"
