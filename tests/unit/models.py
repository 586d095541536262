"""Models for the registry's tests: a small trained classifier, its job, and registering it (in the store
the ``tracking`` fixture of ``tests/conftest.py`` names)."""

from __future__ import annotations

import numpy as np
import torch

from trainyard import algorithms, registry
from trainyard.spec import parse_job


def trained(seed: int = 0, steps: int = 60):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(400, 3)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    job = parse_job(
        {
            "name": "reg-test",
            "algorithm": {"builtin": "mlp-classifier"},
            "hyperparameters": {"hidden_sizes": [8], "seed": seed},
            "inputs": {
                "train": {"s3_uri": "s3://bkt/t/", "label": "y"},
                "validation": {"s3_uri": "s3://bkt/v/", "label": "y"},
            },
            "output": {"s3_uri": "s3://bkt/o/"},
            "registry": {"promote_if": {"metric": "val_accuracy", "mode": "max"}},
        }
    )
    return job, fit(job, x, y, steps), x


def fit(job, x: np.ndarray, y: np.ndarray, steps: int) -> torch.nn.Module:
    """``job``'s built-in model, trained full-batch for ``steps`` steps, in eval mode."""
    model, loss_fn = algorithms.build(job.algorithm, job.hyperparameters, x, y, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)).mean().backward()
        opt.step()
    return model.eval()


def register(job, model, x, job_id, accuracy, tmp_path, tags: dict | None = None):
    """Register ``model`` as job ``job_id``'s, its final ``val_accuracy`` ``accuracy``; ``tags``: lineage tags
    beside the training channel's digest."""
    plot = tmp_path / f"{job_id}.png"
    plot.write_bytes(b"\x89PNG")
    history = [{"epoch": 1, "train_loss": 0.5, "val_accuracy": accuracy}]
    lineage = {"data.train.manifest_digest": "d", **(tags or {})}
    return registry.register(model, job, job_id, x[:5], history, {"hp.seed": 0}, lineage, {"curves": plot})
