"""``trainyard clean``: old jobs' folders go, recent and running ones stay; ``trainyard --version``."""

from __future__ import annotations

import json
import os
import time

import pytest
from typer.testing import CliRunner

from trainyard import housekeeping
from trainyard.cli import app
from trainyard.home import home, jobs_dir


@pytest.fixture
def trainyard_home(tmp_path, monkeypatch):
    """A TRAINYARD_HOME of the test's own: it counts every job in it."""
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def make_job(job_id: str, days_idle: float, prefect: bool = True) -> None:
    """A job's folders as a run leaves them, last written ``days_idle`` days ago."""
    folders = [jobs_dir() / job_id] + ([home() / "prefect" / job_id] if prefect else [])
    then = time.time() - days_idle * 86_400
    for folder in folders:
        (folder / "replicas/0/attempt-0").mkdir(parents=True)
        (folder / "replicas/0/attempt-0/model.pt").write_bytes(b"m" * 2**20)
        for path in [*folder.rglob("*"), folder]:
            os.utime(path, (then, then))


def test_jobs_idle_longer_than_asked_are_removed_and_the_others_kept(trainyard_home):
    make_job("old-20260101-000000-aaaaaa", days_idle=40)
    make_job("recent-20261201-000000-bbbbbb", days_idle=2)
    make_job("quiet-but-running-20260101-000000-cccccc", days_idle=40, prefect=False)
    running = jobs_dir() / "quiet-but-running-20260101-000000-cccccc"
    (running / "supervisor.json").write_text(json.dumps({"pid": os.getpid()}))  # its supervisor alive
    os.utime(running / "supervisor.json", (time.time() - 40 * 86_400,) * 2)
    # one written to a minute ago, in a group's folder: not idle
    make_job("touched-20260101-000000-dddddd", days_idle=40)
    (jobs_dir() / "touched-20260101-000000-dddddd/replicas/0/attempt-0/steps.jsonl").write_text("{}\n")

    listed = CliRunner().invoke(app, ["clean", "--older-than", "30", "--dry-run"])
    assert listed.exit_code == 0 and "old-20260101-000000-aaaaaa" in listed.output
    assert "1 job(s), 2.0 MiB" in listed.output  # its job folder and its Prefect home
    assert (jobs_dir() / "old-20260101-000000-aaaaaa").exists()  # a dry run removes nothing

    removed = CliRunner().invoke(app, ["clean", "--older-than", "30"])
    assert removed.exit_code == 0 and "1 job(s)" in removed.output
    assert sorted(p.name for p in jobs_dir().iterdir()) == [
        "quiet-but-running-20260101-000000-cccccc",
        "recent-20261201-000000-bbbbbb",
        "touched-20260101-000000-dddddd",
    ]
    assert not (home() / "prefect" / "old-20260101-000000-aaaaaa").exists()
    assert (home() / "prefect" / "recent-20261201-000000-bbbbbb").exists()


def test_files_hard_linked_from_the_cache_are_not_counted_as_freed(trainyard_home):
    make_job("raw-20260101-000000-eeeeee", days_idle=40, prefect=False)
    cached = home() / "cached.bin"
    cached.write_bytes(b"c" * 2**20)
    os.link(cached, jobs_dir() / "raw-20260101-000000-eeeeee" / "config.bin")  # a raw channel's layout
    then = time.time() - 40 * 86_400
    for path in (cached, jobs_dir() / "raw-20260101-000000-eeeeee"):
        os.utime(path, (then, then))
    (found,) = housekeeping.old_jobs(30 * 86_400)
    assert found.size == 2**20  # the model only: the link frees nothing


def test_the_version_is_printed():
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"trainyard {version('trainyard')}\n"


