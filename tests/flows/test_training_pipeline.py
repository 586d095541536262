"""The six-stage pipeline as a real Prefect flow, against the local S3 endpoint over HTTP.

These run on moto alone: each is a whole job (tens of seconds), and what they add over the unit
tests is the flow, not S3. Staging, streaming and reading channels are tested on both endpoints
(moto and rclone) in ``tests/unit``."""

from __future__ import annotations

import contextlib
import io
import json
import time
from datetime import timedelta
from pathlib import Path

import mlflow
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import flows.job_summary
from flows import client
from flows.training_pipeline import JobFailed, training_pipeline
from tests.conftest import job_dict, put_table, upload_dataset
from tests.flows.pipeline_runs import flow_run_state, run_pipeline
from trainyard import STAGES, cache, esg, kept_rowgroups, listing, s3
from trainyard.cli import app
from trainyard.home import job_dir
from trainyard.spec import parse_job

SUMMARY_KEYS = {
    "status",
    "secondary_status_transitions",
    "metrics",
    "compute",
    "sifting",
    "elastic",
    "carbon",
    "data",
    "model",
    "timings",
}


def test_pipeline_trains_and_registers(prefect_api, s3_server, bucket, mlflow_uri, monkeypatch, capfd):
    secret = "tysecret-0123456789-do-not-leak"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)  # moto takes any key
    uris = upload_dataset(bucket, rows=800)
    summary, job_id = run_pipeline(job_dict(uris, resources={"replicas": 2}))
    assert set(summary) >= SUMMARY_KEYS
    assert summary["status"] == "Completed", summary.get("failure_reason")
    assert [t["status"] for t in summary["secondary_status_transitions"]] == [
        "Starting",
        "Downloading",
        "Training",
        "Uploading",
        "Completed",
    ]
    assert summary["metrics"]["val_accuracy"] > 0.85 and summary["metrics"]["epochs"] == 3
    assert "group_train_flops" not in summary["metrics"]  # per-epoch bookkeeping: FLOPs are in "compute"
    assert "steps" not in summary["metrics"]  # the job's steps are in "compute", an epoch's in "training"
    # the six stages, and the model's upload between training and carbon, each timed and metered
    assert list(summary["timings"]) == [*STAGES[:4], "uploading", *STAGES[4:]]
    assert set(summary["carbon"]["by_stage"]) == {*STAGES, "uploading"}
    compute = summary["compute"]
    assert compute["flops_total"] == compute["flops_forward"] + compute["flops_backward"] + compute["flops_evaluation"]
    assert compute["samples_trained"] == 3 * 600
    assert summary["data"]["channels"]["train"]["objects"] == 2
    assert not list(cache.pins_dir().glob("*.pin"))  # staging's pin on the cached objects was released
    # the model: registered, loadable, and its run holds the summary and the curves
    model = summary["model"]
    assert model["name"] == "test-job" and "champion" in model["aliases"]
    loaded = mlflow.pyfunc.load_model("models:/test-job@champion")
    x = np.random.default_rng(0).normal(size=(33, 4)).astype(np.float32)
    assert np.asarray(loaded.predict(x)).shape == (33, 2)
    # what its columns and outputs are travels with it: used as the README shows, on the validation rows
    meta = loaded.metadata.metadata["trainyard"]
    assert meta == {"task": "classification", "features": ["f0", "f1", "f2", "f3"], "label": "label", "classes": [0, 1]}
    body = s3.client().get_object(Bucket=bucket, Key="data/validation/part-0.parquet")["Body"].read()
    rows = pq.read_table(io.BytesIO(body)).to_pandas()
    logits = loaded.predict(rows[meta["features"]].to_numpy("float32", copy=True))
    predicted = np.asarray(meta["classes"])[np.asarray(logits).argmax(axis=1)]
    assert (predicted == rows[meta["label"]]).mean() == pytest.approx(summary["metrics"]["val_accuracy"], abs=1e-6)
    artifacts = {a.path for a in mlflow.MlflowClient(mlflow_uri).list_artifacts(model["run_id"])}
    assert {"summary.json", "training_curves.png", "train.objects.json", "validation.objects.json"} <= artifacts
    # the data lineage: the staged manifest's digest (of the objects it lists), in the summary and on the run,
    # and its objects in the run (a job folder cleaned away leaves them there), without this machine's paths
    staged = listing.ChannelManifest.from_dict(json.loads((job_dir(job_id) / "staging" / "train.json").read_text()))
    assert staged.digest == listing.lineage_digest(staged.objects)
    kept = json.loads(
        Path(
            mlflow.artifacts.download_artifacts(
                run_id=model["run_id"], artifact_path="train.objects.json", tracking_uri=mlflow_uri
            )
        ).read_text()
    )
    assert kept["digest"] == staged.digest and [o["key"] for o in kept["objects"]] == [o.key for o in staged.objects]
    assert "path" not in kept["objects"][0] and kept["objects"][0]["etag"] == staged.objects[0].etag
    tags = mlflow.MlflowClient(mlflow_uri).get_run(model["run_id"]).data.tags
    assert tags["data.train.manifest_digest"] == staged.digest
    assert summary["data"]["channels"]["train"]["manifest_digest"] == staged.digest
    # the outputs in S3
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket, Prefix=f"output/{job_id}/")["Contents"]}
    # credentials appear nowhere: not in the logs, the job folder (manifests, plan, replica logs) or MLflow
    out, err = capfd.readouterr()
    assert secret not in out + err
    local = [p for p in job_dir(job_id).rglob("*") if p.is_file()]
    local += [p for p in Path(mlflow_uri.removeprefix("sqlite:///")).parent.rglob("*") if p.is_file()]
    assert not [p for p in local if secret.encode() in p.read_bytes()]
    # nor in what was uploaded (the summary, the model's card, the carbon ledger)
    uploaded = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket, Prefix="output/")["Contents"]}
    assert {f"output/{job_id}/summary.json", f"output/carbon-ledger/{job_id}.csv"} <= uploaded
    body = lambda key: s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()  # noqa: E731
    assert not [key for key in uploaded if secret.encode() in body(key)]
    assert keys == {
        f"output/{job_id}/model/model.pt",
        f"output/{job_id}/model/model.json",
        f"output/{job_id}/summary.json",
    }
    # the ESG report: consistent, each group metered on its own, and the job's line in the ledger
    c = summary["carbon"]
    assert c["emissions_kg"] == pytest.approx(c["it_energy_kwh"] * c["intensity_g_per_kwh"] * c["pue"] / 1000)
    assert c["energy_kwh"] == pytest.approx(sum(s["energy_kwh"] for s in c["by_stage"].values()))
    assert c["energy_kwh"] == pytest.approx(sum(c["by_device_kwh"].values()))
    assert set(c["by_replica"]) == {"0", "1"}
    # two groups on one machine: attributed shares of the training stage, not added to the total
    assert sum(r["energy_kwh"] for r in c["by_replica"].values()) <= c["by_stage"]["training"]["energy_kwh"]
    assert c["scope2_market_based_kg"] is None and c["scope2_market_basis"] == "not provided"
    assert c["g_per_1k_samples_trained"] == pytest.approx(c["emissions_kg"] * 1e6 / compute["samples_trained"])
    live = mlflow.search_runs(experiment_names=["test-job"], filter_string=f"tags.`trainyard.live_job_id` = '{job_id}'")
    assert len(live) == 1  # energy and emissions logged while the groups trained
    history = mlflow.MlflowClient(mlflow_uri).get_metric_history(live.run_id[0], "emissions_kg")
    assert history and history[-1].value > 0
    # one figure everywhere: the version's tags say what the summary and the ledger say
    version = mlflow.MlflowClient(mlflow_uri).get_model_version("test-job", str(model["version"]))
    assert version.tags["carbon.emissions_kg"] == f"{c['emissions_kg']:.6g}"
    assert "columns in this order: `f0`, `f1`, `f2`, `f3`" in version.description and "`0`, `1`" in version.description
    ledger = s3.client().get_object(Bucket=bucket, Key=f"output/carbon-ledger/{job_id}.csv")["Body"].read().decode()
    header, row = ledger.strip().splitlines()
    assert header.startswith("job_id,") and row.startswith(f"{job_id},")


