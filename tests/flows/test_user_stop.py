"""A job stopped on request keeps what it learnt: ``trainyard stop JOB_ID`` on the job's machine, and
``trainyard jobs stop RUN_ID --graceful`` through the Prefect API. Every group stops at a step boundary,
the model so far is uploaded, and the job ends Stopped, registered nowhere."""

from __future__ import annotations

import contextlib
import json
import threading

import numpy as np
import pytest
from prefect.client.orchestration import get_client
from typer.testing import CliRunner

from flows.training_pipeline import JobFailed, training_pipeline
from tests.conftest import job_dict, upload_dataset, wait_for_step
from trainyard import registry, s3
from trainyard.cli import app
from trainyard.home import job_dir, jobs_dir
from trainyard.spec import parse_job


def _start(bucket: str, name: str) -> tuple[str, threading.Thread]:
    spec = job_dict(upload_dataset(bucket, rows=400), name=name)
    spec["hyperparameters"]["epochs"] = 100_000  # stops only when asked
    job_id = f"{name}-{np.random.default_rng().integers(1e9)}"

    def run() -> None:
        with contextlib.suppress(JobFailed):  # the summary says how it ended
            training_pipeline(parse_job(spec), job_id=job_id)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return job_id, thread


def _training(job_id: str, steps: int = 20) -> None:
    # the path alone (attempt_dir would make the folder, which the run, starting, sets aside as an earlier run's)
    wait_for_step(jobs_dir() / job_id / "replicas" / "0" / "attempt-0" / "heartbeat.json", steps)


def _stopped_with_its_model(job_id: str, thread: threading.Thread, bucket: str, mlflow_uri: str) -> dict:
    thread.join(timeout=120)
    assert not thread.is_alive()
    summary = json.loads((job_dir(job_id) / "summary.json").read_text())
    assert summary["status"] == "Stopped" and summary["failure_reason"] == "Stopped"
    assert summary["training"]["stop_reason"] == "Stopped" and 4 <= summary["metrics"]["epochs"] < 100_000
    head = s3.client().head_object(Bucket=bucket, Key=f"output/{job_id}/model/model.pt")
    assert head["ContentLength"] > 0  # what it learnt, uploaded
    assert summary["model"] is None  # and not registered
    assert registry.registered(summary["job_name"], job_id) is None
    return summary


def test_trainyard_stop_ends_a_job_at_a_step_boundary_and_keeps_its_model(prefect_api, s3_server, bucket, mlflow_uri):
    runner = CliRunner()
    result = runner.invoke(app, ["stop", "no-such-job"])
    assert result.exit_code == 2 and "no job 'no-such-job'" in result.output
    job_id, thread = _start(bucket, "stop-local")
    _training(job_id)
    # a second run of the job id while it runs is refused, and touches nothing of the first's
    with pytest.raises(JobFailed, match=f"job {job_id} not run: job {job_id} is already running on this machine"):
        training_pipeline(parse_job(job_dict(upload_dataset(bucket, rows=400), name="stop-local")), job_id=job_id)
    assert (job_dir(job_id) / "plan.json").exists() and not (job_dir(job_id) / "earlier-runs").exists()
    assert not (job_dir(job_id) / "summary.json").exists()
    result = runner.invoke(app, ["stop", job_id])
    assert result.exit_code == 0 and "asked to stop within a few steps" in result.output, result.output
    _stopped_with_its_model(job_id, thread, bucket, mlflow_uri)
    result = runner.invoke(app, ["stop", job_id])  # ended: refused, saying why
    assert result.exit_code == 2 and "is not training now; only a job in its training stage stops" in result.output
    # run again under its id, it trains to its end: the stop asked of the earlier run is not this one's
    spec = job_dict(upload_dataset(bucket, rows=400), name="stop-local")
    again = training_pipeline(parse_job(spec), job_id=job_id)
    assert again["status"] == "Completed" and again["metrics"]["epochs"] == 3


