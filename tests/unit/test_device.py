"""Where a group computes: the CPU with gloo unless the job asks for GPUs; asked for GPUs it cannot
see, a group fails with the field and the fix rather than training on the CPU unnoticed."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torchft import ProcessGroupGloo

from trainyard.errors import TrainingError
from trainyard.training import device


def test_a_cpu_job_trains_on_the_cpu_with_gloo():
    chosen = device.select(0, replica=0)
    assert chosen == torch.device("cpu")
    assert isinstance(device.process_group(chosen, timedelta(seconds=5)), ProcessGroupGloo)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_asking_for_gpus_without_one_fails_naming_the_field(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(TrainingError, match=r"resources.gpus_per_replica is 1 .* group 2 .*CUDA_VISIBLE_DEVICES=3"):
        device.select(1, replica=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_job_trains_on_its_first_visible_gpu_with_nccl():
    from torchft import ProcessGroupNCCL

    chosen = device.select(1, replica=0)
    assert chosen == torch.device("cuda", 0)
    assert isinstance(device.process_group(chosen, timedelta(seconds=5)), ProcessGroupNCCL)


def test_saved_state_is_on_the_cpu():
    state = device.cpu_state(torch.nn.Linear(3, 2))
    assert set(state) == {"weight", "bias"} and all(t.device.type == "cpu" for t in state.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_local_gpu_job_on_a_machine_without_one_fails_before_the_groups_train(trainyard_home):
    from tests.unit.test_training import make_job
    from trainyard.training import supervisor

    job, job_id, folder, plan = make_job(trainyard_home, resources={"replicas": 1, "gpus_per_replica": 1})
    with pytest.raises(TrainingError, match="resources.gpus_per_replica is 1"):
        supervisor.preflight(job, plan)
