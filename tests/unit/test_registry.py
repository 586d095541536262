"""Registration in a real MLflow store (SQLite): any batch size, exactly once per job, the champion gate,
the model card (``trainyard models`` is ``test_models_cli.py``)."""

from __future__ import annotations

import json

import mlflow
import numpy as np
import pytest
import torch

from tests.unit.models import register, trained
from trainyard import model_card, promotion, registry, registry_admin
from trainyard.promotion import decide
from trainyard.spec import PromoteIf, parse_job


def test_each_epochs_metrics_are_logged_sifting_s_among_them(tracking, tmp_path):
    job, model, x = trained()
    history = [
        {"epoch": 1, "train_loss": 0.5, "val_accuracy": 0.8, "kept_fraction": None, "group_train_flops": 9.0},
        {"epoch": 2, "train_loss": 0.6, "candidate_loss": 0.4, "val_accuracy": 0.9, "kept_fraction": 0.5}
        | {"mean_keep_probability": 0.45, "pruned_fraction": 0.3},
    ]
    info = registry.register(model, job, "job-m", x[:5], history, {}, {}, {})
    client = mlflow.MlflowClient(tracking)
    run_id = client.get_model_version(job.model_name, info["version"]).run_id
    logged = {
        k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)]
        for k in client.get_run(run_id).data.metrics
    }
    assert logged == {
        "train_loss": [(1, 0.5), (2, 0.6)],
        "val_accuracy": [(1, 0.8), (2, 0.9)],
        "candidate_loss": [(2, 0.4)],
        "kept_fraction": [(2, 0.5)],
        "mean_keep_probability": [(2, 0.45)],
        "pruned_fraction": [(2, 0.3)],
    }


def test_registered_model_predicts_on_any_batch_size(tracking, tmp_path):
    job, model, x = trained()
    info = register(job, model, x, "job-1", 0.9, tmp_path)
    assert info["version"] == 1 and info["aliases"] == ["champion"]
    assert info["approval_status"] == "PendingManualApproval"
    loaded = mlflow.pyfunc.load_model(info["uri"])
    for n in (1, 7, 300):
        got = loaded.predict(x[:n])
        want = model(torch.from_numpy(x[:n])).detach().numpy()
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    version = mlflow.MlflowClient(tracking).get_model_version("reg-test", "1")
    assert version.tags["trainyard.job_id"] == "job-1"
    assert version.tags["data.train.manifest_digest"] == "d"


def test_registering_the_same_job_twice_makes_one_version(tracking, tmp_path):
    job, model, x = trained()
    first = register(job, model, x, "job-7", 0.9, tmp_path)
    again = register(job, model, x, "job-7", 0.9, tmp_path)
    assert again["version"] == first["version"]
    assert len(mlflow.MlflowClient(tracking).search_model_versions("name='reg-test'")) == 1


def test_champion_moves_only_to_a_better_model(tracking, tmp_path):
    job, model, x = trained()
    assert register(job, model, x, "a", 0.80, tmp_path)["aliases"] == ["champion"]
    assert register(job, model, x, "b", 0.70, tmp_path)["aliases"] == ["candidate"]
    assert register(job, model, x, "c", 0.85, tmp_path)["aliases"] == ["champion"]
    client = mlflow.MlflowClient(tracking)
    assert int(client.get_model_version_by_alias("reg-test", "champion").version) == 3


def test_a_rejected_champion_is_no_bar_to_the_next_version(tracking, tmp_path):
    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    registry_admin.set_approval("reg-test", "1", "Rejected")  # a person found it unfit, good metric or not
    second = register(job, model, x, "b", 0.70, tmp_path)
    assert second["aliases"] == ["champion"] and second["gate"] == "champion: the champion v1 was Rejected"
    # in its place, a version the gate keeps out for itself (a diverged metric) still stays out
    registry_admin.set_approval("reg-test", "2", "Rejected")
    third = register(job, model, x, "c", float("nan"), tmp_path)
    assert third["aliases"] == ["candidate"] and "did training diverge?" in third["gate"]


