"""Exact FLOP counts of the forward and backward passes, measured with ``torch.utils.flop_counter``.

A model's cost depends on the batch size, so each distinct batch size is measured once, on a
separate probe model of the same architecture, and reused. The probe keeps the measurement away
from the trained model: its parameters carry torchft's DDP hooks, which a copy would fire again.

Sifting's scoring passes come in many sizes (with ``reuse_loss_epochs`` only the candidates without
a recent loss are scored), and a measurement costs a forward pass under the counter, about as much as
a training step of a small model. Most models' cost is linear in the batch size (``a + b * n``): once
three sizes measured lie exactly on one line, other sizes are computed from it, exact to the FLOP; a
model whose cost is not linear keeps being measured size by size.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainyard.algorithms import LossFn, one_row_batch_norm


class FlopMeter:
    """Counts forward, backward and evaluation FLOPs spent by one process."""

    def __init__(self, probe: nn.Module, loss_fn: LossFn):
        self._model = probe
        self._loss_fn = loss_fn
        self._train_cost = CostBySize()
        self._eval_cost = CostBySize()
        self.forward = 0
        self.backward = 0
        self.evaluation = 0
        self.scoring = 0
        # of scoring, a proxy's training (sifting.score: proxy): its backward, and forwards of rows it had not scored
        self.proxy_training = 0

    def add_train_step(self, x: torch.Tensor, y: torch.Tensor, forward: bool = True) -> None:
        """Record one training forward and backward pass over batch ``x``; the backward alone with
        ``forward`` False (a pass whose forward was counted already, as scoring)."""

        def measure() -> tuple[int, int]:
            xs, ys = x.cpu(), y.cpu()  # the probe stays on the CPU; the count does not depend on the device
            with FlopCounterMode(display=False) as fwd, one_row_batch_norm(self._model, len(xs)):
                loss = self._loss_fn(self._model(xs), ys).mean()
            with FlopCounterMode(display=False) as bwd:
                loss.backward()
            self._model.zero_grad(set_to_none=True)
            return fwd.get_total_flops(), bwd.get_total_flops()

        f, b = self._train_cost(x.shape[0], measure)
        self.forward += f if forward else 0
        self.backward += b

    def add_evaluation(self, x: torch.Tensor) -> None:
        """Record one no-grad forward pass over batch ``x`` (validation or scoring)."""

        def measure() -> tuple[int]:
            xs = x.cpu()
            with torch.no_grad(), FlopCounterMode(display=False) as fwd, one_row_batch_norm(self._model, len(xs)):
                self._model(xs)
            return (fwd.get_total_flops(),)

        self.evaluation += self._eval_cost(x.shape[0], measure)[0]

    @property
    def measurements(self) -> int:
        """How many passes were run under the FLOP counter (the rest were looked up or computed)."""
        return self._train_cost.measured + self._eval_cost.measured

    def add_scoring(self, x: torch.Tensor) -> None:
        """Record one no-grad forward pass that scored candidates for sifting."""
        before = self.evaluation
        self.add_evaluation(x)
        self.scoring += self.evaluation - before
        self.evaluation = before

    def as_dict(self) -> dict[str, int]:
        return {
            "forward": self.forward,
            "backward": self.backward,
            "evaluation": self.evaluation,
            "scoring": self.scoring,
            "proxy_training": self.proxy_training,
        }


class CostBySize:
    """A pass's FLOPs (a tuple of counts) by batch size: measured once per size until three sizes lie
    exactly on one line ``a + b * n``, then computed from it wherever that gives whole numbers."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[int, ...]] = {}
        self._line: tuple[int, tuple[int, ...], tuple[Fraction, ...]] | None = None  # (n0, cost at n0, slope)
        self.measured = 0

    def __call__(self, n: int, measure: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
        if n not in self._known:
            computed = self._on_line(n)
            if computed is not None:
                self._known[n] = computed
            else:
                self._known[n] = tuple(measure())
                self.measured += 1
                self._fit()
        return self._known[n]

    def _on_line(self, n: int) -> tuple[int, ...] | None:
        if self._line is None:
            return None
        n0, cost0, slope = self._line
        values = [c + s * (n - n0) for c, s in zip(cost0, slope, strict=True)]
        if any(v.denominator != 1 or v < 0 for v in values):
            return None
        return tuple(int(v) for v in values)

    def _fit(self) -> None:
        """A line through the two smallest sizes measured, once every other size measured lies on it
        (at least one: two points always make a line)."""
        if self._line is not None or len(self._known) < 3:
            return
        (n0, c0), (n1, c1), *rest = sorted(self._known.items())
        slope = tuple(Fraction(b - a, n1 - n0) for a, b in zip(c0, c1, strict=True))

        def on_line(n: int, cost: tuple[int, ...]) -> bool:
            return all(c == a + s * (n - n0) for c, a, s in zip(cost, c0, slope, strict=True))

        if all(on_line(n, cost) for n, cost in rest):
            self._line = (n0, c0, slope)