def test_a_rerun_of_a_registered_job_id_trains_nothing_and_leaves_its_model(
    prefect_api, s3_server, bucket, mlflow_uri, monkeypatch
):
    # A retry of a run killed after its registration trained again: it uploaded another model over the
    # registered one's, while the version (one per job id) kept the first.
    job = parse_job(job_dict(upload_dataset(bucket, rows=400)))
    job_id = f"rerun-{np.random.default_rng().integers(1e9)}"
    first = training_pipeline(job, job_id=job_id)
    model_key = f"output/{job_id}/model/model.pt"
    etag = s3.client().head_object(Bucket=bucket, Key=model_key)["ETag"]
    trained = lambda: [p.stat().st_mtime_ns for p in job_dir(job_id).glob("replicas/*/attempt-*/*")]  # noqa: E731
    before = trained()
    rerun = training_pipeline(job, job_id=job_id, return_state=True)
    again = rerun.result()
    assert again["model"] == first["model"] and again["metrics"] == first["metrics"]
    # what a service following the rerun sees: its own transitions (not the first run's), ended as the job ended
    for _ in range(60):  # its events reach the API a moment after the run ends
        said = client.status(str(rerun.state_details.flow_run_id))
        if said["metrics"] is not None and said["secondary_status"] == "Completed":  # (the events may land apart)
            break
        time.sleep(0.25)
    assert [t["status"] for t in said["secondary_status_transitions"]] == ["Starting", "Completed"]  # was: Starting
    assert (said["status"], said["model"]["version"]) == ("Completed", first["model"]["version"])
    assert trained() == before  # no group started (a retrained job's rewrote its files, the same ones)
    assert s3.client().head_object(Bucket=bucket, Key=model_key)["ETag"] == etag
    tracking = mlflow.MlflowClient(mlflow_uri)
    assert [int(v.version) for v in tracking.search_model_versions(f"name='{job.model_name}'")] == [1]
    # killed after its registration, before its summary (here or in S3): it had no ledger line either. The rerun
    # writes them, the runs' energy from their journals and the metrics the version holds; nothing is trained
    # (S3 holds a summary an earlier run uploaded, one that failed before the registering run: not the job's end)
    (job_dir(job_id) / "summary.json").unlink()
    s3.client().delete_object(Bucket=bucket, Key=f"output/carbon-ledger/{job_id}.csv")
    stale = {"status": "Failed", "model": None, "prefect_flow_run_id": "0" * 8 + "-0000-4000-8000-" + "0" * 12}
    stale["secondary_status_transitions"] = [{"status": "Failed", "start_time": "2026-12-01T00:00:00+00:00"}]
    s3.client().put_object(Bucket=bucket, Key=f"output/{job_id}/summary.json", Body=json.dumps(stale).encode())
    made = training_pipeline(job, job_id=job_id)
    assert (made["status"], made["model"]["version"]) == ("Completed", first["model"]["version"])
    assert made["metrics"] == pytest.approx(first["metrics"], rel=1e-5)
    assert made["carbon"]["energy_kwh"] >= first["carbon"]["energy_kwh"] > 0  # every run's, the first's included
    ledger = [r for r in esg.read_ledger(f"s3://{bucket}/output/") if r["job_id"] == job_id]
    assert [float(r["energy_kwh"]) for r in ledger] == pytest.approx([made["carbon"]["energy_kwh"]])
    assert trained() == before and json.loads((job_dir(job_id) / "summary.json").read_text())["status"] == "Completed"

    # interrupted while it publishes that summary again (Ctrl-C; SIGTERM is the same branch, but Prefect's engine
    # passes it on to this process): the job has ended Completed, and stays so (it was ended again, Stopped, with
    # no model, and every later rerun refused)
    def interrupted(*_):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(flows.job_summary, "publish", interrupted)
        with pytest.raises(KeyboardInterrupt):
            training_pipeline(job, job_id=job_id)
    kept = json.loads((job_dir(job_id) / "summary.json").read_text())
    assert (kept["status"], kept["model"]["version"]) == ("Completed", first["model"]["version"])
    # killed so on another machine: no journal of its run here to count its energy by (other runs' are), and
    # nothing is made up
    (job_dir(job_id) / "summary.json").unlink()
    (registering,) = (job_dir(job_id) / "energy").glob(f"{first['prefect_flow_run_id']}-*.json")
    registering.rename(registering.with_name(f"{stale['prefect_flow_run_id']}-0a1b2c3d.json"))  # another run's
    s3.client().delete_object(Bucket=bucket, Key=f"output/{job_id}/summary.json")
    with pytest.raises(JobFailed, match=r"by an earlier run, which ended before its summary, on another machine"):
        training_pipeline(job, job_id=job_id)
    assert trained() == before and not (job_dir(job_id) / "summary.json").exists()
    # a week on, Prefect has let the first run's events go (PREFECT_EVENTS_RETENTION_PERIOD): its outcome is read
    # from its summary artifact, which Prefect keeps (it read no metrics, model nor transitions)
    monkeypatch.setattr(client.job_events, "read", lambda *_: ([], None))
    monkeypatch.setattr(client, "EVENTS_SETTLE", timedelta(0))  # (a week on: long past the run's end)
    said = client.status(first["prefect_flow_run_id"])
    assert (said["status"], said["metrics"]) == ("Completed", first["metrics"])
    assert said["summary_uri"] == first["summary_uri"]
    assert said["model"] == {key: first["model"][key] for key in ("name", "version", "uri", "aliases")}
    assert [t["status"] for t in said["secondary_status_transitions"]][-1] == "Completed"


