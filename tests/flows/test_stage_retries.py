"""Stage tasks as Prefect runs them: a retried stage counts every attempt, and a work pool is checked first."""

from __future__ import annotations

import time

import pytest
from prefect import flow, task

from tasks._metering import retry_transient, stage_meter
from tests.conftest import job_dict
from trainyard.errors import StorageError
from trainyard.spec import parse_job

JOB = parse_job(job_dict({"train": "s3://bkt/t/", "validation": "s3://bkt/v/", "output": "s3://bkt/o/"}))


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


@pytest.mark.parametrize("fails", [1, 3])  # one hiccup then success; or every attempt failing
def test_a_retried_stage_counts_every_attempt(prefect_api, fails):
    attempts = []

    @task(name="staging", retries=2, retry_delay_seconds=0, retry_condition_fn=retry_transient)
    def stage() -> dict:
        attempts.append(1)
        with stage_meter("staging", JOB) as record:
            busy(0.4)  # a download, then the connection drops
            if len(attempts) <= fails:
                raise StorageError("connection reset", transient=True)
        return record

    @flow
    def job() -> dict:
        try:
            return stage()
        except StorageError as exc:
            return exc.stage_record  # type: ignore[attr-defined]

    record = job()
    assert len(attempts) == min(fails + 1, 3) and record["attempts"] == len(attempts)
    assert record["seconds"] >= 0.4 * len(attempts)  # the last attempt alone took 0.4 s
    assert record["energy"]["duration_seconds"] >= 0.35 * len(attempts) and record["energy"]["energy_kwh"] > 0


def test_a_work_pool_without_its_replica_deployment_is_refused_before_any_compute(prefect_api):
    from tasks.pool_launcher import check_deployment
    from trainyard.errors import SpecError

    # the groups' first runs failed after staging, as "internal error: ObjectNotFound(None)"
    with pytest.raises(SpecError, match="resources.work_pool: 'trainyard-gpus' has no train-replica/trainyard-gpus"):
        check_deployment("trainyard-gpus")


def test_a_bad_trainyard_setting_fails_the_job_before_it_stages_anything(
    prefect_api, s3_server, bucket, mlflow_uri, monkeypatch
):
    from tests.conftest import upload_dataset
    from tests.flows.pipeline_runs import run_pipeline

    monkeypatch.setenv("TRAINYARD_TORCH_THREADS", "all")  # read by the launch stage, after staging had fetched it all
    summary, _ = run_pipeline(job_dict(upload_dataset(bucket, rows=200)))
    assert summary["status"] == "Failed" and "TRAINYARD_TORCH_THREADS='all'" in summary["failure_reason"], summary
    assert "staging" not in summary["timings"] and summary["data"]["channels"] == {}


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("TRAINYARD_SILENT_GROUP_SECONDS", "-3"),
        ("TRAINYARD_CANCEL_CONFIRM_SECONDS", "soon"),
        ("TRAINYARD_CACHE_MAX_BYTES", "lots"),
        ("TRAINYARD_CACHE_VERIFY", "sometimes"),
        ("TRAINYARD_PROGRESS", "quiet"),
        ("TRAINYARD_HOST", "fd00::7"),
    ],
)
def test_every_setting_a_later_stage_reads_is_checked_at_the_start(monkeypatch, setting, value):
    from flows.training_pipeline import _check_settings
    from trainyard.errors import TrainyardError

    _check_settings()
    monkeypatch.setenv(setting, value)
    with pytest.raises(TrainyardError, match=setting):
        _check_settings()


def test_a_rerun_failing_before_any_stage_still_counts_the_earlier_runs_energy(
    prefect_api, s3_server, bucket, mlflow_uri, monkeypatch
):
    # its summary and ledger line replace the earlier runs': they said 0 kWh for a job that had trained for hours
    import contextlib
    import json

    from flows.training_pipeline import JobFailed, training_pipeline
    from tests.conftest import upload_dataset
    from trainyard.carbon import StageEnergy
    from trainyard.home import job_dir

    earlier = dict.fromkeys(StageEnergy.ADDED, 0.0) | {"energy_kwh": 1.5, "emissions_kg": 0.6, "duration_seconds": 60}
    (job_dir("rerun-1") / "energy").mkdir(parents=True)
    (job_dir("rerun-1") / "energy" / "an-earlier-run.json").write_text(json.dumps({"stages": {"training": earlier}}))
    monkeypatch.setenv("TRAINYARD_TORCH_THREADS", "all")  # refused at the start
    with contextlib.suppress(JobFailed):
        training_pipeline(parse_job(job_dict(upload_dataset(bucket, rows=200))), job_id="rerun-1")
    summary = json.loads((job_dir("rerun-1") / "summary.json").read_text())
    assert summary["status"] == "Failed" and "TRAINYARD_TORCH_THREADS='all'" in summary["failure_reason"]
    assert summary["carbon"]["energy_kwh"] >= 1.5


