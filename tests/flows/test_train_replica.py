"""The ``train-replica`` flow: what a group run on a work pool sees before its entrypoint starts."""

from __future__ import annotations

import os

import pytest

from flows import train_replica as flow_module
from trainyard.training import replica as entrypoint


@pytest.mark.parametrize(("gpus_per_replica", "seen"), [(0, ""), (1, "0,1"), (None, "0,1")])
def test_a_cpu_jobs_group_on_a_gpu_worker_sees_no_gpu(prefect_api, monkeypatch, tmp_path, gpus_per_replica, seen):
    # The worker's flow-run process inherits the GPUs the pool gives it; monkeypatch restores the variable
    # after the test (the flow sets it in its own process, as a real run does in the worker's child).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    saw = {}

    def group(argv):
        saw["argv"], saw["visible"] = argv, os.environ.get("CUDA_VISIBLE_DEVICES")
        return 0

    monkeypatch.setattr(entrypoint, "main", group)
    code = flow_module.train_replica(job_dir=str(tmp_path), replica=1, attempt=2, gpus_per_replica=gpus_per_replica)
    assert code == 0
    assert saw["argv"] == ["--job-dir", str(tmp_path), "--replica", "1", "--attempt", "2"]
    assert saw["visible"] == seen
