"""Single runs for the sifting benchmark (``benchmarks/sifting.py``); its datasets are
``_sifting_datasets.py``.

One run is one Trainyard job without Prefect (``launch.launch`` + ``supervisor.train`` with real
torchft replica processes and a lighthouse, as ``tests/unit/test_training.py`` runs them), one
replica group. The combination's prefilter runs here first (``filtering.prefilter``), timed and
FLOP-counted, and the job trains on the rows it keeps.

Training FLOPs per epoch are not in the outcome (only totals are), so they are rebuilt from exact
per-sample costs (``FlopMeter`` on a probe model: an MLP's FLOPs are linear in the batch) and the
rows each epoch trained and scored (sifting's keep counts, from Trainyard's own ``Sifter``); the sum
is checked against the outcome's measured totals to the FLOP. Wall time per epoch comes from the
step log (``TRAINYARD_STEP_LOG=1``): the time from the first committed step to the epoch's last,
plus one median step for the first step's own work (the first step also waits for torchft's first
quorum, which every arm pays alike and is left out).
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np
from _sifting_datasets import Dataset, load
from _sifting_run import Run

DELAY_STEPS = 10  # sifting.delay_steps of the keep rule's arms (proxy arms leave it unset: 0, Sifting.default_delay)


# --- one run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """Which filtering is on: online sifting's beta (None: off) and the prefilter's drop fractions."""

    beta: float | None = None
    prefilter: tuple[float, float] | None = None  # (drop_learnt_fraction, drop_unlearnable_fraction)
    reducible: bool = False  # online sifting by reducible loss (RHO-LOSS), from the prefilter's reference losses
    reuse: int = 0  # sifting.reuse_loss_epochs: rank by a remembered loss up to this many epochs old
    proxy: bool = False  # sifting.score proxy with selection top: the 1 / (1 + beta) highest by a proxy model's loss
    # sifting.noisy_share 0.1, the rule left unset (stop 48): the filtering stage picks it from the labels
    # (trainyard/label_noise.py); the run is of what it picked (``adapted``), that stage's work timed and counted
    auto: bool = False
    prune: tuple[float, float, float] | None = None  # sifting.prune's (learnt_fraction, hardest_fraction, batch_factor)
    # The schedule's length: None, as many epochs as fit in the baseline's FLOPs; k, k times the baseline's
    # epochs (1: the baseline's job with sifting turned on), its accuracy then at fewer FLOPs than the budget.
    epochs: float | None = None

    def label(self) -> str:
        parts = [f"prefilter {self.prefilter[0]:g}/{self.prefilter[1]:g}"] if self.prefilter else []
        if self.beta:
            score = "reducible " if self.reducible else "proxy top, " if self.proxy else ""
            parts += [f"online {score}beta {self.beta:g}"]
            parts += [f"losses reused {self.reuse} ep"] if self.reuse else []
        if self.prune:
            parts += [f"pruning {self.prune[0]:g}/{self.prune[1]:g} x{self.prune[2]:g}"]
        label = " + ".join(parts) or ("the labels' pick" if self.auto else "no filtering")
        label = f"noisy_share 0.1: {label}" if self.auto else label
        return label + (f" ({self.epochs:g}x epochs)" if self.epochs else "")

    def length(self, base_epochs: int, budget: float) -> dict:
        """``train``'s keyword for this arm's schedule: its epochs, or the FLOPs budget they fill."""
        return {"epochs": max(1, round(self.epochs * base_epochs))} if self.epochs else {"budget": budget}

    @property
    def measured_cost(self) -> bool:
        """Whether an epoch's cost is known only once run (remembered losses, pruning, a proxy's)."""
        return bool(self.reuse or self.prune or self.proxy)


@dataclass
class Prefiltered:
    keep: np.ndarray
    dropped: dict[str, int]
    flops: int
    wall_seconds: float
    losses: np.ndarray | None  # each row's reference loss, when computed


class PerSample:
    """Exact FLOPs per sample of a training step's forward and backward and of a no-grad forward."""

    def __init__(self, data: Dataset):
        import torch

        from trainyard import algorithms
        from trainyard.spec import Algorithm, Hyperparameters
        from trainyard.training.flops import FlopMeter

        hp = Hyperparameters(hidden_sizes=data.hidden_sizes)
        probe, loss_fn = algorithms.build(
            Algorithm(builtin="mlp-classifier"), hp, data.x_train, data.y_train, data.num_classes
        )
        meter = FlopMeter(probe, loss_fn)
        x, y = torch.from_numpy(data.x_train[:1]), torch.from_numpy(data.y_train[:1])
        meter.add_train_step(x, y)
        meter.add_evaluation(x)
        self.forward, self.backward, self.evaluation = meter.forward, meter.backward, meter.evaluation


