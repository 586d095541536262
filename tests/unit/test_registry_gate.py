"""A version that missed its promotion gate (its job failed, or gave up waiting for the gate, after registering
it): what the failure says, ``trainyard models gate``, a version rejected meanwhile; the card without the state
that changes by hand; the embedded store created under a lock."""

from __future__ import annotations

import mlflow
import pytest
from typer.testing import CliRunner

from tests.unit.models import register, trained
from trainyard import model_card, promotion, registry, registry_admin, tracking_store
from trainyard.cli import app
from trainyard.home import Locked, flocked


@pytest.fixture
def gate_fails(monkeypatch):
    """Call it, and ``promotion.gate`` fails as an unreachable MLflow does until the test calls what it returns."""
    real = promotion.gate

    def unavailable(*args, **kwargs):
        raise OSError("simulated: the tracking server went away during the gate")

    def fail():
        monkeypatch.setattr(promotion, "gate", unavailable)
        return lambda: monkeypatch.setattr(promotion, "gate", real)

    return fail


def test_a_failure_after_the_version_is_made_names_it_and_models_gate_finishes_it(tracking, tmp_path, gate_fails):
    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)  # v1: champion
    heal = gate_fails()
    with pytest.raises(registry.RegistryUnavailable) as failed:
        register(job, model, x, "b", 0.90, tmp_path)
    message = str(failed.value)
    assert "Version 2 of 'reg-test' is registered" in message and "trainyard models gate reg-test 2" in message
    assert "No version was left half-made" not in message  # (what it said: there was one, ungated)
    heal()
    result = CliRunner().invoke(app, ["models", "gate", "reg-test", "2"])
    assert result.exit_code == 0, result.output
    assert "val_accuracy 0.9 beats the champion's 0.8" in result.output
    client = mlflow.MlflowClient(tracking)
    assert int(client.get_model_version_by_alias("reg-test", "champion").version) == 2
    # judged once: a second gate is refused, saying what the first decided
    again = CliRunner().invoke(app, ["models", "gate", "reg-test", "2"])
    assert again.exit_code == 1 and "has been through the gate: champion: val_accuracy" in again.output


def test_a_failure_before_any_version_still_says_none_was_left(tracking, tmp_path, monkeypatch):
    job, model, x = trained()

    def unavailable(*args, **kwargs):
        raise OSError("simulated: the tracking server went away while logging the model")

    monkeypatch.setattr(registry, "_create_version", unavailable)
    with pytest.raises(registry.RegistryUnavailable, match="No version was left half-made"):
        register(job, model, x, "a", 0.80, tmp_path)


def test_a_failure_looking_the_new_version_up_names_it_as_made(tracking, tmp_path, monkeypatch):
    # the version made, then the look-up that checks it is the job's only one fails: it is there, and ungated
    job, model, x = trained()
    real, looks = registry._one_version_of_job, []

    def second_fails(*args):
        looks.append(args)
        if len(looks) == 2:
            raise OSError("simulated: the tracking server went away after the version was made")
        return real(*args)

    monkeypatch.setattr(registry, "_one_version_of_job", second_fails)
    with pytest.raises(registry.RegistryUnavailable) as failed:
        register(job, model, x, "a", 0.80, tmp_path)
    assert "Version 1 of 'reg-test' is registered" in str(failed.value)
    assert "No version was left half-made" not in str(failed.value)


def test_a_version_rejected_before_its_gate_ran_takes_no_alias(tracking, tmp_path, gate_fails):
    job, model, x = trained()
    heal = gate_fails()
    with pytest.raises(registry.RegistryUnavailable):
        register(job, model, x, "a", 0.99, tmp_path)  # v1, the first: the gate would make it champion
    heal()
    registry_admin.set_approval("reg-test", "1", "Rejected")  # a reviewer saw it in `models list` first
    info = registry_admin.gate("reg-test", "1")
    assert info["aliases"] == [] and info["gate"].startswith("not judged: the version was Rejected")
    # nor does the job's own rerun (a Prefect retry of the job id) promote it
    rerun = register(job, model, x, "a", 0.99, tmp_path)
    assert rerun["aliases"] == [] and rerun["gate"].startswith("not judged")


