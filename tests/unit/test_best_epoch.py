"""``stopping.restore_best``: the model a job keeps is its best epoch's, not its last's, and everything that
describes the model (the summary's metrics, the version's, the end table) says that epoch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.jobs import make_job, run
from tests.unit.models import trained
from trainyard import registry, status
from trainyard.cli import print_summary
from trainyard.errors import SpecError
from trainyard.spec import parse_job
from trainyard.training import supervisor
from trainyard.training.epochs import evaluate
from trainyard.training.trainer import load_arrays


def _validation_against_training(folder) -> None:
    """Validation labels flipped: the better the groups learn the training rows, the worse the validation
    loss, so the first epoch is the best and every later one is worse."""
    data = np.load(folder / "data" / "validation.npz")
    np.savez(folder / "data" / "validation.npz", x=data["x"], y=1 - data["y"])


def _val_loss_of(outcome, job, plan) -> float:
    model = supervisor.load_model(outcome, job, plan)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    return evaluate(model, loss_fn, *load_arrays(plan.validation_data), "classification")["val_loss"]


def test_a_job_with_patience_keeps_its_best_epochs_parameters_not_its_last(trainyard_home):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        hyperparameters={"epochs": 10, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
        stopping={"patience_epochs": 2},
    )
    _validation_against_training(folder)
    outcome, _ = run(job, job_id, folder, plan)
    losses = [e["val_loss"] for e in outcome.history]
    best = 1 + int(np.argmin(losses))
    assert outcome.stop_reason == "NoImprovement" and best < len(losses)  # the case: the best is not the last
    assert outcome.best_epoch == outcome.restored_epoch == best
    # both groups kept the best epoch's parameters; the model is one of those copies
    assert len(list(folder.glob(f"replicas/*/attempt-0/best-epoch-{best}.pt"))) == 2
    assert _val_loss_of(outcome, job, plan) == pytest.approx(losses[best - 1], rel=1e-5)
    assert status.final_metrics(outcome.history, outcome.restored_epoch)["val_loss"] == losses[best - 1]


def test_without_restore_best_the_model_is_the_last_epochs(trainyard_home):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        hyperparameters={"epochs": 3, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
        stopping={"patience_epochs": 5, "restore_best": False},
        resources={"replicas": 1},
    )
    _validation_against_training(folder)
    outcome, _ = run(job, job_id, folder, plan)
    assert outcome.best_epoch == 1 and outcome.restored_epoch is None
    assert not list(folder.glob("replicas/*/attempt-*/best-epoch-*.pt"))  # nothing kept that is not used
    assert _val_loss_of(outcome, job, plan) == pytest.approx(outcome.history[-1]["val_loss"], rel=1e-5)


def test_a_stop_mid_epoch_after_the_best_epoch_keeps_the_best_epochs_parameters(trainyard_home):
    # the best epoch is the last whole one, and the stop came mid-way through the next: the model had trained past it
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:stop_at_step_build"},
        hyperparameters={"epochs": 10, "batch_size": 64, "learning_rate": 0.01, "stop_at_step": 14},
        stopping={"patience_epochs": 5},
        resources={"replicas": 1},
    )
    _validation_against_training(folder)
    outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Stopped" and len(outcome.history) == 1 and outcome.steps > 10  # (10 an epoch)
    assert outcome.best_epoch == outcome.restored_epoch == 1  # was: the model of step 16, described as epoch 1's
    kept = torch.load(outcome.model_path, weights_only=True)
    (saved,) = folder.glob("replicas/0/attempt-0/best-epoch-1.pt")
    assert all(torch.equal(kept[k], v) for k, v in torch.load(saved, weights_only=True).items())


def _spec(**stopping) -> dict:
    return {
        "name": "best",
        "algorithm": {"builtin": "mlp-classifier"},
        "inputs": {"train": {"s3_uri": "s3://bkt/t/", "label": "y"}},
        "output": {"s3_uri": "s3://bkt/o/"},
        "stopping": stopping,
    }


def test_restore_best_is_on_with_patience_by_default_and_needs_validation():
    with_validation = _spec(patience_epochs=2) | {
        "inputs": {
            "train": {"s3_uri": "s3://bkt/t/", "label": "y"},
            "validation": {"s3_uri": "s3://bkt/v/", "label": "y"},
        }
    }
    assert parse_job(with_validation).stopping.restores_best
    assert not parse_job(_spec()).stopping.restores_best
    with pytest.raises(SpecError, match=r"stopping.restore_best: .*add inputs.validation"):
        parse_job(_spec(restore_best=True))
    # watching train_loss (one group: each group's own), patience and the best epoch need no validation channel
    target = {"name": "train_loss", "value": 0.01}
    on_training = _spec(target_metric=target, patience_epochs=3, restore_best=True) | {"resources": {"replicas": 1}}
    assert parse_job(on_training).stopping.restores_best
    with pytest.raises(SpecError, match=r"stopping.patience_epochs: needs a validation channel"):
        parse_job(_spec(patience_epochs=3) | {"resources": {"replicas": 1}})  # (watching val_loss)


HISTORY = [
    {"epoch": 1, "train_loss": 0.7, "val_loss": 0.30, "val_accuracy": 0.90, "kept_fraction": 0.5},
    {"epoch": 2, "train_loss": 0.5, "val_loss": 0.35, "val_accuracy": 0.88, "kept_fraction": 0.4},
    {"epoch": 3, "train_loss": 0.4, "val_loss": 0.40, "val_accuracy": 0.86, "kept_fraction": 0.3},
]


def test_the_summary_and_end_table_give_the_restored_epochs_metrics(capsys):
    metrics = status.final_metrics(HISTORY, 1)
    assert metrics == {"train_loss": 0.7, "val_loss": 0.30, "val_accuracy": 0.90, "kept_fraction": 0.5, "epochs": 3}
    assert status.final_metrics(HISTORY)["val_accuracy"] == 0.86
    summary = {"job_id": "j", "status": "Completed", "metrics": metrics, "training": {"restored_epoch": 1}}
    print_summary(summary)
    table = capsys.readouterr().out
    assert "kept_fraction (epoch 1)" in table and "(last epoch)" not in table
    assert "model from epoch" in table and "1 (the best)" in table


def test_a_restored_versions_final_metrics_are_its_epochs_and_every_epoch_is_logged(tracking):
    import mlflow

    job, model, x = trained()
    info = registry.register(model, job, "job-best", x[:5], HISTORY, {}, {}, {}, model_epoch=1)
    client = mlflow.MlflowClient(tracking)
    version = client.get_model_version(job.model_name, info["version"])
    assert version.tags["metrics.val_accuracy"] == "0.9" and version.tags["metrics.val_loss"] == "0.3"
    logged = client.get_metric_history(version.run_id, "val_accuracy")
    assert [(m.step, m.value) for m in logged] == [(1, 0.90), (2, 0.88), (3, 0.86)]


def test_the_curves_mark_the_epoch_the_model_is_from():
    from trainyard.plots import history_figure

    def marks(fig) -> list[str]:
        return [line.get_label() for ax in fig.axes for line in ax.get_lines() if line.get_label().startswith("model")]

    assert marks(history_figure(HISTORY, "j", 1)) == ["model: epoch 1 (best)"] * 2  # the loss and metric panels
    assert marks(history_figure(HISTORY, "j")) == []


def test_the_epoch_that_reaches_the_target_is_the_best_one_kept():
    from trainyard.training.epochs import History, end_epoch

    job = parse_job(
        _spec(patience_epochs=3, target_metric={"name": "val_accuracy", "value": 0.95})
        | {
            "inputs": {
                "train": {"s3_uri": "s3://bkt/t/", "label": "y"},
                "validation": {"s3_uri": "s3://bkt/v/", "label": "y"},
            }
        }
    )
    history = History()
    for epoch, accuracy in enumerate((0.90, 0.93, 0.96), start=1):
        end_epoch(history, epoch, {"val_accuracy": accuracy, "val_loss": 1 - accuracy}, job, 0.0)
    assert (history.stop_reason, history.best_epoch, history.best) == ("TargetMetricReached", 3, 0.96)