def test_carbon_budget_stops_the_job_cleanly(prefect_api, s3_server, bucket, mlflow_uri):
    uris = upload_dataset(bucket, rows=800)
    spec = job_dict(uris, carbon={"country_iso_code": "IRL", "budget_kg": 1e-9, "renewable_share": 0.25})
    spec["hyperparameters"]["epochs"] = 2000
    summary, job_id = run_pipeline(spec)
    assert summary["status"] == "Stopped" and summary["failure_reason"] == "CarbonBudgetExceeded"
    assert summary["metrics"].get("epochs", 0) < 2000  # stopped at the first reading past the budget
    assert summary["model"] is None  # a stopped job registers nothing
    if summary["metrics"].get("epochs"):  # but its live run has its curves
        where = f"tags.`trainyard.live_job_id` = '{job_id}'"
        live = mlflow.search_runs(experiment_names=["test-job"], filter_string=where)
        artifacts = {a.path for a in mlflow.MlflowClient(mlflow_uri).list_artifacts(live.run_id[0])}
        assert "training_curves.png" in artifacts
        assert live.status[0] == "KILLED"  # stopped, not FINISHED as a completed job's
    c = summary["carbon"]
    assert c["budget_exceeded"] and c["emissions_kg"] > c["budget_kg"]
    assert c["scope2_market_based_kg"] == pytest.approx(0.75 * c["scope2_location_based_kg"])
    # the run completed for Prefect, named as the job ended: `jobs list` said Completed for a Stopped job
    state = flow_run_state(summary["prefect_flow_run_id"])
    assert (state.type.value, state.name, client._run_status(state)) == ("COMPLETED", "Stopped", "Stopped")
    # A rerun of the job id counts the first run's energy (its ledger line replaces the first run's, which
    # it used to drop), and the budget with it: the first run's emissions alone are past it, so it stops
    # before any compute (it staged, filtered and launched its groups before its first live reading stopped it)
    with contextlib.suppress(JobFailed):
        training_pipeline(parse_job(spec), job_id=job_id)
    again = json.loads((job_dir(job_id) / "summary.json").read_text())
    earlier = again["carbon"]["by_stage"]["earlier runs"]
    assert earlier["energy_kwh"] == pytest.approx(c["energy_kwh"]) and earlier["emissions_kg"] > c["budget_kg"]
    assert list(again["carbon"]["by_stage"]) == ["earlier runs"], again["carbon"]["by_stage"]
    assert (again["status"], again["failure_reason"]) == ("Stopped", "CarbonBudgetExceeded")
    assert "nothing was run again" in again["secondary_status_transitions"][-1]["message"]
    assert again["carbon"]["energy_kwh"] == pytest.approx(c["energy_kwh"]) and again["carbon"]["budget_exceeded"]
    ledger = [r for r in esg.read_ledger(spec["output"]["s3_uri"]) if r["job_id"] == job_id]
    assert [float(r["energy_kwh"]) for r in ledger] == pytest.approx([again["carbon"]["energy_kwh"]])