def test_a_version_without_a_job_spec_has_no_gate_to_run(tracking, tmp_path):
    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    client = mlflow.MlflowClient(tracking)
    client.delete_model_version_tag("reg-test", "1", promotion.GATE_TAG)
    client.delete_model_version_tag("reg-test", "1", model_card.JOB_SPEC_TAG)
    result = CliRunner().invoke(app, ["models", "gate", "reg-test", "1"])
    assert result.exit_code == 1 and "no trainyard.job_spec tag" in result.output
    assert "Traceback" not in result.output


def test_the_card_leaves_the_approval_and_the_gate_to_the_versions_tags(tracking, tmp_path):
    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    result = CliRunner().invoke(app, ["models", "approve", "reg-test", "1", "--reason", "passed the bias review"])
    assert result.exit_code == 0, result.output
    info = registry_admin.describe("reg-test", "1")
    assert info["tags"]["approval_status"] == "Approved"
    # who, when and why, as SageMaker keeps ModifiedBy, the time and ApprovalDescription
    assert info["tags"]["approval_status.reason"] == "passed the bias review" and info["tags"]["approval_status.by"]
    assert info["tags"]["approval_status.at"].endswith("+00:00")
    registry_admin.set_approval("reg-test", "1", "Rejected")  # a later decision without a reason: none shown
    assert registry_admin.describe("reg-test", "1")["tags"]["approval_status.reason"] == ""
    # the card was written at registration: it does not say PendingManualApproval beside an Approved tag
    card = registry_admin.describe("reg-test", "1")["card"]
    assert "approval_status" not in card and "trainyard.gate" not in card
    assert "## Lineage" in card and "trainyard.job_id" in card


def test_a_reason_with_brackets_is_shown_as_written_not_read_as_markup(tracking, tmp_path):
    # rich read table cells as markup: "[/docs]" raised MarkupError (a traceback), "[leak]" vanished
    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    reason = "[leak] label leak, see [/docs] for why"
    assert CliRunner().invoke(app, ["models", "reject", "reg-test", "1", "--reason", reason]).exit_code == 0
    for command in (["models", "show", "reg-test", "1"], ["models", "list"]):
        result = CliRunner().invoke(app, command, env={"COLUMNS": "400"})
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output
    assert reason in CliRunner().invoke(app, ["models", "show", "reg-test", "1"], env={"COLUMNS": "400"}).output


