"""Helpers for the spec tests: a minimal valid job, and the problems a bad one is refused with."""

from __future__ import annotations

import textwrap

import pytest

from trainyard.errors import SpecError
from trainyard.spec import parse_job

# the spec DESIGN.md shows, every section set
DESIGN_EXAMPLE = textwrap.dedent(
    """
    name: churn-mlp
    algorithm: {builtin: mlp-classifier}
    hyperparameters: {epochs: 10, batch_size: 256, learning_rate: 0.001, hidden_sizes: [128, 128],
                      weight_decay: 0.0, seed: 0}
    inputs:
      train: {s3_uri: "s3://bucket/churn/train/", format: parquet, label: churned}
      validation: {s3_uri: "s3://bucket/churn/val/", format: parquet, label: churned}
    output: {s3_uri: "s3://bucket/churn/output/"}
    resources: {replicas: 2, min_replicas: 1, max_replicas: 4, work_pool: local}
    sifting: {enabled: true}
    elastic: {fault_injection: [{replica: 1, at_step: 40, kind: kill}]}
    stopping: {max_runtime_seconds: 3600, target_metric: {name: val_accuracy, value: 0.95}, patience_epochs: 3}
    carbon: {country_iso_code: IRL, pue: 1.2, budget_kg: 5.0}
    registry: {model_name: churn-mlp, promote_if: {metric: val_accuracy, mode: max}}
    retries: {max_attempts: 3}
    """
)


def minimal(**changes) -> dict:
    job = {
        "name": "j",
        "algorithm": {"builtin": "mlp-classifier"},
        "inputs": {"train": {"s3_uri": "s3://bkt/train/", "label": "y"}},
        "output": {"s3_uri": "s3://bkt/out/"},
    }
    job.update(changes)
    return job


def problems(data) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_job(data)
    return info.value.problems
