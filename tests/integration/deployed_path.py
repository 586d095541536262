"""What the deployed-path tests share: the ``deployed`` fixture (a real ``prefect server``, the pools from
``trainyard infra apply``, the deployments from ``prefect.yaml`` and four process workers) and helpers that
read a job's summary, its groups' flow runs and folders, and the workers' logs."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows import client
from tests.integration.conftest import PREFECT, REPO
from trainyard.cli import app

GPU_POOL = "trainyard-gpu"


@pytest.fixture(scope="module")
def deployed(prefect_server, tmp_path_factory):
    """Pools applied, the deployments deployed, four workers running; yields (url, mlflow uri, home,
    GPU-pool worker processes). Each GPU-pool worker runs one group at a time (one node with one
    group's GPUs): two run a job's groups and the third is the spare a lost group is resubmitted to."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url, env, home = prefect_server
    mlflow_uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    # Workers look for runs every second (default 10): groups start as soon as they are submitted.
    # A group silent for 12 s is taken for lost (120 s in production: long collectives, slow steps).
    env = {
        **env,
        "MLFLOW_TRACKING_URI": mlflow_uri,
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "TRAINYARD_STEP_LOG": "1",
        "TRAINYARD_SILENT_GROUP_SECONDS": "12",
    }
    applied = CliRunner().invoke(app, ["infra", "apply", "--api-url", url, "--gpus-per-pool", "4"])
    assert applied.exit_code == 0, applied.output
    # as the README deploys them: every deployment in prefect.yaml, in one process
    subprocess.run([PREFECT, "--no-prompt", "deploy", "--all"], env=env, cwd=REPO, check=True)
    workers = []
    for pool, n, limit in (("trainyard-process", 1, []), (GPU_POOL, 3, ["--limit", "1"])):
        for i in range(n):
            log = open(home / f"worker-{pool}-{i}.log", "wb")  # noqa: SIM115 - closed with the worker
            command = [PREFECT, "worker", "start", "--pool", pool, *limit]
            workers.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=log))
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            yield url, mlflow_uri, home, workers[1:]
    finally:
        for worker in workers:
            worker.terminate()
        # One deadline for all four, not 30 s each: three of them outlived SIGTERM by 30 s each (90 s of
        # teardown, measured on 2026-12-02). What the tests check has been checked by now, so a worker
        # still there is killed.
        deadline = time.monotonic() + 10
        for worker in workers:
            try:
                worker.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(timeout=30)


def summary_of(job_id: str) -> dict:
    return json.loads((Path(os.environ["TRAINYARD_HOME"]) / "jobs" / job_id / "summary.json").read_text())


def replica_runs(job_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as api:
        tags = FlowRunFilterTags(all_=[f"trainyard-job:{job_id}", "trainyard-replica"])
        return api.read_flow_runs(flow_run_filter=FlowRunFilter(tags=tags))


def attempt_folder(run_id: str, replica: int, attempt: int) -> Path:
    """A group attempt's folder, once the pipeline run has made its job (a folder that isn't there before)."""
    job_id = client.status(run_id).get("job_id")
    return Path(os.environ["TRAINYARD_HOME"]) / "jobs" / str(job_id) / "replicas" / str(replica) / f"attempt-{attempt}"


def worker_logs(home: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(home.glob("worker-*.log")))


def rest(request: urllib.request.Request, attempts: int = 5) -> dict:
    """One call to the Prefect REST API, as another service makes it: a 503 (the server's SQLite busy
    under the workers' load) is retried with backoff, as Prefect's own client does."""
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or attempt == attempts - 1:
                raise
            time.sleep(2**attempt)
    raise AssertionError("unreachable")


def pool_room(url: str, groups: int) -> None:
    """Room for ``groups`` groups on the GPU pool, as its platform team sets it."""
    applied = CliRunner().invoke(app, ["infra", "apply", "--api-url", url, "--gpus-per-pool", str(groups)])
    assert applied.exit_code == 0, applied.output
