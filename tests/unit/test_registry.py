"""Registration in a real MLflow store (SQLite): any batch size, exactly once per job, the champion gate."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest
import torch

from trainyard import algorithms, registry
from trainyard.spec import parse_job


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def trained(seed: int = 0, steps: int = 60):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(400, 3)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    job = parse_job(
        {
            "name": "reg-test",
            "algorithm": {"builtin": "mlp-classifier"},
            "hyperparameters": {"hidden_sizes": [8], "seed": seed},
            "inputs": {"train": {"s3_uri": "s3://bkt/t/", "label": "y"}},
            "output": {"s3_uri": "s3://bkt/o/"},
            "registry": {"promote_if": {"metric": "val_accuracy", "mode": "max"}},
        }
    )
    model, loss_fn = algorithms.build(job.algorithm, job.hyperparameters, x, y, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)).mean().backward()
        opt.step()
    return job, model.eval(), x


def register(job, model, x, job_id, accuracy, tmp_path):
    plot = tmp_path / f"{job_id}.png"
    plot.write_bytes(b"\x89PNG")
    history = [{"epoch": 1, "train_loss": 0.5, "val_accuracy": accuracy}]
    return registry.register(
        model, job, job_id, x[:5], history, {"hp.seed": 0}, {"data.train.manifest_digest": "d"}, {"curves": plot}
    )


def test_registered_model_predicts_on_any_batch_size(tracking, tmp_path):
    job, model, x = trained()
    info = register(job, model, x, "job-1", 0.9, tmp_path)
    assert info["version"] == 1 and info["aliases"] == ["champion"]
    assert info["approval_status"] == "PendingManualApproval"
    loaded = mlflow.pyfunc.load_model(info["uri"])
    for n in (1, 7, 300):
        got = loaded.predict(x[:n])
        want = model(torch.from_numpy(x[:n])).detach().numpy()
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    version = mlflow.MlflowClient(tracking).get_model_version("reg-test", "1")
    assert version.tags["trainyard.job_id"] == "job-1"
    assert version.tags["data.train.manifest_digest"] == "d"


def test_registering_the_same_job_twice_makes_one_version(tracking, tmp_path):
    job, model, x = trained()
    first = register(job, model, x, "job-7", 0.9, tmp_path)
    again = register(job, model, x, "job-7", 0.9, tmp_path)
    assert again["version"] == first["version"]
    assert len(mlflow.MlflowClient(tracking).search_model_versions("name='reg-test'")) == 1


def test_champion_moves_only_to_a_better_model(tracking, tmp_path):
    job, model, x = trained()
    assert register(job, model, x, "a", 0.80, tmp_path)["aliases"] == ["champion"]
    assert register(job, model, x, "b", 0.70, tmp_path)["aliases"] == ["candidate"]
    assert register(job, model, x, "c", 0.85, tmp_path)["aliases"] == ["champion"]
    client = mlflow.MlflowClient(tracking)
    assert int(client.get_model_version_by_alias("reg-test", "champion").version) == 3