def epoch_counts(rows: int, batch: int, beta: float | None, epochs: int) -> list[tuple[int, int]]:
    """``(rows trained, rows scored)`` in each epoch, as Trainyard's sampler and sifter deal them."""
    if not beta:  # no keep rule: every row dealt trains, none is scored
        return [(rows, 0)] * epochs
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    sifter = Sifter(Sifting(enabled=True, beta=beta, delay_steps=DELAY_STEPS), 0)
    candidates = sifter.candidate_batch(batch)
    sizes = [min(candidates, rows - i * candidates) for i in range(math.ceil(rows / candidates))]
    out, step = [], 0
    for _ in range(epochs):
        trained = scored = 0
        for size in sizes:
            trained += sifter.keep_count(size)
            scored += size if step >= DELAY_STEPS else 0
            step += 1
        out.append((trained, scored))
    return out


def cumulative_flops(cost: PerSample, rows: int, batch: int, beta: float | None, epochs: int, start: int = 0):
    """Training FLOPs at the end of each of ``epochs`` epochs, from ``start`` (the prefilter's)."""
    out, total = [], start
    for trained, scored in epoch_counts(rows, batch, beta, epochs):
        total += trained * (cost.forward + cost.backward) + scored * cost.evaluation
        out.append(total)
    return out


def epochs_within(cost: PerSample, rows: int, batch: int, beta: float | None, budget: float, start: int = 0) -> int:
    """The most epochs whose training FLOPs (from ``start``) stay within ``budget`` (at least 1)."""
    first, second = cumulative_flops(cost, rows, batch, beta, 2)
    guess = max(1, int((budget - start) / max(second - first, 1)) + 2)
    return max(1, sum(f <= budget * (1 + 1e-9) for f in cumulative_flops(cost, rows, batch, beta, guess, start)))


@functools.cache
def prefiltered(name: str, seed: int, quick: bool, fractions: tuple[float, float], with_losses: bool) -> Prefiltered:
    """Trainyard's offline prefilter on the training rows, timed here (once per process and setting)."""
    from trainyard import filtering
    from trainyard.spec import Prefilter

    data = load(name, seed, quick)
    config = Prefilter(
        enabled=True, drop_learnt_fraction=fractions[0], drop_unlearnable_fraction=fractions[1], seed=seed
    )
    started = time.perf_counter()
    done = filtering.prefilter(  # as the filtering stage runs it, its default class balance guard included
        data.x_train,
        data.y_train,
        config,
        "classification",
        data.num_classes,
        with_losses=with_losses,
        min_class_fraction=config.min_class_fraction,
    )
    return Prefiltered(done.keep, done.dropped, done.flops, time.perf_counter() - started, done.losses)


@functools.cache
def adapted(name: str, seed: int, quick: bool) -> tuple[Setting, Prefiltered]:
    """What ``sifting: {enabled: true, noisy_share: 0.1}`` picks for this dataset and seed, and its filtering
    stage's work, run as the engine runs it (``filtering.filter_samples``: the labels measured, the proxy's cost
    against the job's model checked on a clean channel, then exact duplicates out for the proxy's top selection,
    whose keep rule prefilters by default), timed here on its second run (the first pays this process's first
    calls into torch, which a pipeline's filtering stage has made before)."""
    from trainyard import filtering
    from trainyard.datasets import StagedData
    from trainyard.spec import parse_job

    data = load(name, seed, quick)
    job = parse_job(_spec(data, Setting(), 0.003, 1, seed) | {"sifting": {"enabled": True, "noisy_share": 0.1}})
    with tempfile.TemporaryDirectory() as folder:
        np.savez(f"{folder}/train.npz", x=data.x_train, y=data.y_train)
        rows = {"train": len(data.x_train)}
        staged = StagedData(f"{folder}/train.npz", None, {"num_outputs": data.num_classes}, rows, [])
        for _ in range(2):
            started = time.perf_counter()
            report = filtering.filter_samples(
                staged, job.sifting, "classification", None, job.algorithm, job.hyperparameters
            )
            wall = time.perf_counter() - started
    assert report.sifting is not None and report.label_noise is not None  # (adaptive: it picked)
    keep = ~filtering.duplicates(data.x_train, data.y_train) if report.dropped else np.ones(len(data.x_train), bool)
    assert int(keep.sum()) == report.kept and set(report.dropped) <= {"duplicate"}
    proxy, beta = report.sifting.score == "proxy", report.sifting.beta
    chosen = Setting(beta, proxy=True, auto=True) if proxy else Setting(0.0, None, prune=(0.7, 0.1, 3.0), auto=True)
    return chosen, Prefiltered(keep, report.dropped, report.scoring_flops, wall, None)


