"""Stage 2, launch: start the job's torchft lighthouse (``lighthouse.py``) and its replica groups.

The lighthouse always runs beside the train stage. The groups are started by a launcher chosen by
``resources.work_pool``: ``local`` is the embedded default, local processes (``LocalProcesses``);
any other name is a Prefect work pool, whose launcher the Prefect layer registers with
``register`` (the engine itself never talks to Prefect). Groups start before the filtering stage so
that their start-up overlaps it; each waits for the train stage's plan. The handle returned is
plain data (ids and addresses); the ``Popen`` objects stay in this process's table.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from trainyard import env_settings
from trainyard.env_settings import THREADS_ENV
from trainyard.errors import TrainingError
from trainyard.lighthouse import start_lighthouse
from trainyard.servers import (
    die_with_parent,
)
from trainyard.spec import Resources
from trainyard.training.plan import LAUNCH_ENV, attempt_dir
from trainyard.training.replica import PARENT_ENV

# How long a stopping job waits for its pool groups to leave before it stops their lighthouse: a group
# leaves within a step of its SIGTERM, or a collective's timeout (trainer.PG_TIMEOUT, 10 s) when a peer
# left first. Well under the 30 s a process worker gives a cancelled pipeline run before it kills it: the
# summary and its upload come after.
POOL_LEAVE_SECONDS = 12.0
_PROCESSES: dict[int, subprocess.Popen] = {}
# The exit codes of the processes ``shutdown`` stopped and forgot: a supervisor that shut its groups
# down (a stop's grace ran out) still asks how they ended.
_ENDED: dict[int, int] = {}


@dataclass(slots=True)
class ReplicaProcess:
    """One attempt of one replica group."""

    replica: int
    attempt: int
    pid: int
    log: str
    resumed: bool = False
    run_id: str | None = None
    """The flow run, when the group runs on a work pool (``pid`` is then 0)."""


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
    gpus_per_replica: int = 0
    gpu_slots: dict[int, int] = field(default_factory=dict)
    """Local groups' slices of this machine's GPUs, by replica group (see ``_local_gpus``)."""
    launch_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """This launch's own: a rerun of the job id (or a retried launch stage) starts new groups, not the last's."""

    def to_dict(self) -> dict:
        return asdict(self)


class Launcher(Protocol):
    """Starts, watches and stops replica groups somewhere."""

    def start(self, handle: LaunchHandle, replica: int, attempt: int, resume: bool) -> ReplicaProcess: ...
    def exit_code(self, proc: ReplicaProcess) -> int | None: ...
    def queued(self, proc: ReplicaProcess) -> bool: ...
    def kill(self, proc: ReplicaProcess) -> None: ...
    def terminate(self, proc: ReplicaProcess) -> None: ...


_LAUNCHERS: dict[str, Launcher] = {}


def register(work_pool: str, launcher: Launcher) -> None:
    """Use ``launcher`` for the groups of jobs whose ``resources.work_pool`` is ``work_pool``."""
    _LAUNCHERS[work_pool] = launcher


def launcher_for(handle: LaunchHandle) -> Launcher:
    if handle.work_pool == "local":
        return LOCAL
    if handle.work_pool not in _LAUNCHERS:
        raise TrainingError(
            f"work pool {handle.work_pool!r}: no launcher for it in this process; work pools other than 'local' "
            "are reached through the Prefect pipeline (trainyard run, or a deployment)"
        )
    return _LAUNCHERS[handle.work_pool]


def launch(job_id: str, job_dir: Path, resources: Resources) -> LaunchHandle:
    """Start the lighthouse and ``resources.replicas`` replica groups."""
    # CPU threads of each group's torch (and OpenMP): the machine's cores dealt among the job's groups, unless
    # the worker sets TRAINYARD_TORCH_THREADS (several jobs sharing a machine: each would else take every core,
    # and torch's idle OpenMP threads spin, so two such jobs on two cores ran their steps about 7x slower).
    threads = env_settings.count(THREADS_ENV, max(1, (os.cpu_count() or 1) // resources.replicas))
    if resources.work_pool != "local" and resources.work_pool not in _LAUNCHERS:
        raise TrainingError(
            f"work pool {resources.work_pool!r}: no launcher for it in this process; work pools other than 'local' "
            "are reached through the Prefect pipeline (trainyard run, or a deployment)"
        )
    lighthouse, addr = start_lighthouse(job_dir, resources.min_replicas)
    _PROCESSES[lighthouse.pid] = lighthouse
    handle = LaunchHandle(
        job_id=job_id,
        job_dir=str(job_dir),
        work_pool=resources.work_pool,
        lighthouse_addr=addr,
        lighthouse_pid=lighthouse.pid,
        num_threads=threads,
        gpus_per_replica=resources.gpus_per_replica,
    )
    try:
        for replica in range(resources.replicas):
            handle.replicas.append(start_replica(handle, replica, attempt=0))
    except BaseException:
        # the caller gets no handle to stop: the lighthouse and the groups already started go now
        shutdown(handle)
        raise
    return handle


def start_replica(handle: LaunchHandle, replica: int, attempt: int, resume: bool = False) -> ReplicaProcess:
    """Start (or restart, with the next attempt number) one replica group; ``resume``: from the job's
    latest S3 checkpoint."""
    return launcher_for(handle).start(handle, replica, attempt, resume)


def exit_code(handle: LaunchHandle, proc: ReplicaProcess) -> int | None:
    """A group's exit code, or None while it runs."""
    return launcher_for(handle).exit_code(proc)


