"""Where a replica group computes: its GPU with NCCL between groups, or the CPU with gloo.

A group is one process. Its launcher pins the group's GPUs with ``CUDA_VISIBLE_DEVICES``, so the
group trains on the first one it sees, ``cuda:0``: the GPU pool's worker on a GPU pool, and for local
groups the launch stage, which gives each live group its own slice of this machine's GPUs (NCCL
refuses two ranks on one GPU) and a local CPU group none. More GPUs a group (torchrun inside it) is not built yet.
"""

from __future__ import annotations

import os
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
        raise TrainingError(
            f"resources.gpus_per_replica is {gpus_per_replica} but replica group {replica} sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={visible}, torch {torch.__version__}); run it on a GPU pool with a CUDA "
            "build of torch, or set resources.gpus_per_replica: 0 to train on CPUs"
        )


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


def free_slot(taken: set[int], gpus_per_replica: int, visible: list[str]) -> int:
    """The lowest slice of ``gpus_per_replica`` visible GPUs that no live group holds."""
    for slot in range(len(visible) // gpus_per_replica):
        if slot not in taken:
            return slot
    raise TrainingError(
        f"no free GPUs for another local replica group: {len(taken)} groups hold {gpus_per_replica} each of this "
        f"machine's {len(visible)}; scale to fewer groups, or run them on a GPU work pool"
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
