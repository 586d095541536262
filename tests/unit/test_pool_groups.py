"""Replica groups on a work pool, with launchers that stand in for the pool (a fake launcher per test): the
fill-up to max_replicas, a group told by its run's state where it wrote no error, a run Prefect crashed for
missed heartbeats whose group trains on, and the Prefect API not answering about a group's run for a while."""

from __future__ import annotations

import time

import pytest

from tests.unit.jobs import make_job


def test_on_a_pool_a_size_asked_for_before_the_first_step_is_not_undone_by_filling_up(trainyard_home, monkeypatch):
    # a pool job fills up to max_replicas once it trains; asked for 1 group at step 0, it must stay at 1
    from trainyard import launch
    from trainyard.launch import LaunchHandle, ReplicaProcess
    from trainyard.training.plan import request_scale
    from trainyard.training.scaling import Scaler

    job, _, folder, _ = make_job(
        trainyard_home, resources={"replicas": 2, "min_replicas": 1, "max_replicas": 4, "work_pool": "gpus"}
    )
    started, terminated = [], []
    monkeypatch.setattr(launch, "start_replica", lambda h, replica, attempt, resume=False: started.append(replica))
    monkeypatch.setattr(launch, "terminate", lambda h, proc: terminated.append(proc.replica))
    live = {r: ReplicaProcess(r, 0, 1000 + r, "") for r in (0, 1)}
    handle = LaunchHandle("j", str(folder), "gpus", "", 0, 1, list(live.values()))
    events = []
    scaler = Scaler(handle, job, lambda kind, payload: events.append(kind))
    request_scale(folder, 1)
    scaler.tick(live, 0)
    assert terminated == [1]
    del live[1]
    scaler.tick(live, 5)  # the first tick once it trains
    assert started == [] and sorted(live) == [0]
    request_scale(folder, 1)  # asked again for the size it has: nothing done, nothing said
    scaler.tick(live, 6)
    assert events == ["job.scaled", "replica.removed"]


def test_a_pool_group_that_failed_before_writing_its_error_is_told_by_its_runs_own_words(trainyard_home, monkeypatch):
    # an image that would not pull, a pod OOM-killed: the group never ran to write error.json; its run's state
    # says why, where an exit code made up from the state ("code 2") said nothing
    from trainyard import launch
    from trainyard.errors import TrainingError
    from trainyard.launch import LaunchHandle, ReplicaProcess
    from trainyard.training import supervisor

    class OomKilled:
        def start(self, handle, replica, attempt, resume):
            return ReplicaProcess(replica, attempt, 0, "", run_id="0" * 32)

        def exit_code(self, proc):
            return 2

        def queued(self, proc):
            return False

        def kill(self, proc):
            pass

        terminate = kill

        def ended_how(self, proc):
            return "its run Crashed: Flow run infrastructure exited with non-zero status code 137"

    monkeypatch.setitem(launch._LAUNCHERS, "oom", OomKilled())
    monkeypatch.setattr(supervisor, "RETRY_BACKOFF_SECONDS", 0.01)
    job, job_id, folder, plan = make_job(
        trainyard_home, resources={"replicas": 1, "work_pool": "oom"}, retries={"max_attempts": 2}
    )
    handle = LaunchHandle(job_id, str(folder), "oom", "", 0, 1, [ReplicaProcess(0, 0, 0, "", run_id="0" * 32)])
    with pytest.raises(TrainingError, match=r"after 2 attempt\(s\).*its run Crashed: .*status code 137") as failed:
        supervisor.train(handle, plan, job)
    assert [f["message"] for f in failed.value.failures] == [OomKilled().ended_how(None)] * 2


def test_a_pool_run_marked_crashed_whose_group_still_beats_is_not_restarted_beside_it(trainyard_home, monkeypatch):
    # Prefect marks a run Crashed that missed its heartbeats (its worker cut off from the API); the group trains on
    import threading
    import time

    from trainyard import launch
    from trainyard.errors import TrainingError
    from trainyard.home import write_json_atomic
    from trainyard.launch import LaunchHandle, ReplicaProcess
    from trainyard.training import supervisor
    from trainyard.training.plan import attempt_dir

    class CutOff:
        def start(self, handle, replica, attempt, resume):
            raise AssertionError("restarted beside a live group")

        def exit_code(self, proc):
            return 2  # Crashed

        def lost_touch(self, proc):
            return True  # for its missed heartbeats (infra.apply's zombie automation)

        def queued(self, proc):
            return False

        def kill(self, proc):
            pass

        terminate = kill

    monkeypatch.setitem(launch._LAUNCHERS, "cut-off", CutOff())
    monkeypatch.setattr(supervisor, "silent_seconds_limit", lambda: 1.0)  # a hung group's limit, shortened
    job, job_id, folder, plan = make_job(trainyard_home, resources={"replicas": 1, "work_pool": "cut-off"})
    beats = attempt_dir(folder, 0, 0) / "heartbeat.json"

    def beating() -> None:  # the group, alive for 2 s more, then gone (and judged once silent for 1 s)
        for _ in range(20):
            write_json_atomic(beats, {"step": 7, "unix": time.time(), "pid": 1})
            time.sleep(0.1)

    group = threading.Thread(target=beating)
    group.start()
    while not beats.exists():  # beating before the supervisor first looks
        time.sleep(0.01)
    handle = LaunchHandle(job_id, str(folder), "cut-off", "", 0, 1, [ReplicaProcess(0, 0, 0, "", run_id="0" * 32)])
    started = time.monotonic()
    with pytest.raises(TrainingError, match="every replica group failed after 1 attempt"):  # once it fell silent
        supervisor.train(
            handle, plan, job.model_copy(update={"retries": job.retries.model_copy(update={"max_attempts": 1})})
        )
    assert time.monotonic() - started >= 2.0 + 1.0
    group.join()


