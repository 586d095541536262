"""Registration against a real ``mlflow server`` over HTTP: SQLite database backend, artifacts proxied to
the local S3 endpoint. Lineage on the version, the promotion gate, exactly once under retries, and a
server that is down or fails mid-registration leaving nothing half-made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from tasks._metering import retry_transient
from tests.fault_proxy import FaultProxy
from tests.unit.models import fit
from trainyard import registry, s3
from trainyard.servers import free_port, stop_process, wait_until_answering
from trainyard.spec import parse_job

pytestmark = pytest.mark.integration

# Fail in seconds, not minutes, when the server is away (MLflow's own default retries for ~4 minutes).
FAST_FAIL_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"}


@pytest.fixture(scope="module")
def mlflow_server(s3_server, tmp_path_factory):
    """``mlflow server`` on 127.0.0.1 with a SQLite backend and artifacts on s3://<bucket>/mlartifacts."""
    bucket = f"mlflow-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = {**os.environ, **s3_server.env, "MLFLOW_S3_ENDPOINT_URL": s3_server.endpoint_url}
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow_cli), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"]
    command += ["--artifacts-destination", f"s3://{bucket}/mlartifacts"]
    with open(folder / "server.log", "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    problem = wait_until_answering(f"{url}/health", proc, timeout_seconds=120)
    if problem:
        stop_process(proc)
        pytest.fail(f"mlflow server {problem}:\n{(folder / 'server.log').read_text()[-3000:]}")
    yield {"url": url, "bucket": bucket}
    stop_process(proc)


@pytest.fixture
def tracking(mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server["url"])
    return mlflow_server["url"]


def blobs(seed: int, rows: int = 400):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int64)


def trained(model_name: str, steps: int = 60, **promote_if):
    x, y = blobs(0)
    job = parse_job(
        {
            "name": "server-test",
            "algorithm": {"builtin": "mlp-classifier"},
            "hyperparameters": {"hidden_sizes": [8]},
            "inputs": {
                "train": {"s3_uri": "s3://bkt/t/", "label": "y"},
                "validation": {"s3_uri": "s3://bkt/v/", "label": "y"},
            },
            "output": {"s3_uri": "s3://bkt/o/"},
            "registry": {"model_name": model_name, "promote_if": {"metric": "val_accuracy", **promote_if}},
        }
    )
    return job, fit(job, x, y, steps), x


def lineage(emissions_kg: float = 0.001) -> dict[str, str]:
    return {
        "data.train.uri": "s3://bkt/t/",
        "data.train.manifest_digest": "sha256:train",
        "data.validation.uri": "s3://bkt/v/",
        "data.validation.manifest_digest": "sha256:val",
        "compute.flops_total": "1234",
        "carbon.energy_kwh": "0.01",
        "carbon.emissions_kg": str(emissions_kg),
        "prefect.flow_run_id": "flow-run-1",
        "prefect.deployment_name": "none",
        "elastic.recoveries": "0",
        "sifting.enabled": "false",
    }


def register(job, model, x, job_id, accuracy, tmp_path, emissions_kg=0.001):
    plot = tmp_path / f"{job_id}.png"
    plot.write_bytes(b"\x89PNG")
    history = [{"epoch": 1, "train_loss": 0.5, "val_accuracy": accuracy}]
    return registry.register(
        model, job, job_id, x[:5], history, {"hp.seed": 0}, lineage(emissions_kg), {"curves": plot}
    )


def accuracy(predictions, y) -> float:
    return float((np.asarray(predictions).argmax(axis=1) == y).mean())


def test_version_carries_lineage_and_card_and_the_champion_loads_back(tracking, mlflow_server, tmp_path):
    job, model, _ = trained("lineage-model")
    x_val, y_val = blobs(1, rows=200)  # the validation channel
    val_accuracy = accuracy(model(torch.from_numpy(x_val)).detach().numpy(), y_val)
    info = register(job, model, x_val, "job-lineage", val_accuracy, tmp_path)
    assert info["aliases"] == ["champion"] and info["tracking_uri"] == tracking

    version = mlflow.MlflowClient(tracking).get_model_version("lineage-model", str(info["version"]))
    tags = version.tags
    assert tags["trainyard.job_id"] == "job-lineage" and tags["approval_status"] == "PendingManualApproval"
    assert tags["data.train.manifest_digest"] == "sha256:train" and tags["data.validation.uri"] == "s3://bkt/v/"
    assert tags["trainyard.code_version"].startswith(("git:", "trainyard=="))
    assert '"model_name":"lineage-model"' in tags["trainyard.job_spec"]
    assert tags["carbon.emissions_kg"] == "0.001" and tags["compute.flops_total"] == "1234"
    assert float(tags["metrics.val_accuracy"]) == pytest.approx(val_accuracy, abs=1e-5)
    assert "## Data" in version.description and "sha256:val" in version.description

    # The artifacts went through the server to S3: the model and its card are in the bucket.
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=mlflow_server["bucket"])["Contents"]]
    assert any(k.endswith("/MLmodel") for k in keys) and any(k.endswith("/model_card.md") for k in keys)

    loaded = mlflow.pyfunc.load_model("models:/lineage-model@champion")
    assert accuracy(loaded.predict(x_val), y_val) == pytest.approx(val_accuracy, abs=1e-6)


