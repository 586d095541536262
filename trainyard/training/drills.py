"""Failure drills (``elastic.fault_injection``): a group fails on purpose at a step, as a user asked.

Users measure their own recovery window this way (SageMaker's evaluation guide recommends it). Each
attempt records the drill it played in its folder (``DRILL_FILE``), so a restarted group plays only the
drills its earlier attempts did not, and every drill fires once, whatever the timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

from trainyard.spec import TrainingJob
from trainyard.training.plan import attempt_dir

DRILL_FILE = "drill.json"  # the drill an attempt played: {at_step, step}


def drills(job: TrainingJob, replica: int, played: set[int]) -> dict[int, str]:
    """The failure drills (step: kind) an attempt of ``replica`` plays: those its earlier attempts did not
    (``played``, their steps), so each fires once."""
    return {f.at_step: f.kind for f in job.elastic.fault_injection if f.replica == replica and f.at_step not in played}


def played_drills(job_dir: Path, replica: int, attempt: int) -> set[int]:
    """The steps of the drills ``replica``'s attempts before ``attempt`` played (each records its own)."""
    played = set()
    for earlier in range(attempt):
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):  # none: it ended without one
            played.add(json.loads((attempt_dir(job_dir, replica, earlier) / DRILL_FILE).read_text())["at_step"])
    return played


def due_drill(faults: dict[int, str], step: int) -> int | None:
    """The step of the drill to play at ``step``: the earliest at or before it, None if none. At or past,
    not only at: a group that healed past a drill's step (a late start on a busy machine, a quorum it
    missed, a restart) still plays it, so every drill fires, whatever the timing."""
    return min((at for at in faults if at <= step), default=None)


def inject_fault(kind: str | None) -> None:
    """Fail this process as the drill says: killed, sent SIGTERM (a graceful leave), or hung (SIGSTOP)."""
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