def password_quoting_build(num_features, num_outputs, hyperparameters):
    """An entrypoint whose build fails quoting a URL with its password (a model hub's, say)."""
    raise ConnectionError("could not fetch https://svc:HUBPASSWORD@models.internal/churn.pt")


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("missing-bucket", "s3://no-such-bucket-anywhere/data/train/: bucket does not exist"),
        ("wrong-label", "label column 'churned' not found"),
        ("nan-labels", "label 'label' has 3 missing"),
        ("unreadable", "/data/train/part-9.parquet: cannot be read as parquet"),
        ("empty", "no objects under"),
        ("mean-loss", "algorithm.entrypoint: the loss function returned shape ()"),
        ("sifting-draw", "sifting.beta: each step draws hyperparameters.batch_size * (1 + beta) = 64 * 5 = 320"),
        ("lost-group", "failed after 1 attempt(s) (retries.max_attempts 3)"),
        (
            "build-quotes-a-password",
            "failed to build: ConnectionError: could not fetch https://svc:***@models.internal",
        ),
    ],
)
def test_bad_data_fails_clearly_and_registers_nothing(
    prefect_api, s3_server, bucket, mlflow_uri, breakage, message, caplog
):
    uris = upload_dataset(bucket, rows=200)
    spec = job_dict(uris)
    if breakage == "missing-bucket":
        spec["inputs"]["train"]["s3_uri"] = "s3://no-such-bucket-anywhere/data/train/"
    elif breakage == "wrong-label":  # in both channels: a validation label unlike train's is the spec's to refuse
        spec["inputs"]["train"]["label"] = spec["inputs"]["validation"]["label"] = "churned"
    elif breakage == "nan-labels":
        put_table(
            bucket,
            "data/train/part-9.parquet",
            pa.table({f"f{i}": [0.0, 1.0, 2.0] for i in range(4)} | {"label": pa.array([None] * 3, pa.int64())}),
        )
    elif breakage == "unreadable":
        s3.client().put_object(Bucket=bucket, Key="data/train/part-9.parquet", Body=b"not parquet")
    elif breakage == "empty":
        spec["inputs"]["train"]["s3_uri"] = f"s3://{bucket}/nothing-here/"
    elif breakage == "mean-loss":  # found on a first batch, before the prefilter's or the groups' compute
        spec["algorithm"] = {"entrypoint": "tests.unit.test_entrypoints:mean_loss_build"}
        spec["sifting"] = {"enabled": True, "prefilter": {"drop_unlearnable_fraction": 0.05}}
    elif breakage == "sifting-draw":  # 150 training rows: one step an epoch, keeping 30 of them, not a batch
        spec["sifting"] = {"enabled": True, "beta": 4}
    elif breakage == "lost-group":  # the only group dies after its first epoch; nothing to heal from, no checkpoint
        spec["elastic"] = {"fault_injection": [{"replica": 0, "at_step": 4, "kind": "kill"}]}
    elif breakage == "build-quotes-a-password":  # the user's code's own error, quoted in the job's
        spec["algorithm"] = {"entrypoint": "tests.flows.test_training_pipeline:password_quoting_build"}
    summary, _ = run_pipeline(spec)
    assert "HUBPASSWORD" not in json.dumps(summary) + caplog.text
    if breakage == "lost-group":  # the group failure that ended training is in the summary
        assert [(f["replica"], f["attempt"]) for f in summary["elastic"]["failure_details"]] == [(0, 0)]
        # and the failed stage's time and energy count: a failed job's footprint is not only its finished stages
        assert summary["timings"]["training"] > 0 and summary["carbon"]["by_stage"]["training"]["energy_kwh"] > 0
        # and so does its compute: the steps it committed before it died
        compute = summary["compute"]
        steps = compute["steps"]  # 150 rows an epoch: steps of 64, 64 and 22 rows
        assert steps >= 1 and compute["samples_trained"] == 150 * (steps // 3) + 64 * (steps % 3)
        assert compute["flops_backward"] > compute["flops_forward"] > 0 and compute["flops_total"] > 0
        # and the metrics of the last epoch it validated, as a stopped job's (SageMaker's final metrics)
        assert summary["metrics"]["epochs"] >= 1 and 0 <= summary["metrics"]["val_accuracy"] <= 1
    if breakage in ("mean-loss", "sifting-draw"):
        assert [t["status"] for t in summary["secondary_status_transitions"]] == ["Starting", "Downloading", "Failed"]
        assert summary["compute"]["flops_prefilter"] == 0
    assert summary["status"] == "Failed"
    assert message in summary["failure_reason"]
    assert summary["secondary_status_transitions"][-1]["status"] == "Failed"
    assert summary["model"] is None
    assert mlflow.MlflowClient(mlflow_uri).search_registered_models() == []
    # the user's mistake, logged as its message: no traceback (Prefect logs one for a flow that raises)
    assert message in caplog.text and "Traceback" not in caplog.text


def test_cli_run_exit_status_and_summary(prefect_api, s3_server, bucket, mlflow_uri, tmp_path):
    import yaml

    uris = upload_dataset(bucket, rows=400)
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(yaml.safe_dump(job_dict(uris)))
    out = tmp_path / "summary.json"
    runner = CliRunner()
    result = runner.invoke(app, ["run", str(spec_path), "--set", "hyperparameters.epochs=2", "--summary-out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert summary["status"] == "Completed" and summary["metrics"]["epochs"] == 2
    assert summary["summary_uri"].endswith(f"/{summary['job_id']}/summary.json")  # where it was uploaded
    where = s3.S3Uri.parse(summary["summary_uri"])
    uploaded = json.loads(s3.client().get_object(Bucket=where.bucket, Key=where.key)["Body"].read())
    # the S3 copy says where it and the ledger line are, as the others do (it said neither)
    assert uploaded["summary_uri"] == summary["summary_uri"] and uploaded["carbon"]["ledger_uri"].endswith(".csv")
    result = runner.invoke(
        app, ["run", str(spec_path), "--set", "inputs.train.label=nope", "--set", "inputs.validation.label=nope"]
    )
    assert result.exit_code == 1
    assert result.output.count("label column 'nope' not found") == 1  # said once, under the table
    assert "Traceback" not in result.output
    result = runner.invoke(app, ["run", str(spec_path), "--set", "resources.replicas=0"])
    assert result.exit_code == 2 and "resources.replicas" in result.output
    # a spec problem only the data shows (more candidates a step than rows): still a spec problem, exit 2
    result = runner.invoke(app, ["run", str(spec_path), "--set", "sifting={enabled: true, beta: 50}"])
    assert result.exit_code == 2 and "sifting.beta" in result.output, result.output
    result = runner.invoke(app, ["run", str(spec_path), "--set", "hyperparameters.warmup_steps=100000"])
    assert result.exit_code == 2 and "hyperparameters.warmup_steps: 100000 is not below" in result.output, result.output


def test_streamed_train_channel_trains_without_staging_it(prefect_api, s3_server, bucket, mlflow_uri):
    """``mode: stream``: the groups read parquet row groups from S3; staging downloads none of them."""
    import pyarrow.parquet as pq

    from tests.conftest import blobs_table

    table = blobs_table(1200, seed=4)
    put_table(bucket, "data/validation/part-0.parquet", table.slice(0, 300))
    for i in range(3):  # three objects of 300 rows, in row groups of 50
        buf = io.BytesIO()
        pq.write_table(table.slice(300 + 300 * i, 300), buf, row_group_size=50)
        s3.client().put_object(Bucket=bucket, Key=f"data/train/part-{i}.parquet", Body=buf.getvalue())
    uris = {
        "train": f"s3://{bucket}/data/train/",
        "validation": f"s3://{bucket}/data/validation/",
        "output": f"s3://{bucket}/output/",
    }
    spec = job_dict(uris, resources={"replicas": 2})
    spec["inputs"]["train"]["mode"] = "stream"
    kept_before = set(cache.rowgroups_dir().glob(f"*{kept_rowgroups.UNIT_SUFFIX}"))
    summary, job_id = run_pipeline(spec)
    assert summary["status"] == "Completed", summary.get("failure_reason")
    train = summary["data"]["channels"]["train"]
    assert train["objects"] == 3 and train["bytes_downloaded"] == 0 and train["verified_by"] == {"streamed": 3}
    assert summary["metrics"]["val_accuracy"] > 0.85
    # 900 rows in 18 row groups, dealt 9 and 9: 450 rows a group, 32 a step -> 15 steps an epoch
    assert summary["compute"]["steps"] == 3 * 15
    assert summary["compute"]["samples_trained"] == 3 * 2 * 450
    kept = set(cache.rowgroups_dir().glob(f"*{kept_rowgroups.UNIT_SUFFIX}")) - kept_before
    assert len(kept) == 18  # each row group read from S3 once, then reused, in the machine's cache
