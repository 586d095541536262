"""Where a replica group computes: its GPU with NCCL between groups, or the CPU with gloo.

A group is one process. Its launcher pins the group's GPUs with ``CUDA_VISIBLE_DEVICES``, so the
group trains on the first one it sees, ``cuda:0``: the GPU pool's worker on a GPU pool, and for local
groups the launch stage, which gives each live group its own slice of this machine's GPUs (NCCL
refuses two ranks on one GPU; ``reserve_slot``, over every job on the machine) and a local CPU group
none. More GPUs a group (torchrun inside it) is not built yet.
"""

from __future__ import annotations

import fcntl
import os
import re
from datetime import timedelta

import torch

from trainyard import env_settings
from trainyard.errors import TrainingError

CPU = torch.device("cpu")
NCCL_NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


def select(gpus_per_replica: int, replica: int) -> torch.device:
    """``cuda:0`` when the job asks for GPUs, else the CPU; a group asked for GPUs that sees none fails."""
    check(gpus_per_replica, replica)
    if gpus_per_replica <= 0:
        return CPU
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)  # NCCL and torchft's transfers use the current device
    return device


def check(gpus_per_replica: int, replica: int) -> None:
    """Fail, naming the field and the fix, when GPUs are asked for and this process sees none."""
    if gpus_per_replica > 0 and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        missing = TrainingError(
            f"resources.gpus_per_replica is {gpus_per_replica} but replica group {replica} sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={visible}, torch {torch.__version__}); run it on a GPU pool with a CUDA "
            "build of torch, or set resources.gpus_per_replica: 0 to train on CPUs"
        )
        # the group's to retry (replica.main), not the job's mistake: on a pool, one node's GPU or driver failed
        # while the others train, and a restart lands elsewhere; a pool with no GPU at all fails each try the same
        missing.transient = True  # type: ignore[attr-defined]
        raise missing


def visible_gpus() -> list[str]:
    """This machine's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (indices, or UUIDs), in its order."""
    names = env_settings.cuda_visible_devices()
    return names if names is not None else [str(i) for i in range(torch.cuda.device_count())]


def check_fits(replicas: int, gpus_per_replica: int, visible: list[str]) -> None:
    """Local groups each need GPUs of their own: fail, naming the fields, when they cannot all have them."""
    if gpus_per_replica > 0 and replicas * gpus_per_replica > len(visible):
        raise TrainingError(
            f"resources.replicas ({replicas}) x resources.gpus_per_replica ({gpus_per_replica}) is "
            f"{replicas * gpus_per_replica} GPUs, but this machine has {len(visible)} "
            f"({','.join(visible) or 'none'}): local groups cannot share a GPU (NCCL refuses it); lower either, "
            "or run the groups on a GPU work pool"
        )


def reserve_slot(gpus_per_replica: int, visible: list[str], prefer: int | None = None) -> tuple[int, list[int]]:
    """``(slot, lock descriptors)``: the lowest slice of ``gpus_per_replica`` visible GPUs (``prefer`` first) that
    no live local group holds, of this job or of another on this machine (sharing its ``TRAINYARD_HOME``).

    Each GPU has a lock file (``<home>/locks/gpu-<name>.lock``); a slice is reserved by locking its GPUs' files
    and passing the descriptors to the group's process (``Popen(pass_fds=...)``), whose lock it then is, gone
    with the process however it ends. The caller closes its own copies once the group has started. Two jobs'
    launchers each counted only their own groups, and gave them the same GPUs while others sat idle."""
    from trainyard.home import home

    folder = home() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    slots = list(range(len(visible) // gpus_per_replica))
    for slot in sorted(slots, key=lambda s: s != prefer):
        fds: list[int] = []
        try:
            for name in visible[slot * gpus_per_replica : (slot + 1) * gpus_per_replica]:
                lock = folder / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.lock"  # (a MIG name has slashes)
                fds.append(os.open(lock, os.O_RDWR | os.O_CREAT))
                fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
            return slot, fds
        except BaseException as exc:  # none kept open: a lock left held would keep that GPU busy for every job
            for fd in fds:
                os.close(fd)
            if not isinstance(exc, BlockingIOError):
                raise
    raise TrainingError(
        f"no free GPUs for another local replica group: every slice of {gpus_per_replica} of this machine's "
        f"{len(visible)} GPUs ({','.join(visible)}) is held by a live group of this job or of another job on this "
        f"machine (their locks: {folder}/gpu-*.lock); scale to fewer groups, wait for the other job, or run the "
        "groups on a GPU work pool"
    )


def slot_devices(slot: int, gpus_per_replica: int, visible: list[str]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of a group given slice ``slot``."""
    return ",".join(visible[slot * gpus_per_replica : (slot + 1) * gpus_per_replica])


def process_group(device: torch.device, timeout: timedelta):
    """torchft's reconfigurable process group across groups: NCCL between GPUs, gloo between CPUs."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    if device.type != "cuda":
        return ProcessGroupGloo(timeout=timeout)
    # NCCL's non-blocking calls time out after this; torchft reads it when the group is made and, when it is
    # unset, warns and sets it to the same timeout. Set here so that it holds before any NCCL call.
    os.environ.setdefault(NCCL_NONBLOCKING_TIMEOUT_ENV, str(timeout.total_seconds()))
    return ProcessGroupNCCL(timeout=timeout)


def close_process_group(pg) -> None:
    """Abort the group's NCCL communicators once it has left the job (gloo needs nothing).

    torchft's ``Manager.shutdown`` drops the process group without aborting it, so NCCL's heartbeat monitor
    runs on until the process exits, polling a TCPStore that is gone by then: the group's log ended with a
    C++ stack trace ("Failed to check the should dump flag on TCPStore") after every clean finish on a GPU.
    """
    from torchft import ProcessGroupNCCL

    if isinstance(pg, ProcessGroupNCCL):
        pg.abort(errored=False)  # not a failure: torchft logs no error for it


def cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers on the CPU: what is saved, compared and registered."""
    return {key: value.detach().cpu() for key, value in module.state_dict().items()}
