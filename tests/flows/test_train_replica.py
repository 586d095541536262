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


def test_a_failed_group_fails_its_run_with_the_groups_own_message_and_no_traceback(
    prefect_api, monkeypatch, tmp_path, caplog
):
    from prefect.client.orchestration import get_client
    from prefect.states import State

    from trainyard.errors import TrainingError
    from trainyard.home import write_json_atomic
    from trainyard.training.plan import attempt_dir

    def group(argv):
        out = attempt_dir(tmp_path, 1, 2)
        write_json_atomic(out / "counts.json", {"step": 7})
        message = "DataError: s3://bkt/t/a.parquet: NaN label in row 3"
        write_json_atomic(out / "error.json", {"message": message, "kind": "DataError", "user_error": True})
        return 1

    monkeypatch.setattr(entrypoint, "main", group)
    state = flow_module.train_replica(job_dir=str(tmp_path), replica=1, attempt=2, return_state=True)
    assert isinstance(state, State) and state.is_failed()
    with pytest.raises(TrainingError, match="failed at step 7: DataError"):
        state.result()
    assert "Traceback" not in caplog.text  # was Prefect's, of the flow's own raise: "see its error.json"
    expected = "replica group 1 attempt 2 failed at step 7: DataError: s3://bkt/t/a.parquet: NaN label in row 3"
    assert state.message == expected
    with get_client(sync_client=True) as client:  # what the launcher reads: a Failed run, resubmitted
        assert client.read_flow_run(state.state_details.flow_run_id).state.type.value == "FAILED"
