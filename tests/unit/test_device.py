"""Where a group computes: the CPU with gloo unless the job asks for GPUs; asked for GPUs it cannot
see, a group fails with the field and the fix rather than training on the CPU unnoticed."""

from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta
from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
import torch
from torchft import ProcessGroupGloo

from trainyard.errors import TrainingError
from trainyard.training import device, preflight


def test_a_cpu_job_trains_on_the_cpu_with_gloo():
    chosen = device.select(0, replica=0)
    assert chosen == torch.device("cpu")
    assert isinstance(device.process_group(chosen, timedelta(seconds=5)), ProcessGroupGloo)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_asking_for_gpus_without_one_fails_naming_the_field(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(
        TrainingError, match=r"resources.gpus_per_replica is 1 .* group 2 .*CUDA_VISIBLE_DEVICES=3"
    ) as e:
        device.select(1, replica=2)
    # the group's to retry, not the job's mistake (replica.main): one pool node's GPU failing failed the whole job
    assert e.value.transient  # type: ignore[attr-defined]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_job_trains_on_its_first_visible_gpu_with_nccl(monkeypatch):
    from torchft import ProcessGroupNCCL

    monkeypatch.delenv(device.NCCL_NONBLOCKING_TIMEOUT_ENV, raising=False)
    chosen = device.select(1, replica=0)
    assert chosen == torch.device("cuda", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torchft warns when NCCL's non-blocking timeout is left unset
        pg = device.process_group(chosen, timedelta(seconds=5))
    assert isinstance(pg, ProcessGroupNCCL)
    assert os.environ[device.NCCL_NONBLOCKING_TIMEOUT_ENV] == "5.0"
    device.close_process_group(pg)


def test_saved_state_is_on_the_cpu():
    state = device.cpu_state(torch.nn.Linear(3, 2))
    assert set(state) == {"weight", "bias"} and all(t.device.type == "cpu" for t in state.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_local_gpu_job_on_a_machine_without_one_fails_before_the_groups_train(trainyard_home):
    from tests.unit.jobs import make_job

    job, job_id, folder, plan = make_job(trainyard_home, resources={"replicas": 1, "gpus_per_replica": 1})
    with pytest.raises(TrainingError, match="resources.gpus_per_replica is 1"):
        preflight.preflight(job, plan)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa, GPU-bb")
    assert device.visible_gpus() == ["GPU-aa", "GPU-bb"]
    for none in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", none)
        assert device.visible_gpus() == []


def test_local_gpu_groups_must_fit_the_machine_without_sharing():
    device.check_fits(2, 2, ["0", "1", "2", "3"])
    device.check_fits(5, 0, [])  # CPU groups need none
    with pytest.raises(TrainingError, match=r"resources.replicas \(3\) x resources.gpus_per_replica \(2\) is 6 GPUs"):
        device.check_fits(3, 2, ["0", "1", "2", "3"])


def test_each_live_local_group_gets_its_own_gpus_across_the_jobs_of_the_machine(monkeypatch, tmp_path):
    """A group holds its GPUs' locks (``device.reserve_slot``) for as long as its process lives: a group
    restarted gets its slice back, a group that left frees it, and two jobs' launchers, which each counted
    only their own groups, no longer give theirs the same GPUs while others sit idle."""
    import subprocess
    import sys

    from trainyard import launch

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    started, processes = [], {}
    real_popen = subprocess.Popen

    class Group:  # a process that lives until killed, holding what the launcher passed it (its GPUs' locks)
        def __init__(self, cmd, env, pass_fds=(), **kwargs):
            sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
            self.proc = real_popen(sleeper, pass_fds=pass_fds)
            self.pid = self.proc.pid
            processes[self.pid] = self.proc
            started.append(env["CUDA_VISIBLE_DEVICES"])

    monkeypatch.setattr(launch.subprocess, "Popen", Group)
    monkeypatch.setattr(device, "visible_gpus", lambda: ["0", "1", "2", "3", "4", "5"])

    def start(handle, replica: int, attempt: int = 0) -> int:
        return launch._start_process(handle, replica, attempt, resume=False).pid

    def end(pid: int) -> None:
        processes[pid].kill()
        processes[pid].wait()

    try:
        with TemporaryDirectory() as one, TemporaryDirectory() as other:
            job = launch.LaunchHandle("j", one, "local", "", 0, 1, gpus_per_replica=2)
            first, second = start(job, 0), start(job, 1)
            another_job = launch.LaunchHandle("k", other, "local", "", 0, 1, gpus_per_replica=2)
            theirs = start(another_job, 0)
            assert started == ["0,1", "2,3", "4,5"]  # the other job's group: the GPUs left, not 0 and 1 again
            with pytest.raises(TrainingError, match="held by a live group of this job or of another job"):
                start(job, 2)  # the machine is full: a scale-up beyond it fails, naming why
            end(first)  # group 0 crashes and is restarted: it gets its GPUs back
            start(job, 0, attempt=1)
            end(second)  # group 1 leaves (a scale-down); a new group takes its GPUs
            start(job, 3)
            end(theirs)  # the other job ends: its GPUs are free for this one
            start(job, 4)
            assert started[-3:] == ["0,1", "2,3", "4,5"]
    finally:
        for proc in processes.values():
            proc.kill()
            proc.wait()


def test_a_local_cpu_group_sees_no_gpu(monkeypatch):
    # It cannot take one by accident, and its carbon meter counts none (tested on a GPU below).
    from trainyard import launch

    envs = []

    class FakePopen:
        def __init__(self, cmd, env, **kwargs):
            self.pid = 2000
            envs.append(env)

    monkeypatch.setattr(launch.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the worker's own GPUs
    with TemporaryDirectory() as folder:
        handle = launch.LaunchHandle("j", folder, "local", "", 0, 1)
        launch._start_process(handle, 0, 0, resume=False)
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == ""


def test_a_scale_up_the_machine_has_no_gpus_for_is_refused_and_the_job_goes_on(monkeypatch):
    from trainyard import launch
    from trainyard.spec import parse_job
    from trainyard.training import scaling
    from trainyard.training.plan import request_scale

    def no_room(handle, replica, attempt, resume=False):
        raise TrainingError("no free GPUs for another local replica group")

    monkeypatch.setattr(launch, "start_replica", no_room)
    job = parse_job(
        {
            "name": "j",
            "algorithm": {"builtin": "mlp-classifier"},
            "inputs": {"train": {"s3_uri": "s3://bkt/t/", "label": "y"}},
            "output": {"s3_uri": "s3://bkt/o/"},
            "resources": {"replicas": 1, "max_replicas": 3, "gpus_per_replica": 1},
        }
    )
    events = []
    with TemporaryDirectory() as folder:
        first = launch.ReplicaProcess(replica=0, attempt=0, pid=1, log="")
        handle = launch.LaunchHandle("j", folder, "local", "", 0, 1, [first], gpus_per_replica=1)
        scaler = scaling.Scaler(handle, job, lambda kind, payload: events.append((kind, payload)))
        request_scale(Path(folder), 3)
        live = {0: first}
        scaler.tick(live, step=5)
    assert list(live) == [0] and len(handle.replicas) == 1
    assert scaler.changes[-1]["to"] == 1  # the record says what the job runs with, not what was asked
    refused = [payload for kind, payload in events if kind == "job.scale_refused"]
    assert len(refused) == 1 and "no free GPUs" in refused[0]["reason"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_one_group_gpu_job_trains_on_its_gpu_and_saves_on_the_cpu(trainyard_home):
    # The device check a GPU session runs (issue 4): a real job, sifting on, one group per GPU here.
    from tests.unit.jobs import make_job, run

    groups = min(2, torch.cuda.device_count())
    job, job_id, folder, plan = make_job(
        trainyard_home,
        resources={"replicas": groups, "gpus_per_replica": 1},
        sifting={"enabled": True, "beta": 1.0, "delay_steps": 2},
    )
    outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed" and outcome.replicas_finished == list(range(groups))
    assert outcome.history[-1]["val_accuracy"] > 0.9
    assert outcome.flops["scoring"] > 0
    states = [torch.load(folder / f"replicas/{r}/attempt-0/model.pt", weights_only=True) for r in range(groups)]
    assert all(t.device.type == "cpu" for t in states[0].values())
    for r in range(groups):  # a clean finish leaves no stack trace from NCCL's heartbeat monitor in the log
        log = (folder / f"replicas/{r}/attempt-0/replica.log").read_text()
        assert "TCPStore" not in log and "frame #" not in log, log[-2000:]
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[-1][key], rtol=0, atol=0)
    for r in range(groups):  # each group's carbon share counts its GPU, read through NVML
        energy = json.loads((folder / f"replicas/{r}/attempt-0/energy.json").read_text())
        assert "gpu:nvml" in energy["measurement_mode"] and energy["gpu_energy_kwh"] > 0, energy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_stage_meter_on_a_gpu_machine_counts_the_gpus_energy():
    from trainyard import carbon
    from trainyard.spec import Carbon

    settings = Carbon(country_iso_code="IRL", measure_power_secs=0.5)
    with carbon.meter("training", settings) as record:
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(200):
            x = torch.tanh(x @ x)
        torch.cuda.synchronize()
    assert "gpu:nvml" in record.measurement_mode, record
    assert record.gpu_energy_kwh > 0 and record.energy_kwh == pytest.approx(
        record.cpu_energy_kwh + record.gpu_energy_kwh + record.ram_energy_kwh
    )
    report = carbon.rollup([record], settings)
    assert report["by_device_kwh"]["gpu"] == record.gpu_energy_kwh and report["emissions_kg"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_lost_gpu_group_resumes_on_its_gpu_from_the_checkpoint_and_loses_nothing(trainyard_home, bucket):
    # The checkpoint is saved from the CPU copy of the state; the restarted group loads it onto its GPU
    # (model, optimizer, data position) and ends where the same job without the failure ends.
    from tests.unit.jobs import make_job, run

    finals = []
    for faults in ([{"replica": 0, "at_step": 25, "kind": "kill"}], []):
        job, job_id, folder, plan = make_job(
            trainyard_home,
            output={"s3_uri": f"s3://{bucket}/out/"},
            algorithm={"entrypoint": "tests.unit.jobs:slow_build"},  # the step-20 upload lands before 25
            resources={"replicas": 1, "gpus_per_replica": 1},
            elastic={"checkpoint_every_steps": 10, "fault_injection": faults},
        )
        outcome, handle = run(job, job_id, folder, plan)
        assert outcome.stop_reason == "Completed" and outcome.steps == 40
        finals.append(torch.load(folder / f"replicas/0/attempt-{len(faults)}/model.pt", weights_only=True))
        if faults:
            (recovery,) = outcome.recoveries
            assert recovery["source"] == "checkpoint" and recovery["rejoined_at_step"] == 21
    assert all(t.device.type == "cpu" for t in finals[0].values())
    for key in finals[0]:
        torch.testing.assert_close(finals[0][key], finals[1][key], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_machine_a_meter_that_sees_no_gpu_counts_none(tmp_path):
    # A CPU group's share (process mode, CUDA_VISIBLE_DEVICES empty) counts no GPU, whether it probes the
    # hardware itself or is seeded from the machine's probe, which lists the GPU. (A GPU group's share counting
    # its GPU is checked on a real job above: this meter lasts milliseconds, too short for NVML's counter.)
    from tests.unit.test_carbon_probe import meter_in_fresh_process

    runs = [meter_in_fresh_process(tmp_path, "process", CUDA_VISIBLE_DEVICES="")]
    assert not (tmp_path / "hardware").exists()  # its probe, without the GPU, is not saved as the machine's
    machine = meter_in_fresh_process(tmp_path, "machine")  # the stage's meter: it saves the machine's probe
    assert machine.returncode == 0 and "gpu:nvml" in json.loads(machine.stdout)["mode"], machine.stderr
    runs.append(meter_in_fresh_process(tmp_path, "process", forbid_probe=True, CUDA_VISIBLE_DEVICES=""))
    for done in runs:
        assert done.returncode == 0, done.stderr
        cpu_group = json.loads(done.stdout)
        assert cpu_group["gpu_kwh"] == 0 and "gpu" not in cpu_group["mode"] and cpu_group["kwh"] > 0, cpu_group


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cpu_jobs_groups_on_a_gpu_machine_count_no_gpu_energy(trainyard_home):
    from tests.unit.jobs import make_job, run

    job, job_id, folder, plan = make_job(trainyard_home, resources={"replicas": 2})
    outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed"
    for r in range(2):
        energy = json.loads((folder / f"replicas/{r}/attempt-0/energy.json").read_text())
        assert energy["gpu_energy_kwh"] == 0 and "gpu" not in energy["measurement_mode"], energy
        assert energy["energy_kwh"] > 0


def test_a_restart_whose_gpus_another_job_took_is_deferred_not_the_jobs_end(trainyard_home, tmp_path, monkeypatch):
    """While a crashed group waited out its backoff, another job's group could lock its GPUs: the restart then
    raised, uncaught, and ended the whole job with its other groups alive."""
    from tests.conftest import rejoined, slow_until
    from tests.unit.jobs import make_job, run
    from trainyard import launch
    from trainyard.training import supervisor

    real, refused = launch.start_replica, []

    def taken_once(handle, replica, attempt, resume=False):
        if attempt > 0 and not refused:
            refused.append(replica)
            raise TrainingError("no free GPUs for another local replica group: held by another job (a test's)")
        return real(handle, replica, attempt, resume=resume)

    monkeypatch.setattr(launch, "start_replica", taken_once)
    monkeypatch.setattr(supervisor, "RESTART_DEFERRED_SECONDS", 1.0)
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        # (0.1 s held steps: 180 steps left give the deferred restart about 20 s)
        hyperparameters={"epochs": 20, "batch_size": 64, "learning_rate": 0.01, "step_sleep": 0.1}
        | {"slow_while": str(tmp_path / "slow")},
        elastic={"fault_injection": [{"replica": 1, "at_step": 20, "kind": "kill"}]},
    )
    events: list = []
    with slow_until(tmp_path / "slow", lambda: rejoined(folder / "replicas/1/attempt-1")):
        outcome, _ = run(job, job_id, folder, plan, events)
    assert outcome.stop_reason == "Completed" and refused == [1]
    assert ("replica.restart_deferred", 1) in events and ("replica.restarted", 1) in events
    (recovery,) = outcome.recoveries
    assert recovery["replica"] == 1 and recovery["source"] == "peer"


def test_a_local_gpu_job_on_a_machine_without_gpus_is_told_the_field(tmp_path, monkeypatch):
    # it was told "every slice of 1 of this machine's 0 GPUs () is held by a live group": none is
    from trainyard import launch

    monkeypatch.setattr(device, "visible_gpus", lambda: [])
    handle = launch.LaunchHandle("j", str(tmp_path), "local", "", 0, 1, gpus_per_replica=1)
    with pytest.raises(TrainingError, match=r"resources.gpus_per_replica is 1 but this machine has no GPU for a local"):
        launch._start_process(handle, 0, 0, resume=False)
