"""A rerun of a job id already registered (``flows.reruns``): which earlier summary is the job's end, and what a
failure to read what the earlier run left does."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from flows import reruns
from tests.conftest import job_dict
from trainyard.errors import StorageError
from trainyard.spec import TrainingJob

MADE = datetime(2026, 12, 7, 12, tzinfo=UTC)  # when the version was registered


def _summary(run_id, ended: datetime) -> dict:
    return {"prefect_flow_run_id": run_id, "secondary_status_transitions": [{"start_time": ended.isoformat()}]}


def test_a_summary_is_the_registering_runs_only_if_it_is_of_its_flow_run_and_ended_after_it_registered():
    record = {"flow_run_id": "run-b", "created": MADE}
    assert reruns._before(_summary("run-a", MADE + timedelta(minutes=5)), record)  # another flow run's
    # the same flow run (a Prefect retry of it): an earlier try's ended before the version; a minute's leeway for
    # the clocks of the worker and the registry's server
    assert reruns._before(_summary("run-b", MADE - timedelta(minutes=5)), record)
    assert not reruns._before(_summary("run-b", MADE - timedelta(seconds=30)), record)
    assert not reruns._before(_summary("run-b", MADE + timedelta(seconds=2)), record)
    # a run outside Prefect: the version's tag says "None" or "none", the summary null
    assert not reruns._before(_summary(None, MADE), {"flow_run_id": "None", "created": MADE})
    assert not reruns._before(_summary(None, MADE), {"flow_run_id": "none", "created": MADE})


def test_a_rerun_that_cannot_read_what_the_registering_run_left_is_refused_and_publishes_nothing(tmp_path, monkeypatch):
    # (it ended the job Failed over the earlier run's Completed one, its summary and ledger line replaced)
    uris = {"train": "s3://data/train/", "validation": "s3://data/val/", "output": "s3://data/out/"}
    job = TrainingJob.model_validate(job_dict(uris))
    model = {"name": job.model_name, "version": 3, "gate": "champion: no champion yet"}
    monkeypatch.setattr(reruns.registry, "finish_gate", lambda *_: model)

    def refused(*_):
        raise StorageError("s3://data/out/j/summary.json: S3 refused the request (AccessDenied)")

    monkeypatch.setattr(reruns.outputs, "published_summary", refused)
    ended: list = []
    log = type("Log", (), {"finish": lambda self, *a, **k: ended.append(a)})()
    said = reruns.registered_earlier(job, "j", tmp_path, "run-1", log, {}, logging.getLogger("test"))
    assert isinstance(said, str) and f"registered as {job.model_name} v3 by an earlier run" in said
    assert "could not read what that run left (s3://data/out/j/summary.json: S3 refused" in said
    assert not ended and not (tmp_path / "summary.json").exists()
