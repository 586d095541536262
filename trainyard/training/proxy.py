"""The proxy model of ``sifting.score: proxy``: selection via proxy (Coleman et al., ICLR 2020), online.

A small model of the job's task on the job's features (``sifting.proxy``: a classifier with one hidden
layer of 32 by default; a linear regression for a regression job) ranks each step's candidates by its
loss, and trains on the rows the step trains on, so its ranking follows what the job's model has
been taught. Its forward over the candidates and its training cost a small share of one forward pass
of the job's model over them (on digits' 64 features with the built-in classifier of 256 and 256, and
beta 2: its forward a thirty-sixth, with its training a twenty-first), where scoring with the job's
model costs a whole one: the ranking is fresh every step at about the price of a remembered loss.
``benchmarks/sifting_bound.py`` (stop 47) measured it on digits as good as an oracle that scores with
the job's model for free. It cannot tell a wrong label from a hard row, so on noisy data it trains on
the noise (that benchmark's tabular set).

Its FLOPs, forward, backward and all, are counted as the sifter's scoring (``FlopMeter.scoring``, the
summary's ``flops_scoring_forward``): what ranking the candidates cost. It learns a step's rows once
the step commits (``StepData.committed``). Its state (weights and optimizer) travels with the group's
torchft state, so a healed group ranks as its peer does; the proxy is each group's own, trained on
that group's rows.
"""

from __future__ import annotations

import numpy as np
import torch

from trainyard import algorithms
from trainyard.spec import Algorithm, Hyperparameters, Proxy
from trainyard.spec.base import SEED_MAX
from trainyard.training.flops import FlopMeter

PROXY_SEED = 7  # added to hyperparameters.seed (benchmarks/sifting_bound.py's PROXY_SEED)


class ProxyScorer:
    """A group's proxy model: ``losses`` ranks candidates, ``train`` teaches it the step's rows."""

    def __init__(self, config: Proxy, task: str, seed: int, x: np.ndarray, y: np.ndarray, num_outputs: int, device):
        builtin = "mlp-classifier" if task == "classification" else "linear-regression"
        # seeded apart from the job's model (whose first layer it would otherwise copy), alike in every group:
        # sifting_bound.py's proxy, as measured
        hp = Hyperparameters(
            hidden_sizes=list(config.hidden_sizes),
            learning_rate=config.learning_rate,
            seed=(seed + PROXY_SEED) % (SEED_MAX + 1),
        )
        algorithm = Algorithm(builtin=builtin)
        self.model, self.loss_fn = algorithms.build(algorithm, hp, x, y, num_outputs)
        self.model.to(device)
        probe, _ = algorithms.build(algorithm, hp, x, y, num_outputs)  # the FLOP counter's, on the CPU
        self.meter = FlopMeter(probe, self.loss_fn)
        # torch's fused kernel where it has one (as the job's optimizer): the Python loop over the parameters was
        # a fifth of a digits step's proxy work
        fused = torch.device(device).type in ("cpu", "cuda")
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.learning_rate, weight_decay=0.0, fused=fused or None
        )

    @property
    def flops(self) -> int:
        """FLOPs this proxy has spent: its scoring passes and its training."""
        return self.meter.scoring + self.meter.forward + self.meter.backward

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        """Each row's loss under the proxy (a no-grad forward pass)."""
        with torch.no_grad():
            losses = self.loss_fn(self.model(x), y)
        self.meter.add_scoring(x)
        return losses.cpu().numpy().astype(np.float64)

    def train(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One optimizer step of the proxy on the rows the job's model trains on this step."""
        if not len(x):
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_fn(self.model(x), y).mean().backward()
        self.optimizer.step()
        self.meter.add_train_step(x, y)

    def state_dict(self) -> dict:
        return {"proxy_model": self.model.state_dict(), "proxy_optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "proxy_model" in state:  # (a peer's state always has it: every group of a job has a proxy or none)
            self.model.load_state_dict(state["proxy_model"])
            self.optimizer.load_state_dict(state["proxy_optim"])
