"""A loss that is no longer a number (NaN or infinite) ends training as Diverged: when it is judged (the shared
validation loss; with one group its train loss too, at every epoch), what the summary says, and real groups
stopping on it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.unit.jobs import make_job, run
from tests.unit.specs import minimal
from trainyard import status
from trainyard.spec import parse_job
from trainyard.training.epochs import diverged


@pytest.mark.parametrize("replicas, validation", [(2, True), (1, False)])
def test_a_loss_that_is_no_longer_a_number_ends_training_as_diverged(trainyard_home, replicas, validation):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        hyperparameters={"epochs": 20, "batch_size": 64, "learning_rate": 10, "optimizer": "sgd"},
        resources={"replicas": replicas},
    )
    if not validation:
        plan.validation_data = None
    outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Diverged" and len(outcome.history) < 20
    loss = outcome.history[-1]["val_loss" if validation else "train_loss"]
    assert not np.isfinite(loss)


def test_a_diverged_job_ends_failed_saying_why_and_its_metrics_are_valid_json():
    history = [
        {"epoch": 1, "train_loss": 0.7, "val_loss": 0.6},
        {"epoch": 2, "train_loss": float("nan"), "val_loss": float("inf")},
    ]
    assert status.primary_status("Diverged") == ("Failed", "Failed")
    reason = status.failure_reason("Diverged", history)
    assert reason.startswith("Diverged: val_loss was inf at the end of epoch 2; lower hyperparameters.learning_rate")
    metrics = status.final_metrics(history)
    assert metrics == {"train_loss": None, "val_loss": None, "epochs": 2}
    json.loads(json.dumps(metrics), parse_constant=lambda c: pytest.fail(f"{c} in the summary"))
    assert status.failure_reason("MaxRuntimeExceeded", history) == "MaxRuntimeExceeded"
    # a train loss that stopped a one-group job between validations (stopping.validate_every_epochs), its epoch then
    # validated all the same: the reason names the loss that is not a number
    history[-1] = {"epoch": 2, "train_loss": float("inf"), "val_loss": 0.41}
    assert status.failure_reason("Diverged", history).startswith("Diverged: train_loss was inf at the end of epoch 2")


def test_one_group_diverges_on_its_train_loss_whether_or_not_the_epoch_was_validated():
    one, two = (parse_job(minimal(resources={"replicas": n})) for n in (1, 2))
    nan = float("nan")
    assert diverged({"train_loss": nan}, one) == "train_loss"
    assert diverged({"train_loss": nan, "val_loss": 0.4}, one) == "train_loss"  # was: judged on val_loss alone
    assert diverged({"train_loss": 0.3, "val_loss": nan}, one) == "val_loss"
    # several groups: each group's train loss is its own, only the shared validation loss is judged
    assert diverged({"train_loss": nan, "val_loss": 0.4}, two) is None
    assert diverged({"train_loss": 0.3, "val_loss": nan}, two) == "val_loss"
