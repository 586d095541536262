"""The start barrier: a job's first groups wait for each other before their first quorum.

Without it the first group up forms a quorum alone and the others join late and heal, which is correct
but wastes their share of the first steps. Each group marks itself ready once its manager is up
(``start_barrier``). The supervisor marks the ones the others must not wait for: a group whose first
attempt ended before it was up (its restart heals from the others), and a group still queued on its
work pool for want of room (``QueuedGroups``), which joins and heals when a worker takes it. Past the
timeout the job starts elastically anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from trainyard import launch
from trainyard.launch import LaunchHandle, ReplicaProcess

# How long a group may sit queued on its pool, once enough others (min_replicas) are ready, before they
# start without it: a worker with room takes a run within its query interval (10 s by default).
QUEUED_GRACE_SECONDS = 15.0
# After this long with every group still queued, the job says so: the pool may have no worker at all.
NO_WORKER_SECONDS = 60.0


def start_barrier(job_dir: Path, replica: int, num_replicas: int, timeout_seconds: float = 120.0) -> None:
    """Mark ``replica`` ready, then wait until every initial group is (or the timeout)."""
    mark_ready(job_dir, replica)
    markers = [_ready_dir(job_dir) / str(r) for r in range(num_replicas)]
    deadline = time.monotonic() + timeout_seconds
    while not all(marker.exists() for marker in markers) and time.monotonic() < deadline:
        time.sleep(0.02)


def mark_ready(job_dir: Path, replica: int) -> None:
    """Count ``replica`` as present at the start barrier."""
    ready = _ready_dir(job_dir)
    ready.mkdir(parents=True, exist_ok=True)
    (ready / str(replica)).touch()


def ready_groups(job_dir: Path) -> set[int]:
    """The groups counted as present at the start barrier."""
    ready = _ready_dir(job_dir)
    return {int(p.name) for p in ready.iterdir() if p.name.isdigit()} if ready.is_dir() else set()


def _ready_dir(job_dir: Path) -> Path:
    return job_dir / "replicas" / "ready"


class QueuedGroups:
    """The supervisor's side: lets the job's first groups start without those still queued on the pool.

    A pool with room for fewer groups than ``replicas`` (its concurrency limit, its workers) left the
    groups that had started idle at the barrier until its timeout: GPUs held for two minutes.
    """

    def __init__(self, handle: LaunchHandle, num_replicas: int, min_replicas: int, emit: Callable[[str, dict], None]):
        self.handle, self.num_replicas, self.min_replicas, self.emit = handle, num_replicas, min_replicas, emit
        self.done = False
        self.released: dict[int, float] = {}  # groups the others started without -> when (unix)
        self._enough_since: float | None = None
        self._since = time.monotonic()
        self._said_no_worker = False

    def tick(self, live: dict[int, ReplicaProcess]) -> None:
        """Called at every look until every initial group is at the barrier."""
        if self.done:
            return
        job_dir = Path(self.handle.job_dir)
        ready = ready_groups(job_dir)
        missing = [r for r in range(self.num_replicas) if r not in ready]
        if not missing:
            self.done = True
            return
        up = ready & set(live)  # (a group marked ready because its first attempt failed is not up)
        if len(up) < self.min_replicas:
            self._enough_since = None
            self._no_worker(live)
            return
        now = time.monotonic()
        self._enough_since = self._enough_since or now
        if now - self._enough_since < QUEUED_GRACE_SECONDS:
            return
        for replica in missing:
            if replica in live and launch.queued(self.handle, live[replica]):
                mark_ready(job_dir, replica)
                self.released[replica] = time.time()
                self.emit(
                    "replica.queued",
                    {
                        "replica": replica,
                        "work_pool": self.handle.work_pool,
                        "message": f"no room on work pool {self.handle.work_pool!r} yet: the job starts with "
                        f"{len(up)} group(s), and group {replica} joins when a worker takes it",
                    },
                )

    def _no_worker(self, live: dict[int, ReplicaProcess]) -> None:
        """Said once: every group still queued after ``NO_WORKER_SECONDS`` (the job shows as launching)."""
        if self._said_no_worker or time.monotonic() - self._since < NO_WORKER_SECONDS:
            return
        if live and all(launch.queued(self.handle, proc) for proc in live.values()):
            self._said_no_worker = True
            self.emit(
                "job.waiting_for_workers",
                {
                    "work_pool": self.handle.work_pool,
                    "message": f"no worker of work pool {self.handle.work_pool!r} has taken any of the job's "
                    f"{len(live)} group run(s) in {NO_WORKER_SECONDS:.0f} s: is one running (prefect worker start "
                    f"--pool {self.handle.work_pool}), and does the pool have room (its concurrency limit)? "
                    "stopping.max_runtime_seconds counts meanwhile",
                },
            )
