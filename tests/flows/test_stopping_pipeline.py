"""How a pipeline's job stops, as a real Prefect flow against the local S3 endpoint: diverged (the run failed,
nothing registered), at its target, by patience (its best epoch registered), and what it tells of epochs between
validations (``stopping.validate_every_epochs``). The rest of the pipeline is ``test_training_pipeline.py``."""

from __future__ import annotations

import io
import itertools
import json
import logging
from types import SimpleNamespace

import mlflow
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import flows.job_summary
import tasks.training
from flows import client
from tests.conftest import job_dict, put_table, upload_dataset
from tests.flows.pipeline_runs import flow_run_state, run_pipeline
from trainyard import s3


def test_a_diverged_job_fails_its_run_and_registers_nothing(prefect_api, s3_server, bucket, mlflow_uri):
    spec = job_dict(upload_dataset(bucket, rows=400))
    spec["algorithm"] = {"builtin": "linear-regression"}  # squared error at step size 10: inf, then NaN
    spec["hyperparameters"] |= {"learning_rate": 10, "optimizer": "sgd", "epochs": 20}
    summary, _ = run_pipeline(spec)
    assert summary["status"] == "Failed" and summary["failure_reason"].startswith("Diverged: val_loss was ")
    assert summary["model"] is None and summary["metrics"]["val_loss"] is None  # null, not NaN, in the JSON
    state = flow_run_state(summary["prefect_flow_run_id"])
    assert state.type.value == "FAILED" and client._run_status(state) == "Failed"  # its run Completed before


def test_target_metric_stops_the_job_early(prefect_api, s3_server, bucket, mlflow_uri):
    uris = upload_dataset(bucket, rows=800)
    spec = job_dict(uris, stopping={"target_metric": {"name": "val_accuracy", "value": 0.6}})
    spec["hyperparameters"]["epochs"] = 30
    summary, _ = run_pipeline(spec)
    assert summary["status"] == "Completed"
    assert summary["metrics"]["val_accuracy"] >= 0.6
    assert summary["metrics"]["epochs"] < 30
    assert summary["model"]["version"] >= 1


def test_an_epoch_between_validations_is_told_with_the_last_validation(
    prefect_api, s3_server, bucket, mlflow_uri, monkeypatch, caplog
):
    # every epoch told (a clock ten seconds on at each look): the once-a-second rule would fold these fast epochs
    monkeypatch.setattr(tasks.training, "time", SimpleNamespace(monotonic=itertools.count(10, 10).__next__))
    caplog.set_level(logging.INFO)
    progress: dict[int, dict] = {}  # the progress events' payloads by epochs done, the real events sent too
    emit = tasks.training.events.emit

    def spy(event: str, job_id: str, payload: dict, replica: int | None = None) -> None:
        if event == "trainyard.progress":
            progress[payload["epochs_done"]] = payload["metrics"]
        emit(event, job_id, payload, replica=replica)

    monkeypatch.setattr(tasks.training.events, "emit", spy)
    uris = upload_dataset(bucket, rows=800)
    spec = job_dict(uris, stopping={"validate_every_epochs": 2}, resources={"replicas": 1})
    spec["hyperparameters"]["epochs"] = 4
    summary, _ = run_pipeline(spec)
    assert summary["status"] == "Completed", summary.get("failure_reason")
    told = {m.split(":")[0]: m for m in caplog.messages if m.startswith("epoch ")}
    assert set(told) == {"epoch 1", "epoch 2", "epoch 3", "epoch 4"}
    assert "val_loss" not in told["epoch 1"]  # nothing validated yet
    assert "'val_accuracy'" in told["epoch 2"] and "validated_epoch" not in told["epoch 2"]
    assert "'val_accuracy'" in told["epoch 3"] and "'validated_epoch': 2" in told["epoch 3"]  # epoch 2's
    assert "validated_epoch" not in told["epoch 4"]  # the last epoch validates
    # the progress event (flows.client.status's "progress") tells each epoch as its log line does
    assert sorted(progress) == [1, 2, 3, 4] and "val_loss" not in progress[1]
    assert progress[3]["validated_epoch"] == 2 and progress[3]["val_accuracy"] == progress[2]["val_accuracy"]
    assert "validated_epoch" not in progress[2] and "validated_epoch" not in progress[4]


