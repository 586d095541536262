"""Validation metrics as an entrypoint's model shapes its outputs."""

from __future__ import annotations

import pytest
import torch

from trainyard.training.epochs import evaluate


class Offset(torch.nn.Module):
    """Predicts the label's feature plus ``offset``, as a column: (N, 1) for (N,) labels."""

    def __init__(self, offset: float):
        super().__init__()
        self.offset = torch.nn.Parameter(torch.tensor(offset))

    def forward(self, x):
        return x[:, :1] + self.offset


def per_row_mse(out, y):
    return (out.reshape(y.shape) - y) ** 2


@pytest.mark.parametrize("offset", [0.0, 1.5])
def test_rmse_of_a_column_output_is_against_its_own_row(offset):
    y = torch.linspace(-10, 10, 50)
    x = y.unsqueeze(1).repeat(1, 3)
    metrics = evaluate(Offset(offset), per_row_mse, x, y, "regression")
    assert metrics["val_rmse"] == pytest.approx(offset, abs=1e-5)
    assert metrics["val_loss"] == pytest.approx(offset**2, abs=1e-4)
