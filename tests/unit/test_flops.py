"""FLOP counting: exact per batch size, without a counted probe pass for every size once the model's
cost is known to be linear in it."""

from __future__ import annotations

import numpy as np
import torch

from trainyard import algorithms
from trainyard.spec import Algorithm, Hyperparameters
from trainyard.training.flops import CostBySize, FlopMeter


def test_a_linear_cost_is_computed_after_three_sizes_and_a_nonlinear_one_is_always_measured():
    linear, calls = CostBySize(), []
    for n in (32, 7, 100, 5, 64, 250, 1):
        assert linear(n, lambda n=n: calls.append(n) or (3 + 10 * n, 20 * n)) == (3 + 10 * n, 20 * n)
    assert calls == [32, 7, 100] and linear.measured == 3
    quadratic = CostBySize()
    for n in (32, 7, 100, 5, 64):
        assert quadratic(n, lambda n=n: (n * n,)) == (n * n,)
    assert quadratic.measured == 5
    # whole FLOPs only: a line with a fractional slope is not extrapolated where it gives a fraction
    halves = CostBySize()
    for n in (2, 4, 6):
        halves(n, lambda n=n: (n // 2,))
    assert halves(8, lambda: (99,)) == (4,) and halves(7, lambda: (3,)) == (3,) and halves.measured == 4


def test_the_meter_counts_every_size_exactly_as_measuring_each_would():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 12)).astype(np.float32)
    y = rng.integers(0, 3, 300)
    model, loss_fn = algorithms.build(
        Algorithm(builtin="mlp-classifier"), Hyperparameters(hidden_sizes=[16, 8]), x, y, 3
    )
    meter = FlopMeter(model, loss_fn)
    sizes = [int(n) for n in rng.integers(1, 300, 40)]
    for n in sizes:
        meter.add_scoring(torch.from_numpy(x[:n]))
        meter.add_train_step(torch.from_numpy(x[:n]), torch.from_numpy(y[:n]))
    assert meter.measurements == 6  # three sizes each for the no-grad pass and the training step
    fresh = FlopMeter(model, loss_fn)
    for n in sizes:  # a meter per size measures every one
        one = FlopMeter(model, loss_fn)
        one.add_scoring(torch.from_numpy(x[:n]))
        one.add_train_step(torch.from_numpy(x[:n]), torch.from_numpy(y[:n]))
        fresh.scoring += one.scoring
        fresh.forward += one.forward
        fresh.backward += one.backward
    assert (meter.scoring, meter.forward, meter.backward) == (fresh.scoring, fresh.forward, fresh.backward)


def test_a_batch_norm_model_is_metered_on_one_row_batches():
    # a validation set with one row over EVAL_BATCH, or one candidate to score: the probe stays in train mode
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    meter = FlopMeter(model, algorithms.per_sample_cross_entropy)
    one = torch.zeros(1, 3)
    meter.add_train_step(one, torch.zeros(1, dtype=torch.long))
    meter.add_evaluation(one)
    meter.add_scoring(one)
    assert meter.forward > 0 and meter.evaluation > 0 and meter.scoring > 0
    assert model[1].training  # left as it was
