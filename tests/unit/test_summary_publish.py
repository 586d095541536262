"""Where a job's summary goes once it has ended (``flows.job_summary.publish``), when the process is told to stop
on the way."""

from __future__ import annotations

import logging

import pytest
from prefect.exceptions import TerminationSignal

import flows.job_summary
from tests.conftest import job_dict
from trainyard.spec import TrainingJob


def _job() -> TrainingJob:
    uris = {"train": "s3://data/train/", "validation": "s3://data/val/", "output": "s3://data/out/"}
    return TrainingJob.model_validate(job_dict(uris))


def _record_publishing(monkeypatch, done: list[str]) -> None:
    """Each of publish's steps but the ledger's write, recorded in ``done`` as it is made, nothing sent."""
    monkeypatch.setattr(flows.job_summary.esg, "ledger_row", lambda summary: {"job_id": "job-1"})
    monkeypatch.setattr(flows.job_summary.esg, "markdown", lambda job_id, carbon: f"# {job_id}")
    monkeypatch.setattr(flows.job_summary.outputs, "upload_summary", lambda *_: done.append("upload"))
    monkeypatch.setattr(flows.job_summary, "create_markdown_artifact", lambda **_: done.append("artifact"))
    monkeypatch.setattr(flows.job_summary.events, "emit", lambda event, job_id, payload: done.append(event))


@pytest.mark.parametrize("signal", [TerminationSignal(signal=15), KeyboardInterrupt()])
def test_a_signal_while_publishing_still_sends_the_ended_event(monkeypatch, caplog, signal):
    # SIGTERM (a worker shutting down, a second stop) while the ledger line is written: the ended event, which
    # callers waiting on the job read its end from, is sent all the same, and the signal raised again after it
    job = _job()
    done: list[str] = []

    def told_to_stop(*_):
        raise signal

    monkeypatch.setattr(flows.job_summary.esg, "write_ledger_row", told_to_stop)
    _record_publishing(monkeypatch, done)
    summary = {
        "status": "Completed",
        "failure_reason": None,
        "metrics": {"val_accuracy": 0.9},
        "sifting": {},
        "carbon": {"emissions_kg": 0.001},
    }
    caplog.set_level(logging.WARNING)
    with pytest.raises(type(signal)):
        flows.job_summary.publish(job, "job-1", summary, None, logging.getLogger("test"))
    assert done == ["trainyard.job.ended"]  # what was left skipped, but the event
    assert "told to stop while publishing the summary of job job-1: sending its ended event" in caplog.messages


def test_publishing_goes_on_past_a_failed_step(monkeypatch, caplog):
    job = _job()
    done: list[str] = []

    def refused(*_):
        raise ConnectionError("S3 refused it")

    monkeypatch.setattr(flows.job_summary.esg, "write_ledger_row", refused)
    _record_publishing(monkeypatch, done)
    summary = {"status": "Failed", "failure_reason": "x", "metrics": {}, "sifting": {}, "carbon": {}}
    flows.job_summary.publish(job, "job-1", summary, None, logging.getLogger("test"))
    assert done == ["upload", "artifact", "trainyard.job.ended", "artifact"]
    assert summary["summary_uri"].startswith("s3://data/out/") and summary["summary_uri"].endswith("/summary.json")
    assert "could not write the carbon ledger row: S3 refused it" in caplog.messages