def ended_how(handle: LaunchHandle, proc: ReplicaProcess) -> str | None:
    """How an ended group's run ended, in its pool's words (a Prefect state's name and message: an image that
    would not pull, a pod OOM-killed), where the launcher can say more than an exit code; None for a process, or
    where the pool's API cannot say."""
    return _ask(handle, "ended_how", proc, None)


def lost_touch(handle: LaunchHandle, proc: ReplicaProcess) -> bool:
    """Whether a group's run ended only in its pool's records, its process maybe alive (a worker cut off from
    the API, its run marked Crashed for missed heartbeats); False for a process, or where the API cannot say."""
    return bool(_ask(handle, "lost_touch", proc, False))


def _ask(handle: LaunchHandle, question: str, proc: ReplicaProcess, unknown):
    """A launcher's answer to a question only some launchers answer (a pool's); ``unknown`` where it has none, or
    where its API cannot say (the group's exit code then stands for itself)."""
    answer = getattr(launcher_for(handle), question, None)
    try:
        return answer(proc) if answer is not None else unknown
    except Exception:  # noqa: BLE001 - the API cannot say
        return unknown


def queued(handle: LaunchHandle, proc: ReplicaProcess) -> bool:
    """Whether a group is still waiting for room to start (a pool's run not yet taken by a worker)."""
    return launcher_for(handle).queued(proc)


def kill(handle: LaunchHandle, proc: ReplicaProcess) -> None:
    """Stop a group at once (it may be stopped or wedged)."""
    launcher_for(handle).kill(proc)


def terminate(handle: LaunchHandle, proc: ReplicaProcess) -> None:
    """Ask a group to leave at its next step boundary (SIGTERM, as a spot interruption notice)."""
    launcher_for(handle).terminate(proc)


class LocalProcesses:
    """The embedded default: each group a process on this machine."""

    def start(self, handle: LaunchHandle, replica: int, attempt: int, resume: bool) -> ReplicaProcess:
        return _start_process(handle, replica, attempt, resume)

    def exit_code(self, proc: ReplicaProcess) -> int | None:
        return _exit_code(proc.pid)

    def queued(self, proc: ReplicaProcess) -> bool:
        return False  # started as it is asked for

    def kill(self, proc: ReplicaProcess) -> None:
        _signal(proc.pid, kill=True)

    def terminate(self, proc: ReplicaProcess) -> None:
        _signal(proc.pid, kill=False)


LOCAL = LocalProcesses()


def _start_process(handle: LaunchHandle, replica: int, attempt: int, resume: bool) -> ReplicaProcess:
    out = attempt_dir(Path(handle.job_dir), replica, attempt)
    log_path = out / "replica.log"
    env = {**os.environ, THREADS_ENV: str(handle.num_threads), "OMP_NUM_THREADS": str(handle.num_threads)}
    env[PARENT_ENV] = str(os.getpid())  # the group gives up waiting for its plan once this process is gone
    env[LAUNCH_ENV] = handle.launch_id  # and takes only its own launch's plan
    # A CPU group sees no GPU: it cannot take one by accident, and its carbon share counts none.
    env["CUDA_VISIBLE_DEVICES"], locks = _local_gpus(handle, replica) if handle.gpus_per_replica > 0 else ("", [])
    with contextlib.ExitStack() as ours:
        for fd in locks:  # this process's copies, closed once started (or not): the group's own hold its GPUs' locks
            ours.callback(os.close, fd)
        log = ours.enter_context(open(log_path, "ab"))
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
            preexec_fn=die_with_parent(),  # gone with the pipeline process, however it dies
            pass_fds=locks,  # its GPUs' locks: held by the group, released when it ends
        )
    _PROCESSES[proc.pid] = proc
    return ReplicaProcess(replica=replica, attempt=attempt, pid=proc.pid, log=str(log_path), resumed=resume)