def test_a_pool_groups_run_state_rides_out_an_api_that_does_not_answer_for_a_while(monkeypatch):
    # one failed read of a group's run ended the job as an internal error, its groups shut down
    import contextlib
    from types import SimpleNamespace

    import httpx
    from prefect.client.schemas.objects import StateType

    from tasks import pool_launcher
    from trainyard.errors import TrainingError
    from trainyard.launch import ReplicaProcess
    from trainyard.spec import Resources

    answers = ["running", "down", "down", "completed"]

    class Api:
        def read_flow_run(self, run_id):
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
            if answer == "down":
                raise httpx.ConnectError("the Prefect API did not answer")
            kind = StateType.RUNNING if answer == "running" else StateType.COMPLETED
            return SimpleNamespace(state=SimpleNamespace(type=kind))

    monkeypatch.setattr(pool_launcher, "get_client", lambda **_: contextlib.nullcontext(Api()))
    monkeypatch.setattr(pool_launcher, "STATE_CACHE_SECONDS", 0.0)
    launcher = pool_launcher.WorkPoolLauncher("gpu", Resources())
    group = ReplicaProcess(0, 0, 0, "", run_id="0" * 32)
    assert [launcher.exit_code(group) for _ in range(4)] == [None, None, None, 0]  # the outage: still running
    answers[:] = ["down"]
    monkeypatch.setattr(pool_launcher, "API_OUTAGE_SECONDS", 0.05)
    launcher.exit_code(group)  # the outage begins
    time.sleep(0.1)
    with pytest.raises(TrainingError, match=r"the Prefect API has not answered for replica group 0's run .* 0.05 s"):
        launcher.exit_code(group)


def test_a_pool_groups_start_or_cancel_the_api_does_not_take_is_asked_again(monkeypatch):
    # one refused call (a server restarting) while a group was restarted, killed as hung or scaled down failed the
    # job as an internal error: a start is now the supervisor's to defer (TrainingError), a cancellation asked again
    import contextlib
    from types import SimpleNamespace

    import httpx
    from prefect.client.schemas.objects import StateType

    from tasks import pool_launcher
    from trainyard.errors import TrainingError
    from trainyard.launch import LaunchHandle, ReplicaProcess
    from trainyard.spec import Resources

    def down(*_, **__):
        raise httpx.ConnectError("the Prefect API did not answer")

    monkeypatch.setattr(pool_launcher, "run_deployment", down)
    launcher = pool_launcher.WorkPoolLauncher("gpu", Resources(work_pool="gpu"))
    handle = LaunchHandle("j", "/nowhere", "gpu", "", 0, 1)
    with pytest.raises(TrainingError, match="the Prefect API did not take replica group 1's run .*; it is asked again"):
        launcher.start(handle, 1, 2, resume=False)
    answers, cancelled = ["down", "running", "running"], []

    class Api:
        def read_flow_run(self, run_id):
            if answers.pop(0) == "down":
                down()
            return SimpleNamespace(state=SimpleNamespace(type=StateType.RUNNING, is_final=lambda: False))

        def set_flow_run_state(self, run_id, state, force):
            cancelled.append(state.type)

    monkeypatch.setattr(pool_launcher, "get_client", lambda **_: contextlib.nullcontext(Api()))
    monkeypatch.setattr(pool_launcher, "STATE_CACHE_SECONDS", 0.0)
    group = ReplicaProcess(0, 0, 0, "", run_id="0" * 32)
    launcher.kill(group)  # the API down: no raise, and nothing cancelled yet
    assert cancelled == []
    assert launcher.exit_code(group) is None and cancelled == [StateType.CANCELLING]  # asked again at the next read
