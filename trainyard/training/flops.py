"""Exact FLOP counts of the forward and backward passes, measured with ``torch.utils.flop_counter``.

A model's cost depends on the batch size, so each distinct batch size is measured once, on a
separate probe model of the same architecture, and reused. The probe keeps the measurement away
from the trained model: its parameters carry torchft's DDP hooks, which a copy would fire again.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainyard.algorithms import LossFn


class FlopMeter:
    """Counts forward, backward and evaluation FLOPs spent by one process."""

    def __init__(self, probe: nn.Module, loss_fn: LossFn):
        self._model = probe
        self._loss_fn = loss_fn
        self._train_cache: dict[int, tuple[int, int]] = {}
        self._eval_cache: dict[int, int] = {}
        self.forward = 0
        self.backward = 0
        self.evaluation = 0
        self.scoring = 0

    def add_train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Record one training forward and backward pass over batch ``x``."""
        n = x.shape[0]
        if n not in self._train_cache:
            x, y = x.cpu(), y.cpu()  # the probe stays on the CPU; the count does not depend on the device
            with FlopCounterMode(display=False) as fwd:
                loss = self._loss_fn(self._model(x), y).mean()
            with FlopCounterMode(display=False) as bwd:
                loss.backward()
            self._model.zero_grad(set_to_none=True)
            self._train_cache[n] = (fwd.get_total_flops(), bwd.get_total_flops())
        f, b = self._train_cache[n]
        self.forward += f
        self.backward += b

    def add_evaluation(self, x: torch.Tensor) -> None:
        """Record one no-grad forward pass over batch ``x`` (validation or scoring)."""
        n = x.shape[0]
        if n not in self._eval_cache:
            with torch.no_grad(), FlopCounterMode(display=False) as fwd:
                self._model(x.cpu())
            self._eval_cache[n] = fwd.get_total_flops()
        self.evaluation += self._eval_cache[n]

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
        }