def test_a_champion_whose_run_is_gone_and_lacks_its_metric_tag_is_beaten_not_a_failed_job(tracking, tmp_path):
    job, model, x = trained()
    first = register(job, model, x, "a", 0.9, tmp_path)
    client = mlflow.MlflowClient(tracking)
    client.delete_model_version_tag("reg-test", first["version"], "metrics.val_accuracy")
    client.delete_run(first["run_id"])
    client._tracking_client.store._hard_delete_run(first["run_id"])  # what `mlflow gc` does
    second = register(job, model, x, "b", 0.95, tmp_path)
    assert second["aliases"] == ["champion"] and "the champion has no val_accuracy" in second["gate"]


def test_a_job_whose_experiment_was_deleted_in_mlflow_restores_it_and_registers(tracking, tmp_path, caplog):
    job, model, x = trained()
    register(job, model, x, "a", 0.8, tmp_path)
    client = mlflow.MlflowClient(tracking)
    experiment = client.get_experiment_by_name("reg-test")
    client.delete_experiment(experiment.experiment_id)  # a tidy of the MLflow UI: every later job failed at the end
    second = register(job, model, x, "b", 0.9, tmp_path)
    assert second["aliases"] == ["champion"] and "was deleted; restoring it" in caplog.text
    assert client.get_experiment(experiment.experiment_id).lifecycle_stage == "active"


def test_a_diverged_jobs_version_does_not_hold_champion_against_later_ones(tracking, tmp_path):
    job, model, x = trained()
    assert register(job, model, x, "a", float("nan"), tmp_path)["aliases"] == ["candidate"]
    assert register(job, model, x, "b", 0.7, tmp_path)["aliases"] == ["champion"]


def test_a_gates_direction_is_its_metrics_and_a_contrary_one_is_refused():
    from trainyard.errors import SpecError

    assert PromoteIf(metric="val_loss").direction == "min" and PromoteIf(metric="val_accuracy").direction == "max"
    assert not decide(PromoteIf(metric="val_loss"), 0.95, 0.20, has_champion=True, emissions_kg=None).wins
    job, _, _ = trained()
    spec = job.model_dump(mode="json")
    for gate, problem in (
        ({"metric": "val_loss", "mode": "max"}, "registry.promote_if: mode max would promote a worse model"),
        ({"metric": "val_acuracy"}, "registry.promote_if.metric: unknown metric 'val_acuracy'"),
        ({"metric": "val_rmse"}, "registry.promote_if.metric: val_rmse is for regression; use val_accuracy"),
    ):
        with pytest.raises(SpecError, match=problem.replace("(", r"\(")):
            parse_job(spec | {"registry": {"promote_if": gate}})
    no_validation = spec | {"inputs": {"train": spec["inputs"]["train"]}, "registry": {"promote_if": {}}}
    with pytest.raises(SpecError, match="val_accuracy needs a validation channel"):
        parse_job(no_validation)
    # the default metric is the task's: a regression job's gate compares val_rmse, smaller winning
    regression = parse_job(spec | {"algorithm": {"builtin": "linear-regression"}, "registry": {"promote_if": {}}})
    assert (regression.gate.metric, regression.gate.direction) == ("val_rmse", "min")
    # a mode against the default metric's direction is refused as one against a named metric is (it was ignored)
    with pytest.raises(
        SpecError, match="registry.promote_if.mode: max would promote a worse model: the gate compares val_rmse"
    ):
        parse_job(spec | {"algorithm": {"builtin": "linear-regression"}, "registry": {"promote_if": {"mode": "max"}}})
    # the built-in regression's loss is over each job's own label spread: versions' losses do not compare
    for metric in ("val_loss", "train_loss"):
        with pytest.raises(SpecError, match=f"registry.promote_if.metric: {metric} of the built-in linear-regression"):
            parse_job(
                spec | {"algorithm": {"builtin": "linear-regression"}, "registry": {"promote_if": {"metric": metric}}}
            )
    classifier = parse_job(spec | {"registry": {"promote_if": {"metric": "val_loss"}}})  # a classifier's: comparable
    assert classifier.gate.metric == "val_loss"


