"""``trainyard models``: listing, showing, approving, rejecting and promoting versions in a real MLflow store
(SQLite), and naming a bad or unreachable tracking server, or a model name MLflow refuses, without a traceback."""

from __future__ import annotations

import os
import re

import mlflow
import pytest
from typer.testing import CliRunner

from tests.unit.models import register, trained
from trainyard import registry_admin
from trainyard.cli import app


def test_a_model_name_mlflow_refuses_is_the_commands_mistake(tracking):
    # "a/b" can name no model: said as not found (exit 2), where it read as the service refusing (exit 1)
    from typer.testing import CliRunner

    from trainyard.cli import app

    for command in (["models", "show", "a/b", "1"], ["models", "list", "a/b"], ["models", "approve", "a/b", "1"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        assert "a/b" in result.output and "no such registered model" in result.output


def test_models_cli_lists_shows_approves_rejects_and_promotes(tracking, tmp_path):
    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    register(job, model, x, "b", 0.70, tmp_path)
    runner = CliRunner()
    listed = runner.invoke(app, ["models", "list"])
    assert listed.exit_code == 0 and "reg-test" in listed.output and "candidate" in listed.output
    assert "val_accuracy 0.8" in listed.output and "val_accuracy 0.7" in listed.output  # each version's, to compare
    assert [r["metrics"] for r in registry_admin.list_versions("reg-test")] == [
        {"train_loss": "0.5", "val_accuracy": "0.7"},
        {"train_loss": "0.5", "val_accuracy": "0.8"},
    ]
    shown = runner.invoke(app, ["models", "show", "reg-test", "candidate"])
    assert shown.exit_code == 0 and "trainyard.job_id" in shown.output and "## Metrics" in shown.output
    assert runner.invoke(app, ["models", "approve", "reg-test", "2"]).exit_code == 0
    assert runner.invoke(app, ["models", "promote", "reg-test", "2"]).exit_code == 0
    client = mlflow.MlflowClient(tracking)
    champion = client.get_model_version_by_alias("reg-test", "champion")
    assert str(champion.version) == "2" and champion.tags["approval_status"] == "Approved"
    # the gate's own decision stays on record beside the hand's
    assert champion.tags["trainyard.gate"].startswith("champion: promoted by hand (the gate had said: candidate: ")
    assert runner.invoke(app, ["models", "reject", "reg-test", "1"]).exit_code == 0
    assert client.get_model_version("reg-test", "1").tags["approval_status"] == "Rejected"
    refused = runner.invoke(app, ["models", "promote", "reg-test", "1"])
    assert refused.exit_code == 2 and "Rejected" in refused.output
    for args in (["show", "reg-test", "9"], ["approve", "nope", "1"], ["list", "nope"], ["promote", "reg-test", "x"]):
        result = runner.invoke(app, ["models", *args])
        assert result.exit_code == 2, (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit)
        assert "Traceback" not in result.output
    assert "approval" in runner.invoke(app, ["models", "--help"]).output


def test_models_list_shows_each_versions_aliases(tracking, tmp_path):
    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    register(job, model, x, "b", 0.70, tmp_path)  # worse: candidate
    rows = {r["version"]: r["aliases"] for r in registry_admin.list_versions("reg-test")}
    assert rows == {1: ["champion"], 2: ["candidate"]}
    listed = CliRunner().invoke(app, ["models", "list"], env={"COLUMNS": "80"})
    assert "champion" in listed.output and "candidate" in listed.output
    # at 80 columns a long value wraps in its cell, whole, rather than end in an ellipsis
    assert "…" not in listed.output and "PendingManualApproval" in "".join(
        line.split("│")[4].strip() for line in listed.output.splitlines() if line.count("│") == 8
    ), listed.output


def test_models_show_draws_the_card_on_a_terminal(tracking, tmp_path, monkeypatch):
    from rich.console import Console

    from trainyard import cli_models

    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    monkeypatch.setattr(cli_models, "out", lambda: Console(force_terminal=True, color_system=None, width=120))
    shown = CliRunner().invoke(app, ["models", "show", "reg-test", "1"])
    # headings and tables drawn, not their Markdown (which a pipe still gets: the test above)
    assert shown.exit_code == 0 and "## Metrics" not in shown.output and "| metric |" not in shown.output
    assert "Metrics" in shown.output and re.search(r"val_accuracy\s+│\s+0\.8", shown.output), shown.output


@pytest.mark.parametrize(
    ("uri", "says"),
    [("mlflow.internal:5000", "was refused"), ("http://127.0.0.1:9", "is unavailable")],
)
def test_models_commands_name_a_bad_or_unreachable_tracking_server_without_a_traceback(monkeypatch, uri, says):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    for args in (["list"], ["show", "m", "1"]):
        result = CliRunner().invoke(app, ["models", *args])
        assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
        flat = " ".join(result.output.split())
        assert says in flat and "half-made" not in flat and "Traceback" not in flat, flat


def test_an_unreachable_server_is_named_in_seconds_and_mistakes_exit_2(monkeypatch, tracking):

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    assert CliRunner().invoke(app, ["models", "list"]).exit_code == 0
    # MLflow's defaults (7 retries, backing off) kept a person waiting 4 minutes for "unavailable"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
    os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    os.environ.pop("MLFLOW_HTTP_REQUEST_TIMEOUT")
    huge = CliRunner().invoke(app, ["models", "approve", "reg-test", "99999999999999999999"])
    assert huge.exit_code == 2 and "no such registered model version" in huge.output, huge.output
    not_s3 = CliRunner().invoke(app, ["report", "carbon", "/tmp/out"])
    assert not_s3.exit_code == 2 and "OUTPUT_URI: '/tmp/out' is not an S3 URI" in not_s3.output, not_s3.output


def test_models_list_on_an_embedded_store_nothing_registered_to_names_it_and_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "elsewhere"))  # another home than the jobs'
    listed = CliRunner().invoke(app, ["models", "list"])
    assert listed.exit_code == 0 and "no registered models in sqlite:///" in listed.stdout, listed.output
    assert "elsewhere/mlflow.db" in " ".join(listed.stdout.split())
    unknown = CliRunner().invoke(app, ["models", "list", "churn"])
    assert unknown.exit_code == 2 and "churn: no such registered model" in unknown.output, unknown.output
    # nor by the commands on one version (they made the store outside the lock a job starting at once takes)
    for command in ("show", "approve", "reject", "promote", "gate"):
        result = CliRunner().invoke(app, ["models", command, "churn", "1"])
        assert result.exit_code == 2 and "churn version 1: no such registered model" in result.output, result.output
    assert not (tmp_path / "elsewhere" / "mlflow.db").exists()
