"""Training with real torchft replica group processes and a real lighthouse (no Prefect): lockstep, stopping,
failures, restarts and heals. A loss no longer a number is ``test_divergence.py``; your own entrypoints
``test_entrypoints.py``; groups added and removed and the S3 checkpoint fallback ``test_elastic.py``. The jobs
they run are built by ``tests/unit/jobs.py``."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.conftest import rejoined, slow_until, slow_while
from tests.unit.jobs import make_job, run
from trainyard.training import accounting, drills, supervisor


def test_two_groups_train_in_lockstep_and_agree(trainyard_home):
    job, job_id, folder, plan = make_job(trainyard_home)
    outcome, handle = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed"
    assert outcome.replicas_finished == [0, 1]
    assert [h["epoch"] for h in outcome.history] == [1, 2, 3, 4]
    assert outcome.history[-1]["val_accuracy"] > 0.9  # an easy, separable problem
    assert outcome.history[-1]["train_loss"] < outcome.history[0]["train_loss"]
    states = [torch.load(folder / f"replicas/{r}/attempt-0/model.pt", weights_only=True) for r in (0, 1)]
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)
    # 600 samples, 2 groups of 32 per step: 10 steps an epoch, every sample trained once per epoch
    assert outcome.steps == 40
    assert outcome.samples_trained == 4 * 600
    assert outcome.flops["backward"] > outcome.flops["forward"] > 0
    assert outcome.flops["evaluation"] > 0


def test_target_metric_stops_early(trainyard_home):
    job, *rest = make_job(
        trainyard_home,
        hyperparameters={"epochs": 50, "batch_size": 64, "learning_rate": 0.01},
        stopping={"target_metric": {"name": "val_accuracy", "value": 0.8}},
    )
    outcome, _ = run(job, *rest)
    assert outcome.stop_reason == "TargetMetricReached"
    assert outcome.history[-1]["val_accuracy"] >= 0.8
    assert len(outcome.history) < 50
    assert all(h["val_accuracy"] < 0.8 for h in outcome.history[:-1])


def test_a_worker_sets_each_groups_cpu_threads_and_a_bad_count_fails_before_anything_starts(
    trainyard_home, monkeypatch
):
    from trainyard import launch
    from trainyard.errors import TrainyardError

    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:threads_recording_build"},
        hyperparameters={"epochs": 1, "batch_size": 64, "threads_file": str(trainyard_home / "threads")},
    )
    monkeypatch.delenv(launch.THREADS_ENV, raising=False)
    unset = launch.launch(job_id, folder, job.resources)  # the machine's cores dealt among the 2 groups
    launch.shutdown(unset)
    assert unset.num_threads == max(1, (os.cpu_count() or 1) // 2)
    monkeypatch.setenv(launch.THREADS_ENV, "1")  # two jobs sharing a 2-core machine
    outcome, handle = run(job, job_id, folder, plan)
    assert handle.num_threads == 1 and outcome.stop_reason == "Completed"
    # what each group's torch ran with (its build recorded it), not only what the launcher meant to give
    recorded = [(trainyard_home / f"threads.{group.pid}").read_text() for group in handle.replicas]
    assert recorded == ["1", "1"]
    for bad in ("0", "two", "-1", "1.5", "²"):
        monkeypatch.setenv(launch.THREADS_ENV, bad)
        other = make_job(trainyard_home)[2]
        with pytest.raises(TrainyardError, match=f"TRAINYARD_TORCH_THREADS='{bad}' is not a whole number"):
            launch.launch("never-started", other, job.resources)
        assert not (other / "lighthouse.log").exists()  # refused before the lighthouse or any group


def test_max_runtime_stops_every_group(trainyard_home):
    job, *rest = make_job(
        trainyard_home, hyperparameters={"epochs": 100_000, "batch_size": 8}, stopping={"max_runtime_seconds": 30}
    )  # (the groups' start counts: on a busy 2-core machine it once took all of 10 s, and no step was taken)
    outcome, _ = run(job, *rest)
    assert outcome.stop_reason == "MaxRuntimeExceeded"
    assert 0 < outcome.steps < 100_000 * 75
    assert outcome.replicas_finished == [0, 1] and not outcome.failures  # each group stopped, none killed


def test_killed_group_is_restarted_and_heals_from_its_peer(trainyard_home, tmp_path):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        # slow steps (10 ms): the survivor is still training when the restarted group comes back
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 80, "batch_size": 64, "learning_rate": 0.01, "slow_while": str(tmp_path / "slow")},
        elastic={"fault_injection": [{"replica": 1, "at_step": 15, "kind": "kill"}]},
    )
    events = []

    def on_event(kind, payload):  # and whether the survivor had finished by then
        events.append((kind, payload.get("replica"), (folder / "replicas/0/attempt-0/result.json").exists()))

    with slow_until(tmp_path / "slow", lambda: rejoined(folder / "replicas/1/attempt-1")):
        outcome, handle = supervisor.launch_and_train(job, plan, folder, on_event)
    # each told as it happened: the recovery while the survivor still trained, not after the job
    assert events == [("replica.failed", 1, False), ("replica.restarted", 1, False), ("replica.recovered", 1, False)]
    assert outcome.stop_reason == "Completed"
    assert len(outcome.failures) == 1 and outcome.failures[0]["replica"] == 1
    assert outcome.failures[0]["exit_code"] == -9
    assert sorted((r.replica, r.attempt) for r in handle.replicas) == [(0, 0), (1, 0), (1, 1)]
    assert outcome.replicas_finished == [0, 1]
    healed = torch.load(folder / "replicas/1/attempt-1/model.pt", weights_only=True)
    survivor = torch.load(folder / "replicas/0/attempt-0/model.pt", weights_only=True)
    for key in survivor:
        torch.testing.assert_close(healed[key], survivor[key], rtol=0, atol=0)
    assert [h["epoch"] for h in outcome.history] == list(range(1, 81))
    # Every committed step's 64 rows counted once, the killed group's steps since its last epoch end
    # (its progress.json) included: 80 epochs of the 600 training rows.
    assert outcome.samples_trained == 80 * 600
    (recovery,) = outcome.recoveries
    assert recovery["replica"] == 1 and recovery["failed_at_step"] == 15
    assert recovery["source"] == "peer"  # healed from the live group: no checkpoint exists
    assert recovery["rejoined_at_step"] > 15
    assert recovery["recovery_seconds"] > 0  # (how fast: benchmarks/recovery.py)
    params = sum(t.numel() for t in survivor.values())
    assert recovery["bytes_moved"] >= 3 * 4 * params  # parameters and Adam's two moments, float32


def test_each_drill_on_a_group_fires_once_at_the_first_step_at_or_past_its_own(trainyard_home, tmp_path):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 80, "batch_size": 64, "learning_rate": 0.01, "slow_while": str(tmp_path / "slow")}
        | {"step_sleep": 0.03},  # held steps: each restart then has 15-25 s, however the two share them
        elastic={
            "fault_injection": [
                {"replica": 1, "at_step": 300, "kind": "kill"},  # listed out of order: played by step
                {"replica": 1, "at_step": 15, "kind": "kill"},
            ]
        },
    )
    first, second = folder / "replicas/1/attempt-1", folder / "replicas/1/attempt-2"
    # Slow while a restart comes back: the first before the survivor reaches step 300 (so that the drill
    # there fires at its own step, not at once on the heal past it), the second before the job ends
    step = lambda attempt: json.loads((attempt / "heartbeat.json").read_text())["step"]  # noqa: E731
    with slow_while(tmp_path / "slow", lambda: not rejoined(first) or (step(first) >= 300 and not rejoined(second))):
        outcome, handle = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed"
    # each at the first step the group was at or past its own: later only if it healed past it (under load)
    assert [f["replica"] for f in outcome.failures] == [1, 1]
    assert outcome.failures[0]["step"] >= 15 and outcome.failures[1]["step"] >= 300
    assert sorted((r.replica, r.attempt) for r in handle.replicas) == [(0, 0), (1, 0), (1, 1), (1, 2)]
    assert [r["source"] for r in outcome.recoveries] == ["peer", "peer"]
    # each attempt recorded the drill it played; a restart plays the others, a healed past one at once
    assert [drills.played_drills(folder, 1, attempt) for attempt in range(4)] == [set(), {15}, {15, 300}, {15, 300}]
    assert drills.drills(job, 1, {15, 300}) == {} and drills.drills(job, 1, {15}) == {300: "kill"}
    # played at the first step at or past their own, the earliest first: a group healed past both plays both
    planned = drills.drills(job, 1, set())
    assert [drills.due_drill(planned, step) for step in (14, 15, 16, 299, 302)] == [None, 15, 15, 15, 15]
    assert drills.due_drill({300: "kill"}, 299) is None and drills.due_drill({300: "kill"}, 302) == 300


@pytest.mark.timeout(120)  # a guard: the blocking sleep this replaced would sit out the 600 s
def test_a_restart_waiting_out_its_backoff_does_not_stop_the_watch(trainyard_home, monkeypatch):
    # With a 10-minute backoff, the supervisor must go on watching the survivor meanwhile: it finishes
    # the job, and the restart, no longer needed, is dropped (a blocking sleep would hang here).
    monkeypatch.setattr(supervisor, "RETRY_BACKOFF_SECONDS", 600.0)
    job, job_id, folder, plan = make_job(
        trainyard_home, elastic={"fault_injection": [{"replica": 1, "at_step": 5, "kind": "kill"}]}
    )
    events = []
    outcome, handle = run(job, job_id, folder, plan, events)
    assert events == [("replica.failed", 1)]
    assert outcome.stop_reason == "Completed" and outcome.replicas_finished == [0]
    assert sorted((r.replica, r.attempt) for r in handle.replicas) == [(0, 0), (1, 0)]


def test_patience_stops_when_nothing_improves(trainyard_home):
    job, *rest = make_job(
        trainyard_home,
        hyperparameters={"epochs": 40, "batch_size": 64, "learning_rate": 1e-12},
        stopping={"patience_epochs": 2},
        resources={"replicas": 1},
    )
    outcome, _ = run(job, *rest)
    assert outcome.stop_reason == "NoImprovement"
    assert len(outcome.history) <= 4


def test_linear_regression_reports_rmse_in_label_units(trainyard_home):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"builtin": "linear-regression"},
        hyperparameters={"epochs": 30, "batch_size": 64, "learning_rate": 0.05},
        stopping={"target_metric": {"name": "val_rmse", "value": 2.0}},
        resources={"replicas": 2},
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(800, 3)).astype(np.float32)
    y = (1000 + 300 * x[:, 0] - 200 * x[:, 2] + rng.normal(0, 1, 800)).astype(np.float32)  # noise sd 1
    np.savez(folder / "data/train.npz", x=x[200:], y=y[200:])
    np.savez(folder / "data/validation.npz", x=x[:200], y=y[:200])
    plan.schema = {"num_outputs": 1, "task": "regression", "classes": []}
    outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "TargetMetricReached"
    assert 0.5 < outcome.history[-1]["val_rmse"] <= 2.0  # near the noise floor, in the label's units
    assert "val_accuracy" not in outcome.history[-1]


def test_sharded_groups_train_on_disjoint_shares(trainyard_home):
    job, job_id, folder, plan = make_job(trainyard_home, hyperparameters={"epochs": 2, "batch_size": 64})
    job.inputs.train.distribution = "sharded"
    plan.job = job.model_dump(mode="json")
    # three objects of 200 rows: too few for 2 groups by object, so by row group (4 of 50 rows each)
    plan.train_layout = [
        {"id": f"s3://b/t/{i}", "start": 200 * i, "end": 200 * (i + 1), "row_groups": [50] * 4} for i in range(3)
    ]
    outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed" and outcome.replicas_finished == [0, 1]
    # 300 rows a group, 32 a step: 10 steps an epoch (the last of 12), the same in both groups
    assert outcome.steps == 20
    assert outcome.samples_trained == 2 * 2 * 300


def test_sigterm_is_a_graceful_leave_and_the_others_go_on(trainyard_home, monkeypatch):
    from trainyard import launch

    real = launch.exit_code
    # as a work pool reports the run it cancelled to make the group leave, its result written first: -15 (a
    # local group's own exit code, 0, takes the same path: its result is what says it finished)
    monkeypatch.setattr(launch, "exit_code", lambda h, p: -15 if real(h, p) == 0 and p.replica == 1 else real(h, p))
    job, job_id, folder, plan = make_job(
        trainyard_home, elastic={"fault_injection": [{"replica": 1, "at_step": 12, "kind": "term"}]}
    )
    outcome, handle = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed" and outcome.steps == 40
    assert outcome.failures == []  # leaving is not failing: no restart
    assert [(r.replica, r.attempt) for r in handle.replicas] == [(0, 0), (1, 0)]
    (departure,) = outcome.departures
    assert departure["replica"] == 1 and 12 <= departure["left_at_step"] <= 13
    assert outcome.model_path.endswith("replicas/0/attempt-0/model.pt")  # the group that finished the job


def test_a_stop_whose_grace_runs_out_ends_the_job_stopped_with_the_finished_groups_model(trainyard_home, monkeypatch):
    # group 1 hangs; max_runtime stops the job; group 0 leaves at its next step, group 1 never does and
    # is shut down when the grace runs out. The job is still Stopped with group 0's model, not Failed.
    monkeypatch.setattr(supervisor, "STOP_GRACE_SECONDS", 3.0)
    job, *rest = make_job(
        trainyard_home,
        hyperparameters={"epochs": 1000, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
        # (group 1 must reach its hang at step 5 before the stop: the groups' start counts, 10 s or more on a busy
        # machine, and with 12 s a CI run could stop both groups cleanly first)
        stopping={"max_runtime_seconds": 25},
        elastic={"fault_injection": [{"replica": 1, "at_step": 5, "kind": "hang"}]},
    )
    outcome, _ = run(job, *rest)
    assert outcome.stop_reason == "MaxRuntimeExceeded"
    assert outcome.replicas_finished == [0] and outcome.model_path
    assert [f["replica"] for f in outcome.failures] == [1]


def test_a_hung_group_is_killed_restarted_and_heals(trainyard_home, monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINYARD_SILENT_GROUP_SECONDS", "12")  # just over the 10 s collective timeout
    # 30 ms steps, 1,000 of them: the survivor is still training when the hung group is found silent
    # (12 s) and back (~5 s); the rest at full speed.
    hp = {
        "epochs": 100,
        "batch_size": 64,
        "learning_rate": 0.01,
        "step_sleep": 0.03,
        "slow_while": str(tmp_path / "slow"),
    }
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters=hp,
        elastic={"fault_injection": [{"replica": 0, "at_step": 10, "kind": "hang"}]},
    )
    with slow_until(tmp_path / "slow", lambda: rejoined(folder / "replicas/0/attempt-1")):
        outcome, handle = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed"
    (failure,) = outcome.failures
    assert failure["replica"] == 0 and "hung" in failure["message"]
    (recovery,) = outcome.recoveries
    assert recovery["source"] == "peer" and recovery["failed_at_step"] == 10 and recovery["rejoined_at_step"] > 10
    assert recovery["recovery_seconds"] > 12  # from its last heartbeat, so the silence it took to notice counts
    states = [torch.load(folder / f"replicas/{r}/attempt-{a}/model.pt", weights_only=True) for r, a in ((0, 1), (1, 0))]
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)


def test_sifting_trains_on_full_batches_of_half_the_candidates_and_survives_a_heal(trainyard_home, tmp_path):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 40, "batch_size": 64, "learning_rate": 0.01, "step_sleep": 0.06}
        | {"slow_while": str(tmp_path / "slow")},
        sifting={"enabled": True, "beta": 1.0, "delay_steps": 5, "reuse_loss_epochs": 0},  # score every candidate
        elastic={"fault_injection": [{"replica": 1, "at_step": 30, "kind": "kill"}]},
    )
    # 120 ms steps (two forwards of 60 ms) until the restart is back: 170 steps left give it 20 s, where
    # the restart takes 3-6 s idle, more under a CI run's load; the rest at full speed
    with slow_until(tmp_path / "slow", lambda: rejoined(folder / "replicas/1/attempt-1")):
        outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed"
    # 128 candidates a step (64 * (1 + beta)): 5 steps an epoch over 600 rows, 64 kept a step
    assert outcome.steps == 40 * 5 and outcome.steps_per_epoch == 5
    assert outcome.sifting["kept_fraction"] == pytest.approx(0.5, abs=0.02)
    assert set(outcome.sifting["kept_fraction_by_class"]) == {"0", "1"}
    assert outcome.flops["scoring"] > 0
    # One linear layer: its backward needs no input gradient, so it costs what the forward does, and
    # scoring 2 candidates per kept sample saves nothing. The summary says so.
    assert outcome.sifting["backward_forward_ratio"] == pytest.approx(1.0)
    from trainyard.status import compute_section, sifting_section

    warning = sifting_section(job, None, outcome)["warning"]
    assert "sifting cost more compute than it saved" in warning and "set sifting.reuse_loss_epochs" in warning
    # a proxy's losses are never reused: the fix named is a smaller proxy (was: reuse_loss_epochs, which it ignores)
    proxy = job.model_copy(update={"sifting": job.sifting.model_copy(update={"score": "proxy"})})
    warning = sifting_section(proxy, None, outcome)["warning"]
    assert "shrink sifting.proxy.hidden_sizes" in warning and "reuse_loss_epochs" not in warning
    # a training stage that gave up has no outcome: its summary counts what the groups did, sifting included
    done = accounting.work_done(folder)
    assert compute_section(None, 0, done)["samples_seen"] == compute_section(outcome)["samples_seen"]
    assert compute_section(outcome)["samples_seen"] > outcome.samples_trained
    assert sifting_section(job, None, None, done)["online"] == outcome.sifting
    # the first epoch's 5 steps are all within delay_steps: nothing ranked, its rows trained unsifted
    assert outcome.history[0]["kept_fraction"] is None and outcome.sifting["unsifted"] > 0
    assert all(h["kept_fraction"] == pytest.approx(0.5, abs=0.02) for h in outcome.history[1:])
    assert all(set(h["kept_fraction_by_class"]) == {"0", "1"} for h in outcome.history[1:])
    (recovery,) = outcome.recoveries
    assert recovery["source"] == "peer"
    assert recovery.get("sifter_history") == 500  # the peer's loss history came with the heal
    states = [torch.load(folder / f"replicas/{r}/attempt-{a}/model.pt", weights_only=True) for r, a in ((0, 0), (1, 1))]
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)


def test_a_group_killed_while_another_is_recovering_also_heals(trainyard_home, tmp_path):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 100, "batch_size": 64, "learning_rate": 0.01, "slow_while": str(tmp_path / "slow")},
        resources={"replicas": 3},
        # group 1 dies at step 15; group 2 ~1.5 s later, while group 1's restart is still coming back
        elastic={
            "fault_injection": [
                {"replica": 1, "at_step": 15, "kind": "kill"},
                {"replica": 2, "at_step": 120, "kind": "kill"},
            ]
        },
    )
    both_back = lambda: all(rejoined(folder / f"replicas/{r}/attempt-1") for r in (1, 2))  # noqa: E731
    with slow_until(tmp_path / "slow", both_back):
        outcome, handle = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed"
    assert sorted((f["replica"], f["step"]) for f in outcome.failures) == [(1, 15), (2, 120)]
    assert sorted((r.replica, r.attempt) for r in handle.replicas) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert sorted((r["replica"], r["source"]) for r in outcome.recoveries) == [(1, "peer"), (2, "peer")]
    assert outcome.replicas_finished == [0, 1, 2]
    states = [
        torch.load(folder / f"replicas/{r}/attempt-{a}/model.pt", weights_only=True)
        for r, a in ((0, 0), (1, 1), (2, 1))
    ]
    for other in states[1:]:
        for key in states[0]:
            torch.testing.assert_close(other[key], states[0][key], rtol=0, atol=0)