def test_jobs_stop_graceful_asks_through_the_prefect_api(prefect_api, s3_server, bucket, mlflow_uri):
    job_id, thread = _start(bucket, "stop-graceful")
    _training(job_id)
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    pipelines = FlowFilter(name=FlowFilterName(any_=["training-pipeline"]))  # (the API gives 200 runs a call)
    with get_client(sync_client=True) as client:
        run = next(r for r in client.read_flow_runs(flow_filter=pipelines) if r.parameters.get("job_id") == job_id)
    result = CliRunner().invoke(app, ["jobs", "stop", str(run.id), "--graceful"])
    assert result.exit_code == 0 and "keeping its model so far" in result.output, result.output
    summary = _stopped_with_its_model(job_id, thread, bucket, mlflow_uri)
    assert summary["prefect_flow_run_id"] == str(run.id)
    with get_client(sync_client=True) as client:  # the run itself completed (named Stopped), not cancelled
        state = client.read_flow_run(run.id).state
    assert (state.type.value, state.name) == ("COMPLETED", "Stopped")
    result = CliRunner().invoke(app, ["jobs", "stop", str(run.id), "--graceful"])
    assert result.exit_code == 0 and "nothing to stop: the job has ended" in result.output


def test_a_job_stopped_before_its_first_step_uploads_no_model_and_leaves_no_earlier_runs(
    prefect_api, s3_server, bucket, mlflow_uri, tmp_path
):
    import time

    gate = tmp_path / "hold"
    gate.touch()
    spec = job_dict(upload_dataset(bucket, rows=400), name="stop-early")
    spec["algorithm"] = {"entrypoint": "tests.unit.jobs:slow_build"}
    spec["hyperparameters"] |= {"step_sleep": 0.0, "group_build_waits_while": str(gate)}
    job_id = f"stop-early-{np.random.default_rng().integers(1e9)}"
    earlier = {f"output/{job_id}/model/model.pt": b"an earlier run's", f"output/{job_id}/model/model.json": b"{}"}
    for key, body in earlier.items():  # a rerun of the job id: what the earlier run uploaded
        s3.client().put_object(Bucket=bucket, Key=key, Body=body)

    def run() -> None:
        with contextlib.suppress(JobFailed):
            training_pipeline(parse_job(spec), job_id=job_id)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "hold.reached").exists():  # the group is building its model: no step taken yet
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.1)
    result = CliRunner().invoke(app, ["stop", job_id])
    assert result.exit_code == 0, result.output
    gate.unlink()
    thread.join(timeout=120)
    summary = json.loads((job_dir(job_id) / "summary.json").read_text())
    assert summary["status"] == "Stopped" and summary["compute"]["steps"] == 0 and summary["model"] is None
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=f"output/{job_id}/model/").get("Contents", [])
    assert listed == []  # its initial parameters are no model, and the earlier run's is not taken for this one's
    assert "uploading" not in summary["timings"]


def test_a_rerun_after_a_run_killed_mid_upload_leaves_no_half_model_of_it(prefect_api, s3_server, bucket, mlflow_uri):
    """A pipeline killed outright between the model's two uploads left model.json alone in S3, and a rerun that
    then failed before its own upload left it there as this job's."""
    spec = job_dict(upload_dataset(bucket, rows=400), name="killed-upload")
    spec["inputs"]["train"]["s3_uri"] = f"s3://{bucket}/no-such-prefix/"  # the rerun fails at staging
    job_id = f"killed-upload-{np.random.default_rng().integers(1e9)}"
    s3.client().put_object(Bucket=bucket, Key=f"output/{job_id}/model/model.json", Body=b"{}")  # the killed run's
    (job_dir(job_id)).mkdir(parents=True, exist_ok=True)
    (job_dir(job_id) / "plan.json").write_text("{}")  # ...and what it left in its folder
    with pytest.raises(JobFailed, match="no objects under"):
        training_pipeline(parse_job(spec), job_id=job_id)
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=f"output/{job_id}/model/").get("Contents", [])
    assert listed == []
