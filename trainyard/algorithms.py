"""Models a job can train: the built-ins, or a user's ``pkg.module:build`` entrypoint.

Every algorithm yields a model and a loss function giving one loss per sample (the sifter ranks
samples by it; a mean-reduced loss is rejected). Built-in models carry their input and target
scaling as buffers, so the registered model takes raw features and returns raw predictions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from trainyard.errors import SpecError, TrainingError
from trainyard.spec import Algorithm, Hyperparameters

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


MOMENT_BYTES = 1 << 27  # a chunk's float64 copy (128 MiB): the most the moments add to memory


def column_moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each column's mean and standard deviation, summed in float64 a chunk of rows at a time. numpy sums a
    float32 column (axis 0 of a row-major array) row after row in float32, whose total stops growing near 2**24
    times a row's value: a 0/1 column of 40M rows, 60% ones, read a mean of 0.42 (and float64 all at once
    would double the channel's memory)."""
    rows = max(1, MOMENT_BYTES // (8 * max(x.shape[1], 1)))
    total = np.zeros(x.shape[1], dtype=np.float64)
    for start in range(0, len(x), rows):
        total += x[start : start + rows].sum(axis=0, dtype=np.float64)
    mean = total / max(len(x), 1)
    squares = np.zeros(x.shape[1], dtype=np.float64)
    for start in range(0, len(x), rows):
        deviation = x[start : start + rows].astype(np.float64)  # the one copy, worked on in place
        deviation -= mean
        np.square(deviation, out=deviation)
        squares += deviation.sum(axis=0)
    return mean, np.sqrt(squares / max(len(x), 1))


class Affine(nn.Module):
    """``(x - shift) / scale`` or, with ``inverse``, ``x * scale + shift``; fixed buffers."""

    buffers_fixed = True  # no forward pass changes them: replica groups need not average them (ddp.BufferSync)
    shift: torch.Tensor  # registered buffers: saved with the model, moved with it
    scale: torch.Tensor

    def __init__(self, shift: np.ndarray | float, scale: np.ndarray | float, inverse: bool = False):
        super().__init__()
        self.register_buffer("shift", torch.as_tensor(shift, dtype=torch.float32))
        self.register_buffer("scale", torch.as_tensor(scale, dtype=torch.float32))
        self.inverse = inverse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift if self.inverse else (x - self.shift) / self.scale


class Squeeze(nn.Module):
    """``[n, 1] -> [n]`` for regression outputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0]


def build(
    algorithm: Algorithm,
    hp: Hyperparameters,
    x_train: np.ndarray,
    y_train: np.ndarray,
    num_outputs: int,
) -> tuple[nn.Module, LossFn]:
    """Build the model and its per-sample loss; seeded by ``hp.seed`` so replica groups agree."""
    torch.manual_seed(hp.seed)
    num_features = x_train.shape[1]
    if algorithm.entrypoint is not None:
        return _from_entrypoint(algorithm.entrypoint, num_features, num_outputs, hp)
    mean, std = column_moments(x_train)
    std = np.where(std > 1e-8, std, 1.0)
    if algorithm.builtin == "mlp-classifier":
        layers: list[nn.Module] = [Affine(mean, std)]
        width = num_features
        for hidden in hp.hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_outputs))
        return nn.Sequential(*layers), per_sample_cross_entropy
    y_moments = column_moments(np.asarray(y_train).reshape(-1, 1))
    y_mean, y_std = float(y_moments[0][0]), float(y_moments[1][0]) or 1.0
    model = nn.Sequential(Affine(mean, std), nn.Linear(num_features, 1), Squeeze(), Affine(y_mean, y_std, inverse=True))
    # Train on standardised targets: the loss scale no longer depends on the label's units.
    return model, _scaled_mse(y_std)


def per_sample_cross_entropy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, one value per sample."""
    return F.cross_entropy(outputs, labels, reduction="none")


def _scaled_mse(y_std: float) -> LossFn:
    def loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ((outputs - labels) / y_std) ** 2

    return loss


def check_per_sample(loss: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``loss``, one per sample; fail clearly when a loss function reduces over the batch. A batch of one row's
    loss may be a scalar (a per-sample loss ending in ``.squeeze()``: its mean is its one loss): returned as (1,),
    where a short last step, one group's share of a step or a single candidate to score failed the job."""
    if isinstance(loss, torch.Tensor) and batch_size == 1 and loss.dim() == 0:
        return loss.reshape(1)
    if not isinstance(loss, torch.Tensor):
        raise TrainingError(
            f"algorithm.entrypoint: the loss function returned a {type(loss).__name__}; it must return a tensor "
            "of one loss per sample (use reduction='none')"
        )
    if loss.dim() != 1 or loss.shape[0] != batch_size:
        if loss.dim() == 2 and loss.shape == (batch_size, batch_size) and batch_size > 1:
            # (N, 1) outputs against (N,) labels broadcast to every output against every label: reducing
            # the trailing dimension would train on a wrong loss without a word
            fix = (
                "if the model's outputs are (N, 1) and the labels (N,), they broadcast to (N, N): drop the "
                "outputs' last dimension, e.g. loss_fn(outputs.squeeze(-1), labels); else reduce the trailing "
                "dimension, e.g. loss.mean(1)"
            )
        elif loss.dim() > 1 and loss.shape[0] == batch_size:  # already per sample, with trailing dimensions
            fix = "reduce the trailing dimensions, e.g. loss.reshape(len(loss), -1).mean(1)"
        else:
            fix = "use reduction='none'"
        raise TrainingError(
            f"algorithm.entrypoint: the loss function returned shape {tuple(loss.shape)} for a batch of {batch_size}; "
            f"it must return shape ({batch_size},), one loss per sample ({fix})"
        )
    return loss


def check_outputs(out, batch_size: int, num_outputs: int, task: str) -> None:
    """Fail clearly when a model's output is not what training, validation and the registry read:
    a tensor of (batch, classes) logits, or one number per row for regression."""
    if not isinstance(out, torch.Tensor):
        raise TrainingError(
            f"algorithm.entrypoint: the model returned a {type(out).__name__}; forward() must return one tensor "
            "(return the logits or predictions, not a tuple or dict)"
        )
    if task == "classification":
        expected, fits = f"({batch_size}, {num_outputs})", tuple(out.shape) == (batch_size, num_outputs)
    else:
        expected = f"({batch_size},) or ({batch_size}, 1)"
        fits = tuple(out.shape) in ((batch_size,), (batch_size, 1))
    if not fits:
        raise TrainingError(
            f"algorithm.entrypoint: the model returned shape {tuple(out.shape)} for a batch of {batch_size}; "
            f"a {task} model must return {expected}"
            + (" (one logit per class: build it with num_outputs)" if task == "classification" else "")
        )


def resolve_entrypoint(entrypoint: str):
    """The function ``package.module:function`` names; a ``SpecError`` saying what to fix if there is none."""
    module_name, _, fn_name = entrypoint.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise SpecError(
            [
                f"algorithm.entrypoint: cannot import {entrypoint!r} ({exc}); install the package that provides "
                "it, or add its folder to PYTHONPATH"
            ]
        ) from exc
    except Exception as exc:  # the module itself fails as it loads: its own error is the news
        raise SpecError(
            [f"algorithm.entrypoint: importing {module_name!r} failed: {type(exc).__name__}: {exc}"]
        ) from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        found = "is not callable" if hasattr(module, fn_name) else "does not exist"
        raise SpecError([f"algorithm.entrypoint: {module_name}.{fn_name} {found}; check the function's name after ':'"])
    return fn


def _from_entrypoint(entrypoint: str, num_features: int, num_outputs: int, hp: Hyperparameters):
    fn = resolve_entrypoint(entrypoint)
    result = fn(num_features, num_outputs, hp.model_dump())
    if not (
        isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module) and callable(result[1])
    ):
        raise TrainingError(f"{entrypoint} must return (torch.nn.Module, loss_fn), got {type(result).__name__}")
    return result


@contextmanager
def one_row_batch_norm(model: torch.nn.Module, rows: int):
    """A batch of one row (a short last step, or a group's small share of a sifted batch) has no
    batch statistics, and BatchNorm refuses to train on it: its BatchNorm layers normalise that row by
    their running statistics instead (eval mode, for this forward pass only), so the row is still trained on."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if rows != 1 or not norms:
        yield
        return
    for m in norms:
        m.eval()
    try:
        yield
    finally:
        for m in norms:
            m.train()
