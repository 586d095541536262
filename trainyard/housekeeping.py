"""What ``trainyard clean`` removes: the folders of old jobs under ``TRAINYARD_HOME``.

Each job leaves ``jobs/<job id>/`` (manifests, replica logs, every group's model) and, run without a
Prefect API, ``prefect/<job id>/`` (its ephemeral Prefect database): nothing else reads them once the
job is over (its model and lineage are in MLflow, its outputs in S3), but they add up on a laptop. The
cache has its own cap (``TRAINYARD_CACHE_MAX_BYTES``) and MLflow's store is never touched here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainyard.errors import TrainyardError
from trainyard.home import Locked, check_job_id, flocked, home, is_job_id, jobs_dir
from trainyard.job_folder import LOCK, pid_alive, training_pid

DOOMED = ".removing-"  # a folder being removed: .removing-<name>-<pid of the remover>


@dataclass(frozen=True)
class OldJob:
    """A job's folders, how long since anything in them was written, and their size."""

    job_id: str
    folders: tuple[Path, ...]
    idle_seconds: float
    size: int  # the bytes removing them frees: files hard-linked from the cache (a raw channel's) not counted


def old_jobs(older_than_seconds: float, now: float | None = None) -> list[OldJob]:
    """The jobs nothing has written to for ``older_than_seconds``, oldest first; never one still running
    (its supervisor alive, or its run lock held), however long it has been quiet."""
    now = time.time() if now is None else now
    found = _interrupted_removals(now)
    for folder in sorted(jobs_dir().iterdir()):
        if not folder.is_dir() or not is_job_id(folder.name) or training_pid(folder) is not None:
            continue
        folders = (folder, *[p for p in [home() / "prefect" / folder.name] if p.is_dir()])
        newest, size = 0.0, 0
        for path in folders:
            last, bytes_ = _walk(path)
            newest, size = max(newest, last), size + bytes_
        if now - newest >= older_than_seconds and not _locked(folder):
            found.append(OldJob(folder.name, folders, now - newest, size))
    return sorted(found, key=lambda job: -job.idle_seconds)


def _interrupted_removals(now: float) -> list[OldJob]:
    """What a removal stopped part-way left (``remove`` moves a folder to ``.removing-<name>-<pid>`` first; a
    Ctrl-C, or files it may not delete, leave it), whose remover is gone: nothing else would ever list it. Listed
    whatever its age, as ``<name> (removal interrupted)``."""
    found = []
    for parent in (jobs_dir(), home() / "prefect"):
        for folder in sorted(parent.glob(f"{DOOMED}*")) if parent.is_dir() else []:
            name, _, pid = folder.name.removeprefix(DOOMED).rpartition("-")
            if folder.is_dir() and not (pid.isdigit() and pid_alive(int(pid))):
                last, size = _walk(folder)
                found.append(OldJob(f"{name} (removal interrupted)", (folder,), now - last, size))
    return found


def _locked(folder: Path) -> bool:
    """Whether a run of the job holds its run lock (staging, training or registering: a quiet job folder
    can be running, its supervisor not yet started or already gone). Looked at after its files' times:
    taking the lock makes the lock file where missing."""
    if not (folder / LOCK).exists():
        return False  # no run has started here since runs took the lock
    try:
        with flocked(folder / LOCK, wait_seconds=0):
            return False
    except Locked:
        return True


@contextlib.contextmanager
def named_jobs(job_ids: list[str], now: float | None = None) -> Iterator[list[OldJob]]:
    """The folders of the jobs ``job_ids`` name, whatever their age, with each job's run lock held for the
    block (no run of it starts meanwhile); a ``TrainyardError`` naming one that has no folder here or is
    running (its lock held: staging, training or registering)."""
    now = time.time() if now is None else now
    found = []
    with contextlib.ExitStack() as held:
        for job_id in dict.fromkeys(job_ids):  # each once, in the order given
            folder = jobs_dir() / check_job_id(job_id)
            if not folder.is_dir():
                raise TrainyardError(
                    f"job {job_id}: no folder under {jobs_dir()}; `trainyard clean --dry-run` lists them"
                )
            folders = (folder, *[p for p in [home() / "prefect" / job_id] if p.is_dir()])
            walked = [_walk(path) for path in folders]  # before the lock file, which a lock may create
            try:
                held.enter_context(flocked(folder / LOCK, wait_seconds=0))
            except Locked:
                raise TrainyardError(f"job {job_id} is running; stop it first (trainyard stop {job_id})") from None
            found.append(OldJob(job_id, folders, now - max(w[0] for w in walked), sum(w[1] for w in walked)))
        yield found


def remove(job: OldJob, lock: bool = False) -> bool:
    """Delete a job's folders; with ``lock`` (a job ``old_jobs`` found: its lock not held by the caller), only
    if no run of it has started since, its run lock held meanwhile. Whether they were removed (False: a run of
    it has started); a ``TrainyardError`` naming what could not be deleted (files another user owns, say)."""
    failed: list[str] = []
    with contextlib.ExitStack() as held:
        if lock and (job.folders[0] / LOCK).exists():
            try:
                held.enter_context(flocked(job.folders[0] / LOCK, wait_seconds=0))
            except Locked:
                return False
        for folder in job.folders:
            # moved aside first, under the lock: a run of the id starting meanwhile makes a folder of its own,
            # not one this is still deleting (its lock file included). (An interrupted removal's is there already.)
            doomed = (
                folder if folder.name.startswith(DOOMED) else folder.with_name(f"{DOOMED}{folder.name}-{os.getpid()}")
            )
            with contextlib.suppress(FileNotFoundError):
                os.replace(folder, doomed)
            # (onerror: Python 3.11's; 3.12 deprecates it for onexc, still calling it)
            shutil.rmtree(doomed, onerror=lambda _, path, info: failed.append(f"{path} ({info[1]})"))
    if failed:
        raise TrainyardError(
            f"{job.job_id}: {len(failed)} path(s) could not be deleted, first {failed[0]}; what is left is listed "
            "by the next `trainyard clean`"
        )
    return True


def _walk(folder: Path) -> tuple[float, int]:
    """The latest modification time in ``folder`` (itself included) and the bytes of its files that have
    no other name (a raw channel's objects are hard links to the cache's)."""
    newest, size = folder.stat().st_mtime, 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name), follow_symlinks=False)
            except FileNotFoundError:
                continue
            newest, size = max(newest, st.st_mtime), size + (st.st_size if st.st_nlink == 1 else 0)
    return newest, size
