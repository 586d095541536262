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
