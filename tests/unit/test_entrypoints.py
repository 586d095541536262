"""Your own model in training (``algorithm.entrypoint``), with real replica group processes: a per-sample loss
is required, an entrypoint trains, a BatchNorm model gets through a one-row step, extra channels reach it as
folders, and a model whose output training cannot read is refused before anything starts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.unit.jobs import make_job, run
from trainyard.errors import TrainingError
from trainyard.training import preflight


def mean_loss_build(num_features, num_outputs, hyperparameters):
    """An entrypoint whose loss wrongly reduces over the batch."""
    model = torch.nn.Linear(num_features, num_outputs)
    return model, lambda out, y: torch.nn.functional.cross_entropy(out, y)


def test_mean_reduced_loss_is_rejected_before_training(trainyard_home):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.test_entrypoints:mean_loss_build"},
        resources={"replicas": 1},
    )
    with pytest.raises(TrainingError, match=r"one loss per sample \(use reduction='none'\)"):
        run(job, job_id, folder, plan)


def test_a_per_sample_loss_with_a_trailing_dimension_is_told_how_to_reduce_it():
    from trainyard.algorithms import check_per_sample

    trailing = r"shape \(4, 1\) .* must return shape \(4,\), .*reshape\(len\(loss\), -1\)"
    with pytest.raises(TrainingError, match=trailing):
        check_per_sample(torch.zeros(4, 1), 4)
    with pytest.raises(TrainingError, match=r"shape \(\) .*\(use reduction='none'\)"):
        check_per_sample(torch.zeros(()), 4)
    check_per_sample(torch.zeros(4), 4)


def test_a_one_row_batchs_scalar_loss_is_its_one_loss_per_sample():
    # a per-sample loss ending in .squeeze() gives () for one row (a short last step, one group's share of a
    # step, a single candidate to score): the job failed there, told to use reduction='none', which it did
    from trainyard.algorithms import check_per_sample

    def squeezed(outputs, labels):
        return torch.nn.functional.mse_loss(outputs, labels.unsqueeze(1), reduction="none").squeeze()

    assert check_per_sample(squeezed(torch.zeros(4, 1), torch.ones(4)), 4).shape == (4,)
    one = check_per_sample(squeezed(torch.zeros(1, 1), torch.ones(1)), 1)
    assert one.shape == (1,) and one.tolist() == [1.0]
    with pytest.raises(TrainingError, match=r"shape \(\) for a batch of 2"):  # a mean over two rows still refused
        check_per_sample(torch.zeros(()), 2)


def test_a_loss_broadcast_to_every_output_against_every_label_is_not_told_to_average_it():
    from trainyard.algorithms import check_per_sample

    outputs, labels = torch.zeros(4, 1), torch.ones(4)
    broadcast = r"shape \(4, 4\) .*broadcast to \(N, N\).*squeeze\(-1\)"
    with pytest.raises(TrainingError, match=broadcast) as error:
        check_per_sample((outputs - labels) ** 2, 4)
    # told what broadcasting did before being told to average: an (N, N) loss trains on every label for each output
    assert str(error.value).index("squeeze") < str(error.value).index("mean(1)")


def per_sample_build(num_features, num_outputs, hyperparameters):
    """A user's entrypoint: a linear classifier with a per-sample loss."""
    model = torch.nn.Linear(num_features, num_outputs)
    return model, lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none")


def test_entrypoint_algorithm_trains(trainyard_home):
    job, *rest = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.test_entrypoints:per_sample_build"},
        resources={"replicas": 1},
    )
    outcome, _ = run(job, *rest)
    assert outcome.stop_reason == "Completed"
    assert outcome.history[-1]["val_accuracy"] > 0.7  # learning: chance is 0.5
    assert outcome.history[-1]["train_loss"] < outcome.history[0]["train_loss"]


def batch_norm_build(num_features, num_outputs, hyperparameters):
    """An entrypoint with a BatchNorm layer, which cannot train on batch statistics of one row."""
    model = torch.nn.Sequential(
        torch.nn.Linear(num_features, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, num_outputs)
    )
    return model, lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none")


