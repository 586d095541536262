"""Epoch bookkeeping shared by every replica group: validation metrics and the stopping rules.

Decisions use only values every group shares (validation metrics of identical parameters, the
epoch count), so the groups agree on when to stop without talking to each other.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from trainyard.errors import SpecError
from trainyard.spec import METRICS, TrainingJob
from trainyard.training.flops import FlopMeter

EVAL_BATCH = 4096


@dataclass(slots=True)
class History:
    """Per-epoch metrics, shared across groups through the state dict."""

    epochs: list[dict] = field(default_factory=list)
    best: float | None = None
    best_epoch: int | None = None  # the epoch of ``best``: the one a job that restores its best epoch keeps
    epochs_since_best: int = 0
    stop_reason: str | None = None


def evaluate(model, loss_fn, x: torch.Tensor, y: torch.Tensor, task: str, meter: FlopMeter | None = None) -> dict:
    """Validation metrics: ``val_loss``, plus ``val_accuracy`` (classification) or ``val_rmse``."""
    model.eval()
    device = next(model.parameters()).device
    loss_sum, correct, sq_err = 0.0, 0, 0.0
    with torch.no_grad():
        for start in range(0, len(x), EVAL_BATCH):
            xb, yb = x[start : start + EVAL_BATCH].to(device), y[start : start + EVAL_BATCH].to(device)
            out = model(xb)
            if meter is not None:
                meter.add_evaluation(xb)
            loss_sum += float(loss_fn(out, yb).sum())
            if task == "classification":
                correct += int((out.argmax(dim=1) == yb).sum())
            else:
                # A regression model may return (N, 1) for (N,) labels; subtracting those would
                # broadcast to (N, N) and give every prediction's error against every label.
                pred = out.reshape(yb.shape) if out.numel() == yb.numel() else out
                sq_err += float(((pred - yb) ** 2).sum())
    model.train()
    metrics = {"val_loss": loss_sum / len(x)}
    if task == "classification":
        metrics["val_accuracy"] = correct / len(x)
    else:
        metrics["val_rmse"] = math.sqrt(sq_err / len(x))
    return metrics


def validates(job: TrainingJob, epoch: int) -> bool:
    """Whether the end of ``epoch`` (counted from 1) validates: every ``stopping.validate_every_epochs``, and the
    last epoch always."""
    return epoch % job.stopping.validate_every_epochs == 0 or epoch >= job.hyperparameters.epochs


def end_epoch(history: History, epoch: int, metrics: dict, job: TrainingJob, started_unix: float) -> None:
    """Record an epoch's metrics (``elapsed_seconds`` since ``started_unix``, the job's training start) and
    decide whether the job stops there (diverged, target reached, no improvement for its patience). An epoch
    that was not validated (``validates``) has no validation metrics: the target and patience wait for one that
    was, unless they watch ``train_loss``."""
    history.epochs.append({"epoch": epoch, "elapsed_seconds": time.time() - started_unix, **metrics})
    if diverged(metrics, job):
        history.stop_reason = "Diverged"
        return
    # The best epoch first: the epoch that reaches the target is the best one, and the model it restores to.
    watched = job.stopping.watched_metric
    value = metrics.get(watched)
    if (job.stopping.patience_epochs is not None or job.stopping.restores_best) and value is not None:
        bigger_better = METRICS[watched]
        # (a NaN never improves: every comparison with it is false)
        improved = history.best is None or (value > history.best if bigger_better else value < history.best)
        if improved and math.isfinite(value):
            history.best, history.best_epoch, history.epochs_since_best = value, epoch, 0
        else:  # in epochs, not validations (stopping.validate_every_epochs may skip some)
            history.epochs_since_best = epoch - (history.best_epoch or 0)
    target = job.stopping.target_metric
    if target is not None and target.name in metrics:
        reached = metrics[target.name]
        if (reached >= target.value) if METRICS[target.name] else (reached <= target.value):
            history.stop_reason = "TargetMetricReached"
            return
    patience = job.stopping.patience_epochs
    if patience is not None and value is not None and history.epochs_since_best >= patience:
        history.stop_reason = "NoImprovement"


def diverged(metrics: dict, job: TrainingJob) -> str | None:
    """The loss that is no longer a number (NaN or infinite) at an epoch's end, or None: the parameters
    are then NaN too, and every later step would be spent for nothing. Judged on ``val_loss``, which every
    group shares; with one group on ``train_loss`` too (each group's own is over its own batches), at every
    epoch alike, validated or not (``stopping.validate_every_epochs``)."""
    watched = ("val_loss", "train_loss") if job.resources.max_replicas == 1 else ("val_loss",)
    return next((k for k in watched if k in metrics and not math.isfinite(metrics[k])), None)


def history_state(history: History) -> dict:
    return {
        "epochs": list(history.epochs),
        "best": history.best,
        "best_epoch": history.best_epoch,
        "epochs_since_best": history.epochs_since_best,
        "stop_reason": history.stop_reason,
    }


def learning_rate(hp, step: int, progress: float, warm_progress: float = 0.0) -> float:
    """The learning rate at ``step``, ``progress`` (0..1) of the way through the epochs; ``warm_progress``: the
    progress at which the warm-up ended (``warmup_steps``' last step; 0 without one).

    ``warmup_steps`` ramp linearly from zero to ``learning_rate``; the schedule's decay then runs over the rest
    of the run, as Hugging Face's schedulers do (it ran from step 0, under the ramp: a warm-up of half the run
    peaked at half the rate with cosine). A function of the committed step, the epoch position and where the
    warm-up ended (the trainer's cursor, in the state a healed group loads), which every group shares.
    """
    lr = hp.learning_rate
    if step < hp.warmup_steps:
        return lr * (step + 1) / hp.warmup_steps
    if hp.lr_schedule != "constant":
        # from where the ramp ended: by progress, as steps per epoch vary (pruning deals more rows a step, a
        # sharded epoch's count follows its groups), so no step count known up front places it
        warm = min(max(warm_progress, 0.0), 1.0)
        t = min(max((progress - warm) / (1 - warm), 0.0), 1.0) if warm < 1 else 1.0
        decay = 0.5 * (1 + math.cos(math.pi * t)) if hp.lr_schedule == "cosine" else 1 - t
        floor = hp.min_lr_fraction
        lr *= floor + (1 - floor) * decay
    return lr


def step_rate(hp, step: int, progress: float, cursor: dict) -> float:
    """``learning_rate`` for a committed ``step``; the warm-up's end is recorded in ``cursor`` (the trainer's, in
    the state a healed group loads) at its last step, or at the first step past it where a group's state has none
    (one saved before it was recorded): the decay then goes on from the rate it is at, without a jump."""
    if hp.warmup_steps and step >= hp.warmup_steps - 1 and "warm_progress" not in cursor:
        cursor["warm_progress"] = progress
    return learning_rate(hp, step, progress, cursor.get("warm_progress", 0.0))


def check_warmup(hp, rows: int, draws: list[int] | None = None) -> None:
    """Refuse a warm-up as long as the run: the learning rate would never reach ``learning_rate``, and the decay
    would never start. ``draws``: the rows each epoch draws a step (``batch_size`` for every epoch without it; more
    with sifting's candidates, and more again in the epochs that ``sifting.prune.batch_factor`` deals more rows), so
    the run's steps are each epoch's ``rows`` over its draw, summed: pruned epochs take fewer (counted as the first
    epoch's, a warm-up could outlast a pruned run)."""
    draws = draws or [hp.batch_size] * hp.epochs
    per_epoch = [max(1, math.ceil(rows / draw)) for draw in draws]
    steps = sum(per_epoch)
    if hp.warmup_steps >= steps:
        epochs = f"{hp.epochs} epochs of {per_epoch[0]}" if len(set(per_epoch)) == 1 else f"epochs of {per_epoch}"
        drawn = f"{draws[0]} a step" if len(set(draws)) == 1 else f"{sorted(set(draws))} a step"
        raise SpecError(
            [
                f"hyperparameters.warmup_steps: {hp.warmup_steps} is not below the run's {steps} steps ({epochs}: "
                f"{rows} rows at {drawn}): the learning rate would never reach learning_rate; set it below {steps} "
                f"(a tenth of the run, {max(1, steps // 10)}, is common)"
            ]
        )
