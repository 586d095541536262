"""The optimizer a replica group steps: torch's fused kernel where it has one, the same update rule."""

from __future__ import annotations

import copy

import pytest
import torch

from trainyard.spec import Hyperparameters
from trainyard.training.trainer import _optimizer


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 5) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_a_cpu_model_gets_the_fused_kernel_and_the_same_updates_as_torchs_default(name):
    hp = Hyperparameters(optimizer=name, learning_rate=0.01, weight_decay=0.01)
    fused_model, plain_model = _mlp(), _mlp()
    fused = _optimizer(fused_model, hp)
    assert fused.defaults["fused"] is True
    options = {"lr": 0.01, "weight_decay": 0.01} | ({"momentum": hp.momentum} if name == "sgd" else {})
    plain = type(fused)(plain_model.parameters(), **options)  # torch's default kernel
    assert not plain.defaults.get("fused")

    _steps(fused_model, fused)
    _steps(plain_model, plain)

    moved = [(a - b).abs().max().item() for a, b in zip(fused_model.parameters(), _mlp().parameters(), strict=True)]
    assert min(moved) > 1e-3  # the steps changed every parameter...
    for a, b in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # ...as torch's default rule does, to rounding
    # a healed group loads its peer's optimizer state: the fused one's loads into a fresh fused optimizer
    again = _optimizer(copy.deepcopy(fused_model), hp)
    again.load_state_dict(fused.state_dict())
    assert again.state_dict()["state"].keys() == fused.state_dict()["state"].keys()


class ComplexGain(torch.nn.Module):
    """An MLP whose outputs are scaled by the modulus of a complex parameter: not a floating-point one."""

    def __init__(self):
        super().__init__()
        self.mlp = _mlp()
        self.gain = torch.nn.Parameter(torch.tensor([1.0 + 0.5j]))

    def forward(self, x):
        return self.mlp(x) * self.gain.abs()


def test_a_model_with_a_parameter_the_fused_kernel_cannot_take_gets_torchs_default():
    refused = ComplexGain()
    with pytest.raises(RuntimeError, match="fused"):  # what the fallback is for: torch refuses it at the first step
        _steps(refused, torch.optim.AdamW(refused.parameters(), fused=True), steps=1)
    model = ComplexGain()
    optimizer = _optimizer(model, Hyperparameters())
    assert not optimizer.defaults.get("fused")
    before = model.gain.detach().clone()
    _steps(model, optimizer, steps=1)
    assert not torch.equal(model.gain.detach(), before)  # it steps, the complex parameter too
