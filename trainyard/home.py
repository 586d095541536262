"""Where Trainyard keeps its state on this machine: ``TRAINYARD_HOME`` (default ``~/.trainyard``).

Layout: ``cache/`` (staged objects, content-addressed), ``jobs/<job id>/`` (one folder a job:
manifests, the training plan, replica logs and results), ``mlflow.db`` and ``mlartifacts/`` (the
embedded MLflow), ``prefect/`` (the embedded Prefect's ``PREFECT_HOME``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainyard.errors import SpecError, TrainingError

TRAINYARD_HOME_ENV = "TRAINYARD_HOME"


def home() -> Path:
    """The state folder, created on first use."""
    path = Path(os.environ.get(TRAINYARD_HOME_ENV) or Path.home() / ".trainyard").expanduser().resolve()
    if not path.exists():
        # its owner's alone: it holds job specs, staged data and the embedded MLflow and Prefect databases
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def cache_dir() -> Path:
    """The machine's cache: staged objects and streamed row groups (``trainyard.cache``)."""
    return _sub("cache")


def jobs_dir() -> Path:
    """Parent of the per-job folders."""
    return _sub("jobs")


def new_job_id(name: str) -> str:
    """A unique, sortable job id: ``<name>-<UTC time>-<random>``."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


# What new_job_id makes, and what a caller's own id (the flow's job_id parameter, `trainyard scale`) may
# be: one folder name under jobs/ and one segment of the output keys, never "..", "/" or empty.
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"


def is_job_id(job_id: str) -> bool:
    """Whether ``job_id`` has the form of one (``JOB_ID_PATTERN``)."""
    return re.fullmatch(JOB_ID_PATTERN, job_id) is not None


def check_job_id(job_id: str) -> str:
    """``job_id`` when it has the form of one; else a ``SpecError`` saying what it may hold."""
    if not is_job_id(job_id):
        raise SpecError(
            [
                f"job_id {job_id!r}: use letters, digits, '.', '_' and '-', starting with a letter or digit "
                "(at most 200), as trainyard's own ids are (<name>-<UTC time>-<random>)"
            ]
        )
    return job_id


def job_dir(job_id: str) -> Path:
    """The folder of one job, created on first use."""
    path = jobs_dir() / check_job_id(job_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json_atomic(path: Path, data: Any, indent: int | None = 2) -> None:
    """Write JSON so a reader never sees half a file: a temporary name, then a rename. ``indent``: None for
    the most compact file (one rewritten often)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # one temporary name per thread: threads of one process write the same file (stop.json), and with one per
    # process a writer could rename another's half-written file or find its own gone
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=str))
    os.replace(tmp, path)


def link_or_copy(source: Path, target: Path) -> None:
    """Make ``target`` the same file as ``source``: a hard link (no bytes copied), or a copy where the
    file system has none or ``target`` is on another one. Whatever was at ``target`` is replaced."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _sub(name: str) -> Path:
    path = home() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


class Locked(TrainingError):
    """A lock file another process (or another open of it) held for longer than the caller would wait."""


@contextlib.contextmanager
def flocked(path: Path, kind: int = fcntl.LOCK_EX, wait_seconds: float | None = None) -> Iterator[None]:
    """A ``flock`` (``kind``: ``LOCK_EX`` or ``LOCK_SH``) on the lock file ``path``, made where missing, for the
    block. ``wait_seconds``: how long to wait for it (None: as long as it takes; 0: not at all), then
    ``Locked``. Per open file: threads of one process wait on each other too. It dies with its process,
    however that dies; it locks the processes of one machine (of one file system)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if wait_seconds is None:
            fcntl.flock(fd, kind)
        else:
            deadline = time.monotonic() + wait_seconds
            while True:
                try:
                    fcntl.flock(fd, kind | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise Locked(f"{path} stayed locked for {wait_seconds:g} s") from None
                    time.sleep(0.1)
        yield
    finally:
        os.close(fd)