def _local_gpus(handle: LaunchHandle, replica: int) -> tuple[str, list[int]]:
    """Pin a local group to GPUs no other live group holds, of this job or another on this machine (NCCL
    refuses two ranks on one GPU): its ``CUDA_VISIBLE_DEVICES`` and the descriptors of its GPUs' locks
    (``device.reserve_slot``). A restarted group gets its slice back unless another group took it while it
    was down."""
    from trainyard.training import device  # torch: only jobs that ask for GPUs pay its import here

    visible = device.visible_gpus()
    if not visible:  # said as the field's, not as every slice of none held by a live group
        raise TrainingError(
            f"resources.gpus_per_replica is {handle.gpus_per_replica} but this machine has no GPU for a local group "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}, torch "
            f"{device.torch.__version__}); run the groups on a GPU work pool, or set resources.gpus_per_replica: 0 "
            "to train on CPUs"
        )
    slot, locks = device.reserve_slot(handle.gpus_per_replica, visible, prefer=handle.gpu_slots.get(replica))
    handle.gpu_slots[replica] = slot
    return device.slot_devices(slot, handle.gpus_per_replica, visible), locks


def _exit_code(pid: int) -> int | None:
    proc = _PROCESSES.get(pid)
    if proc is None:
        if pid in _ENDED:
            return _ENDED[pid]
        raise TrainingError(f"process {pid} was not started by this launcher")
    return proc.poll()


def _signal(pid: int, kill: bool) -> None:
    proc = _PROCESSES.get(pid)
    if proc is not None and proc.poll() is None:
        proc.kill() if kill else proc.terminate()


def shutdown(handle: LaunchHandle, grace_seconds: float = 5.0) -> None:
    """Stop every replica group still running, then the lighthouse.

    Groups first, and the lighthouse kept up until they have ended: one told to leave (SIGTERM) finishes its
    step, whose quorum needs the lighthouse; without it the group hangs in its quorum until it is killed. A
    pool's groups are cancelled, their workers SIGTERM them when they notice, and their runs are waited for
    up to ``POOL_LEAVE_SECONDS``."""
    try:
        if handle.work_pool != "local":
            _cancel_pool_groups(handle)
    finally:  # the lighthouse and this machine's processes stop whatever the pool's API did
        _stop_processes([r.pid for r in handle.replicas if r.pid], grace_seconds)
        _stop_processes([handle.lighthouse_pid], grace_seconds)


def _cancel_pool_groups(handle: LaunchHandle) -> None:
    """Cancel each of the job's group runs on its pool and wait for them to end; a run the API would not cancel
    is logged and the others still are (the job writes its summary either way)."""
    launcher = launcher_for(handle)
    for replica in handle.replicas:
        try:
            launcher.kill(replica)  # the run is cancelled: its worker sends the group SIGTERM
        except Exception:  # noqa: BLE001 - the API failing here must not leave the other groups or the lighthouse
            logging.getLogger(__name__).warning(
                "could not cancel replica group %d's run on %s; it ends once it finds the job's lighthouse gone",
                replica.replica,
                handle.work_pool,
                exc_info=True,
            )
    deadline = time.monotonic() + POOL_LEAVE_SECONDS
    while time.monotonic() < deadline:
        try:
            if all(launcher.exit_code(r) is not None for r in handle.replicas):
                return
        except Exception:  # noqa: BLE001 - as above: stop waiting on what the API cannot say
            logging.getLogger(__name__).warning("could not read the group runs' states", exc_info=True)
            return
        time.sleep(0.5)


def _stop_processes(pids: list[int], grace_seconds: float) -> None:
    """SIGTERM each of this launcher's processes still running, then SIGKILL those left after the grace."""
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
        _ENDED[pid] = proc.returncode
