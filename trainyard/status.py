"""The job's status and summary, in SageMaker's vocabulary.

Primary status: Completed | Failed | Stopped. Secondary status transitions: Starting, Downloading,
Training, Uploading, then Completed / Failed / Stopped / MaxRuntimeExceeded, each with start and end
times and a message. ``summary`` assembles the job record whose keys are a public contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime

PROGRESS_EVENT = "trainyard.progress"  # the train stage's epochs so far; not a "trainyard.job.*" status event
JOB_TAG = "trainyard-job:"  # every run of a job is tagged with its id (the pipeline's by submit, each group's)
REPLICA_TAG = "trainyard-replica"  # and a group's run (tasks/pool_launcher.py) with this too


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class StatusLog:
    """Secondary status transitions, each open until the next begins."""

    def __init__(self, on_transition: Callable[[dict], None] | None = None) -> None:
        self.transitions: list[dict] = []
        self.status = "InProgress"
        self.failure_reason: str | None = None
        self._on_transition = on_transition

    def enter(self, status: str, message: str) -> None:
        """Begin a secondary status (closing the current one)."""
        now = _now()
        if self.transitions and self.transitions[-1]["end_time"] is None:
            if self.transitions[-1]["status"] == status:  # the same status, further on: told again
                self.transitions[-1]["message"] = message
                if self._on_transition is not None:
                    self._on_transition(self.transitions[-1])
                return
            self.transitions[-1]["end_time"] = now
        self.transitions.append({"status": status, "start_time": now, "end_time": None, "message": message})
        if self._on_transition is not None:
            self._on_transition(self.transitions[-1])

    def finish(self, status: str, secondary: str, message: str, failure_reason: str | None = None) -> None:
        """End the job: primary ``status`` (Completed / Failed / Stopped) and its final secondary status."""
        self.enter(secondary, message)
        self.transitions[-1]["end_time"] = self.transitions[-1]["start_time"]
        self.status = status
        self.failure_reason = failure_reason


def primary_status(stop_reason: str) -> tuple[str, str]:
    """(primary, final secondary) for a training stop reason."""
    if stop_reason == "MaxRuntimeExceeded":
        return "Stopped", "MaxRuntimeExceeded"
    if stop_reason in ("Stopped", "CarbonBudgetExceeded", "Left"):  # Left: every group was told to go
        return "Stopped", "Stopped"
    if stop_reason == "Diverged":
        return "Failed", "Failed"
    return "Completed", "Completed"


def failure_reason(stop_reason: str, history: list[dict]) -> str:
    """The summary's ``failure_reason`` for a training stop that is not Completed."""
    if stop_reason != "Diverged" or not history:
        return stop_reason
    last = history[-1]
    # the loss that is not a number (a train loss between validations may be, its epoch then validated all the same)
    losses = [k for k in ("val_loss", "train_loss") if k in last]
    loss = next((k for k in losses if last[k] is None or not math.isfinite(last[k])), losses[0] if losses else "loss")
    return (
        f"Diverged: {loss} was {last.get(loss)} at the end of epoch {last['epoch']}; lower "
        "hyperparameters.learning_rate (or add warmup_steps), or look in the data for extreme feature values"
    )


def compute_section(outcome, prefilter_flops: int = 0, done: dict | None = None) -> dict:
    """The summary's ``compute`` section from a training outcome (FLOPs measured, not estimated).

    ``flops_scoring_forward`` is what ranking the candidates cost: the online sifter's no-grad passes (with
    ``sifting.score: proxy``, the proxy's passes and its training, the part ``flops_scoring_proxy_training``
    says: its backward passes, and its forwards over rows it learnt unscored); ``flops_prefilter`` the offline
    prefilter's (its reference models' training and scoring, or the champion's forward pass).
    ``samples_seen`` counts the candidates drawn: trained, ranked by the sifter and passed over, or left
    out unscored before sifting started. Without an outcome (a training stage that gave up or was
    stopped by a signal), ``done`` (``accounting.work_done``) gives what the groups computed until then.
    """
    if outcome is None and done is not None:
        flops, trained, steps = done["flops"], done["samples_trained"], done["steps"]
    else:
        flops = outcome.flops if outcome else {"forward": 0, "backward": 0, "evaluation": 0}
        trained = outcome.samples_trained if outcome else 0
        steps = outcome.steps if outcome else 0
    scoring = flops.get("scoring", 0)
    return {
        "flops_total": flops["forward"] + flops["backward"] + flops["evaluation"] + scoring + prefilter_flops,
        "flops_scoring_forward": scoring,
        "flops_scoring_proxy_training": flops.get("proxy_training", 0),  # part of it, not beside it
        "flops_prefilter": prefilter_flops,
        "flops_forward": flops["forward"],
        "flops_backward": flops["backward"],
        "flops_evaluation": flops["evaluation"],
        "samples_seen": trained + untrained(online_totals(outcome, done)),
        "samples_trained": trained,
        "steps": steps,
    }