def test_a_rerun_on_a_machine_without_the_earlier_runs_folder_leaves_no_earlier_model_as_its_own(
    prefect_api, s3_server, bucket, mlflow_uri
):
    # an earlier run of the id (stopped, its model uploaded) ran on another worker, or its folder was cleaned: this
    # run failed in staging, and its summary said no model beside the earlier run's model.pt and model.json
    import contextlib
    import json

    from flows.training_pipeline import JobFailed, training_pipeline
    from tests.conftest import upload_dataset
    from trainyard import outputs, s3
    from trainyard.home import job_dir

    spec = job_dict(upload_dataset(bucket, rows=200))
    spec["inputs"]["train"]["s3_uri"] = f"s3://{bucket}/nothing-here/"
    job = parse_job(spec)
    model = outputs.job_prefix(job, "rerun-elsewhere").join("model")
    for name in ("model.pt", "model.json"):
        s3.client().put_object(Bucket=bucket, Key=model.join(name).key, Body=b"an earlier run's")
    with contextlib.suppress(JobFailed):
        training_pipeline(job, job_id="rerun-elsewhere")
    summary = json.loads((job_dir("rerun-elsewhere") / "summary.json").read_text())
    assert summary["status"] == "Failed" and summary["model"] is None
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=model.key)
    assert listed.get("KeyCount", 0) == 0, listed.get("Contents")


def test_a_full_disk_under_the_local_summary_keeps_the_summary_published(
    prefect_api, s3_server, bucket, mlflow_uri, monkeypatch
):
    # the job folder's copy was written first, unguarded: ENOSPC there published nothing (no S3 summary, ledger
    # line or ended event) and replaced the job's own end with the error
    import json

    import flows.training_pipeline as pipeline
    from tests.conftest import upload_dataset
    from trainyard import outputs, s3

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device (a test's)")

    monkeypatch.setattr(pipeline, "write_json_atomic", full_disk)
    spec = job_dict(upload_dataset(bucket, rows=200))
    spec["hyperparameters"]["epochs"] = 1
    job = parse_job(spec)
    summary = pipeline.training_pipeline(job, job_id="full-disk-1")
    assert summary["status"] == "Completed" and summary["summary_uri"] == outputs.summary_uri(job, "full-disk-1")
    where = s3.S3Uri.parse(summary["summary_uri"])
    uploaded = json.loads(s3.client().get_object(Bucket=where.bucket, Key=where.key)["Body"].read())
    assert uploaded["status"] == "Completed"


def test_a_summary_section_that_cannot_be_made_leaves_the_rest_published(
    prefect_api, s3_server, bucket, mlflow_uri, monkeypatch, capsys
):
    # summary() ran after the job's end, unguarded: a bug in one section failed the completed, registered job's run
    # with no summary, ledger line or ended event
    import json
    import types

    import flows.job_summary as job_summary
    from flows.training_pipeline import training_pipeline
    from tests.conftest import upload_dataset
    from trainyard import cli, esg, s3, status

    def broken(*args, **kwargs):
        raise RuntimeError("a bug, in a test")

    def compute_broken(*args):  # the summary's call (the registry's lineage tags make theirs without `done`)
        return broken() if len(args) == 3 else status.compute_section(*args)

    broke = {"sifting_section": broken, "compute_section": compute_broken}
    monkeypatch.setattr(job_summary, "status", types.SimpleNamespace(**vars(status) | broke))
    monkeypatch.setattr(job_summary, "esg", types.SimpleNamespace(**vars(esg) | {"report": broken}))
    spec = job_dict(upload_dataset(bucket, rows=200))
    spec["hyperparameters"]["epochs"] = 1
    job = parse_job(spec)
    summary = training_pipeline(job, job_id="bad-section-1")
    assert summary["status"] == "Completed" and summary["model"]["version"] == 1
    assert summary["sifting"] is None and summary["compute"] is None and summary["metrics"]["val_accuracy"] is not None
    assert [e.split(":")[0] for e in summary["summary_errors"]] == ["compute", "sifting", "carbon"]
    assert "RuntimeError('a bug, in a test')" in summary["summary_errors"][1]
    # the carbon section is the stages' energy rolled up, without the ESG report's figures
    assert summary["carbon"]["energy_kwh"] > 0 and "training" in summary["carbon"]["by_stage"]
    where = s3.S3Uri.parse(summary["summary_uri"])
    uploaded = json.loads(s3.client().get_object(Bucket=where.bucket, Key=where.key)["Body"].read())
    assert uploaded["summary_errors"] == summary["summary_errors"]
    (row,) = [r for r in esg.read_ledger(job.output.s3_uri) if r["job_id"] == "bad-section-1"]
    assert float(row["energy_kwh"]) == summary["carbon"]["energy_kwh"] > 0
    cli.print_summary(summary)  # the end-of-job table, with what could not be made said under it
    assert "summary incomplete: compute: internal error" in capsys.readouterr().out
