"""A rerun of a job id sets aside what the earlier run left in the job's folder."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainyard import job_folder
from trainyard.errors import TrainingError
from trainyard.home import write_json_atomic


def _earlier_run(folder):
    write_json_atomic(folder / "plan.json", {"lighthouse_addr": "http://127.0.0.1:1"})
    write_json_atomic(folder / "stop.json", {"reason": "Stopped", "message": "stopped on request"})
    (folder / "replicas" / "0" / "attempt-0").mkdir(parents=True)
    (folder / "replicas" / "0" / "attempt-0" / "result.json").write_text("{}")
    (folder / "data").mkdir()
    (folder / "data" / "train.npz").write_bytes(b"x" * 1000)
    write_json_atomic(folder / "energy" / "run-1.json", {"stages": {}})


def test_a_rerun_finds_its_folder_clean_but_for_the_energy_journals(tmp_path):
    folder = tmp_path / "job-1"
    folder.mkdir()
    assert job_folder.set_aside_earlier_run(folder) is None  # a first run: nothing to set aside
    _earlier_run(folder)
    aside = job_folder.set_aside_earlier_run(folder)
    assert aside == folder / "earlier-runs" / "1"
    assert sorted(p.name for p in folder.iterdir()) == ["earlier-runs", "energy"]
    assert (folder / "energy" / "run-1.json").exists()  # counted by the rerun (energy_journal)
    assert sorted(p.name for p in aside.iterdir()) == ["plan.json", "replicas", "stop.json"]  # data/: deleted
    assert (aside / "replicas" / "0" / "attempt-0" / "result.json").exists()
    _earlier_run(folder)
    assert job_folder.set_aside_earlier_run(folder) == folder / "earlier-runs" / "2"
    assert job_folder.set_aside_earlier_run(folder) is None
    for _ in range(3):  # the last three earlier runs are kept, numbered on from the last
        _earlier_run(folder)
        job_folder.set_aside_earlier_run(folder)
    assert sorted(p.name for p in (folder / "earlier-runs").iterdir()) == ["3", "4", "5"]
    assert (folder / "earlier-runs" / "5" / "plan.json").exists()


def test_one_run_of_a_job_id_at_a_time_and_a_killed_run_holds_nothing(tmp_path):
    folder = tmp_path / "job-1"
    folder.mkdir()
    with job_folder.RunLock(folder):
        with pytest.raises(TrainingError, match="job job-1 is already running on this machine"):
            job_folder.RunLock(folder)
        assert job_folder.set_aside_earlier_run(folder) is None  # its lock file stays where it is
    with job_folder.RunLock(folder):  # released at the end of the run
        pass
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from trainyard.job_folder import RunLock; "
            "lock = RunLock(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)",
            str(folder),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(TrainingError, match="already running"):
            job_folder.RunLock(folder)
        holder.kill()  # killed outright: no exit handler runs, and the lock goes with the process
        holder.wait()
        with job_folder.RunLock(folder):
            pass
    finally:
        holder.kill()
        holder.wait()
