"""The proxy model of ``sifting.score: proxy``: selection via proxy (Coleman et al., ICLR 2020), online.

A small model of the job's task on the job's features (``sifting.proxy``: a classifier with one hidden
layer of 32 by default; a linear regression for a regression job) ranks each step's candidates by its
loss, and trains on the rows the step trains on, so its ranking follows what the job's model has
been taught. Its forward over the candidates and its training cost a small share of one forward pass
of the job's model over them (on digits' 64 features with the built-in classifier of 256 and 256, and
beta 2: its forward a thirty-sixth, with its training a twenty-sixth), where scoring with the job's
model costs a whole one: the ranking is fresh every step at about the price of a remembered loss.
``benchmarks/sifting_bound.py`` (stop 47) measured it on digits as good as an oracle that scores with
the job's model for free. It cannot tell a wrong label from a hard row, so on noisy data it trains on
the noise (that benchmark's tabular set).

Its FLOPs (its forward over the candidates, and its backward over the rows it learns: their forward
is the scoring's) are counted as the sifter's scoring (``FlopMeter.scoring``, the summary's
``flops_scoring_forward``, its training also apart, ``flops_scoring_proxy_training``): what ranking the
candidates cost. It learns a step's rows once the step commits (``StepData.committed``). Its state (weights
and optimizer) travels with the group's torchft state, so a healed group ranks as its peer does; the proxy is
each group's own, trained on that group's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from trainyard import algorithms
from trainyard.spec import Algorithm, Hyperparameters, Proxy
from trainyard.spec.base import SEED_MAX
from trainyard.training.flops import FlopMeter

PROXY_SEED = 7  # added to hyperparameters.seed (benchmarks/sifting_bound.py's PROXY_SEED)


@dataclass(slots=True)
class Pass:
    """A proxy forward pass over a step's candidates, kept so that the proxy can learn the rows the
    step trains on from it (``ProxyScorer.learn``) without a second forward pass."""

    x: torch.Tensor
    y: torch.Tensor
    inputs: list[torch.Tensor]
    """Each module's input (the rows' activations on their way through the model)."""
    output: torch.Tensor
    version: int
    """The proxy's weights it was computed with (``ProxyScorer._version``)."""

    def of(self, rows: torch.Tensor) -> Pass:
        """The pass over ``rows`` (indices) only: the rows a step trains on."""
        x = self.x[rows]  # (the first module's input is x itself)
        return Pass(x, self.y[rows], [x, *(t[rows] for t in self.inputs[1:])], self.output[rows], self.version)


def relative_cost(
    config: Proxy, algorithm: Algorithm, hp: Hyperparameters, x: np.ndarray, y: np.ndarray, outputs: int
) -> float:
    """The proxy's forward FLOPs over the job's model's, on the same rows: what scoring a candidate with it
    costs against a forward pass of the model (a thirty-sixth on digits, with the built-in classifier of 256
    and 256 and the default proxy)."""
    builtin = "mlp-classifier" if algorithm.task == "classification" else "linear-regression"
    small = Hyperparameters(hidden_sizes=list(config.hidden_sizes), learning_rate=config.learning_rate, seed=hp.seed)
    x, y = np.asarray(x[:64]), np.asarray(y[:64])  # (a few rows: the models' input scaling is not what is counted)
    rows, costs = torch.from_numpy(x), []
    for algo, params in ((Algorithm(builtin=builtin), small), (algorithm, hp)):
        model, loss_fn = algorithms.build(algo, params, x, y, outputs)
        meter = FlopMeter(model, loss_fn)
        meter.add_scoring(rows)
        costs.append(meter.scoring)
    return costs[0] / max(costs[1], 1)


