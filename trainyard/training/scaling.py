"""Elastic size: groups added or asked to leave while the job runs (``trainyard scale JOB_ID N``).

A request is a number of groups, written to the job's folder (``plan.request_scale``). The train
stage acts on each new request once: it starts new groups, which heal from a live peer and join
the next quorum, or SIGTERMs the newest groups, which leave at their next step boundary. Either
way the others never stop; the data of the next epoch is dealt to the groups then in the quorum.

On a work pool, a job with room to grow (``max_replicas`` above ``replicas``) also fills up by
itself: the train stage submits the remaining groups at once; the pool's concurrency limit holds
them queued (not failed) and they join as capacity appears. Those still queued when the job ends
are withdrawn (their runs cancelled).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from trainyard import launch
from trainyard.errors import TrainingError
from trainyard.home import is_job_id, jobs_dir
from trainyard.job_folder import training_pid
from trainyard.launch import LaunchHandle, ReplicaProcess
from trainyard.spec import TrainingJob
from trainyard.training.plan import TrainingPlan, attempt_dir, request_scale, scale_requested
from trainyard.training.start_barrier import mark_ready


class Scaler:
    """Carries out scale requests for one job's train stage."""

    def __init__(self, handle: LaunchHandle, job: TrainingJob, emit: Callable[[str, dict], None]):
        self.handle, self.job, self.emit = handle, job, emit
        self.job_dir = Path(handle.job_dir)
        self.leaving: set[int] = set()
        self.added: dict[int, float] = {}  # replica -> when it was started (unix)
        self.changes: list[dict] = []
        self._next = max(r.replica for r in handle.replicas) + 1
        self._seen = scale_requested(self.job_dir)  # a request from before this stage is not new
        # A local launcher has no queue to wait in: there, only `trainyard scale` grows a job.
        assert job.resources.max_replicas is not None  # the spec sets it (default: replicas)
        self.min_replicas, self.max_replicas = job.resources.min_replicas, job.resources.max_replicas
        self._fill = handle.work_pool != "local" and self.max_replicas > len(handle.replicas)
        self.withdrawn: list[int] = []

    def tick(self, live: dict[int, ReplicaProcess], step: int) -> None:
        """Act on a new request, if there is one (the first tick on a pool also fills up to max_replicas)."""
        request = scale_requested(self.job_dir)
        # Fill once the job trains: a filling group that got the pool's room before the first groups
        # would have no peer to heal from.
        fill = self._fill and step > 0
        new = request if request is not None and request != self._seen else None
        # An explicit request settles the size: the fill must not undo one made before the first step.
        self._fill = self._fill and not fill and not new
        if not (new or fill):
            return
        asked = new[0] if new else self.max_replicas
        self._seen = new or self._seen
        target = min(max(asked, self.min_replicas), self.max_replicas)
        active = sorted(r for r in live if r not in self.leaving)
        if target == len(active):
            return  # the size asked for is the size it has: nothing to do, nor to tell
        change = {"unix": time.time(), "at_step": step, "from": len(active), "to": target, "asked": asked}
        self.changes.append(change)
        self.emit("job.scaled", change)
        for _ in range(target - len(active)):
            replica, self._next = self._next, self._next + 1
            try:
                proc = launch.start_replica(self.handle, replica, attempt=0)
            except TrainingError as exc:  # e.g. no free GPUs on this machine: the job goes on at its size
                change["to"] = len([r for r in live if r not in self.leaving])
                self.emit("job.scale_refused", {"replica": replica, "at_step": step, "reason": str(exc)})
                break
            self.handle.replicas.append(proc)
            live[replica] = proc
            self.added[replica] = time.time()
            self.emit("replica.added", {"replica": replica, "pid": proc.pid, "at_step": step})
        for replica in active[target:][::-1]:  # the newest groups leave first
            launch.terminate(self.handle, live[replica])
            self.leaving.add(replica)
            # present at the start barrier as far as the others go: one asked to leave before it got there (still
            # loading, or queued on its pool) held them for the barrier's whole 120 s
            mark_ready(self.job_dir, replica)
            self.emit("replica.removed", {"replica": replica, "at_step": step})

    def withdraw_unstarted(self, live: dict[int, ReplicaProcess], also: Iterable[int] = ()) -> None:
        """The job is over: cancel added groups that never started (still queued on their pool), and the
        groups in ``also`` (first groups the job started without, ``start_barrier.QueuedGroups``)."""
        for replica in sorted({*self.added, *also}):
            proc = live.get(replica)
            if proc is None or (attempt_dir(self.job_dir, replica, proc.attempt) / "pid").exists():
                continue
            launch.kill(self.handle, proc)
            del live[replica]
            self.withdrawn.append(replica)
            self.emit("replica.withdrawn", {"replica": replica, "reason": "the job ended before it started"})

    def joins(self, also: dict[int, float] | None = None) -> list[dict]:
        """One record per added group that committed a step: when, and what it took from its peer. ``also``:
        more late groups, by when they were asked for (unix; the first groups the job started without)."""
        records = []
        for replica, started in sorted({**self.added, **(also or {})}.items()):
            path = attempt_dir(self.job_dir, replica, 0) / "progress.json"
            recovery = json.loads(path.read_text()).get("recovery") if path.exists() else None
            if not recovery or "rejoined_at_step" not in recovery:
                continue
            records.append(
                {
                    "replica": replica,
                    "joined_at_step": recovery["rejoined_at_step"],
                    "seconds_to_first_step": round(recovery["first_commit_unix"] - started, 3),
                    "source": recovery["source"],
                    "bytes_moved": recovery.get("bytes_moved", 0),
                }
            )
        return records


def request(job_id: str, replicas: int) -> str:
    """Ask a running job for ``replicas`` groups; returns what was asked, in words.

    Refused, with the reason, when the job is unknown, not training (any more), or ``replicas`` is
    outside the job's ``resources.min_replicas``..``max_replicas``.
    """
    folder = training_folder(job_id, "scales")
    resources = TrainingPlan.read(folder).job["resources"]
    low, high = resources["min_replicas"], resources["max_replicas"]
    if not low <= replicas <= high:
        raise TrainingError(
            f"replicas: {replicas} is outside the job's range {low}..{high} "
            "(resources.min_replicas..resources.max_replicas); pick a number in it"
        )
    request_scale(folder, replicas)
    return f"job {job_id}: asked for {replicas} replica group(s); the change takes effect within a step"


def training_folder(job_id: str, what: str) -> Path:
    """The folder of job ``job_id``, which must be in its training stage on this machine now (``what`` it
    is asked to do, for the refusal: "scales", "stops")."""
    if not is_job_id(job_id):
        raise TrainingError(f"{job_id!r} is not a job id (letters, digits, '.', '_' and '-'); check the job id")
    folder = jobs_dir() / job_id
    if not folder.is_dir():
        raise TrainingError(f"no job {job_id!r} under {jobs_dir()}; check the job id (and TRAINYARD_HOME)")
    if training_pid(folder) is None:
        raise TrainingError(f"job {job_id!r} is not training now; only a job in its training stage {what}")
    return folder