@pytest.mark.parametrize("artifact", ["creating", "updating", "starting"])
def test_a_job_whose_progress_reports_fail_trains_and_registers(
    prefect_api, s3_server, bucket, mlflow_uri, monkeypatch, caplog, artifact
):
    # the Prefect and MLflow APIs failing the training stage's reports past their clients' retries: the job's
    # groups train on, and its model is registered (it was lost with the stage, for a progress bar or a plot)
    def down(*_, **__):
        raise ConnectionError("the API did not answer")

    if artifact == "starting":  # MLflow down as training starts (its check was before staging): no live run
        monkeypatch.setattr(tasks.training, "LiveRun", down)
    else:
        calls = {"creating": "create_progress_artifact", "updating": "update_progress_artifact"}
        monkeypatch.setattr(tasks.training, calls[artifact], down)
        monkeypatch.setattr(tasks.training.LiveRun, "log_file", down)
        monkeypatch.setattr(tasks.training.LiveRun, "close", down)
    monkeypatch.setattr(flows.job_summary, "create_markdown_artifact", down)  # the summary's and carbon's artifacts
    caplog.set_level(logging.WARNING)
    spec = job_dict(upload_dataset(bucket, rows=400), resources={"replicas": 1})
    spec["hyperparameters"]["epochs"] = 2
    summary, _ = run_pipeline(spec)
    assert summary["status"] == "Completed", summary.get("failure_reason")
    assert summary["model"]["version"] >= 1 and summary["summary_uri"].startswith("s3://")
    assert flow_run_state(summary["prefect_flow_run_id"]).type.value == "COMPLETED"  # as its summary says
    warned = " ".join(caplog.messages)
    if artifact == "starting":
        assert "starting the live MLflow run failed (the API did not answer); the job trains without" in warned
    else:
        assert f"{artifact} the progress artifact failed (the API did not answer); the job goes on" in warned
        assert "logging the training curves to MLflow failed" in warned
        assert "closing the live MLflow run failed" in warned
    assert "could not create the summary artifact: the API did not answer" in warned


def test_a_job_with_patience_registers_its_best_epoch_not_its_last(prefect_api, s3_server, bucket, mlflow_uri):
    uris = upload_dataset(bucket, rows=800)
    # validation labels flipped: the better the model learns, the worse its validation loss; the first epoch
    # is the best, and patience ends the job two epochs later
    table = pq.read_table(
        io.BytesIO(s3.client().get_object(Bucket=bucket, Key="data/validation/part-0.parquet")["Body"].read())
    )
    flipped = table.set_column(table.schema.get_field_index("label"), "label", pa.array(1 - table["label"].to_numpy()))
    put_table(bucket, "data/validation/part-0.parquet", flipped)
    spec = job_dict(uris, stopping={"patience_epochs": 2})
    spec["hyperparameters"]["epochs"] = 10
    summary, job_id = run_pipeline(spec)
    assert summary["status"] == "Completed", summary.get("failure_reason")
    restored = summary["training"]["restored_epoch"]
    tracking = mlflow.MlflowClient(mlflow_uri)
    curve = {m.step: m.value for m in tracking.get_metric_history(summary["model"]["run_id"], "val_loss")}
    assert restored == min(curve, key=curve.get) and restored < summary["metrics"]["epochs"] == max(curve)
    # the summary, the version and the model itself are that epoch's
    assert summary["metrics"]["val_loss"] == pytest.approx(curve[restored])
    version = tracking.get_model_version("test-job", str(summary["model"]["version"]))
    assert version.tags["training.restored_epoch"] == str(restored)
    assert float(version.tags["metrics.val_accuracy"]) == pytest.approx(summary["metrics"]["val_accuracy"], abs=1e-5)
    loaded = mlflow.pyfunc.load_model(f"models:/test-job/{summary['model']['version']}")
    rows = flipped.to_pandas()
    predicted = np.asarray(loaded.predict(rows[["f0", "f1", "f2", "f3"]].to_numpy("float32", copy=True))).argmax(axis=1)
    assert (predicted == rows["label"]).mean() == pytest.approx(summary["metrics"]["val_accuracy"], abs=1e-6)


def test_ctrl_c_ends_the_job_stopped_with_its_summary(prefect_api, s3_server, bucket, mlflow_uri, monkeypatch):
    # KeyboardInterrupt is neither a TrainyardError, an Exception nor Prefect's TerminationSignal: the flow wrote no
    # summary, and `trainyard run --summary-out` none either
    from flows.training_pipeline import training_pipeline
    from trainyard.home import job_dir
    from trainyard.spec import parse_job

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(tasks.training.supervisor, "train", interrupted)
    job_id = f"ctrl-c-{np.random.default_rng().integers(1e9)}"
    with pytest.raises(KeyboardInterrupt):
        training_pipeline(parse_job(job_dict(upload_dataset(bucket, rows=200))), job_id=job_id)
    summary = json.loads((job_dir(job_id) / "summary.json").read_text())
    assert (summary["status"], summary["failure_reason"]) == ("Stopped", "Interrupted")
    assert "staging" in summary["timings"] and summary["model"] is None
