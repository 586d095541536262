"""The start barrier's supervisor side: the first groups start without those their pool has no room for,
and a job whose groups no worker takes says so. (Against a real pool: tests/integration/test_deployment.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard import launch
from trainyard.launch import LaunchHandle, ReplicaProcess
from trainyard.training import start_barrier
from trainyard.training.start_barrier import QueuedGroups, mark_ready, ready_groups


class QueuedPool:
    """A pool whose runs in ``waiting`` no worker has taken."""

    def __init__(self, waiting: set[int]):
        self.waiting = waiting

    def queued(self, proc: ReplicaProcess) -> bool:
        return proc.replica in self.waiting


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.setattr(start_barrier, "QUEUED_GRACE_SECONDS", 0.0)
    monkeypatch.setattr(start_barrier, "NO_WORKER_SECONDS", 0.0)
    pool = QueuedPool({1, 2})
    monkeypatch.setitem(launch._LAUNCHERS, "small-pool", pool)
    handle = LaunchHandle("j", str(tmp_path), "small-pool", "http://127.0.0.1:1", 0, 1)
    live = {r: ReplicaProcess(replica=r, attempt=0, pid=0, log="", run_id=f"run-{r}") for r in range(3)}
    return handle, live, pool


def test_groups_still_queued_once_min_replicas_are_up_are_not_waited_for(job):
    handle, live, pool = job
    said: list[tuple[str, dict]] = []
    groups = QueuedGroups(
        handle, num_replicas=3, min_replicas=2, emit=lambda kind, payload: said.append((kind, payload))
    )
    mark_ready(Path(handle.job_dir), 0)
    groups.tick(live)  # one up, two queued: fewer than min_replicas, the barrier holds
    assert ready_groups(Path(handle.job_dir)) == {0} and groups.released == {}
    pool.waiting = {2}  # group 1 started and is up; group 2 still has no room
    mark_ready(Path(handle.job_dir), 1)
    groups.tick(live)
    assert ready_groups(Path(handle.job_dir)) == {0, 1, 2} and list(groups.released) == [2]
    assert [kind for kind, _ in said] == ["replica.queued"]
    assert (
        "no room on work pool 'small-pool' yet: the job starts with 2 group(s), and group 2 joins"
        in said[0][1]["message"]
    )
    groups.tick(live)
    assert groups.done and len(said) == 1


def test_a_job_whose_groups_no_worker_takes_says_so_once(job):
    handle, live, pool = job
    pool.waiting = {0, 1, 2}
    said: list[tuple[str, dict]] = []
    groups = QueuedGroups(
        handle, num_replicas=3, min_replicas=1, emit=lambda kind, payload: said.append((kind, payload))
    )
    groups.tick(live)
    groups.tick(live)
    assert [kind for kind, _ in said] == ["job.waiting_for_workers"]
    assert "prefect worker start --pool small-pool" in said[0][1]["message"]
    assert ready_groups(Path(handle.job_dir)) == set()  # nobody to start without


def test_a_first_group_the_pool_had_no_room_for_starts_late_joins_and_heals(trainyard_home, tmp_path, monkeypatch):
    """Real groups: room for group 0 only until it has trained 20 steps. The job starts without group 1, which
    then heals from group 0 and joins (it trained alone from step 0 before, a first attempt taken for a founder)."""
    import json
    import threading

    from tests.conftest import rejoined, slow_until, wait_for_step
    from tests.unit.jobs import make_job, run
    from trainyard.training.plan import attempt_dir

    monkeypatch.setattr(start_barrier, "QUEUED_GRACE_SECONDS", 0.5)

    class RoomForOne:
        """A pool that starts group 1 only once group 0 is 20 steps in: until then its run is queued."""

        def start(self, handle, replica, attempt, resume):
            if replica == 0 or attempt > 0:
                return launch.LOCAL.start(handle, replica, attempt, resume)
            proc = ReplicaProcess(replica=replica, attempt=attempt, pid=0, log="")

            def when_room() -> None:
                wait_for_step(attempt_dir(folder, 0, 0) / "heartbeat.json", 20)
                started = launch.LOCAL.start(handle, replica, attempt, resume)
                proc.log, proc.pid = started.log, started.pid
                over.wait()  # a local group gets SIGTERM when the thread that started it ends (die_with_parent)

            threading.Thread(target=when_room, daemon=True).start()
            return proc

        def exit_code(self, proc):
            return None if proc.pid == 0 else launch.LOCAL.exit_code(proc)

        def queued(self, proc):
            return proc.pid == 0

        def kill(self, proc):
            if proc.pid:
                launch.LOCAL.kill(proc)

        def terminate(self, proc):
            if proc.pid:
                launch.LOCAL.terminate(proc)

    over = threading.Event()
    monkeypatch.setitem(launch._LAUNCHERS, "room-for-one", RoomForOne())
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 60, "batch_size": 64, "learning_rate": 0.01, "slow_while": str(tmp_path / "slow")},
        resources={"replicas": 2, "min_replicas": 1, "work_pool": "room-for-one"},
    )
    events: list = []
    try:
        with slow_until(tmp_path / "slow", lambda: rejoined(folder / "replicas/1/attempt-0")):
            outcome, _ = run(job, job_id, folder, plan, events)
    finally:
        over.set()
    assert ("replica.queued", 1) in events
    assert outcome.stop_reason == "Completed" and outcome.failures == [] and outcome.replicas_finished == [0, 1]
    recovery = json.loads((folder / "replicas/1/attempt-0/progress.json").read_text())["recovery"]
    assert recovery is not None, "group 1 started as a founder, from step 0"
    assert recovery["joined"] is True and recovery["source"] == "peer" and recovery["rejoined_at_step"] > 20
    (join,) = outcome.joins  # in the summary's elastic.joins, as a group added mid-job is
    assert join["replica"] == 1 and join["joined_at_step"] == recovery["rejoined_at_step"]
