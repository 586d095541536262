"""Each job's Prefect home starts from a copy of a migrated database (``trainyard.prefect_template``)."""

from __future__ import annotations

import subprocess
from importlib.metadata import version

from trainyard import prefect_template


def _template(templates):
    path = templates / f".template-{version('prefect')}" / "prefect.db"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"migrated schema")
    return path


def test_a_job_home_gets_a_copy_of_the_template_and_nothing_is_migrated_again(tmp_path, monkeypatch):
    _template(tmp_path)
    monkeypatch.setattr(prefect_template, "_migrate", lambda target: (_ for _ in ()).throw(AssertionError(target)))
    for job in ("a", "b"):
        (tmp_path / job).mkdir()
        assert prefect_template.seed(tmp_path / job, tmp_path)
        assert (tmp_path / job / "prefect.db").read_bytes() == b"migrated schema"
        assert [p.name for p in (tmp_path / job).iterdir()] == ["prefect.db"]  # no partial copy left


def test_an_existing_database_or_a_database_server_is_left_alone(tmp_path, monkeypatch):
    _template(tmp_path)
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "prefect.db").write_bytes(b"this job's runs")
    assert not prefect_template.seed(tmp_path / "job", tmp_path)
    assert (tmp_path / "job" / "prefect.db").read_bytes() == b"this job's runs"
    for setting in ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL"):
        with monkeypatch.context() as m:  # either spelling: the user's database, not ours to seed
            m.setenv(setting, "postgresql+asyncpg://u:p@127.0.0.1/prefect")
            (tmp_path / "other").mkdir(exist_ok=True)
            assert not prefect_template.seed(tmp_path / "other", tmp_path)
            assert not (tmp_path / "other" / "prefect.db").exists()


def test_a_failed_migration_leaves_no_template_and_the_job_migrates_its_own(tmp_path, monkeypatch):

    def failing(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, b"", b"alembic failed")

    monkeypatch.setattr(prefect_template.subprocess, "run", failing)
    (tmp_path / "job").mkdir()
    assert not prefect_template.seed(tmp_path / "job", tmp_path)
    assert not (tmp_path / "job" / "prefect.db").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job"]  # no half-made template folder


def test_templates_live_in_the_users_cache_or_else_in_trainyard_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert prefect_template.templates_dir(fallback=tmp_path / "home") == tmp_path / "cache" / "trainyard"
    (tmp_path / "file").write_text("")  # a cache path that cannot be a folder
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert prefect_template.templates_dir(fallback=tmp_path / "home") == tmp_path / "home"
