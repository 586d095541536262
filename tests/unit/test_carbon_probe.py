"""The hardware probe is done once a machine: later processes (replica groups) start their meter
without py-cpuinfo's subprocess, and a bad saved probe only costs the probe."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from trainyard import carbon_probe

# One meter in a fresh process. With FORBID_PROBE, asking py-cpuinfo (the probe's costly part: it
# runs in a subprocess) fails the meter, so "it started" means "it used the saved probe".
SCRIPT = """
import json, os, sys
import cpuinfo
if os.environ.get("FORBID_PROBE"):
    def refuse(*args, **kwargs):
        print("probed the hardware again", file=sys.stderr, flush=True)  # codecarbon may swallow the error
        raise AssertionError("probed the hardware again")
    cpuinfo.get_cpu_info = refuse
from trainyard import carbon
from trainyard.spec import Carbon
with carbon.meter("m", Carbon(), tracking_mode=sys.argv[1]) as record:
    sum(range(10**6))
print(json.dumps({"mode": record.measurement_mode, "kwh": record.energy_kwh, "gpu_kwh": record.gpu_energy_kwh}))
"""


def meter_in_fresh_process(home, mode: str, forbid_probe: bool = False, **env_vars) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINYARD_HOME": str(home), **env_vars}
    if forbid_probe:
        env["FORBID_PROBE"] = "1"
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120)


def test_later_processes_reuse_the_machine_probe(tmp_path):
    first = meter_in_fresh_process(tmp_path, "machine")
    assert first.returncode == 0, first.stderr
    saved = list((tmp_path / "hardware").glob("codecarbon-*.json"))
    assert len(saved) == 1

    group = meter_in_fresh_process(tmp_path, "process", forbid_probe=True)
    assert group.returncode == 0, group.stderr
    machine, process = json.loads(first.stdout), json.loads(group.stdout)
    assert process["mode"] == machine["mode"]  # same hardware, same measurement mode
    assert process["kwh"] > 0


def test_without_a_saved_probe_the_meter_probes(tmp_path):
    # The guard in SCRIPT does catch a probe: with nothing saved, the meter must probe.
    alone = meter_in_fresh_process(tmp_path, "process", forbid_probe=True)
    assert "probed the hardware again" in alone.stderr


def test_a_corrupt_saved_probe_falls_back_to_probing(tmp_path):
    assert meter_in_fresh_process(tmp_path, "machine").returncode == 0
    (saved,) = (tmp_path / "hardware").glob("codecarbon-*.json")
    saved.write_text("{not json")
    again = meter_in_fresh_process(tmp_path, "process")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["kwh"] > 0


def test_a_process_given_no_gpu_is_told_apart_from_one_given_all(monkeypatch):
    # Launch gives a CPU group CUDA_VISIBLE_DEVICES="", and its meter then tracks no GPU; unset means
    # every GPU the machine has (the stages' machine-wide meters), and a list is codecarbon's own to read.
    for value, none in (("", True), ("-1", True), (" , ", True), ("0", False), ("GPU-aa,GPU-bb", False)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert carbon_probe.sees_no_gpu() is none, value
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert not carbon_probe.sees_no_gpu()


def test_a_cpu_group_is_seeded_from_the_machines_probe(tmp_path):
    # A CPU group (CUDA_VISIBLE_DEVICES empty) shares the probe the stage's machine-wide meter saved, as
    # every group did before CPU groups were hidden from the GPUs.
    assert meter_in_fresh_process(tmp_path, "machine").returncode == 0
    group = meter_in_fresh_process(tmp_path, "process", forbid_probe=True, CUDA_VISIBLE_DEVICES="")
    assert group.returncode == 0, group.stderr
    assert json.loads(group.stdout)["kwh"] > 0


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: tests/unit/test_device.py")
def test_without_gpus_a_cpu_groups_probe_is_the_machines_and_is_saved(tmp_path):
    # With no stage meter before it (a worker's first group, the tests, the benchmarks), the first group's
    # probe serves the ones after it. On a GPU machine a CPU group's probe leaves the GPUs out and is not saved.
    first = meter_in_fresh_process(tmp_path, "process", CUDA_VISIBLE_DEVICES="")
    assert first.returncode == 0, first.stderr
    later = meter_in_fresh_process(tmp_path, "process", forbid_probe=True, CUDA_VISIBLE_DEVICES="")
    assert later.returncode == 0, later.stderr
    assert json.loads(later.stdout)["kwh"] > 0


def test_a_stage_meter_does_not_take_the_probe_a_group_saved_asking_for_the_load_model(tmp_path):
    # A group's meter asks codecarbon for its CPU load model (RAPL reads the whole package); a machine-wide stage
    # meter seeded from that plan would lose RAPL where the machine has it: it probes for itself instead
    assert meter_in_fresh_process(tmp_path, "process").returncode == 0
    stage = meter_in_fresh_process(tmp_path, "machine", forbid_probe=True)
    assert "probed the hardware again" in stage.stderr