def test_the_embedded_store_is_created_under_a_lock(trainyard_home, monkeypatch):
    """Two jobs starting at once on a fresh home both ran MLflow's migrations into one file: one failed, and a
    store could be left half migrated. Its creation (MLflow's first request) now holds a lock of the home."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRAINYARD_HOME", str(trainyard_home / "fresh-home"))
    lock = registry.home() / "locks" / "mlflow-store.lock"
    held = []

    class Probe(mlflow.MlflowClient):
        def search_experiments(self, *args, **kwargs):
            try:  # another open of the lock file: refused while the store is being made under it
                with flocked(lock, wait_seconds=0):
                    held.append(False)
            except Locked:
                held.append(True)
            return super().search_experiments(*args, **kwargs)

    monkeypatch.setattr(mlflow, "MlflowClient", Probe)
    tracking_store.ensure_store()
    assert held == [True] and tracking_store.embedded_store().exists()
    # a store elsewhere (MLFLOW_TRACKING_URI) is not this home's to lock: a server migrates its own
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{trainyard_home / 'fresh-home' / 'other.db'}")
    tracking_store.ensure_store()
    assert held == [True, False]


@pytest.mark.parametrize(
    "error",
    [
        "alembic CommandError: Online migration expected to match one row when updating ...; 0 found",
        "sqlalchemy OperationalError: table _alembic_tmp_experiments already exists",
    ],
)
def test_a_store_left_half_migrated_is_named_with_what_to_do_not_reported_as_a_bug(error):
    from alembic.util.exc import CommandError
    from sqlalchemy.exc import OperationalError

    from trainyard.registry_errors import translate

    exc = CommandError(error) if "CommandError" in error else OperationalError(error, None, Exception(error))
    message = str(translate(exc, "checking the tracking store", "sqlite:////home/x/mlflow.db", registering=False))
    assert "left part-way through a schema migration" in message and "move it aside" in message
    assert "unavailable" not in message  # (not a service to wait for: retrying finds it the same)


def test_an_entrypoints_source_is_in_the_lineage_by_its_digest():
    import hashlib
    from pathlib import Path

    from tests.unit.specs import minimal
    from trainyard.spec import parse_job

    job = parse_job(minimal(algorithm={"entrypoint": "tests.unit.jobs:slow_build"}))
    source = Path(__file__).parent / "jobs.py"
    tags = model_card.lineage_tags(job, {})
    assert tags[model_card.ENTRYPOINT_TAG] == f"sha256:{hashlib.sha256(source.read_bytes()).hexdigest()}"
    assert model_card.entrypoint_digest("no_such_package.models:build") == "unknown"
    built_in = parse_job(minimal())
    assert model_card.ENTRYPOINT_TAG not in model_card.lineage_tags(built_in, {})  # its code is Trainyard's own


def test_a_gate_that_could_not_be_had_names_the_version_and_its_command(tracking, tmp_path):
    from contextlib import contextmanager

    from trainyard.errors import RegistryError

    @contextmanager
    def held_elsewhere(name):
        raise RegistryError(f"the promotion gate of {name!r} stayed held by another job of this machine")
        yield

    job, model, x = trained()
    history = [{"epoch": 1, "train_loss": 0.5, "val_accuracy": 0.9}]
    with pytest.raises(RegistryError) as failed:
        registry.register(model, job, "job-held", x[:5], history, {}, {}, {}, held_elsewhere)
    assert str(failed.value).endswith("; it is version 1: `trainyard models gate reg-test 1` gates it")
    assert registry_admin.gate("reg-test", "1")["aliases"] == ["champion"]  # what it says to do, done


def test_a_live_run_an_earlier_run_of_the_job_id_left_running_is_closed_by_the_rerun(tracking):
    """A pipeline killed outright (SIGKILL) mid-training left ``<job id>-live`` RUNNING for good, and its rerun
    added a second one beside it."""
    from trainyard.live_metrics import LiveRun

    job, _, _ = trained()
    killed = LiveRun(job, "job-k")  # ...and the process dies: never closed
    other = LiveRun(job, "job-other")  # another job's, running: not this job's to close
    rerun = LiveRun(job, "job-k")
    client = mlflow.MlflowClient(tracking)
    assert client.get_run(killed.run_id).info.status == "KILLED"
    assert client.get_run(other.run_id).info.status == "RUNNING"
    assert client.get_run(rerun.run_id).info.status == "RUNNING"


def test_a_jobs_live_run_ends_as_its_training_did():
    # it always ended FINISHED: a stopped, diverged or failed job's live run read in MLflow as a finished one
    from types import SimpleNamespace

    from trainyard.live_metrics import live_status

    reasons = ("Completed", "Diverged", "Stopped")
    ended = {reason: live_status(SimpleNamespace(stop_reason=reason)) for reason in reasons}
    assert ended == {"Completed": "FINISHED", "Diverged": "FAILED", "Stopped": "KILLED"}
    assert live_status(SimpleNamespace(stop_reason="CarbonBudgetExceeded")) == "KILLED"
    assert live_status(SimpleNamespace(stop_reason="TargetMetricReached")) == "FINISHED"  # the job Completed
    assert live_status(None) == "FAILED"  # the training stage raised
