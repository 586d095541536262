"""What a replica group's attempt writes beside itself for the supervisor and the job: its heartbeat,
the running counts of every committed step, ``progress.json`` at epoch ends, and (for benchmarks) a
step log; and reading them back. Small writes that a kill cannot leave half done.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.home import write_json_atomic
from trainyard.training.plan import attempt_dir

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from trainyard.launch import LaunchHandle
    from trainyard.training.batches import StepData
    from trainyard.training.epochs import History
    from trainyard.training.flops import FlopMeter

COUNTS_FILE = "counts.json"
BEST_EPOCH_FILE = "best-epoch-{epoch}.pt"
STEP_LOG_ENV = "TRAINYARD_STEP_LOG"
"""Set to 1: each group writes ``steps.jsonl``, a line per committed step (benchmarks read it)."""


def _beat(out: Path) -> dict:
    """An attempt's last heartbeat (``Heartbeat``: its step and when), empty before its first."""
    try:
        beat = json.loads((out / "heartbeat.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return beat if isinstance(beat, dict) else {}


def last_step(out: Path) -> int:
    """The last step an attempt reported (its heartbeat), 0 if none."""
    return _beat(out).get("step", 0)


def silent_seconds(out: Path) -> float:
    """Seconds since an attempt's last heartbeat (0 before its first)."""
    beat = _beat(out)
    return time.time() - beat["unix"] if "unix" in beat else 0.0


# A beat of a group's own slow work this recent shows it still at it (the heartbeat's watcher beats every second).
BUSY_FRESH_SECONDS = 5.0


def moving(out: Path, group: tuple[int, int], stepped: dict[tuple[int, int], int]) -> bool:
    """Whether an attempt's heartbeat shows it moving since last looked at (``stepped``: each group's step then): a
    step further, or a fresh beat of slow work of its own (``Heartbeat.while_busy``: validating, saving its state
    or its model), not of a wait on its peers."""
    beat = _beat(out)
    if "step" not in beat:
        return False
    step, busy = beat["step"], bool(beat.get("own_work")) and time.time() - beat["unix"] < BUSY_FRESH_SECONDS
    before, stepped[group] = stepped.get(group), step
    return (before is not None and step > before) or busy


def job_step(job_dir: Path) -> int:
    """The furthest step any group of the job has reported, 0 if none."""
    return max((last_step(path.parent) for path in job_dir.glob("replicas/*/attempt-*/heartbeat.json")), default=0)


class Heartbeat:
    """The group's current step in ``heartbeat.json``, at most every ``interval`` seconds: the
    supervisor reads it to know where a group was when it failed, and whether it has gone silent."""

    def __init__(self, path: Path, interval: float = 0.2, busy_every: float = 1.0):
        self.path, self.interval, self.busy_every, self._last = path, interval, busy_every, 0.0
        self._step: int | None = None  # the step of the last beat
        # the group's loop and the watcher (while_busy) both beat, through one temporary file: one at a time
        self._lock = threading.Lock()
        self._busy: int | None = None  # the step of the slow work under way
        self._own_work = False  # whether that work is the group's own (not a wait on its peers)
        self._watcher: threading.Thread | None = None
        self._closed = threading.Event()

    def beat(self, step: int, force: bool = False) -> None:
        if force or time.time() - self._last >= self.interval:
            with self._lock:
                self._write(step)

    @contextlib.contextmanager
    def while_busy(self, step: int, closing_beat: bool = True, own_work: bool = True) -> Iterator[None]:
        """Beat from a thread, at least every ``busy_every`` seconds, while the group does slow work of its own
        (validation, saving its state). Every group validates at the same step, so a validation longer than the
        silence limit read as all of them hung: all were killed, with none left to heal from. Such work waits
        on no peer, so it cannot hang the way the limit is there to catch (a wedged collective). One watcher
        thread, started at the first such work (again if it died): starting one each time took 1 to 2 ms at every
        epoch's end.

        Also around each step's quorum and commit vote (``closing_beat`` False: the loop beats at its next step,
        and a write there took half a millisecond), which wait for a peer's restart, a heal's transfer or a vote
        from a peer that died: at a silence limit below torchft's timeouts a group waiting there was killed as
        hung. Neither can hang: torchft gives up on them (``plan.quorum_timeout_seconds``, ``trainer.MANAGER_TIMEOUT``).

        ``own_work`` (not for those waits): the watcher's beats say so (``moving``), so that a stop's
        grace lasts while a group validates or saves, and not while it waits on peers that have left."""
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(target=self._watch, name="heartbeat", daemon=True)
            self._watcher.start()
        self._busy, self._own_work = step, own_work
        try:
            yield
        finally:
            with self._lock:  # the watcher beats no more for it: a later step's beat is never followed by this one's
                self._busy, self._own_work = None, False
                # (a write took half a millisecond: not when this step's beat is recent)
                if closing_beat and (self._step != step or time.time() - self._last >= self.interval):
                    self._write(step)

    def close(self) -> None:
        """Stop the watcher: the group is done (slow work after this beats only at its end)."""
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(self.busy_every / 4):
            with self._lock:
                if self._busy is not None and time.time() - self._last >= self.busy_every:
                    try:
                        self._write(self._busy, self._own_work)
                    except OSError as exc:  # (a full disk): the group's own beats will say so; keep watching
                        log.warning("heartbeat: %s", exc)

    def _write(self, step: int, own_work: bool = False) -> None:
        now = time.time()
        beat = {"step": step, "unix": now, "pid": os.getpid()} | ({"own_work": True} if own_work else {})
        write_json_atomic(self.path, beat)
        self._last, self._step = now, step


class StepCounts:
    """The group's running counts (samples trained, FLOPs, sifting's), rewritten in place after every
    committed step in one small write, which a kill cannot leave half done. progress.json is written
    only at epoch ends: for a group killed between two, the job adds up these instead (``latest_counts``)."""

    def __init__(self, path: Path):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._size = 1024  # every write is padded with spaces to the longest yet: it covers the last one

    def write(self, step: int, samples_trained: int, meter: FlopMeter, data: StepData) -> None:
        values = {"step": step, "samples_trained": samples_trained, "flops": meter.as_dict(), "sifting": data.counts()}
        line = json.dumps(values, separators=(",", ":")).encode()
        self._size = max(self._size, len(line))
        os.pwrite(self._fd, line.ljust(self._size), 0)

    def close(self) -> None:
        os.close(self._fd)


def latest_counts(folder: Path) -> dict | None:
    """What an attempt (its folder) spent: its progress.json, with the counts of its last committed step
    where those are later (a group killed mid-epoch, or before its first epoch ended); None when it
    committed nothing."""
    progress = _read_json(folder / "progress.json")
    counts = _read_json(folder / COUNTS_FILE)
    if counts is None or (progress is not None and counts["step"] <= progress["step"]):
        return progress
    # the counts replace the report's (its fractions are derived, and recomputed from counts by the job)
    sifting = {**((progress or {}).get("sifting") or {}), **counts["sifting"]} if counts["sifting"] else None
    return (progress or {}) | {key: counts[key] for key in ("step", "samples_trained", "flops")} | {"sifting": sifting}


def save_best_epoch(out: Path, epoch: int, state: dict) -> None:
    """Keep ``state`` (the model's parameters on the CPU) as epoch ``epoch``'s, the best yet, in the attempt's
    folder (``stopping.restore_best``); the attempt's earlier best goes once this one is whole. Every group
    that ended the epoch writes one (they hold equal parameters): the job takes any (``best_epoch_file``)."""
    import torch

    path = out / BEST_EPOCH_FILE.format(epoch=epoch)
    torch.save(state, out / f".{path.name}.tmp")
    os.replace(out / f".{path.name}.tmp", path)
    for earlier in out.glob(BEST_EPOCH_FILE.format(epoch="*")):
        if earlier != path:
            earlier.unlink(missing_ok=True)


def best_epoch_file(job_dir: Path, epoch: int) -> Path | None:
    """The parameters some attempt of the job kept as epoch ``epoch``'s (``save_best_epoch``), None if none
    did. Attempts' folders outlive them, so a group killed after that epoch still has its copy; a restart
    that healed later has none of its own."""
    return min(job_dir.glob(f"replicas/*/attempt-*/{BEST_EPOCH_FILE.format(epoch=epoch)}"), default=None)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None


class StepLog:
    """``{"step", "unix"}`` per committed step, appended to a JSON-lines file."""

    def __init__(self, path: Path):
        self._file = path.open("a", buffering=1)  # noqa: SIM115 - open for the attempt's life

    def add(self, step: int) -> None:
        self._file.write(json.dumps({"step": step, "unix": time.time()}) + "\n")


def write_progress(
    out: Path,
    replica: int,
    attempt: int,
    step: int,
    history: History,
    meter: FlopMeter,
    samples_trained: int,
    recovery: dict | None = None,
    data: StepData | None = None,
) -> dict:
    """The attempt's ``progress.json``, rewritten at every epoch end (and on a heal): what the train stage
    shows while the job runs and what the job adds up once it is over."""
    progress = {
        "replica": replica,
        "attempt": attempt,
        "step": step,
        "epochs": history.epochs,
        "flops": meter.as_dict(),
        "samples_trained": samples_trained,
        "recovery": recovery,
        "sifting": data.report() if data else None,
    }
    write_json_atomic(out / "progress.json", progress, indent=None)  # (indented, a long job's took a millisecond)
    return progress


def finished_the_job(job_dir: Path, finished: dict[int, dict], live: dict) -> bool:
    """Whether a group has finished the job (not just left it), even if its process is still exiting."""
    results = list(finished.values())
    for replica, proc in live.items():
        try:
            results.append(json.loads((attempt_dir(job_dir, replica, proc.attempt) / "result.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            continue
    return any(res["stop_reason"] != "Left" for res in results)


def report_progress(job_dir: Path, handle: LaunchHandle, seen: int, on_progress) -> int:
    """Each epoch a group has ended since the ``seen`` first, to ``on_progress(epoch, its metrics)``, in order,
    from the group that is furthest; returns the epochs seen."""
    best: dict | None = None
    for proc in handle.replicas:
        path = attempt_dir(job_dir, proc.replica, proc.attempt) / "progress.json"
        if path.exists():
            try:
                progress = json.loads(path.read_text())
            except (json.JSONDecodeError, OSError):
                continue
            if best is None or len(progress["epochs"]) > len(best["epochs"]):
                best = progress
    if best is None:
        return seen
    done = len(best["epochs"])
    if on_progress is not None:
        for epoch in range(seen, done):  # each epoch once, in order: several may end between two looks
            on_progress(epoch + 1, best["epochs"][epoch])
    return max(done, seen)