def test_a_password_in_the_tracking_uri_is_not_printed(mlflow_server, tmp_path, monkeypatch, capfd):
    # MLflow printed "View run ... at: http://user:password@host/..." to stdout for every run it ended
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server["url"].replace("http://", "http://ci:TRACKINGPW@"))
    job, model, x = trained("password-model", steps=5)
    info = register(job, model, x, "job-password", 0.5, tmp_path)
    out, err = capfd.readouterr()
    assert "TRACKINGPW" not in out + err and "TRACKINGPW" not in json.dumps(info)


def test_gate_promotes_a_better_model_and_keeps_worse_ones_off_champion(tracking, tmp_path):
    job, model, x = trained("gated-model", min_gain=0.01, max_emissions_kg=1.0)
    client = mlflow.MlflowClient(tracking)
    assert register(job, model, x, "g1", 0.80, tmp_path)["aliases"] == ["champion"]
    small = register(job, model, x, "g2", 0.805, tmp_path)  # better, but by less than min_gain
    assert small["aliases"] == ["candidate"] and "does not beat" in small["gate"]
    dirty = register(job, model, x, "g3", 0.95, tmp_path, emissions_kg=5.0)  # better, over the carbon ceiling
    assert dirty["aliases"] == ["candidate"] and "ceiling" in dirty["gate"]
    better = register(job, model, x, "g4", 0.90, tmp_path)
    assert better["aliases"] == ["champion"]
    assert str(client.get_model_version_by_alias("gated-model", "champion").version) == str(better["version"])


def test_a_retried_registration_makes_no_duplicate(tracking, tmp_path):
    job, model, x = trained("retried-model")
    first = register(job, model, x, "job-retry", 0.9, tmp_path)
    again = register(job, model, x, "job-retry", 0.9, tmp_path)
    assert again["version"] == first["version"] and again["run_id"] == first["run_id"]
    assert len(mlflow.MlflowClient(tracking).search_model_versions("name='retried-model'")) == 1


def test_server_down_fails_clearly_is_retried_and_leaves_nothing_half_made(tracking, tmp_path, monkeypatch):
    for key, value in FAST_FAIL_ENV.items():
        monkeypatch.setenv(key, value)
    job, model, x = trained("outage-model")
    client = mlflow.MlflowClient(tracking)

    # Down before anything is made: nothing answers on the port.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(registry.RegistryUnavailable) as down:
        register(job, model, x, "job-outage", 0.9, tmp_path)
    assert down.value.transient and "unavailable" in str(down.value)
    assert _task_would_retry(down.value)

    # Down in the middle: the run and the model's artifacts are logged, then creating the version fails.
    with FaultProxy(tracking) as proxy:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.endpoint_url)
        proxy.drop(100, key="model-versions/create")
        with pytest.raises(registry.RegistryUnavailable):
            register(job, model, x, "job-outage", 0.9, tmp_path)
        assert proxy.applied["drop"] >= 1
        assert client.search_model_versions("name='outage-model'") == []  # no version, so none without artifacts
        failed_runs = client.search_runs(
            [client.get_experiment_by_name("server-test").experiment_id], "tags.`trainyard.job_id` = 'job-outage'"
        )
        assert len(failed_runs) == 1

        proxy.clear_faults()  # the server is back: the task's retry registers it, once
        info = register(job, model, x, "job-outage", 0.9, tmp_path)
    assert [v.version for v in client.search_model_versions("name='outage-model'")] in ([1], ["1"])
    assert client.get_run(failed_runs[0].info.run_id).info.lifecycle_stage == "deleted"
    files = {a.path.rsplit("/", 1)[-1] for a in mlflow.artifacts.list_artifacts(artifact_uri=info["source"])}
    assert "MLmodel" in files


def _task_would_retry(exc: Exception) -> bool:
    """What the registry task's retry condition decides for a task run that raised ``exc``."""

    class FailedState:
        def result(self):
            raise exc

    return retry_transient(None, None, FailedState())