def test_model_card_has_data_metrics_carbon_and_lineage():
    job, _, _ = trained()
    tags = {
        "data.train.uri": "s3://b/train/",
        "data.train.manifest_digest": "sha256:abc",
        "carbon.emissions_kg": "0.0012",
        "carbon.energy_kwh": "0.004",
        "compute.flops_total": "123",
        "prefect.flow_run_id": "f-1",
        "sifting.filtered_manifest_digest": "sha256:def",
        **model_card.lineage_tags(job, {"val_accuracy": 0.91}),
    }
    card = model_card.render("reg-test", "job-1", tags)
    for expected in ("## Data", "s3://b/train/", "sha256:abc", "sha256:def", "| val_accuracy | 0.91 |", "0.0012"):
        assert expected in card
    assert "f-1" in card
    assert "## Job spec" in card
    assert tags[model_card.CODE_VERSION_TAG].startswith(("git:", "trainyard=="))


def test_version_has_lineage_card_and_a_gate_decision(tracking, tmp_path):
    job, model, x = trained()
    info = register(job, model, x, "job-1", 0.9, tmp_path)
    assert info["gate"] == "champion: no champion yet"
    version = mlflow.MlflowClient(tracking).get_model_version("reg-test", "1")
    assert version.tags["metrics.val_accuracy"] == "0.9"
    assert json.loads(version.tags["trainyard.job_spec"])["name"] == "reg-test"
    assert version.description.startswith("# reg-test") and "| train | `?` | `d` |" in version.description


def test_a_crash_after_the_version_is_made_is_finished_by_the_retry(tracking, tmp_path, monkeypatch):
    job, model, x = trained()
    real_gate = promotion.gate

    def crash(*args, **kwargs):
        raise registry.RegistryUnavailable("the process died here")

    monkeypatch.setattr(promotion, "gate", crash)
    with pytest.raises(registry.RegistryUnavailable):
        register(job, model, x, "job-9", 0.9, tmp_path)
    monkeypatch.setattr(promotion, "gate", real_gate)
    info = register(job, model, x, "job-9", 0.9, tmp_path)
    assert info["version"] == 1 and info["aliases"] == ["champion"]
    assert len(mlflow.MlflowClient(tracking).search_model_versions("name='reg-test'")) == 1


def test_a_crash_after_the_model_is_logged_leaves_no_second_model_or_live_run_after_the_retry(
    tracking, tmp_path, monkeypatch
):
    job, model, x = trained()
    real_check = registry._check_artifacts

    def crash(*args):  # the model is logged; the process dies before the version is made
        raise SystemExit("killed")

    monkeypatch.setattr(registry, "_check_artifacts", crash)
    with pytest.raises(SystemExit):
        register(job, model, x, "job-8", 0.9, tmp_path)
    monkeypatch.setattr(registry, "_check_artifacts", real_check)
    info = register(job, model, x, "job-8", 0.9, tmp_path)
    client = mlflow.MlflowClient(tracking)
    experiment = client.get_run(info["run_id"]).info.experiment_id
    assert [m.source_run_id for m in client.search_logged_models([experiment])] == [info["run_id"]]
    killed = client.search_runs([experiment], run_view_type=mlflow.entities.ViewType.DELETED_ONLY)
    assert [r.info.status for r in killed] == ["KILLED"]


def test_the_live_run_is_in_the_jobs_experiment_with_the_registered_versions_run(tracking):
    from trainyard.live_metrics import LiveRun

    job, _, _ = trained()
    job = job.model_copy(update={"registry": job.registry.model_copy(update={"model_name": "nightly-reg"})})
    live = LiveRun(job, "job-1")
    live.close()
    client = mlflow.MlflowClient(tracking)
    assert client.get_experiment(client.get_run(live.run_id).info.experiment_id).name == job.name == "reg-test"


def test_the_versions_carbon_figures_become_the_jobs_final_ones(tracking, tmp_path):
    job, model, x = trained()
    info = register(job, model, x, "job-1", 0.9, tmp_path)
    client = mlflow.MlflowClient(tracking)
    client.set_model_version_tag("reg-test", "1", "carbon.emissions_kg", "0.002")  # what the gate saw
    summary = {"job_id": "job-1", "model": info, "carbon": {"energy_kwh": 0.0125, "emissions_kg": 0.0031}}
    registry.log_summary(info["run_id"], summary)
    version = client.get_model_version("reg-test", "1")
    assert version.tags["carbon.energy_kwh"] == "0.0125" and version.tags["carbon.emissions_kg"] == "0.0031"
    assert version.tags["carbon.emissions_kg_at_gate"] == "0.002"
    assert "| emissions (kgCO2e) | 0.0031 |" in version.description
    assert client.get_run(info["run_id"]).data.tags["carbon.emissions_kg"] == "0.0031"