def timed(repeats: int, *args, **kwargs) -> Run:
    """``train(*args, **kwargs)`` done ``repeats`` times, one after another: the same run each time
    (one group on the CPU, seeded: its accuracy and FLOPs repeat to the digit), its wall time at each
    epoch end and per step the median over the repeats. A digits baseline reaches its target in about
    half a second, so one stall of the machine moved a single run's wall ratio by half (stops 26 and
    27 measured 1.03x and 1.51x for one arm and seed). A repeat that differs is reported and the first
    run is used as it is."""
    runs = [train(*args, **kwargs) for _ in range(repeats)]
    first = runs[0]
    if any(run.accuracy != first.accuracy or run.cum_flops != first.cum_flops for run in runs[1:]):
        print(f"  WARNING {first.setting.label()} seed {first.seed}: its repeats differ; wall of the first run only")
        return first
    return replace(
        first,
        cum_wall=[statistics.median(walls) for walls in zip(*(run.cum_wall for run in runs), strict=True)],
        median_step_ms=statistics.median(run.median_step_ms for run in runs),
    )


def baseline_budget(name: str, seed: int, quick: bool, epochs: int) -> int:
    """Training FLOPs of ``epochs`` epochs without filtering."""
    data = load(name, seed, quick)
    return cumulative_flops(PerSample(data), len(data.x_train), data.batch_size, None, epochs)[-1]


def train(
    name: str,
    seed: int,
    quick: bool,
    setting: Setting,
    lr: float,
    *,
    epochs: int | None = None,
    budget: float | None = None,
    init: int = 0,
) -> Run:
    """Train one arm as a Trainyard job: ``epochs`` epochs, or as many as fit in ``budget`` training FLOPs.
    ``init`` shifts the model's seed (``hyperparameters.seed``) from ``seed``, which also draws the data: the
    same data and split with another initialisation and batch order."""
    data = load(name, seed, quick)
    cost = PerSample(data)
    if setting.auto:  # the run is of what the filtering stage picked from the labels, on this arm's schedule
        chosen, pre = adapted(name, seed, quick)
        setting = replace(chosen, epochs=setting.epochs)
    else:
        pre = prefiltered(name, seed, quick, setting.prefilter, setting.reducible) if setting.prefilter else None
    x, y = (data.x_train[pre.keep], data.y_train[pre.keep]) if pre else (data.x_train, data.y_train)
    reference = pre.losses[pre.keep].astype(np.float32) if setting.reducible else None
    pre_flops, pre_wall = (pre.flops, pre.wall_seconds) if pre else (0, 0.0)
    fit = epochs is None
    if fit:
        # With reused losses or pruning an epoch costs less than online sifting's, by an amount known only once
        # run: its count is first fitted as online sifting's (an upper bound on the cost), then once
        # more from the run's own per-epoch FLOPs.
        epochs = epochs_within(cost, len(x), data.batch_size, setting.beta, budget, pre_flops)
    outcome, commits = _job(data, x, y, setting, lr, epochs, seed + init, reference)
    if fit and setting.measured_cost:
        more = _refit_epochs(outcome.history, epochs, budget - pre_flops)
        if more > epochs:
            epochs = more
            outcome, commits = _job(data, x, y, setting, lr, epochs, seed + init, reference)
    done = len(outcome.history)
    # Measured per epoch by the group itself (its FLOP meter, in the history).
    cum_flops = [pre_flops + entry["group_train_flops"] for entry in outcome.history]
    rebuilt = cumulative_flops(cost, len(x), data.batch_size, setting.beta, done, pre_flops)
    check = (
        None
        if setting.measured_cost or rebuilt == cum_flops
        else f"rebuilt {rebuilt[-1]:,} != measured {cum_flops[-1]:,}"
    )
    gaps = np.diff(commits)
    step_s = float(statistics.median(gaps)) if len(gaps) else 0.0
    ends = np.cumsum([entry["steps"] for entry in outcome.history])  # pruning's batch_factor: fewer in some epochs
    cum_wall = [pre_wall + commits[min(int(end), len(commits)) - 1] - commits[0] + step_s for end in ends]
    report = None
    if pre is not None:
        report = {"dropped": pre.dropped, "kept_fraction": float(pre.keep.mean())}
        if data.noisy is not None:
            report |= {
                "flipped_removed": int((data.noisy & ~pre.keep).sum()),
                "flipped": int(data.noisy.sum()),
                "clean_removed": int((~data.noisy & ~pre.keep).sum()),
            }
    return Run(
        cadence=len(data.x_train) * (cost.forward + cost.backward),  # the baseline's epoch: every row trained once
        setting=setting,
        lr=lr,
        epochs=epochs,
        seed=seed,
        history=outcome.history,
        cum_flops=cum_flops,
        cum_wall=cum_wall,
        eval_flops=outcome.flops["evaluation"],
        train_rows=len(x),
        median_step_ms=1000 * step_s,
        stop_reason=outcome.stop_reason,
        prefilter=report,
        flop_check=check,
    )