def online_totals(outcome, done: dict | None = None) -> dict | None:
    """The online sifter's totals: the outcome's, or without one what the groups sifted until the
    training stage gave up (``done``: ``accounting.work_done``); None without sifting."""
    if outcome is not None:
        return outcome.sifting
    return (done or {}).get("sifting_totals")


def pruned_rows(counts: dict) -> int:
    """The rows ``sifting.prune`` left out, in a group's or the job's counts (0 without pruning)."""
    return counts.get("pruned_learnt", 0) + counts.get("pruned_hardest", 0)


def pruned_fraction(counts: dict) -> float:
    """The share of the rows dealt to the pruner that it left out."""
    dealt = counts.get("prune_dealt", 0)
    return pruned_rows(counts) / dealt if dealt else 0.0


def trained_fraction_by_class(dealt: dict[str, int], left_out: dict[str, int]) -> dict[str, float]:
    """Each class's share of its rows dealt to the pruner that trained (classes dealt at least once): what
    shows a class sitting out, which the keep rule's per-class kept fraction does not (beta 0: no ranking)."""
    return {c: 1 - left_out.get(c, 0) / n for c, n in sorted(dealt.items()) if n}


def untrained(sifting: dict | None) -> int:
    """The candidates online sifting drew and did not train on: passed over by the keep rule, left out
    unscored before it started, or pruned by their last loss (``sifting.prune``) (``sifting``: the
    outcome's totals; None without sifting)."""
    return (sifting["passed_over"] + sifting.get("skipped", 0) + pruned_rows(sifting)) if sifting else 0


def sifting_section(job, report, outcome, done: dict | None = None) -> dict:
    """The summary's ``sifting`` section: the offline prefilter's report and the online sifter's totals
    (``done``: as for ``compute_section``)."""
    online = online_totals(outcome, done)
    sifted_epochs = [e for e in outcome.history if "kept_fraction" in e] if outcome else []
    section = {
        "enabled": job.sifting.enabled,
        "beta": job.sifting.beta,
        # what ranked the candidates and how they were picked (with sifting.noisy_share, as the labels called for:
        # the prefilter report's label_noise); none with the keep rule off (beta 0: pruning alone, by the training
        # passes' own losses)
        "score": job.sifting.score if job.sifting.beta else None,
        "selection": job.sifting.selection if job.sifting.beta else None,
        "kept_fraction": online["kept_fraction"] if online else (report.kept_fraction if report else None),
        "online": online,
        "prefilter": report.to_dict() if report else None,
        "kept_fraction_by_epoch": [e["kept_fraction"] for e in sifted_epochs],
        # what the keep rule alone would have kept, epoch by epoch (None where nothing was ranked)
        "mean_keep_probability_by_epoch": [e.get("mean_keep_probability") for e in sifted_epochs],
    }
    if job.sifting.prunes:  # the share of each epoch's rows that sat out
        section["pruned_fraction_by_epoch"] = [e.get("pruned_fraction") for e in sifted_epochs]
    if online and online.get("scoring_flops") and online["scoring_flops"] >= online["training_flops_skipped"]:
        # Scoring every one of C candidates costs C forwards and saves the forward and backward of the
        # C * beta / (1 + beta) dropped ones: a saving only when backward / forward > 1 / beta. Reused
        # losses (reuse_loss_epochs) make scoring cheaper, so the measured FLOPs decide.
        ratio = online.get("backward_forward_ratio") or 0.0
        # (a proxy's losses are never reused: what makes its scoring cheaper is a smaller proxy)
        proxy = job.sifting.score == "proxy"
        cheaper = "shrink sifting.proxy.hidden_sizes" if proxy else "set sifting.reuse_loss_epochs"
        section["warning"] = (
            f"sifting cost more compute than it saved: its scoring passes took {online['scoring_flops']:.3g} FLOPs, "
            f"the training passes its keep rule skipped would have taken {online['training_flops_skipped']:.3g} "
            "(the carbon report's sifting_saved also counts rows left out before delay_steps, which no scoring "
            f"paid for; backward/forward "
            f"FLOP ratio {ratio:.2f}, beta {job.sifting.beta:g}); raise sifting.beta, {cheaper}, "
            "or turn sifting off for this model"
        )
    for warning in (_prefilter_cost_warning(job, report, outcome), _measure_cost_warning(report, outcome)):
        if warning:
            section["warning"] = " ".join(filter(None, [section.get("warning"), warning]))
    return section


def training_flops_per_sample(outcome) -> float:
    """The training passes' FLOPs (forward and backward) per sample trained: what a row not trained saved."""
    return (outcome.flops["forward"] + outcome.flops["backward"]) / outcome.samples_trained


def prefilter_flops_spared(outcome, dropped_rows: int) -> float:
    """The training FLOPs the prefilter's ``dropped_rows`` were spared: at most, each trained in every epoch
    that ran (sifting or pruning might have left some out anyway)."""
    return dropped_rows * (len(outcome.history) or 1) * training_flops_per_sample(outcome)


