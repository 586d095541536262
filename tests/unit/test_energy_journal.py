"""The energy journal: what each run of a job spent, written as it is spent, counted by the job's next run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trainyard import energy_journal

STAGE = {"energy_kwh": 2.0, "emissions_kg": 0.5, "duration_seconds": 10.0, "cpu_energy_kwh": 1.5}


def test_the_other_runs_journals_add_up_as_one_stage_and_this_runs_is_left_out(tmp_path):
    assert energy_journal.earlier(tmp_path, "now") is None  # a job's first run
    failed = energy_journal.Journal(tmp_path, "failed")
    failed.ended("staging", STAGE | {"measurement_mode": "cpu:constant"})
    failed.ended("training", STAGE)
    killed = energy_journal.Journal(tmp_path, "killed")
    killed.ended("staging", STAGE)
    killed.running("training", 3.0, 1.0, 30.0)  # killed outright while it trained: its last figures
    energy_journal.Journal(tmp_path, "now").ended("staging", STAGE)
    (tmp_path / "energy" / "torn.json").write_text('{"stages": {')  # not whole: skipped, not a crash
    record = energy_journal.earlier(tmp_path, "now")
    assert record["stage"] == "earlier runs" and record["runs"] == 2
    assert record["energy"]["energy_kwh"] == pytest.approx(3 * 2.0 + 3.0)
    assert record["energy"]["emissions_kg"] == pytest.approx(3 * 0.5 + 1.0)
    assert record["energy"]["cpu_energy_kwh"] == pytest.approx(3 * 1.5)
    assert record["seconds"] == pytest.approx(3 * 10.0 + 30.0)
    assert "cpu:constant" in record["energy"]["measurement_mode"]


def test_a_stage_that_ends_replaces_its_running_figures(tmp_path):
    journal = energy_journal.Journal(tmp_path, "run")
    journal.running("training", 1.0, 0.1, 5.0)
    journal.ended("training", STAGE)
    written = json.loads(journal.path.read_text())
    assert written["running"] is None and written["stages"]["training"]["energy_kwh"] == 2.0
    assert energy_journal.earlier(tmp_path, "next")["energy"]["energy_kwh"] == pytest.approx(2.0)


_KILLED_STAGE = """
import sys, time
import tasks._metering as metering
from tests.conftest import job_dict
from trainyard.spec import parse_job

metering.JOURNAL_SECONDS = 0.2
job = parse_job(job_dict({"train": "s3://bkt/t/", "validation": "s3://bkt/v/", "output": "s3://bkt/o/"}))
with metering.journal(sys.argv[1], "killed"):
    with metering.stage_meter("staging", job):
        pass
    with metering.stage_meter("training", job):
        print("training", flush=True)
        while True:
            sum(range(10_000))
"""


def test_a_run_killed_outright_mid_stage_leaves_what_it_spent_for_the_next_run(tmp_path):
    env = os.environ | {"PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_STAGE, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"training"
        time.sleep(2)  # several of the running stage's writes
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    written = json.loads((tmp_path / "energy" / "killed.json").read_text())
    assert set(written["stages"]) == {"staging"}
    assert written["running"]["stage"] == "training" and written["running"]["duration_seconds"] > 1.0
    record = energy_journal.earlier(tmp_path, "rerun")
    assert record["runs"] == 1 and record["energy"]["energy_kwh"] > written["stages"]["staging"]["energy_kwh"] > 0
    assert record["energy"]["emissions_kg"] > 0
    # its split by device adds up to its total, the running stage's too (the report's by_device_kwh)
    running = written["running"]
    assert running["energy_kwh"] == pytest.approx(sum(running[f"{d}_energy_kwh"] for d in ("cpu", "gpu", "ram")))
    devices = sum(record["energy"][f"{d}_energy_kwh"] for d in ("cpu", "gpu", "ram"))
    assert devices == pytest.approx(record["energy"]["energy_kwh"])


def attempt(folder, replica: int, launch: str | None, machine: str, kwh: float) -> None:
    """A group attempt's energy file (``launch`` None: a group of a Trainyard that did not name it)."""
    where = folder / "replicas" / str(replica) / "attempt-0"
    where.mkdir(parents=True)
    record = {"energy_kwh": kwh, "cpu_energy_kwh": kwh / 2, "gpu_energy_kwh": kwh / 2, "ram_energy_kwh": 0.0}
    named = {"launch": launch} if launch else {}
    (where / "energy.json").write_text(json.dumps(record | named | {"machine": machine}))


