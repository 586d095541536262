"""A job that ends inside its registration, after its version is made and before its gate (an outage here; a
signal ends it the same way): its summary says which version it left and how to finish it, and a rerun of the
job id gates that version and completes the job, training nothing."""

from __future__ import annotations

import json

import mlflow
import numpy as np
import pytest

from flows.training_pipeline import JobFailed, training_pipeline
from tests.conftest import job_dict, upload_dataset
from trainyard import esg, promotion
from trainyard.home import job_dir
from trainyard.spec import parse_job


def test_a_job_ended_between_its_version_and_its_gate_says_so_and_its_rerun_completes_it(
    prefect_api, s3_server, bucket, mlflow_uri, monkeypatch
):
    job = parse_job(job_dict(upload_dataset(bucket, rows=400), name="gate-outage"))
    job_id = f"gate-outage-{np.random.default_rng().integers(1e9)}"
    real = promotion.gate

    def outage(*args, **kwargs):
        raise OSError("simulated: the tracking server went away during the gate")

    monkeypatch.setattr(promotion, "gate", outage)
    with pytest.raises(JobFailed):
        training_pipeline(job, job_id=job_id)
    summary = json.loads((job_dir(job_id) / "summary.json").read_text())
    # it said no model beside a registered, ungated version
    assert summary["status"] == "Failed" and summary["model"]["version"] == 1 and summary["model"]["gate"] is None
    assert (
        f"`trainyard models gate {job.model_name} 1` (or a rerun of job {job_id}) gates it" in summary["failure_reason"]
    )
    monkeypatch.setattr(promotion, "gate", real)
    trained = sorted(p.stat().st_mtime_ns for p in job_dir(job_id).glob("replicas/*/attempt-*/*"))
    rerun = training_pipeline(job, job_id=job_id)
    assert rerun["status"] == "Completed" and rerun["failure_reason"] is None
    assert rerun["model"]["version"] == 1 and rerun["model"]["aliases"] == ["champion"]
    assert rerun["secondary_status_transitions"][-1]["message"] == "registered: champion: no champion yet"
    assert sorted(p.stat().st_mtime_ns for p in job_dir(job_id).glob("replicas/*/attempt-*/*")) == trained
    versions = mlflow.MlflowClient(mlflow_uri).search_model_versions(f"name='{job.model_name}'")
    assert [int(v.version) for v in versions] == [1]
    # the carbon ledger's line of the job says so too (it replaced the failed run's)
    (row,) = [r for r in esg.read_ledger(job.output.s3_uri) if r["job_id"] == job_id]
    assert row["status"] == "Completed"


def test_a_plot_that_fails_costs_the_job_its_curves_not_its_model(
    prefect_api, s3_server, bucket, mlflow_uri, monkeypatch
):
    # unguarded, a plot failing after training (a full disk under savefig, say) ended the job as an internal error
    # and lost its trained model; at registration it failed the registration
    from tests.flows.pipeline_runs import run_pipeline
    from trainyard import plots

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device (a test's)")

    monkeypatch.setattr(plots, "plot_history", full_disk)
    summary, job_id = run_pipeline(job_dict(upload_dataset(bucket, rows=400), name="plot-fails"))
    assert summary["status"] == "Completed" and summary["model"]["version"] >= 1, summary.get("failure_reason")
    run = mlflow.MlflowClient(mlflow_uri).get_run(summary["model"]["run_id"])
    assert "training_curves.png" not in {
        a.path for a in mlflow.MlflowClient(mlflow_uri).list_artifacts(run.info.run_id)
    }
