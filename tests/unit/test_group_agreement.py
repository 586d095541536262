"""Replica groups that must agree, with real group processes and a lighthouse: on a model's buffers (BatchNorm),
on how a job that finished in its last step ended, through a heal whose transfer broke, and through a validation
longer than the silence that marks a group hung."""

from __future__ import annotations

import json

from tests.conftest import rejoined, slow_until
from tests.unit.jobs import make_job, run
from trainyard.training.plan import attempt_dir


def _results(folder, replicas=(0, 1)) -> list[dict]:
    """Each group's result.json, of its last attempt."""
    results = []
    for replica in replicas:
        attempts = sorted((folder / "replicas" / str(replica)).glob("attempt-*"), key=lambda p: int(p.name[8:]))
        results.append(json.loads((attempts[-1] / "result.json").read_text()))
    return results


def test_groups_average_a_batch_norms_statistics_so_they_validate_and_end_as_one_model(trainyard_home):
    job, job_id, folder, plan = make_job(trainyard_home, algorithm={"entrypoint": "tests.unit.jobs:batch_norm_build"})
    outcome, _ = run(job, job_id, folder, plan)  # refused before: "ended with different parameters"
    assert outcome.stop_reason == "Completed" and not outcome.failures
    first, second = _results(folder)
    assert [e["val_loss"] for e in first["epochs"]] == [e["val_loss"] for e in second["epochs"]]
    import torch

    models = [torch.load(attempt_dir(folder, r, 0) / "model.pt", weights_only=True) for r in (0, 1)]
    for key in ("1.running_mean", "1.running_var"):
        assert torch.equal(models[0][key], models[1][key]), key


def test_a_group_told_to_leave_in_the_jobs_last_step_leaves_it_completed(trainyard_home):
    job, job_id, folder, plan = make_job(trainyard_home)
    steps = run(job, job_id, folder, plan)[0].steps  # the job's length, from a run without the drill
    job, job_id, folder, plan = make_job(
        trainyard_home, elastic={"fault_injection": [{"replica": 0, "at_step": steps - 1, "kind": "term"}]}
    )
    outcome, _ = run(job, job_id, folder, plan)  # a spot notice, a scale-down or a cancel in the last step
    assert (outcome.stop_reason, outcome.steps) == ("Completed", steps)  # was Left: the job ended Stopped
    assert [r["stop_reason"] for r in _results(folder)] == ["Completed", "Completed"]


def test_a_heal_whose_transfer_breaks_is_tried_again_not_taken_for_no_peer(trainyard_home, tmp_path):
    marker, folders = tmp_path / "heal-breaks-once", []
    marker.touch()
    # group 0's steps are slow until the restart is back, however long that takes on a busy machine
    with slow_until(tmp_path / "slow", lambda: rejoined(attempt_dir(folders[0], 1, 1))) as slow:
        hp = {
            "epochs": 30,
            "batch_size": 64,
            "learning_rate": 0.01,
            "heal_breaks_once": str(marker),
            "slow_while": slow,
            # slow: 285 steps of 50 ms after the kill give the restart 14 s to come back (10 ms: under 3 s, which a
            # loaded 2-core machine's restart once took longer than, and the job ended before it healed)
            "step_sleep": 0.05,
        }
        job, job_id, folder, plan = make_job(
            trainyard_home,
            algorithm={"entrypoint": "tests.unit.jobs:flaky_heal_build"},
            hyperparameters=hp,
            elastic={"fault_injection": [{"replica": 1, "at_step": 15, "kind": "kill"}]},
        )
        folders.append(folder)
        outcome, _ = run(job, job_id, folder, plan)
    assert not marker.exists()  # the restart's first fetch broke
    assert outcome.stop_reason == "Completed" and [f["replica"] for f in outcome.failures] == [1]  # the drill's
    (recovery,) = outcome.recoveries
    assert recovery["source"] == "peer"  # was: NoPeerToHeal, never retried, group 0 trained on alone
    assert _results(folder)[1]["step"] == outcome.steps


def test_a_heal_that_keeps_breaking_fails_the_group_after_a_few_tries_and_the_job_goes_on(trainyard_home, tmp_path):
    marker = tmp_path / "heal-breaks"
    marker.touch()
    hp = {"epochs": 25, "batch_size": 64, "learning_rate": 0.01, "heal_breaks_once": str(marker)}
    hp |= {"heal_always_breaks": True, "step_sleep": 0.15, "slow_while": str(tmp_path / "slow")}
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:flaky_heal_build"},
        hyperparameters=hp,
        elastic={"fault_injection": [{"replica": 1, "at_step": 15, "kind": "kill"}]},
        retries={"max_attempts": 2},
    )
    # the survivor's steps are slow until the restart has failed its three tries, however long its start takes
    with slow_until(tmp_path / "slow", lambda: (folder / "replicas/1/attempt-1/error.json").exists()):
        outcome, _ = run(job, job_id, folder, plan)  # was: the restart redid its step for ever, no step committed
    assert outcome.stop_reason == "Completed" and outcome.replicas_finished == [0]
    (kill, heal) = outcome.failures
    assert "could not fetch a live peer's state 3 times" in heal["message"], heal


def test_a_validation_longer_than_the_silence_limit_is_not_taken_for_hung_groups(trainyard_home, monkeypatch):
    monkeypatch.setenv("TRAINYARD_SILENT_GROUP_SECONDS", "12")  # the least it takes: the process group's 10 s + 2
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_validation_build"},
        hyperparameters={"epochs": 2, "batch_size": 64, "learning_rate": 0.01, "validation_seconds": 14},
    )
    outcome, _ = run(job, job_id, folder, plan)  # every group was killed as silent, none left to heal from
    assert outcome.stop_reason == "Completed" and not outcome.failures


def test_a_stop_asked_while_one_group_is_already_in_the_next_step_stops_both_at_one_step(trainyard_home):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:stop_while_validating_build"},
        hyperparameters={"epochs": 50, "batch_size": 64, "learning_rate": 0.01},
        resources={"replicas": 2, "min_replicas": 2},
    )
    outcome, _ = run(job, job_id, folder, plan)
    # was: group 1 left at once, and group 0 waited for it in the step's quorum until it was killed (no result)
    assert outcome.stop_reason == "Stopped" and outcome.replicas_finished == [0, 1] and not outcome.failures
    first, second = _results(folder)
    assert first["step"] == second["step"] == outcome.steps and len(first["epochs"]) == 1
