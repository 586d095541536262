"""``stopping.validate_every_epochs``: a job validates at every that many epochs' end and at its last (every epoch
by default). The target and patience are judged at validated epochs, patience still in epochs, and what describes
the model says which validation its metrics are from; two groups with a heal between validations agree."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rejoined, slow_while
from tests.unit.jobs import make_job, run
from tests.unit.test_best_epoch import _val_loss_of, _validation_against_training
from tests.unit.test_group_agreement import _results
from trainyard import status
from trainyard.errors import SpecError
from trainyard.plots import history_figure
from trainyard.spec import parse_job
from trainyard.training.drills import DRILL_FILE
from trainyard.training.epochs import History, end_epoch, validates
from trainyard.training.plan import attempt_dir


def _job(stopping: dict | None = None, sifting: dict | None = None, **more):
    return parse_job(
        more
        | {
            "name": "cadence",
            "algorithm": {"builtin": "mlp-classifier"},
            "inputs": {
                "train": {"s3_uri": "s3://bkt/t/", "label": "y"},
                "validation": {"s3_uri": "s3://bkt/v/", "label": "y"},
            },
            "output": {"s3_uri": "s3://bkt/o/"},
            "stopping": stopping or {},
            "sifting": sifting or {},
        }
    )


def _validated(job) -> list[int]:
    return [epoch for epoch in range(1, job.hyperparameters.epochs + 1) if validates(job, epoch)]


def test_by_default_every_epoch_validates_even_with_sifting():
    # measured (stop 52): validating sifting's epochs only once per unfiltered epoch's steps read the digits proxy
    # arm's target later, 0.63x the baseline's FLOPs against 0.58x, and saved no wall time
    job = _job(sifting={"enabled": True, "beta": 3.0}, hyperparameters={"epochs": 4})
    assert _validated(job) == [1, 2, 3, 4]


def test_a_cadence_validates_its_multiples_and_always_the_last_epoch():
    assert _validated(_job({"validate_every_epochs": 4}, hyperparameters={"epochs": 10})) == [4, 8, 10]
    assert _validated(_job({"validate_every_epochs": 3}, hyperparameters={"epochs": 9})) == [3, 6, 9]
    assert _validated(_job({"validate_every_epochs": 20}, hyperparameters={"epochs": 5})) == [5]


def test_a_cadence_below_one_is_refused_naming_the_field():
    with pytest.raises(SpecError, match="stopping.validate_every_epochs"):
        _job({"validate_every_epochs": 0})


def _end(history, job, epoch, accuracy=None):
    metrics = {"train_loss": 1.0 / epoch}
    if accuracy is not None:
        metrics |= {"val_accuracy": accuracy, "val_loss": 1 - accuracy}
    end_epoch(history, epoch, metrics, job, 0.0)


def test_patience_counts_epochs_between_validations():
    job = _job({"patience_epochs": 3, "validate_every_epochs": 4})
    history = History()
    for epoch in range(1, 5):
        _end(history, job, epoch, 0.9 if epoch == 4 else None)
    assert (history.best_epoch, history.epochs_since_best, history.stop_reason) == (4, 0, None)
    for epoch in range(5, 8):  # not validated: patience waits for a validation
        _end(history, job, epoch)
    assert (history.epochs_since_best, history.stop_reason) == (0, None)
    _end(history, job, 8, 0.85)  # no better, four epochs after the best: past a patience of three
    assert (history.best_epoch, history.epochs_since_best, history.stop_reason) == (4, 4, "NoImprovement")

    patient = _job({"patience_epochs": 5, "validate_every_epochs": 4})
    history = History()
    for epoch, accuracy in ((1, None), (2, None), (3, None), (4, 0.9), (5, None), (6, None), (7, None), (8, 0.85)):
        _end(history, patient, epoch, accuracy)
    assert (history.epochs_since_best, history.stop_reason) == (4, None)


def test_patience_in_epochs_is_as_before_when_every_epoch_validates():
    job = _job({"patience_epochs": 2})
    history = History()
    for epoch, accuracy in enumerate((0.9, 0.8, 0.85), start=1):
        _end(history, job, epoch, accuracy)
    assert (history.best_epoch, history.epochs_since_best, history.stop_reason) == (1, 2, "NoImprovement")


def test_a_cadence_without_a_validation_channel_is_warned_about():
    from trainyard.spec import ignored_settings

    job = _job({"validate_every_epochs": 2})
    assert not any("validate_every_epochs" in w for w in ignored_settings(job))
    alone = parse_job(job.model_dump(mode="json") | {"inputs": {"train": {"s3_uri": "s3://bkt/t/", "label": "y"}}})
    (warning,) = [w for w in ignored_settings(alone) if "validate_every_epochs" in w]
    assert "no validation channel" in warning and "inputs.validation" in warning


HISTORY = [
    {"epoch": 1, "train_loss": 0.9, "kept_fraction": 0.25},
    {"epoch": 2, "train_loss": 0.7, "val_loss": 0.30, "val_accuracy": 0.90, "kept_fraction": 0.25},
    {"epoch": 3, "train_loss": 0.5, "kept_fraction": 0.25},
]


def test_a_model_from_between_validations_reports_the_last_validation_and_its_epoch():
    metrics = status.final_metrics(HISTORY)
    assert metrics["train_loss"] == 0.5 and metrics["epochs"] == 3  # the model's epoch's own
    assert (metrics["val_accuracy"], metrics["val_loss"], metrics["validated_epoch"]) == (0.90, 0.30, 2)
    assert "validated_epoch" not in status.final_metrics(HISTORY, 2)  # its own epoch was validated
    assert "val_loss" not in status.final_metrics(HISTORY[:1])  # nothing validated yet: nothing said
    assert status.final_metrics([]) == {"epochs": 0}  # no epoch ended: it was {}, without the epochs README promises


def test_progress_shows_an_unvalidated_epoch_with_the_last_validation_and_its_epoch():
    # what the train task logs and sends in its progress event at each epoch
    shown = status.with_last_validation(HISTORY[2], HISTORY[1])
    assert (shown["epoch"], shown["train_loss"], shown["val_accuracy"], shown["validated_epoch"]) == (3, 0.5, 0.90, 2)
    assert status.with_last_validation(HISTORY[1], HISTORY[1]) == HISTORY[1]  # a validated epoch: its own
    assert status.with_last_validation(HISTORY[0], None) == HISTORY[0]  # nothing validated yet


def test_the_curves_draw_the_validated_epochs_as_one_line():
    fig = history_figure(HISTORY + [HISTORY[1] | {"epoch": 4, "val_accuracy": 0.92}], "j")
    (accuracy,) = [line for line in fig.axes[1].get_lines() if line.get_label() == "val_accuracy"]
    assert list(accuracy.get_xdata()) == [2, 4] and list(accuracy.get_ydata()) == [0.90, 0.92]


def test_a_job_validates_at_its_cadence_and_at_its_last_epoch(trainyard_home):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        hyperparameters={"epochs": 6, "batch_size": 16, "learning_rate": 0.01, "hidden_sizes": [16]},
        sifting={"enabled": True, "beta": 3.0, "score": "proxy", "selection": "top"},
        stopping={"validate_every_epochs": 4},
        resources={"replicas": 1},
    )
    outcome, _ = run(job, job_id, folder, plan)
    validated = [e["epoch"] for e in outcome.history if "val_accuracy" in e]
    assert [e["epoch"] for e in outcome.history] == [1, 2, 3, 4, 5, 6]
    assert validated == [4, 6]
    assert all("kept_fraction" in e and "train_loss" in e for e in outcome.history)  # every epoch's own figures
    assert outcome.flops["evaluation"] == 2 * _validation_flops(job, plan)  # two validations' worth, no more


def test_an_epoch_a_train_loss_target_stops_at_is_validated_between_validations(trainyard_home):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        hyperparameters={"epochs": 8, "batch_size": 16, "learning_rate": 0.01, "hidden_sizes": [16]},
        stopping={"validate_every_epochs": 4, "target_metric": {"name": "train_loss", "value": 100.0}},
        resources={"replicas": 1},
    )
    outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "TargetMetricReached" and len(outcome.history) == 1  # reached at epoch 1
    assert "val_accuracy" in outcome.history[0]  # what the model is registered by: its own, not none
    assert "validated_epoch" not in status.final_metrics(outcome.history)


def _validation_flops(job, plan) -> int:
    """One validation's FLOPs: the job's model over the validation rows, counted as the groups count it."""
    import numpy as np

    from trainyard import algorithms
    from trainyard.training.flops import FlopMeter

    x, y = (np.load(plan.validation_data)[k] for k in ("x", "y"))
    model, loss_fn = algorithms.build(job.algorithm, job.hyperparameters, x, y, 2)
    meter = FlopMeter(model, loss_fn)
    meter.add_evaluation(torch.from_numpy(x))
    return meter.evaluation


def test_two_groups_with_a_heal_between_validations_stop_together_and_keep_the_best_validated_epoch(
    trainyard_home, tmp_path
):
    folders: list = []

    def slow() -> bool:  # group 0's steps, from group 1's kill until its restart is back: it heals before the end
        killed = (attempt_dir(folders[0], 1, 0) / DRILL_FILE).exists()
        return killed and not rejoined(attempt_dir(folders[0], 1, 1))

    with slow_while(tmp_path / "slow", slow) as hold:
        job, job_id, folder, plan = make_job(
            trainyard_home,
            algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
            # 38 steps an epoch, 0.3 s each while slow: the 72 from the kill to epoch 4's end give the restart 21 s
            hyperparameters={
                "epochs": 10,
                "batch_size": 16,
                "learning_rate": 0.05,
                "step_sleep": 0.3,
                "slow_while": hold,
            },
            stopping={"patience_epochs": 2, "validate_every_epochs": 2},
            elastic={"fault_injection": [{"replica": 1, "at_step": 80, "kind": "kill"}]},  # early in epoch 3
        )
        folders.append(folder)
        _validation_against_training(folder)  # the first validation (epoch 2) is the best
        outcome, _ = run(job, job_id, folder, plan)
    steps = [e["steps"] for e in outcome.history]
    assert sum(steps[:2]) < 80 <= sum(steps[:3])  # the kill fell between the validations of epochs 2 and 4
    assert [f["replica"] for f in outcome.failures] == [1] and outcome.recoveries[0]["source"] == "peer"
    # the healed group took the best epoch and patience from its peer: both stopped at epoch 4's validation
    assert [e["epoch"] for e in outcome.history if "val_loss" in e] == [2, 4]
    assert outcome.stop_reason == "NoImprovement" and len(outcome.history) == 4
    assert [(r["stop_reason"], r["best_epoch"]) for r in _results(folder)] == [("NoImprovement", 2)] * 2
    assert outcome.best_epoch == outcome.restored_epoch == 2
    assert _val_loss_of(outcome, job, plan) == pytest.approx(outcome.history[1]["val_loss"], rel=1e-5)
