"""Where a replica group computes: its GPU with NCCL between groups, or the CPU with gloo.

A group is one process. On a GPU pool the launcher pins the group's GPUs with
``CUDA_VISIBLE_DEVICES``, so the group trains on the first one it sees, ``cuda:0``; more GPUs a
group (torchrun inside it) is not built yet.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from trainyard.errors import TrainingError

CPU = torch.device("cpu")


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


def process_group(device: torch.device, timeout: timedelta):
    """torchft's reconfigurable process group across groups: NCCL between GPUs, gloo between CPUs."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    return ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)


def cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers on the CPU: what is saved, compared and registered."""
    return {key: value.detach().cpu() for key, value in module.state_dict().items()}
