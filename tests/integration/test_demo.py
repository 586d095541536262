"""``trainyard demo`` as a user runs it: a fresh TRAINYARD_HOME, no Prefect API configured (the ephemeral
one starts), a local S3 endpoint started and stopped by Trainyard, MLflow on SQLite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

pytestmark = pytest.mark.integration


def test_demo_registers_a_model_whose_run_holds_the_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_", "MLFLOW_"))}
    env |= {"TRAINYARD_HOME": str(tmp_path / "home"), "DO_NOT_TRACK": "1"}
    out = tmp_path / "summary.json"
    trainyard = str(Path(sys.executable).with_name("trainyard"))
    result = subprocess.run(
        [trainyard, "demo", "--rows", "4000", "--epochs", "2", "--summary-out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["status"] == "Completed"
    assert summary["model"]["version"] == 1
    assert summary["model"]["tracking_uri"] == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
    client = mlflow.MlflowClient(summary["model"]["tracking_uri"])
    artifacts = {a.path for a in client.list_artifacts(summary["model"]["run_id"])}
    assert "summary.json" in artifacts
    assert (tmp_path / "home" / "prefect" / summary["job_id"]).is_dir()
    assert "Traceback" not in result.stderr


def test_an_ephemeral_api_that_does_not_start_is_one_message_not_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_", "MLFLOW_"))}
    # No Prefect API can start in 0 s: the user is told what to do instead of reading Prefect's traceback.
    env |= {"TRAINYARD_HOME": str(tmp_path / "home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "0"}
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: no-api\nalgorithm: {builtin: mlp-classifier}\n"
        "inputs: {train: {s3_uri: 's3://bkt/train/', label: y}}\noutput: {s3_uri: 's3://bkt/out/'}\n"
    )
    trainyard = str(Path(sys.executable).with_name("trainyard"))
    result = subprocess.run([trainyard, "run", str(job)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PREFECT_API_URL" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    # a Prefect API set (here in the environment; a profile's alike) that is down: Prefect's words and what to do
    env.pop("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
    env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"  # (the discard port: nothing listens)
    result = subprocess.run([trainyard, "run", str(job)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Failed to reach API at http://127.0.0.1:9/api" in result.stderr and "unset it" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_a_job_told_to_stop_or_killed_leaves_no_server(tmp_path, signal_name):
    """SIGTERM: the job ends Stopped, with its summary. SIGKILL (the OOM killer): nothing it started outlives
    it, the ephemeral Prefect API (a fifth of a core busy, for good) included."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_", "MLFLOW_"))}
    env |= {"TRAINYARD_HOME": str(tmp_path / "home"), "DO_NOT_TRACK": "1"}
    trainyard = str(Path(sys.executable).with_name("trainyard"))
    demo = subprocess.Popen(
        [trainyard, "demo", "--rows", "2000", "--epochs", "500"],
        env=env,
        # not pipes: a server the demo left behind would hold them open
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while not list((tmp_path / "home" / "jobs").glob("*/replicas/0/attempt-0/heartbeat.json")):
            assert demo.poll() is None and time.monotonic() < deadline, "the demo never started training"
            time.sleep(0.5)
        children = [int(p.name) for p in Path("/proc").glob("[0-9]*") if _parent(p) == demo.pid]
        servers = [pid for pid in children if re.search(rb"moto.server|uvicorn", _cmdline(pid))]
        assert len(servers) == 2, "the demo's S3 endpoint and Prefect API were not found"
        demo.send_signal(getattr(signal, signal_name))
        # within Kubernetes' default grace (30 s) before SIGKILL; the job's last logs once held it 80 s
        demo.wait(timeout=30)
    finally:
        demo.kill()
    if signal_name == "SIGTERM":
        (summary_path,) = (tmp_path / "home" / "jobs").glob("*/summary.json")
        summary = json.loads(summary_path.read_text())
        assert summary["status"] == "Stopped" and summary["failure_reason"] == "Terminated"
        assert "training" in summary["timings"]
    left = servers if signal_name == "SIGTERM" else children  # killed: the lighthouse and the groups too
    deadline = time.monotonic() + 15
    while any(_cmdline(pid) for pid in left) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = {pid: _cmdline(pid).replace(b"\0", b" ")[:200] for pid in left if _cmdline(pid)}
    assert not survivors, f"a process the job started outlived it: {survivors}"


def _cmdline(pid: int) -> bytes:
    """A live process's command line; empty once it is gone (or a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parent(proc: Path) -> int | None:
    try:
        for line in (proc / "status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