def flops_spared(outcome, dropped_rows: int) -> float:
    """The training FLOPs filtering did not spend: every row online sifting or pruning left out (counted), and at
    most the prefilter's ``dropped_rows`` in every epoch (``prefilter_flops_spared``)."""
    left_out = untrained(outcome.sifting) * training_flops_per_sample(outcome)
    return left_out + prefilter_flops_spared(outcome, dropped_rows)


def _prefilter_cost_warning(job, report, outcome) -> str | None:
    """A warning when the prefilter's scoring cost more than the training passes of the rows it dropped
    could have: at most every dropped row trained (forward and backward) in every epoch that ran.

    Not for reducible-loss sifting: its reference losses rank every candidate online, so they are what
    the scoring is for, whatever it drops (the spec refuses turning that prefilter off). Nor for the measure of
    the labels that picks online sifting's rule (``sifting.noisy_share``): it runs whether the prefilter does or
    not, and what it buys is the rule, not dropped rows (the prefilter reuses its losses where it scores)."""
    if job.sifting.by_reducible_loss or not report or not outcome or not outcome.samples_trained:
        return None
    scoring = report.scoring_flops - (report.label_noise or {}).get("flops", 0)  # the prefilter's own
    if scoring <= 0:
        return None
    dropped, epochs = report.total - report.kept, len(outcome.history) or 1
    saved_at_most = prefilter_flops_spared(outcome, dropped)
    if scoring < saved_at_most:
        return None
    return (
        f"the prefilter cost more compute than it saved: scoring the rows took {scoring:.3g} FLOPs, "
        f"training the {dropped} rows it dropped for {epochs} epochs would have taken at most {saved_at_most:.3g}; "
        "let it drop exact duplicates only (sifting.prefilter.drop_learnt_fraction and drop_unlearnable_fraction 0), "
        "or turn it off (sifting.prefilter.enabled: false) for a job this short"
    )


def _measure_cost_warning(report, outcome) -> str | None:
    """A warning when measuring the labels to pick online sifting's rule (``sifting.noisy_share``, the
    default's) cost more than all the training filtering spared: every row sifting or pruning left out, and
    at most every row the prefilter dropped in every epoch. A short job's measure (two reference models)
    can cost more than the job."""
    if not report or not report.label_noise or not outcome or not outcome.samples_trained:
        return None
    measure, spared = report.label_noise.get("flops") or 0, flops_spared(outcome, report.total - report.kept)
    if not measure or measure < spared:
        return None
    return (
        f"measuring the labels to pick sifting's rule cost {measure:.3g} FLOPs, more than filtering spared in "
        f"training ({spared:.3g} at most); for a job this short, state the rule (sifting.noisy_share: null prunes "
        "without measuring) or turn sifting off"
    )


# Per-epoch bookkeeping in the history, not the model's metrics: the FLOPs and the job's steps are in the
# summary's `compute`, the steps of an epoch in `training.steps_per_epoch` (an epoch's own "steps" was the
# last epoch's, which the end-of-job table printed beside the job's total under the same name)
NOT_METRICS = (
    "epoch",
    "elapsed_seconds",
    "group_train_flops",
    "kept_fraction_by_class",
    "trained_fraction_by_class",
    "steps",
)


# Under ``metrics``, sifting's figures are the model's epoch's (the last, unless it restored its best); the job's
# are the summary's ``sifting`` section.
LAST_EPOCH_SIFTING = ("kept_fraction", "mean_keep_probability", "pruned_fraction")


def with_last_validation(entry: dict, validated: dict | None) -> dict:
    """A history entry of an epoch that was not validated (``stopping.validate_every_epochs``) with the
    validation metrics of ``validated``, the last validated epoch's entry before it, and ``validated_epoch``
    naming that epoch; ``entry`` itself where it was validated or nothing was yet."""
    if validated is None or "val_loss" in entry:
        return entry
    last = {k: v for k, v in validated.items() if k.startswith("val_")}
    return entry | last | {"validated_epoch": validated["epoch"]}


def final_metrics(history: list[dict], model_epoch: int | None = None) -> dict:
    """The metrics of the model's epoch: ``model_epoch`` where the job restored its best, else the last; and
    ``epochs``, how many were trained. Where that epoch was not validated (a job stopped between two
    validations: ``stopping.validate_every_epochs``), its validation metrics are the last validation's before
    it, whose epoch ``validated_epoch`` names."""
    if not history:  # (a job that ended before its first epoch did: README promises ``epochs`` all the same)
        return {"epochs": 0}
    at = model_epoch - 1 if model_epoch else len(history) - 1  # epochs count from 1, one entry each
    entry = history[at]
    entry = with_last_validation(entry, next((h for h in reversed(history[: at + 1]) if "val_loss" in h), None))
    # NaN (a diverged run's loss) as null: JSON has no NaN, and json.dumps would write one that parsers refuse
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v
        for k, v in entry.items()
        if k not in NOT_METRICS
    } | {"epochs": history[-1]["epoch"]}
