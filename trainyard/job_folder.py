"""A job's folder between runs of its job id: what a rerun sets aside before it starts.

A run leaves its plan, its stop and scale requests, its groups' folders (heartbeats, results, models),
its logs and its summary in ``jobs/<job id>/``. A rerun of the id (a Prefect retry of a failed or crashed
run, a resubmission) must not read them as its own: an earlier run's stop request stopped the rerun at
once, and its plan sent the rerun's first groups to a lighthouse that was gone. So a run first moves them
to ``earlier-runs/<n>/`` (kept for a post-mortem, the last ``EARLIER_KEPT`` of them: a job retried again
and again would otherwise keep every attempt's group models; ``trainyard clean`` removes the folder with
the job's),
keeping in place only the energy journals (``energy/``: every run's, counted by the rerun) and deleting
the prepared arrays (``data/``: made again from the cache, and as large as the channels). A run holds
the job's ``RunLock`` throughout, so no second run of the id moves the folder from under a live one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from trainyard.errors import TrainingError
from trainyard.home import Locked, flocked
from trainyard.training.plan import SUPERVISOR_FILE

EARLIER = "earlier-runs"
LOCK = "run.lock"
KEPT = frozenset({"energy", EARLIER, LOCK})
EARLIER_KEPT = 3
DERIVED = frozenset({"data"})


class RunLock:
    """Held for the whole of one run of the job id (an exclusive ``flock`` on ``run.lock`` in its folder,
    taken when made): a second run of the id while one runs on this machine is refused before it touches
    the folder. The lock dies with its process, however it dies, so a crashed run never blocks its rerun."""

    def __init__(self, job_dir: Path):
        self.path = job_dir / LOCK
        self._held = contextlib.ExitStack()
        try:
            self._held.enter_context(flocked(self.path, wait_seconds=0))
        except Locked:
            raise TrainingError(
                f"job {job_dir.name} is already running on this machine (another run of it holds {self.path}): "
                f"wait for it, stop it (trainyard stop {job_dir.name}, or trainyard jobs stop), or run the job "
                "under a new id"
            ) from None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self._held.close()


def set_aside_earlier_run(job_dir: Path) -> Path | None:
    """Move what an earlier run of the job id left in ``job_dir`` to ``earlier-runs/<n>/``; returns where
    (None: nothing was left). Call it holding the job's ``RunLock``: no other run of it is then running."""
    leftovers = sorted(p for p in job_dir.iterdir() if p.name not in KEPT)
    if not leftovers:
        return None
    earlier = job_dir / EARLIER
    earlier.mkdir(exist_ok=True)
    target = earlier / str(1 + max((int(p.name) for p in earlier.iterdir() if p.name.isdigit()), default=0))
    target.mkdir()
    for path in leftovers:
        if path.name in DERIVED:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        else:
            os.replace(path, target / path.name)
    # numbers keep counting up past the ones removed, so a post-mortem's "earlier-runs/4" never changes meaning
    for old in sorted((p for p in earlier.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))[:-EARLIER_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def training_pid(job_dir: Path) -> int | None:
    """The pid of the job's training supervisor when it is alive (``supervisor.json`` names it), else None."""
    try:
        pid = int(json.loads((job_dir / SUPERVISOR_FILE).read_text())["pid"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return pid if pid_alive(pid) else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` is alive (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
