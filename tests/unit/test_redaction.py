"""Secrets stay out of what Trainyard records: lineage, summaries, S3 messages."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from botocore.exceptions import EndpointConnectionError

from tests.unit.models import register, trained
from trainyard import registry, s3
from trainyard.errors import StorageError
from trainyard.redaction import MASK, SECRET_NAME, redact_spec, redact_text, redact_url


def test_a_urls_password_is_masked_and_its_user_kept():
    assert (
        redact_text("see https://alice:s3cr%2Ft@mlflow.example:5000/api")
        == f"see https://alice:{MASK}@mlflow.example:5000/api"
    )
    assert redact_text("s3://bucket/key:with@odd/chars") == "s3://bucket/key:with@odd/chars"
    assert redact_text("http://127.0.0.1:9000/") == "http://127.0.0.1:9000/"
    # an unencoded "@" in the password: parsers (botocore's) take the host after the last one
    assert redact_text('to "http://minio:p@ss-w0rd@127.0.0.1:1/b"') == f'to "http://minio:{MASK}@127.0.0.1:1/b"'
    assert redact_text("http://127.0.0.1:9000/a@b") == "http://127.0.0.1:9000/a@b"
    compact = '{"a":"http://u:pw@h:9000","b":"x@y.com"}'  # the password stops at the quote
    assert redact_text(compact) == f'{{"a":"http://u:{MASK}@h:9000","b":"x@y.com"}}'


def test_one_url_is_masked_with_or_without_its_scheme():
    assert redact_url("http://minio:pw@minio_1:9000/x") == f"http://minio:{MASK}@minio_1:9000/x"
    assert redact_url("minio:p@ss@127.0.0.1:1") == f"minio:{MASK}@127.0.0.1:1"
    assert redact_url("http://127.0.0.1:9000") == "http://127.0.0.1:9000"
    assert redact_url("http://u:pw@h:9000/x?next=http://y") == f"http://u:{MASK}@h:9000/x?next=http://y"


def test_secret_named_job_variables_are_masked_and_other_names_kept():
    spec = {
        "resources": {"job_variables": {"env": {"HF_TOKEN": "hf_x", "OMP_NUM_THREADS": "2", "DB_PASSWORD": "p"}}},
        "inputs": {"tokenizer": {"s3_uri": "s3://b/tok/"}},
        "hyperparameters": {"max_tokens": 512, "author_id": 3},
    }
    redacted = redact_spec(spec)
    assert redacted["resources"]["job_variables"]["env"] == {
        "HF_TOKEN": MASK,
        "OMP_NUM_THREADS": "2",
        "DB_PASSWORD": MASK,
    }
    # names outside the job variables are the spec's own fields and the user's settings: lineage keeps them
    assert redacted["inputs"] == spec["inputs"] and redacted["hyperparameters"] == spec["hyperparameters"]
    assert spec["resources"]["job_variables"]["env"]["HF_TOKEN"] == "hf_x"  # a copy
    names = ["AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY", "GOOGLE_APPLICATION_CREDENTIALS", "github-token", "AUTHOR"]
    assert [bool(SECRET_NAME.search(n)) for n in names] == [True, True, True, True, False]


def test_secrets_in_the_job_spec_never_reach_the_registry(tracking, tmp_path):
    job, model, x = trained()
    job = job.model_copy(
        update={
            "resources": job.resources.model_copy(
                update={"job_variables": {"env": {"WANDB_API_KEY": "wandb-s3cret", "OMP_NUM_THREADS": "3"}}}
            )
        }
    )
    register(job, model, x, "job-1", 0.9, tmp_path)
    client = mlflow.MlflowClient(tracking)
    version = client.get_model_version("reg-test", "1")
    recorded = json.dumps(version.tags) + version.description
    spec_file = mlflow.artifacts.download_artifacts(
        run_id=version.run_id, artifact_path="job_spec.json", dst_path=str(tmp_path)
    )
    spec = Path(spec_file).read_text()
    assert "wandb-s3cret" not in recorded + spec
    assert json.loads(spec)["resources"]["job_variables"]["env"]["OMP_NUM_THREADS"] == "3"


def test_the_summary_names_the_tracking_server_without_its_password(tracking, tmp_path):
    job, model, x = trained()
    register(job, model, x, "job-1", 0.9, tmp_path)
    version = mlflow.MlflowClient(tracking).get_model_version("reg-test", "1")
    summary = registry.model_summary(None, "reg-test", version, "https://alice:pw123@mlflow.example/")
    assert summary["tracking_uri"] == f"https://alice:{MASK}@mlflow.example/"


@pytest.mark.parametrize("answered", [set(), {"127.0.0.1:9"}])  # never yet (told at once), or before (a blip)
def test_an_s3_error_quoting_the_endpoint_masks_its_password(monkeypatch, answered):
    monkeypatch.setattr(s3, "_answered_hosts", answered)
    error = s3.describe_error(EndpointConnectionError(endpoint_url="http://key:SECRETPW@127.0.0.1:9/b"), "s3://b/k")
    assert "SECRETPW" not in str(error) and "127.0.0.1:9" in str(error) and error.transient is bool(answered)


@pytest.mark.parametrize("endpoint", ["http://minio:SECRETPW@minio_1:9000", "minio:SECRETPW@127.0.0.1:1"])
def test_an_endpoint_botocore_refuses_is_named_without_its_password(monkeypatch, endpoint):
    monkeypatch.setattr(s3, "_clients", {})
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with pytest.raises(StorageError, match="AWS_ENDPOINT_URL_S3") as caught:
        s3.client()  # botocore: ValueError("Invalid endpoint: <the URL>")
    assert "SECRETPW" not in str(caught.value) and f":{MASK}@" in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__context__ is None  # no chained traceback quotes it


def test_another_settings_error_is_not_called_the_endpoints(monkeypatch):
    monkeypatch.setattr(s3, "_clients", {})
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu west 1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with pytest.raises(ValueError, match="region") as caught:
        s3.client()
    assert not isinstance(caught.value, StorageError)


def test_arrow_takes_the_endpoints_host_without_its_userinfo(monkeypatch):
    from trainyard import streaming

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://key:SECRETPW@127.0.0.1:9/")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    settings = streaming.arrow_filesystem().__reduce__()[1][0]  # pyarrow exposes its settings only so
    assert settings["endpoint_override"] == "127.0.0.1:9"


def test_a_bugs_exception_is_masked_in_place_with_its_chain_and_traceback_kept():
    import traceback

    from tasks._metering import stage_meter
    from tests.conftest import job_dict
    from trainyard.spec import parse_job

    job = parse_job(job_dict({"train": "s3://bkt/t/", "validation": "s3://bkt/v/", "output": "s3://bkt/o/"}))

    password = "hunter" + "2"  # not in the traceback's source lines either

    def fails():
        try:
            raise ConnectionError(111, f"cannot reach http://minio:{password}@10.0.0.1:9000/")
        except ConnectionError as exc:
            raise ValueError(f"retry of http://u:{password}@h/ failed", 3) from exc

    with pytest.raises(ValueError) as raised, stage_meter("staging", job):
        fails()
    shown = "".join(traceback.format_exception(raised.value))
    assert password not in shown and shown.count(MASK) == 2, shown
    assert raised.value.args[1] == 3 and raised.value.__cause__.errno == 111  # what is not text is left alone
    assert "in fails" in shown  # the traceback is the bug's own


def test_tokens_in_urls_query_parameters_and_connection_strings_are_masked_and_plain_text_kept():
    github = "ghp_" + "a1B2c3D4e5F6g7H8i9J0"
    assert redact_text(f"cloning https://{github}@github.com/org/repo") == f"cloning https://{MASK}@github.com/org/repo"
    assert redact_text("https://alice@github.com/org/repo") == "https://alice@github.com/org/repo"  # a user name
    presigned = "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA1&X-Amz-Signature=abc123&partNumber=2"
    assert redact_text(presigned) == (
        f"https://b.s3.amazonaws.com/k?X-Amz-Credential={MASK}&X-Amz-Signature={MASK}&partNumber=2"
    )
    azure = "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=Zm9vYmFy==;EndpointSuffix=core.windows.net"
    assert redact_text(azure) == (
        f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={MASK};EndpointSuffix=core.windows.net"
    )
    assert (
        redact_text("postgres://db/x?sslmode=require&password=hunter2")
        == f"postgres://db/x?sslmode=require&password={MASK}"
    )
    for plain in ("max_tokens=512 tokenizer=bpe", "s3://bucket/tokens/part-0.parquet", "val_loss=0.25"):
        assert redact_text(plain) == plain
    names = ["PGPASSWORD", "SENTRY_DSN", "AZURE_STORAGE_CONNECTION_STRING", "MYSQL_PWD", "PASSWORD_LENGTH_MIN"]
    assert [bool(SECRET_NAME.search(n)) for n in names] == [True, True, True, True, True]
    assert not any(SECRET_NAME.search(n) for n in ("OMP_NUM_THREADS", "AUTHOR", "DSNX", "tokenizer"))


def test_exceptions_whose_messages_come_from_elsewhere_than_their_text_args_are_masked_too():
    import subprocess
    import traceback
    import urllib.error

    from trainyard.redaction import redact_exception

    secret = "hunter" + "3"
    failed = subprocess.CalledProcessError(1, ["git", "clone", f"https://u:{secret}@git.example/r"])
    http = urllib.error.HTTPError(f"https://u:{secret}@api.example/x", 401, "denied", {}, None)
    nested = KeyError(("http://a:" + secret + "@h/", 3))
    noted = ValueError("plain")
    noted.add_note(f"while reading http://u:{secret}@h/")
    group = ExceptionGroup("several", [failed, http, nested, noted])
    shown = "".join(traceback.format_exception(redact_exception(group)))
    assert secret not in shown and shown.count(MASK) == 3, shown  # the command, the key, the note
    assert http.url == f"https://u:{MASK}@api.example/x"  # not in its message, but in what a handler logs
    assert nested.args[0][1] == 3 and failed.returncode == 1  # what is not text is left alone


def test_the_groups_plan_holds_no_secret_named_job_variable_and_a_new_home_is_its_owners(tmp_path, monkeypatch):
    from tests.conftest import job_dict
    from trainyard.home import home
    from trainyard.spec import TrainingJob, parse_job
    from trainyard.training.plan import TrainingPlan

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "new-home"))
    assert (home().stat().st_mode & 0o777) == 0o700  # job specs, data and the embedded stores: not other users'
    spec = job_dict({"train": "s3://bkt/t/", "validation": "s3://bkt/v/", "output": "s3://bkt/o/"})
    spec["resources"] = {"work_pool": "gpu", "job_variables": {"env": {"DB_PASSWORD": "pw-7", "OMP_NUM_THREADS": "2"}}}
    job = parse_job(spec).model_dump(mode="json")
    TrainingPlan("j", job, "train.npz", None, {}, 1, "127.0.0.1:1").write(tmp_path)
    written = (tmp_path / "plan.json").read_text()
    assert "pw-7" not in written  # a shared TRAINYARD_HOME volume shows it to every job on it
    read = TrainingJob.model_validate(TrainingPlan.read(tmp_path).job)  # what a group parses
    assert read.resources.job_variables["env"] == {"DB_PASSWORD": MASK, "OMP_NUM_THREADS": "2"}


def test_a_hyperparameter_named_as_a_secret_is_warned_of():
    from tests.conftest import job_dict
    from trainyard.spec import ignored_settings, parse_job

    spec = job_dict({"train": "s3://bkt/t/", "validation": "s3://bkt/v/", "output": "s3://bkt/o/"})
    spec["algorithm"] = {"entrypoint": "pkg.mod:build", "task": "classification"}
    spec["hyperparameters"] |= {"hf_token": "hf_abc", "max_tokens": 512}
    warned = [w for w in ignored_settings(parse_job(spec)) if "secret" in w]
    assert len(warned) == 1 and warned[0].startswith("hyperparameters.hf_token: named as a secret")