def test_a_batch_norm_model_trains_through_a_one_row_step(trainyard_home):
    job, *rest = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.test_entrypoints:batch_norm_build"},
        hyperparameters={"epochs": 2, "batch_size": 599, "learning_rate": 0.05},  # 600 rows: 599, then 1
        resources={"replicas": 1},
    )
    outcome, _ = run(job, *rest)
    assert outcome.stop_reason == "Completed"
    assert outcome.samples_trained == 1200  # the one-row steps' rows were trained on


def channel_reading_build(num_features, num_outputs, hyperparameters):
    """An entrypoint that reads its width from a raw channel, as SageMaker scripts read SM_CHANNEL_*."""
    from pathlib import Path

    config = json.loads((Path(os.environ["TRAINYARD_CHANNEL_CONFIG"]) / "model.json").read_text())
    assert os.environ["SM_CHANNEL_CONFIG"] == os.environ["TRAINYARD_CHANNEL_CONFIG"]  # SageMaker's name too
    model = torch.nn.Sequential(
        torch.nn.Linear(num_features, config["width"]), torch.nn.ReLU(), torch.nn.Linear(config["width"], num_outputs)
    )
    return model, lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none")


def test_extra_channels_reach_the_entrypoint_as_folders(trainyard_home, tmp_path):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.test_entrypoints:channel_reading_build"},
        resources={"replicas": 1},
    )
    (tmp_path / "model.json").write_text('{"width": 7}')
    plan.extra_channels = {"config": str(tmp_path)}
    outcome, _ = run(job, job_id, folder, plan)
    assert torch.load(outcome.model_path, weights_only=True)["0.weight"].shape == (7, 4)


def test_the_early_algorithm_check_sees_the_extra_channels_and_names_a_failing_entrypoint(
    trainyard_home, tmp_path, monkeypatch
):

    monkeypatch.delenv("TRAINYARD_CHANNEL_CONFIG", raising=False)
    monkeypatch.delenv("SM_CHANNEL_CONFIG", raising=False)
    job, _, _, plan = make_job(
        trainyard_home, algorithm={"entrypoint": "tests.unit.test_entrypoints:channel_reading_build"}
    )
    with pytest.raises(
        TrainingError, match="algorithm.entrypoint tests.unit.test_entrypoints:channel_reading_build: failed"
    ):
        preflight.check_algorithm(job, plan.train_data, 2)  # no channel: the entrypoint's own KeyError, named
    (tmp_path / "model.json").write_text('{"width": 7}')
    preflight.check_algorithm(job, plan.train_data, 2, {"config": str(tmp_path)})  # the flow passes them: builds


class TupleOut(torch.nn.Linear):
    def forward(self, x):
        out = super().forward(x)
        return out, out.detach()


def tuple_output_build(num_features, num_outputs, hyperparameters):
    """A model returning (logits, features), which training would only trip on late."""
    return TupleOut(num_features, num_outputs), lambda out, y: torch.nn.functional.cross_entropy(
        out[0], y, reduction="none"
    )


def one_column_build(num_features, num_outputs, hyperparameters):
    """A 'classifier' with one output whatever the class count."""
    return torch.nn.Linear(num_features, 1), lambda out, y: (out[:, 0] - y) ** 2


@pytest.mark.parametrize(
    ("build", "says"),
    [
        ("tuple_output_build", r"the model returned a tuple; forward\(\) must return one tensor"),
        ("one_column_build", r"returned shape \(4, 1\) for a batch of 4; a classification model must return \(4, 2\)"),
    ],
)
def test_a_model_whose_output_training_cannot_read_is_refused_early(trainyard_home, build, says):

    job, _, _, plan = make_job(trainyard_home, algorithm={"entrypoint": f"tests.unit.test_entrypoints:{build}"})
    with pytest.raises(TrainingError, match=says):
        preflight.check_algorithm(job, plan.train_data, 2)
