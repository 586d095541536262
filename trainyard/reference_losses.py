"""Reference losses: each training row's loss under a model that did not train on it, for the
prefilter's loss-based drops and for RHO-LOSS sifting's reducible loss (``filtering``).

By default the rows are split in two halves, a small reference model is trained briefly on each half
and scores the other (``held_out_losses``, cross-fitting). With ``reference: champion`` the registry's
current champion scores every row instead (``champion_losses``); one that is missing or does not fit
the data gives no losses, and the caller falls back to cross-fitting. An entrypoint's rows are scored
with its own loss (``job_loss``), on the reference's outputs put in the form its model gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from trainyard import algorithms
from trainyard.algorithms import LossFn
from trainyard.errors import DataError
from trainyard.spec import Algorithm, Hyperparameters, Prefilter
from trainyard.training.flops import FlopMeter

REFERENCE_BATCH = 256
# rows per scoring forward pass (the champion's, the holdout references'): one pass over a channel of millions of
# rows would hold all their activations at once
SCORING_BATCH = 8192
HOLDOUT = "holdout: two reference models, each scoring the half it did not train on"


@dataclass(frozen=True, slots=True)
class Champion:
    """The registry's champion as the prefilter's reference model: the model, or why there is none."""

    model: torch.nn.Module | None
    label: str
    """``"<name> v<N>"``, or why no champion can be used."""
    io: dict | None = None
    """What the version was logged as taking and giving (``model_card.io_metadata``: features and classes in
    order), where it says."""


def fitting(champion: Champion, schema: dict) -> Champion:
    """``champion``, or no champion (saying why) where its logged inputs or outputs are not this data's: the same
    count of columns in another order, or of classes with other names, would pass the shape check and score every
    row by the wrong features or the wrong class. A version logged without them is judged by its outputs' shape."""
    if champion.model is None or not champion.io:
        return champion
    theirs, ours = champion.io, schema
    for what in ("features", "classes"):
        logged, given = theirs.get(what), ours.get(what)
        if logged is None or given is None:
            continue
        if [str(v) for v in logged] != [str(v) for v in given]:
            return Champion(
                None,
                f"the champion {champion.label} takes other {what} ({_listed(logged)}; this data's: {_listed(given)})",
            )
    return champion


def _listed(values: list) -> str:
    shown = ", ".join(str(v) for v in values[:6])
    return shown + (f", ... {len(values)} in all" if len(values) > 6 else "")


def champion_losses(
    x: np.ndarray,
    y: np.ndarray,
    rows: np.ndarray,
    champion: Champion | None,
    task: str,
    num_outputs: int,
    loss_fn: JobLoss | None = None,
) -> tuple[np.ndarray | None, int, str]:
    """Each selected row's loss under the champion (NaN elsewhere), its FLOPs and ``"champion <name> vN"``;
    ``(None, 0, why)`` when there is no champion to use, so the caller falls back to cross-fitting."""
    if champion is None or champion.model is None:
        why = champion.label if champion is not None else "no champion was given"
        return None, 0, f"{HOLDOUT}; the champion could not be used: {why}"
    losses = np.full(len(x), np.nan)
    chosen = np.flatnonzero(rows)
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            for part in _scoring_batches(chosen):
                outputs = champion.model(torch.from_numpy(x[part]))
                labels = torch.from_numpy(y[part])
                _check_shape(outputs, task, num_outputs, len(part))
                scored = loss_fn(outputs, labels) if loss_fn else _reference_loss(outputs, labels, task)
                losses[part] = scored.numpy()
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:  # another model's inputs or outputs
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, 0, f"{HOLDOUT}; the champion {champion.label} does not fit this data ({detail})"
    return losses, counter.get_total_flops(), f"champion {champion.label}"


def _scoring_batches(rows: np.ndarray) -> list[np.ndarray]:
    """``rows`` in consecutive parts of at most ``SCORING_BATCH``, one scoring forward pass each."""
    return np.array_split(rows, max(1, math.ceil(len(rows) / SCORING_BATCH)))


def _check_shape(outputs: torch.Tensor, task: str, num_outputs: int, rows: int) -> None:
    """A champion trained on other data may not fit this job's: its outputs say so."""
    if task == "classification" and (outputs.dim() != 2 or outputs.shape[1] != num_outputs):
        raise ValueError(f"it gives outputs of shape {tuple(outputs.shape)} for {num_outputs} classes")
    if task != "classification" and outputs.numel() != rows:
        raise ValueError(f"it gives outputs of shape {tuple(outputs.shape)} for {rows} rows")