def test_a_version_not_yet_gated_takes_the_final_carbon_and_no_figure_as_judged_at_its_gate(tracking, tmp_path):
    # a job that ended inside its registration: its gate runs later (models gate, a rerun) on the final figure
    job, model, x = trained()
    info = register(job, model, x, "job-1", 0.9, tmp_path)
    client = mlflow.MlflowClient(tracking)
    client.set_model_version_tag("reg-test", "1", "carbon.emissions_kg", "0.002")  # registration's figure
    client.delete_model_version_tag("reg-test", "1", promotion.GATE_TAG)  # ended before its gate
    summary = {"job_id": "job-1", "model": info, "carbon": {"energy_kwh": 0.0125, "emissions_kg": 0.0031}}
    registry.log_summary(info["run_id"], summary)
    tags = client.get_model_version("reg-test", "1").tags
    assert tags["carbon.emissions_kg"] == "0.0031" and "carbon.emissions_kg_at_gate" not in tags


def test_a_process_killed_while_it_gives_the_version_its_final_carbon_keeps_the_gates_figure(
    tracking, tmp_path, monkeypatch
):
    job, model, x = trained()
    info = register(job, model, x, "job-1", 0.9, tmp_path)
    client = mlflow.MlflowClient(tracking)
    client.set_model_version_tag("reg-test", "1", "carbon.emissions_kg", "0.002")  # what the gate saw
    summary = {"job_id": "job-1", "model": info, "carbon": {"energy_kwh": 0.0125, "emissions_kg": 0.0031}}
    real, calls = mlflow.MlflowClient.set_model_version_tag, []

    def killed_after_two(self, *args):  # the process dies after two of the version's tags
        if len(calls) == 2:
            raise SystemExit("killed")
        calls.append(args)
        return real(self, *args)

    monkeypatch.setattr(mlflow.MlflowClient, "set_model_version_tag", killed_after_two)
    with pytest.raises(SystemExit):
        registry.log_summary(info["run_id"], summary)
    monkeypatch.setattr(mlflow.MlflowClient, "set_model_version_tag", real)
    registry.log_summary(info["run_id"], summary)  # the rerun's
    tags = client.get_model_version("reg-test", "1").tags
    assert tags["carbon.emissions_kg_at_gate"] == "0.002" and tags["carbon.emissions_kg"] == "0.0031"


def test_a_version_an_earlier_gate_made_candidate_is_not_left_candidate_when_it_wins(tracking, tmp_path):
    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)  # champion
    register(job, model, x, "b", 0.70, tmp_path)  # loses: candidate
    client = mlflow.MlflowClient(tracking)
    # b's gate ran, killed before its tag; meanwhile the champion went (deleted by an operator)
    client.delete_model_version_tag("reg-test", "2", promotion.GATE_TAG)
    client.delete_model_version("reg-test", "1")
    assert register(job, model, x, "b", 0.70, tmp_path)["aliases"] == ["champion"]  # the rerun's gate: it wins
    assert "candidate" not in client.get_registered_model("reg-test").aliases


def test_a_gate_whose_champion_another_gate_moved_meanwhile_judges_again(tracking, tmp_path, monkeypatch):
    job, model, x = trained()
    register(job, model, x, "a", 0.60, tmp_path)  # champion
    register(job, model, x, "b", 0.70, tmp_path)  # beats a: champion
    client = mlflow.MlflowClient(tracking)
    client.set_registered_model_alias("reg-test", "champion", "1")  # as if b's gate had read a and not written yet
    moved = []
    real = mlflow.MlflowClient.set_registered_model_alias

    def interleaved(self, name, alias, version):  # b's late write lands right after c's
        real(self, name, alias, version)
        if alias == "champion" and str(version) == "3" and not moved:
            moved.append(True)
            real(self, name, "champion", "2")

    monkeypatch.setattr(mlflow.MlflowClient, "set_registered_model_alias", interleaved)
    register(job, model, x, "c", 0.90, tmp_path)  # best: must end champion, whatever b wrote meanwhile
    assert moved and str(client.get_model_version_by_alias("reg-test", "champion").version) == "3"
