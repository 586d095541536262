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


def test_a_job_id_still_training_here_is_not_run_again(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = tmp_path / "job-1"
        folder.mkdir()
        write_json_atomic(folder / "supervisor.json", {"pid": sleeper.pid})
        with pytest.raises(
            TrainingError, match=rf"already training on this machine \(its supervisor, pid {sleeper.pid}"
        ):
            job_folder.set_aside_earlier_run(folder)
        assert (folder / "supervisor.json").exists()  # nothing moved
    finally:
        sleeper.kill()
        sleeper.wait()
    assert job_folder.set_aside_earlier_run(folder) == folder / "earlier-runs" / "1"  # its supervisor gone