def test_a_rerun_adds_what_a_run_killed_in_training_drew_on_other_machines_once(tmp_path):
    # its training stage never ended, so the groups on a GPU pool's nodes were never added: the job's ledger left
    # them out for good
    from trainyard import job_folder
    from trainyard.training import accounting

    ended = energy_journal.Journal(tmp_path, "ended")  # its training ended: its stage has its groups already
    ended.launched("launch-a", "pipeline-host")
    ended.ended("training", STAGE)
    killed = energy_journal.Journal(tmp_path, "killed")
    killed.launched("launch-b", "pipeline-host")
    killed.running("training", 1.0, 0.25, 30.0)  # 250 g/kWh at PUE 1.5: this machine's meter so far
    attempt(tmp_path, 0, "launch-b", "pipeline-host", 0.4)  # inside that meter already
    attempt(tmp_path, 1, "launch-b", "gpu-node-1", 2.0)
    job_folder.set_aside_earlier_run(tmp_path)  # a rerun that failed before launching set them aside
    attempt(tmp_path, 1, "launch-a", "gpu-node-1", 5.0)  # the ended run's: counted in its stage
    attempt(tmp_path, 2, "launch-b", "gpu-node-2", 1.0)

    # the training stage's own count, by its launch: neither that killed run's groups nor the ended one's
    assert accounting.energy_elsewhere(tmp_path, "pipeline-host", "launch-c") is None
    assert accounting.energy_elsewhere(tmp_path, "pipeline-host", "launch-b")["energy_kwh"] == pytest.approx(3.0)
    assert energy_journal.settle_killed(tmp_path, "now", pue=1.5) == 1
    record = energy_journal.earlier(tmp_path, "now")
    assert record["energy"]["energy_kwh"] == pytest.approx(2.0 + 1.0 + (2.0 + 1.0) * 1.5)
    assert record["energy"]["emissions_kg"] == pytest.approx(0.5 + 0.25 + 4.5 * 0.25)
    assert record["energy"]["gpu_energy_kwh"] == pytest.approx(1.5 * 1.5)
    assert "other machines' groups" in record["energy"]["measurement_mode"]
    # once: the next rerun reads it from the journal, and the groups' files may be gone by then
    for path in (tmp_path / "earlier-runs").rglob("energy.json"):
        path.unlink()
    assert energy_journal.settle_killed(tmp_path, "later", pue=1.5) == 0
    assert energy_journal.earlier(tmp_path, "later")["energy"]["energy_kwh"] == pytest.approx(7.5)


def test_an_energy_file_without_a_launch_is_the_launch_s_whose_folder_it_is_in(tmp_path):
    # a pool's worker of an older Trainyard names no launch: its group counts for the run it trains for, not
    # for another run's launch when it lies in a folder set aside (that run counted it)
    from trainyard import job_folder
    from trainyard.training import accounting

    attempt(tmp_path, 0, None, "gpu-node-1", 4.0)
    job_folder.set_aside_earlier_run(tmp_path)
    attempt(tmp_path, 0, None, "gpu-node-1", 1.0)
    attempt(tmp_path, 1, "launch-x", "gpu-node-2", 0.5)
    attempt(tmp_path, 2, "launch-x", "gpu-node-3", 0.25)
    unset = tmp_path / "replicas/2/attempt-0/energy.json"  # a group started without the launch id: written null
    unset.write_text(json.dumps(json.loads(unset.read_text()) | {"launch": None}))
    assert accounting.energy_elsewhere(tmp_path, "pipeline-host", "launch-x")["energy_kwh"] == pytest.approx(1.75)
    assert accounting.energy_elsewhere(tmp_path, "gpu-node-1", "launch-x")["energy_kwh"] == pytest.approx(0.75)
