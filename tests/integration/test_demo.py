"""``trainyard demo`` as a user runs it: a fresh TRAINYARD_HOME, no Prefect API configured (the ephemeral
one starts), a local S3 endpoint started and stopped by Trainyard, MLflow on SQLite."""

from __future__ import annotations

import json
import os
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
