"""Elastic training with real replica group processes: groups added and removed mid-job, scale requests, and
the S3 checkpoint, the fallback when every group is lost at once."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from tests.conftest import rejoined, slow_until, slow_while, wait_for_step
from tests.unit.jobs import make_job, run
from trainyard.errors import TrainingError


def test_groups_added_and_removed_mid_job_never_stop_the_others(trainyard_home, tmp_path):
    import threading
    import time

    from trainyard.training import scaling
    from trainyard.training.plan import attempt_dir

    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 150, "batch_size": 64, "learning_rate": 0.01, "slow_while": str(tmp_path / "slow")},
        resources={"replicas": 2, "max_replicas": 3},
    )
    asked = []

    def operator():  # what `trainyard scale JOB_ID N` does, from another process
        wait_for_step(attempt_dir(folder, 0, 0) / "heartbeat.json", 20)
        asked.append(scaling.request(job_id, 3))
        wait_for_step(attempt_dir(folder, 2, 0) / "progress.json", 0)  # the new group committed a step
        time.sleep(1.0)
        asked.append(scaling.request(job_id, 2))

    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    events = []
    # slow steps until the added group has left (its result written), then full speed
    with slow_until(tmp_path / "slow", lambda: (folder / "replicas/2/attempt-0/result.json").exists()):
        outcome, handle = run(job, job_id, folder, plan, events)
    thread.join(timeout=5)
    assert len(asked) == 2 and "asked for 3" in asked[0]
    assert outcome.stop_reason == "Completed" and outcome.failures == []
    assert sorted((r.replica, r.attempt) for r in handle.replicas) == [(0, 0), (1, 0), (2, 0)]  # nobody restarted
    assert [(c["from"], c["to"]) for c in outcome.scaling] == [(2, 3), (3, 2)]
    assert ("replica.added", 2) in events and ("replica.removed", 2) in events
    (join,) = outcome.joins
    assert join["replica"] == 2 and join["source"] == "peer" and join["joined_at_step"] > 20
    assert join["bytes_moved"] > 0
    (departure,) = outcome.departures
    assert departure["replica"] == 2 and departure["left_at_step"] > join["joined_at_step"]
    assert outcome.replicas_finished == [0, 1, 2] and outcome.steps == 150 * 10
    # every committed step trained its whole global batch once, whoever was in the quorum
    assert outcome.samples_trained == 150 * 600
    states = [torch.load(folder / f"replicas/{r}/attempt-0/model.pt", weights_only=True) for r in (0, 1)]
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)


def test_a_group_scaled_away_while_it_starts_is_not_a_failure_and_not_restarted(trainyard_home):
    import threading
    import time

    from trainyard.training import scaling
    from trainyard.training.plan import attempt_dir

    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 30, "batch_size": 64, "learning_rate": 0.01},
        resources={"replicas": 2, "max_replicas": 3},
    )

    def operator():  # 2 -> 3, then back to 2 before the new group is up (its SIGTERM handler may not be)
        path = attempt_dir(folder, 0, 0) / "heartbeat.json"
        while not path.exists() or json.loads(path.read_text() or "{}").get("step", 0) < 20:
            time.sleep(0.05)
        scaling.request(job_id, 3)
        time.sleep(0.5)
        scaling.request(job_id, 2)

    threading.Thread(target=operator, daemon=True).start()
    outcome, handle = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed" and outcome.failures == []
    assert all(r.attempt == 0 for r in handle.replicas) and 2 not in outcome.replicas_finished


def test_scale_requests_are_checked(trainyard_home):

    from trainyard.home import write_json_atomic
    from trainyard.training import scaling

    job, job_id, folder, plan = make_job(trainyard_home, resources={"replicas": 2, "max_replicas": 4})
    with pytest.raises(TrainingError, match="no job 'nope'"):
        scaling.request("nope", 2)
    with pytest.raises(TrainingError, match="is not training now"):
        scaling.request(job_id, 3)
    plan.write(folder)
    write_json_atomic(folder / "supervisor.json", {"pid": os.getpid()})
    with pytest.raises(TrainingError, match=r"replicas: 5 is outside the job's range 1\.\.4"):
        scaling.request(job_id, 5)
    assert "asked for 4" in scaling.request(job_id, 4)
    assert json.loads((folder / "scale.json").read_text())["replicas"] == 4


def test_asking_again_for_the_size_last_asked_for_is_acted_on(trainyard_home, monkeypatch):
    # 3 groups asked for and running; a spot notice takes one; `trainyard scale JOB 3` again must replace it
    from trainyard import launch
    from trainyard.launch import LaunchHandle, ReplicaProcess
    from trainyard.training.plan import request_scale
    from trainyard.training.scaling import Scaler

    job, _, folder, _ = make_job(trainyard_home, resources={"replicas": 2, "max_replicas": 3})
    started = []

    def start_replica(handle, replica, attempt, resume=False):
        started.append(replica)
        return ReplicaProcess(replica, attempt, 1000 + replica, "")

    monkeypatch.setattr(launch, "start_replica", start_replica)
    live = {r: ReplicaProcess(r, 0, 1000 + r, "") for r in (0, 1)}
    handle = LaunchHandle("j", str(folder), "local", "", 0, 1, list(live.values()))
    scaler = Scaler(handle, job, lambda kind, payload: None)
    request_scale(folder, 3)
    scaler.tick(live, 10)
    assert started == [2] and sorted(live) == [0, 1, 2]
    scaler.tick(live, 11)  # the same request: acted on once
    assert started == [2]
    del live[1]  # group 1 left (a spot notice)
    request_scale(folder, 3)
    scaler.tick(live, 50)
    assert started == [2, 3] and sorted(live) == [0, 2, 3]


def test_a_group_asked_to_leave_before_the_start_barrier_does_not_hold_the_others_there(trainyard_home, monkeypatch):
    # `trainyard scale JOB 2` while group 2 was still queued (or loading): groups 0 and 1 waited out the 120 s
    from trainyard import launch
    from trainyard.launch import LaunchHandle, ReplicaProcess
    from trainyard.training.plan import request_scale
    from trainyard.training.scaling import Scaler
    from trainyard.training.start_barrier import mark_ready, ready_groups

    job, _, folder, _ = make_job(trainyard_home, resources={"replicas": 3, "min_replicas": 2})
    monkeypatch.setattr(launch, "terminate", lambda handle, proc: None)
    live = {r: ReplicaProcess(r, 0, 1000 + r, "") for r in (0, 1, 2)}
    scaler = Scaler(LaunchHandle("j", str(folder), "local", "", 0, 1, list(live.values())), job, lambda *_: None)
    mark_ready(folder, 0), mark_ready(folder, 1)
    request_scale(folder, 2)
    scaler.tick(live, 0)
    assert scaler.leaving == {2} and ready_groups(folder) == {0, 1, 2}


def _checkpointed_job(trainyard_home, bucket, killed: list[int], **changes):
    """A job checkpointing to S3 every 10 steps whose groups ``killed`` die at step 25."""
    return make_job(
        trainyard_home,
        output={"s3_uri": f"s3://{bucket}/out/"},
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},  # the step-20 upload lands before 25
        elastic={
            "checkpoint_every_steps": 10,
            "fault_injection": [{"replica": r, "at_step": 25, "kind": "kill"} for r in killed],
        },
        **changes,
    )


def test_with_every_group_lost_the_s3_checkpoint_is_the_fallback(trainyard_home, bucket):
    from trainyard import s3

    job, job_id, folder, plan = _checkpointed_job(trainyard_home, bucket, killed=[0], resources={"replicas": 1})
    # an earlier run of the job id got further: its state (of other data, perhaps) is not this run's to resume
    earlier = f"out/{job_id}/checkpoints/0123456789ab/step-000000900.pt"
    s3.client().put_object(Bucket=bucket, Key=earlier, Body=b"an earlier run's state")
    events = []
    outcome, handle = run(job, job_id, folder, plan, events)
    assert outcome.stop_reason == "Completed" and outcome.steps == 40
    assert [(r.replica, r.attempt, r.resumed) for r in handle.replicas] == [(0, 0, False), (0, 1, True)]
    (recovery,) = outcome.recoveries
    assert recovery["source"] == "checkpoint" and recovery["failed_at_step"] == 25
    assert recovery["rejoined_at_step"] == 21  # steps 21-25 recomputed from the step-20 checkpoint
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket, Prefix="out/")["Contents"]]
    assert f"out/{job_id}/checkpoints/{handle.launch_id}/step-000000020.pt" in keys


def test_groups_lost_together_all_resume_from_the_checkpoint_on_their_first_restart(trainyard_home, bucket, tmp_path):
    # Both groups die at the same step (one node, one power cut). Neither is a live peer for the other:
    # both restarts load the checkpoint at once, so max_attempts 2 is enough.
    # 10 ms steps up to the kill (the step-20 upload lands before 25). Once a restart is back, its steps
    # take 1 s until the other is back too: on a busy machine (CI) the first restart back trained steps
    # 21-40 alone before the second had imported torch, which then never committed a step.
    hp = {"epochs": 4, "batch_size": 64, "learning_rate": 0.01, "step_sleep": 1.0, "fast_step_sleep": 0.01}
    hp["slow_while"] = str(tmp_path / "slow")
    job, job_id, folder, plan = _checkpointed_job(
        trainyard_home, bucket, killed=[0, 1], retries={"max_attempts": 2}, hyperparameters=hp
    )
    restarts = [folder / f"replicas/{r}/attempt-1" for r in (0, 1)]
    one_back = lambda: any(rejoined(a) for a in restarts) and not all(rejoined(a) for a in restarts)  # noqa: E731
    with slow_while(tmp_path / "slow", one_back):
        outcome, handle = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed" and outcome.steps == 40
    assert sorted((r.replica, r.attempt, r.resumed) for r in handle.replicas) == [
        (0, 0, False),
        (0, 1, True),
        (1, 0, False),
        (1, 1, True),
    ]
    assert sorted((f["replica"], f["attempt"]) for f in outcome.failures) == [(0, 0), (1, 0)]
    assert sorted((r["replica"], r["source"]) for r in outcome.recoveries) == [(0, "checkpoint"), (1, "checkpoint")]


def test_a_group_added_that_comes_up_after_the_job_finished_does_not_train_it_again(trainyard_home, tmp_path):
    import threading
    import time

    from trainyard.training import scaling

    # The first groups' steps are slow until the added group's process is up (its pid written: it is not
    # withdrawn when the job ends); its model is built only once they have finished (``build_waits_while``).
    gate = tmp_path / "gate"
    # (0.5 s held steps: the added group's process has 18 s to write its pid, 8 s at 0.2 s, under a CI run's load)
    hp = {"epochs": 4, "batch_size": 64, "learning_rate": 0.01, "step_sleep": 0.5}
    hp |= {"slow_while": str(tmp_path / "slow"), "build_waits_while": str(gate)}
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters=hp,
        resources={"replicas": 2, "max_replicas": 3},
    )

    def operator():
        path = folder / "replicas/0/attempt-0/heartbeat.json"
        while not path.exists() or json.loads(path.read_text() or "{}").get("step", 0) < 3:
            time.sleep(0.01)
        gate.touch()  # the first groups built theirs long ago
        scaling.request(job_id, 3)
        finished = folder / "replicas/1/attempt-0/result.json"
        while not (folder / "replicas/0/attempt-0/result.json").exists() or not finished.exists():
            time.sleep(0.05)
        gate.unlink()

    threading.Thread(target=operator, daemon=True).start()
    events = []
    with slow_until(tmp_path / "slow", lambda: (folder / "replicas/2/attempt-0/pid").exists()):
        outcome, handle = run(job, job_id, folder, plan, events)
    assert ("replica.added", 2) in events and outcome.withdrawn == []  # it started
    assert outcome.stop_reason == "Completed" and outcome.failures == []
    assert outcome.replicas_finished == [0, 1] and outcome.steps == 40  # it did not train the job alone again
    assert outcome.joins == []


def test_without_checkpoints_a_lost_job_fails_and_says_why(trainyard_home):
    job, *rest = make_job(
        trainyard_home,
        resources={"replicas": 1},
        elastic={"fault_injection": [{"replica": 0, "at_step": 25, "kind": "kill"}]},
    )
    with pytest.raises(
        TrainingError, match=r"no live replica group is left to heal from \(elastic.checkpoint_every"
    ) as info:
        run(job, *rest)
    # one attempt ran (a restart could not heal from anyone), and the error carries it for the summary
    assert "failed after 1 attempt(s) (retries.max_attempts 3)" in str(info.value)
    assert [(f["replica"], f["attempt"]) for f in info.value.failures] == [(0, 0)]


def test_a_group_lost_for_good_after_the_others_left_fails_the_job_not_stops_it(trainyard_home):
    # group 1 leaves (a spot notice) at step 10; group 0, alone, is lost at step 30 with no peer to heal from
    job, *rest = make_job(
        trainyard_home,
        hyperparameters={"epochs": 10, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
        elastic={
            "fault_injection": [
                {"replica": 1, "at_step": 10, "kind": "term"},
                {"replica": 0, "at_step": 30, "kind": "kill"},
            ]
        },
    )
    # it ended "Left" (Stopped), its result the model group 1 left with at step 11
    with pytest.raises(TrainingError, match="replica group.s. 0 failed for good after the others had left the job"):
        run(job, *rest)


def test_a_group_wedged_before_its_first_heartbeat_does_not_hold_a_finished_job(trainyard_home, monkeypatch):
    import signal
    import time

    from trainyard.training import supervisor

    monkeypatch.setattr(supervisor, "STOP_GRACE_SECONDS", 2.0)
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 40, "batch_size": 64, "learning_rate": 0.01, "step_sleep": 0.005},
        stopping={"max_runtime_seconds": 120},
        elastic={"fault_injection": [{"replica": 1, "at_step": 15, "kind": "kill"}]},
    )

    # the restart stops as soon as it is up (a stuck import or connect): it never beats
    signal_when_up(folder / "replicas/1/attempt-1/pid", signal.SIGSTOP)
    started = time.monotonic()
    outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed" and time.monotonic() - started < 90  # not max_runtime's 120 s
    assert [(f["replica"], f["attempt"]) for f in outcome.failures] == [(1, 0)]  # the drill; the wedged one ended


def test_too_few_groups_left_for_min_replicas_fails_at_once_naming_the_settings(trainyard_home):
    import time

    job, *rest = make_job(
        trainyard_home,
        hyperparameters={"epochs": 30, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
        resources={"replicas": 2, "min_replicas": 2},
        retries={"max_attempts": 1},
        elastic={"fault_injection": [{"replica": 1, "at_step": 15, "kind": "kill"}]},
    )
    started = time.monotonic()
    with pytest.raises(TrainingError, match="fewer than resources.min_replicas 2 a step needs: lower min_replicas"):
        run(job, *rest)
    assert time.monotonic() - started < 90  # (without: the survivor waited out its quorum timeout, then failed)


def test_a_group_dying_in_its_start_up_does_not_hold_the_others_at_the_start_barrier(trainyard_home):
    import signal
    import time

    job, job_id, folder, plan = make_job(
        trainyard_home,
        hyperparameters={"epochs": 4, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
        resources={"replicas": 2},
    )

    # group 1's first attempt dies as soon as it exists, long before its manager is up
    signal_when_up(folder / "replicas/1/attempt-0/pid", signal.SIGKILL)
    started = time.monotonic()
    outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed"
    assert [(f["replica"], f["attempt"]) for f in outcome.failures] == [(1, 0)]
    assert time.monotonic() - started < 90  # group 0 waited out the barrier's 120 s for a group that had died


def test_a_group_killed_from_outside_fails_at_its_last_committed_step_not_its_last_heartbeat(
    trainyard_home, monkeypatch
):
    import signal
    import threading
    import time

    monkeypatch.setenv("TRAINYARD_STEP_LOG", "1")  # each committed step, as the group logs it
    job, job_id, folder, plan = make_job(
        trainyard_home,
        hyperparameters={"epochs": 60, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
        resources={"replicas": 2},
        retries={"max_attempts": 1},
    )
    attempt = folder / "replicas/1/attempt-0"

    def kill():  # mid-job, between heartbeats (every 0.2 s; a step takes milliseconds)
        while True:
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                if json.loads((attempt / "heartbeat.json").read_text())["step"] >= 40:
                    break
            time.sleep(0.01)
        time.sleep(0.13)
        os.kill(int((attempt / "pid").read_text()), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    outcome, _ = run(job, job_id, folder, plan)
    (failure,) = outcome.failures
    committed = json.loads((attempt / "steps.jsonl").read_text().splitlines()[-1])["step"]
    # the counts are written just after the step log: a kill between the two is one step short
    assert committed - 1 <= failure["step"] <= committed


def signal_when_up(pid_file, signum: int) -> None:
    """Send ``signum`` to the group attempt whose ``pid`` file this is, as soon as it exists (a thread)."""
    import threading
    import time

    def send() -> None:
        while not pid_file.exists():
            time.sleep(0.01)
        os.kill(int(pid_file.read_text()), signum)

    threading.Thread(target=send, daemon=True).start()