def _refit_epochs(history: list[dict], epochs: int, budget: float) -> int:
    """The most epochs within ``budget`` at the measured cost: the first epoch's, then the later ones' mean."""
    spent = [entry["group_train_flops"] for entry in history]
    first = spent[0]
    later = (spent[-1] - first) / (len(spent) - 1) if len(spent) > 1 else first
    return max(epochs, 1 + int((budget * (1 + 1e-9) - first) // max(later, 1)))


def _spec(data: Dataset, setting: Setting, lr: float, epochs: int, seed: int) -> dict:
    """The job spec of one run."""
    hp = {"epochs": epochs, "batch_size": data.batch_size, "learning_rate": lr, "lr_schedule": "cosine"}
    return {
        "name": "sifting-bench",
        "algorithm": {"builtin": "mlp-classifier"},
        "hyperparameters": hp | {"hidden_sizes": data.hidden_sizes, "seed": seed},
        "inputs": {
            "train": {"s3_uri": "s3://unused/train/", "label": "label"},
            "validation": {"s3_uri": "s3://unused/validation/", "label": "label"},
        },
        "output": {"s3_uri": "s3://unused/out/"},
        "resources": {"replicas": 1},
        "sifting": {
            "enabled": setting.beta is not None,
            "beta": 1.0 if setting.beta is None else setting.beta,
            **({} if setting.proxy else {"delay_steps": DELAY_STEPS}),
            "score": "reducible_loss" if setting.reducible else "proxy" if setting.proxy else "loss",
            "selection": "top" if setting.proxy else "keep_rule",
            "reuse_loss_epochs": setting.reuse,
            "prune": dict(
                zip(("learnt_fraction", "hardest_fraction", "batch_factor"), setting.prune or (0, 0, 1), strict=True)
            ),
        },
    }


def _job(data: Dataset, x, y, setting: Setting, lr: float, epochs: int, seed: int, reference):
    """One Trainyard job without Prefect, one replica group: ``(outcome, commit times)``."""
    from trainyard.home import job_dir, new_job_id
    from trainyard.spec import parse_job
    from trainyard.training import supervisor
    from trainyard.training.plan import TrainingPlan

    spec = _spec(data, setting, lr, epochs, seed)
    job = parse_job(spec)
    job_id = new_job_id(job.name)
    folder = job_dir(job_id)
    (folder / "data").mkdir()
    np.savez(folder / "data/train.npz", x=x, y=y, **({"irreducible": reference} if reference is not None else {}))
    np.savez(folder / "data/validation.npz", x=data.x_val, y=data.y_val)
    schema = {"num_outputs": data.num_classes, "classes": list(range(data.num_classes)), "task": "classification"}
    train_path, val_path = str(folder / "data/train.npz"), str(folder / "data/validation.npz")
    plan = TrainingPlan(job_id, job.model_dump(mode="json"), train_path, val_path, schema, 1, "")
    outcome, _ = supervisor.launch_and_train(job, plan, folder)
    with (folder / "replicas/0/attempt-0/steps.jsonl").open() as log:
        commits = [json.loads(line)["unix"] for line in log]
    shutil.rmtree(folder)
    return outcome, commits