def _reference_loss(outputs: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Per-row loss of a reference model's outputs: cross-entropy, or for regression the squared error
    in the label's units (``prefilter`` puts it on the training loss's scale once the kept rows are known)."""
    if task == "classification":
        if _output_form(outputs, outputs.shape[-1]) == "probabilities":  # a champion ending in Softmax
            return torch.nn.functional.nll_loss(outputs.float().clamp_min(1e-12).log(), labels, reduction="none")
        # logits, or log-probabilities (a LogSoftmax's: cross-entropy reads them as they are)
        return torch.nn.functional.cross_entropy(outputs.float(), labels, reduction="none")
    return (outputs.reshape(-1).float() - labels.float()) ** 2


class JobLoss:
    """An entrypoint's own per-row loss (``job_loss``), scoring another model's outputs: a built-in
    reference model's, or a champion's.

    Those are put in the form the job's model gives first: a classifier ending in ``LogSoftmax`` (for
    ``NLLLoss``) or ``Softmax`` gives log-probabilities or probabilities, and its loss of raw logits would
    be meaningless (NLLLoss of logits is negative). Outputs already in another form (a champion the same
    entrypoint trained) are scored as they are."""

    def __init__(self, loss_fn: LossFn, tail: tuple, form: str, num_outputs: int):
        self._loss_fn, self._tail, self.form, self._num_outputs = loss_fn, tail, form, num_outputs

    def __call__(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.form != "logits" and _output_form(outputs, self._num_outputs) == "logits":
            softmax = torch.log_softmax if self.form == "log_probabilities" else torch.softmax
            outputs = softmax(outputs.float(), dim=-1)
        # reshaped to what the job's model gives (a regression model may give (N, 1) where the reference gives (N,))
        losses = self._loss_fn(outputs.reshape(len(outputs), *self._tail), labels)
        return algorithms.check_per_sample(losses, len(outputs)).detach().float()


def job_loss(algorithm: Algorithm, hp: Hyperparameters, x: np.ndarray, y: np.ndarray, num_outputs: int) -> JobLoss:
    """The entrypoint's per-row loss, and the form its model's outputs take (from a few rows through it)."""
    model, loss_fn = algorithms.build(algorithm, hp, x, y, num_outputs)
    with torch.no_grad():
        sample = model.eval()(torch.from_numpy(x[: min(8, len(x))])).float()
    return JobLoss(loss_fn, tuple(sample.shape[1:]), _output_form(sample, num_outputs), num_outputs)


def _output_form(outputs: torch.Tensor, num_outputs: int) -> str:
    """``log_probabilities``, ``probabilities`` or ``logits``: what a classifier's outputs are."""
    if num_outputs < 2 or outputs.dim() != 2 or outputs.shape[1] != num_outputs or not len(outputs):
        return "logits"
    if torch.allclose(torch.logsumexp(outputs, dim=1), torch.zeros(len(outputs)), atol=1e-4):
        return "log_probabilities"
    if (outputs >= 0).all() and torch.allclose(outputs.sum(dim=1), torch.ones(len(outputs)), atol=1e-4):
        return "probabilities"
    return "logits"


def held_out_losses(
    x: np.ndarray,
    y: np.ndarray,
    rows: np.ndarray,
    config: Prefilter,
    task: str,
    num_outputs: int,
    loss_fn: JobLoss | None = None,
) -> tuple[np.ndarray, int]:
    """Each selected row's loss under a reference model trained on the other half; NaN elsewhere.
    ``loss_fn`` scores the reference's outputs (default: the loss it trained with)."""
    losses = np.full(len(x), np.nan)
    chosen = np.flatnonzero(rows)
    if len(chosen) < 2:  # each half trains a reference model for the other: both need rows
        raise DataError(
            "the prefilter's reference models train on one half of the rows and score the other, and "
            f"{len(chosen)} distinct row(s) are left once duplicates are dropped; stage more data, or set "
            "sifting.prefilter.drop_learnt_fraction and drop_unlearnable_fraction to 0 and sifting.score to loss"
        )
    halves = np.array_split(np.random.default_rng(config.seed).permutation(chosen), 2)
    flops = 0
    for train_rows, score_rows in ((halves[0], halves[1]), (halves[1], halves[0])):
        model, spent = _reference(x[train_rows], y[train_rows], config, task, num_outputs)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            for part in _scoring_batches(score_rows):
                scored, labels = model(torch.from_numpy(x[part])), torch.from_numpy(y[part])
                # Not the loss the reference trained with: a regression one's is scaled by its half's labels'
                # spread, where squared errors in the label's units put both halves on one scale.
                score = loss_fn(scored, labels) if loss_fn else _reference_loss(scored, labels, task)
                losses[part] = score.numpy()
        flops += spent + counter.get_total_flops()
    return losses, flops


def _reference(x: np.ndarray, y: np.ndarray, config: Prefilter, task: str, num_outputs: int):
    """A small model of the job's task, trained briefly: ``(model, FLOPs spent)``."""
    builtin = "mlp-classifier" if task == "classification" else "linear-regression"
    hp = Hyperparameters(hidden_sizes=list(config.reference_hidden_sizes), seed=config.seed)
    model, loss_fn = algorithms.build(Algorithm(builtin=builtin), hp, x, y, num_outputs)
    # counted as the job's steps are (a probe measures each batch size once): under torch's FLOP counter
    # throughout, the cross-fitting took 58 ms on digits, not 25, and 262 on the sifting benchmark's tabular set, not 64
    meter = FlopMeter(algorithms.build(Algorithm(builtin=builtin), hp, x, y, num_outputs)[0], loss_fn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.reference_learning_rate)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    gen = torch.Generator().manual_seed(config.seed)
    for _ in range(config.reference_epochs):
        for batch in torch.randperm(len(xt), generator=gen).split(REFERENCE_BATCH):
            optimizer.zero_grad()
            loss_fn(model(xt[batch]), yt[batch]).mean().backward()
            optimizer.step()
            meter.add_train_step(xt[batch], yt[batch])
    return model.eval(), meter.forward + meter.backward
