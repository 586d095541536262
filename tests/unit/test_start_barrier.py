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
    assert ready_groups(Path(handle.job_dir)) == {0} and groups.released == set()
    pool.waiting = {2}  # group 1 started and is up; group 2 still has no room
    mark_ready(Path(handle.job_dir), 1)
    groups.tick(live)
    assert ready_groups(Path(handle.job_dir)) == {0, 1, 2} and groups.released == {2}
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
