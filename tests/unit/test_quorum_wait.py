"""A survivor that needs a failed group for its next step (``resources.min_replicas``) waits for the restart in
torchft's quorum, longer than the supervisor takes to find the failure and bring the group back
(``trainyard.training.restarts``): real replica processes and a lighthouse, no Prefect."""

from __future__ import annotations

import pytest

from tests.unit.jobs import make_job, run
from trainyard.training import restarts


@pytest.mark.timeout(300)
def test_a_survivor_needing_a_hung_group_outwaits_its_restart_and_heals_it(trainyard_home, monkeypatch):
    # Group 0 hangs at step 10; with min_replicas 2, group 1 can take no step without it and waits in the
    # quorum. The hang is found after 80 s of silence (over the minute torchft's quorum used to be given):
    # the survivor must still be there to heal the restart, not fail as well and leave both to begin at step 0.
    monkeypatch.setenv(restarts.SILENT_GROUP_SECONDS_ENV, "80")
    job, *rest = make_job(
        trainyard_home,
        resources={"replicas": 2, "min_replicas": 2},
        elastic={"fault_injection": [{"replica": 0, "at_step": 10, "kind": "hang"}]},
    )
    outcome, _ = run(job, *rest)
    assert outcome.stop_reason == "Completed"
    # the survivor did not fail
    assert [(f["replica"], "hung" in f["message"]) for f in outcome.failures] == [(0, True)]
    (recovery,) = outcome.recoveries
    assert recovery["source"] == "peer" and recovery["failed_at_step"] == 10 and recovery["rejoined_at_step"] >= 10
    assert outcome.replicas_finished == [0, 1] and outcome.steps == 40


def test_the_quorum_outlasts_finding_a_hung_group_its_backoff_and_its_start(monkeypatch):
    monkeypatch.setenv(restarts.SILENT_GROUP_SECONDS_ENV, "300")
    silent = restarts.silent_seconds_limit()
    for pool, start in (("local", restarts.LOCAL_START_SECONDS), ("gpu-pool", restarts.POOL_START_SECONDS)):
        assert restarts.quorum_timeout_seconds(silent, pool) >= 300 + restarts.MOST_BACKOFF_SECONDS + start
    # the backoff doubles per attempt up to its ceiling: retries.max_attempts goes to 100
    waits = [restarts.backoff_seconds(attempt) for attempt in range(100)]
    assert waits[:3] == [0.5, 1.0, 2.0] and max(waits) == restarts.MOST_BACKOFF_SECONDS
    assert restarts.backoff_seconds(3, base=600.0) == 600.0  # a base over the ceiling is kept, not cut


@pytest.mark.timeout(120)
def test_a_group_that_leaves_a_job_needing_it_ends_the_job_at_once(trainyard_home):
    # a spot interruption notice (SIGTERM) makes group 1 leave, and a group that left is never restarted: with
    # min_replicas 2, group 0 would wait out its quorum timeout (minutes now) before the job failed
    import time

    from trainyard.errors import TrainingError

    job, *rest = make_job(
        trainyard_home,
        hyperparameters={"epochs": 30, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
        resources={"replicas": 2, "min_replicas": 2},
        elastic={"fault_injection": [{"replica": 1, "at_step": 15, "kind": "term"}]},
    )
    started = time.monotonic()
    with pytest.raises(TrainingError, match=r"replica group\(s\) 1 left the job \(SIGTERM\), leaving 1 group\(s\)"):
        run(job, *rest)
    assert time.monotonic() - started < 90  # (a group start under load counts; the quorum would wait 240 s)
