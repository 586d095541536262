"""Stage 2, launch: start the job's torchft lighthouse and its replica groups as local processes.

This is the embedded default launcher (work pool ``local``). Groups start before the filtering
stage so that their start-up overlaps it; each waits for the train stage's plan. The handle
returned is plain data (pids and addresses); the ``Popen`` objects stay in this process's table.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainyard.errors import TrainingError
from trainyard.servers import free_port, stop_process, wait_until_answering
from trainyard.spec import Resources
from trainyard.training.plan import attempt_dir
from trainyard.training.replica import THREADS_ENV

# Lighthouse failure detection: a silent group is dropped from the quorum after this long.
HEARTBEAT_TIMEOUT_MS = 3000
JOIN_TIMEOUT_MS = 3000
_PROCESSES: dict[int, subprocess.Popen] = {}


@dataclass(slots=True)
class ReplicaProcess:
    """One attempt of one replica group."""

    replica: int
    attempt: int
    pid: int
    log: str
    resumed: bool = False


@dataclass(slots=True)
class LaunchHandle:
    """What the launch stage started: enough for the train stage to watch and restart groups."""

    job_id: str
    job_dir: str
    work_pool: str
    lighthouse_addr: str
    lighthouse_pid: int
    num_threads: int
    replicas: list[ReplicaProcess] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def launch(job_id: str, job_dir: Path, resources: Resources) -> LaunchHandle:
    """Start the lighthouse and ``resources.replicas`` replica group processes."""
    if resources.work_pool != "local":
        raise TrainingError(
            f"work pool {resources.work_pool!r}: only the embedded 'local' pool is available in this version; "
            "set resources.work_pool to local"
        )
    port = free_port()
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    log = open(job_dir / "lighthouse.log", "ab")  # noqa: SIM115 - owned by the child process
    lighthouse = subprocess.Popen(
        [
            binary,
            "--min_replicas",
            str(resources.min_replicas),
            "--bind",
            f"127.0.0.1:{port}",
            "--heartbeat_timeout_ms",
            str(HEARTBEAT_TIMEOUT_MS),
            "--join_timeout_ms",
            str(JOIN_TIMEOUT_MS),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    _PROCESSES[lighthouse.pid] = lighthouse
    addr = f"http://127.0.0.1:{port}"
    problem = wait_until_answering(addr, lighthouse, timeout_seconds=15.0)
    if problem:
        stop_process(lighthouse)
        raise TrainingError(f"the torchft lighthouse {problem}")
    handle = LaunchHandle(
        job_id=job_id,
        job_dir=str(job_dir),
        work_pool=resources.work_pool,
        lighthouse_addr=addr,
        lighthouse_pid=lighthouse.pid,
        num_threads=max(1, (os.cpu_count() or 1) // resources.replicas),
    )
    for replica in range(resources.replicas):
        handle.replicas.append(start_replica(handle, replica, attempt=0))
    return handle


def start_replica(handle: LaunchHandle, replica: int, attempt: int, resume: bool = False) -> ReplicaProcess:
    """Start (or restart, with the next attempt number) one replica group process; ``resume``: from
    the job's latest S3 checkpoint."""
    out = attempt_dir(Path(handle.job_dir), replica, attempt)
    log_path = out / "replica.log"
    env = {**os.environ, THREADS_ENV: str(handle.num_threads), "OMP_NUM_THREADS": str(handle.num_threads)}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainyard.training.replica",
                "--job-dir",
                handle.job_dir,
                "--replica",
                str(replica),
                "--attempt",
                str(attempt),
                *(["--resume"] if resume else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    _PROCESSES[proc.pid] = proc
    return ReplicaProcess(replica=replica, attempt=attempt, pid=proc.pid, log=str(log_path), resumed=resume)


def exit_code(pid: int) -> int | None:
    """The exit code of a process this module started, or None while it runs."""
    proc = _PROCESSES.get(pid)
    if proc is None:
        raise TrainingError(f"process {pid} was not started by this launcher")
    return proc.poll()


def kill(pid: int) -> None:
    """Kill a process this module started (SIGKILL: it may be stopped or wedged)."""
    proc = _PROCESSES.get(pid)
    if proc is not None and proc.poll() is None:
        proc.kill()


def terminate(pid: int) -> None:
    """SIGTERM a process this module started: a replica group leaves at its next step boundary."""
    proc = _PROCESSES.get(pid)
    if proc is not None and proc.poll() is None:
        proc.terminate()


def shutdown(handle: LaunchHandle, grace_seconds: float = 5.0) -> None:
    """Stop every replica group still running, then the lighthouse."""
    pids = [r.pid for r in handle.replicas] + [handle.lighthouse_pid]
    for pid in pids:
        proc = _PROCESSES.get(pid)
        if proc is not None and proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_seconds
    for pid in pids:
        proc = _PROCESSES.pop(pid, None)
        if proc is None:
            continue
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
