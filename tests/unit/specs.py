"""Helpers for the spec tests: a minimal valid job, and the problems a bad one is refused with."""

from __future__ import annotations

import pytest

from trainyard.errors import SpecError
from trainyard.spec import parse_job


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
