"""The built-in models' fixed input (and a regression's target) scaling, from the training channel's moments."""

from __future__ import annotations

import numpy as np

from trainyard import algorithms
from trainyard.spec import Algorithm, Hyperparameters


def test_the_scaling_of_a_channel_past_float32s_running_total_is_right():
    # numpy sums a float32 column row after row in float32: past 2**24 rows of ones the total stops growing, and a
    # column of all ones read a mean of 0.99 (a 60% indicator over 40M rows, 0.42), into the registered model
    rows = (1 << 24) + (1 << 22)
    x = np.zeros((rows, 2), dtype=np.float32)
    x[:, 0] = 1.0
    x[::2, 1] = 2.0
    mean, std = algorithms.column_moments(x)
    np.testing.assert_allclose(mean, [1.0, 1.0], rtol=1e-9)
    np.testing.assert_allclose(std, [0.0, 1.0], rtol=1e-9)
    model, _ = algorithms.build(
        Algorithm(builtin="mlp-classifier"), Hyperparameters(hidden_sizes=[4]), x, np.zeros(rows, np.int64), 2
    )
    scaling = model[0]
    assert scaling.shift.dtype.is_floating_point and scaling.shift.tolist() == [1.0, 1.0]


def test_a_regressions_target_is_scaled_by_its_own_moments():
    x = np.random.default_rng(0).normal(size=(500, 3)).astype(np.float32)
    y = (10 + 4 * np.random.default_rng(1).normal(size=500)).astype(np.float32)
    model, _ = algorithms.build(Algorithm(builtin="linear-regression"), Hyperparameters(), x, y, 1)
    target = model[-1]
    assert target.shift.item() == np.float32(y.astype(np.float64).mean())
    assert abs(target.scale.item() - y.astype(np.float64).std()) < 1e-5