class ProxyScorer:
    """A group's proxy model: ``score`` ranks candidates, ``learn`` teaches it the step's rows.

    Its gradients are written out by hand (``_backward``) for the built-in models it can be (linear
    layers, ReLUs, the fixed input and output scaling), from the scoring pass's activations: autograd's
    forward and backward took a third of a millisecond a step on digits' 64 rows (its fixed cost per
    operation, for a model a twentieth the job's), as much as the rest of a step's sifting work."""

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
        self.classification = task == "classification"
        self._layers: list[nn.Module] = list(self.model.children())  # a built-in model is one nn.Sequential
        self._version = 0  # counts changes of the weights: a Pass is of the version it was computed with
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

    def score(self, x: torch.Tensor, y: torch.Tensor) -> tuple[np.ndarray, Pass]:
        """Each row's loss under the proxy (a no-grad forward pass, counted as scoring), and the pass."""
        done = self._forward(x, y)
        with torch.no_grad():
            losses = self.loss_fn(done.output, y)
        self.meter.add_scoring(x)
        return losses.cpu().numpy().astype(np.float64), done

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        """Each row's loss under the proxy (a no-grad forward pass)."""
        return self.score(x, y)[0]

    def learn(self, done: Pass) -> None:
        """One optimizer step of the proxy on a scoring pass's rows (``Pass.of``: those the job's model trains
        on this step). Only the backward pass is counted: the forward was the scoring's. A pass from before
        the proxy's weights were replaced (a heal) is run again first."""
        if done.version != self._version:
            self.train(done.x, done.y)
        else:
            self._step(done, forward_counted=True)

    def train(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One optimizer step of the proxy on rows it has not scored (before sifting starts)."""
        self._step(self._forward(x, y), forward_counted=False)

    def _step(self, done: Pass, forward_counted: bool) -> None:
        if not len(done.x):
            return
        self._backward(done)
        self.optimizer.step()
        self._version += 1
        self.meter.add_train_step(done.x, done.y, forward=not forward_counted)

    def _forward(self, x: torch.Tensor, y: torch.Tensor) -> Pass:
        inputs = []
        with torch.no_grad():
            h = x
            for module in self._layers:
                inputs.append(h)
                h = module(h)
        return Pass(x, y, inputs, h, self._version)

    def _backward(self, done: Pass) -> None:
        """The mean loss's gradients over the pass's rows, into the parameters' ``.grad``."""
        out, y, n = done.output, done.y, len(done.output)
        with torch.no_grad():
            if self.classification:  # d(mean cross-entropy)/d(logits)
                grad = torch.softmax(out, dim=1)
                grad[torch.arange(n, device=out.device), y] -= 1
            else:  # d(mean ((out - y) / scale) ** 2)/d(out), the scale the output's (algorithms._scaled_mse)
                scale = self._layers[-1]
                assert isinstance(scale, algorithms.Affine)
                grad = 2 * (out - y) / scale.scale**2
            grad = grad.to(out.dtype) / n
            for i in range(len(self._layers) - 1, 0, -1):  # 0, the input's scaling, is fixed: nothing below learns
                module, inp = self._layers[i], done.inputs[i]
                if isinstance(module, nn.Linear):
                    module.weight.grad = grad.T @ inp
                    module.bias.grad = grad.sum(0)
                    grad = grad @ module.weight if i > 1 else grad  # (the input's gradient: none needed)
                elif isinstance(module, nn.ReLU):
                    grad = grad * (inp > 0)
                elif isinstance(module, algorithms.Squeeze):
                    grad = grad[:, None]
                elif isinstance(module, algorithms.Affine):  # the output's scaling (regression)
                    grad = grad * module.scale
                else:  # (the proxy is always a built-in model)
                    raise AssertionError(f"no gradient for {type(module).__name__}")

    def state_dict(self) -> dict:
        return {"proxy_model": self.model.state_dict(), "proxy_optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "proxy_model" in state:  # (a peer's state always has it: every group of a job has a proxy or none)
            self.model.load_state_dict(state["proxy_model"])
            self.optimizer.load_state_dict(state["proxy_optim"])
            self._version += 1  # a pass computed before is not of these weights