def test_jobs_named_are_removed_whatever_their_age_and_never_a_running_one(trainyard_home):
    from trainyard.job_folder import RunLock

    make_job("recent-20261201-000000-bbbbbb", days_idle=0.01)
    make_job("live-20261201-000000-eeeeee", days_idle=0.01, prefect=False)
    with RunLock(jobs_dir() / "live-20261201-000000-eeeeee"):  # staging, training or registering
        refused = CliRunner().invoke(app, ["clean", "recent-20261201-000000-bbbbbb", "live-20261201-000000-eeeeee"])
        assert refused.exit_code == 2 and "job live-20261201-000000-eeeeee is running" in refused.output
        assert (jobs_dir() / "recent-20261201-000000-bbbbbb").exists()  # one refused: none removed
    unknown = CliRunner().invoke(app, ["clean", "nope-20261201-000000-ffffff"])
    assert unknown.exit_code == 2 and "job nope-20261201-000000-ffffff: no folder under" in unknown.output
    removed = CliRunner().invoke(app, ["clean", "recent-20261201-000000-bbbbbb", "recent-20261201-000000-bbbbbb"])
    assert removed.exit_code == 0 and "1 job(s), 2.0 MiB" in removed.output, removed.output  # named twice: once
    assert sorted(p.name for p in jobs_dir().iterdir()) == ["live-20261201-000000-eeeeee"]
    assert not (home() / "prefect" / "recent-20261201-000000-bbbbbb").exists()


def test_an_idle_job_whose_run_holds_its_lock_is_neither_listed_nor_removed_by_age(trainyard_home):
    """A quiet folder can be a running job's (staging a large channel, waiting for workers): its run lock says so."""
    from trainyard.job_folder import LOCK, RunLock

    make_job("quiet-20260101-000000-aaaaaa", days_idle=40)
    make_job("old-20260101-000000-bbbbbb", days_idle=40)
    folder = jobs_dir() / "quiet-20260101-000000-aaaaaa"
    then = time.time() - 40 * 86_400
    with RunLock(folder):
        os.utime(folder / LOCK, (then, then))
        os.utime(folder, (then, then))
        listed = CliRunner().invoke(app, ["clean", "--older-than", "30", "--dry-run"])
        assert listed.exit_code == 0 and "quiet-20260101" not in listed.output and "old-20260101" in listed.output
    # found idle, then a run of it starts before the removal: it is kept, and said so
    (found,) = [job for job in housekeeping.old_jobs(30 * 86_400) if job.job_id.startswith("quiet")]
    with RunLock(folder):
        assert not housekeeping.remove(found, lock=True)
    assert folder.exists()
    assert housekeeping.remove(found, lock=True) and not folder.exists()


def test_what_an_interrupted_removal_left_is_listed_and_removed_by_the_next_clean(trainyard_home):
    # a Ctrl-C mid-delete (or files it may not delete) left .removing-<id>-<pid>: reported removed, never listed again
    make_job("old-20260101-000000-aaaaaa", days_idle=40, prefect=False)
    os.replace(jobs_dir() / "old-20260101-000000-aaaaaa", jobs_dir() / ".removing-old-20260101-000000-aaaaaa-999999")
    mine = jobs_dir() / f".removing-other-20260101-000000-bbbbbb-{os.getpid()}"  # a removal under way: left to it
    mine.mkdir()
    result = CliRunner().invoke(app, ["clean", "--older-than", "30"])
    assert result.exit_code == 0, result.output
    assert "old-20260101-000000-aaaaaa (removal" in result.output and "other-" not in result.output
    assert not (jobs_dir() / ".removing-old-20260101-000000-aaaaaa-999999").exists() and mine.exists()


def test_a_folder_that_cannot_all_be_deleted_is_said_not_reported_removed(trainyard_home, monkeypatch):
    make_job("old-20260101-000000-aaaaaa", days_idle=40, prefect=False)

    def refuse(path, *, onerror):
        onerror(
            os.unlink, str(path / "replicas/0/attempt-0/model.pt"), (PermissionError, PermissionError(13, "no"), None)
        )

    monkeypatch.setattr(housekeeping.shutil, "rmtree", refuse)
    result = CliRunner().invoke(app, ["clean", "--older-than", "30"])
    assert "could not be deleted, first" in result.output and "model.pt" in result.output
    assert "0 job(s), 0.0 MiB" in result.output
    assert result.exit_code == 1  # a script's `trainyard clean && ...` must not take it as done (it exited 0)
    make_job("named-20260101-000000-cccccc", days_idle=1, prefect=False)  # (the first is set aside as .removing-)
    named = CliRunner().invoke(app, ["clean", "named-20260101-000000-cccccc"])
    assert named.exit_code == 1 and "could not be deleted, first" in named.output
