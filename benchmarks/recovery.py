"""Recovery benchmark: one replica group killed mid-job, Trainyard against a torchrun-style restart.

Run from the repository root::

    .venv/bin/python benchmarks/recovery.py            # 3,200 steps a run, 3 repeats (about 6 minutes)
    .venv/bin/python benchmarks/recovery.py --quick    # a small smoke run

The same job throughout: the built-in ``mlp-classifier`` (hidden sizes 256, 256) on 4,096 rows of 16
features, a global batch of 256 over 2 workers, AdamW, the same number of steps, the same rows at
every step, one worker killed (SIGKILL, by itself) when it has committed ``--fail-at`` steps (by
default half-way between two of the baseline's checkpoints, about a quarter into the job, so that
the baseline recomputes K/2 steps: its average over failure steps). In the same run, for each repeat:

- Trainyard: ``launch.launch`` + ``supervisor.train`` with 2 torchft replica groups and a real
  lighthouse (as ``tests/unit/test_training.py`` runs them), failure-free and with
  ``elastic.fault_injection`` killing group 1; the supervisor restarts it and it heals from group 0.
- the restart baseline (``_recovery_baseline.py``): plain ``torch.distributed`` gloo DDP, 2 ranks
  launched as ``torchrun --max-restarts 1`` would; rank 0 checkpoints model and optimizer to S3
  (moto on 127.0.0.1) every K steps; when rank 1 dies every rank is stopped, restarted, loads the
  newest checkpoint and goes on. K is chosen as a user would: the round number of steps (1, 2 or 5
  times a power of ten) at which saving a checkpoint costs at most 3% of the training time, from a
  measured step time and checkpoint save time. Also run without checkpoints: plain DDP's step time.

Every worker logs ``{"step", "unix"}`` per committed step (Trainyard's ``TRAINYARD_STEP_LOG=1``).
From those logs:

- training wall: the job's first to last committed step;
- time lost per failure: the wall with the failure minus the failure-free wall, per repeat. Also,
  immune to the load drifting between runs, judged from the failure run alone: the time from the
  failure to the first commit of a step the job had not done yet, less the steps the survivor
  advanced the job by meanwhile times that run's step time outside that window;
- recovery: from the failure being noticed (Trainyard's supervisor, the baseline's launcher) to the
  restarted worker's first commit, and to the first commit of a new step (the baseline recomputes
  first); Trainyard's own figure from ``outcome.recoveries`` beside them;
- steps recomputed: step numbers a worker committed more than once, over its attempts;
- the survivor (worker 0): committed steps a second between the failure (the killed worker's last
  commit) and the restarted worker's first commit, against the same length of time just before the
  failure; its stall, the longest gap between its commits from 1 s before the failure to 1 s after
  the restarted worker's first commit;
- per-step time: the median gap between consecutive commits, failure-free (baseline: no checkpoints).

Figures are medians over the repeats; the order of the runs alternates between repeats.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [p for p in (str(REPO), str(REPO / "benchmarks")) if p not in sys.path]

from _recovery_baseline import choose_checkpoint_every  # noqa: E402
from _recovery_runs import (  # noqa: E402
    BATCH,
    BUCKET,
    BUSY_SHARE,
    CHECKPOINT_BUDGET,
    FEATURES,
    ROWS,
    Bench,
    cpu_snapshot,
    ddp_run,
    failure_figures,
    other_cpu_share,
    recomputed,
    step_ms,
    training_wall,
    trainyard_run,
)
from _targets import Target  # noqa: E402

# --- the measurements -----------------------------------------------------------------------------


def measure(bench: Bench) -> tuple[dict[str, list[float]], int, dict[str, float]]:
    """Every run of every repeat; returns the samples per figure, K, and the checkpoint calibration."""
    args = bench.args
    samples: dict[str, list[float]] = {}
    every = args.checkpoint_every
    calibration: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    for repeat in range(args.repeats):
        order = ["ddp plain", "ddp free", "ddp kill", "ty free", "ty kill"]
        runs: dict[str, object] = {}
        for kind in order if repeat % 2 == 0 else order[::-1]:
            if kind == "ddp free" and not every:  # after the first plain run: its step time sets K
                step_s = step_ms(runs["ddp plain"].steps) / 1000
                every, calibration = choose_checkpoint_every(bench.spec, bench.data, BUCKET, step_s, CHECKPOINT_BUDGET)
            if not args.fail_at and every:
                # Half-way between two checkpoints: the baseline recomputes K/2 steps, what it would on
                # average for a failure at a random step; about a quarter of the way into the job.
                args.fail_at = min(max(every * round(args.steps / 4 / every), every) + every // 2, args.steps // 2)
            cpu = cpu_snapshot(bench)
            if kind.startswith("ddp"):
                fail_at = args.fail_at if kind == "ddp kill" else None
                runs[kind] = ddp_run(
                    bench, f"{kind.replace(' ', '-')}-{repeat}", 0 if kind == "ddp plain" else every, fail_at
                )
            else:
                runs[kind] = trainyard_run(bench, args.fail_at if kind == "ty kill" else None)
            share = other_cpu_share(bench, cpu)
            bench.busy_runs += share > BUSY_SHARE
            timeline = runs[kind][0] if kind.startswith("ty") else runs[kind].steps
            print(
                f"  repeat {repeat + 1}/{args.repeats}, {kind}: training wall {training_wall(timeline):.2f} s, "
                f"{step_ms(timeline):.2f} ms a step (median); other processes' CPU {share:.2f} s/s",
                flush=True,
            )

        plain, free, kill = runs["ddp plain"], runs["ddp free"], runs["ddp kill"]
        (ty_free, _, ty_free_wall), (ty_kill, outcome, ty_kill_wall) = runs["ty free"], runs["ty kill"]
        if outcome.steps != args.steps or len(outcome.recoveries) != 1:
            failures = "; ".join(f"{f['replica']}/{f['attempt']}: {f['message']}" for f in outcome.failures)
            print(
                f"  warning: Trainyard ran {outcome.steps} steps, {len(outcome.recoveries)} recoveries; "
                f"failures: {failures}"
            )
        kills = {"ty": (ty_free, ty_kill, outcome.failures[0]), "ddp": (free.steps, kill.steps, kill.failures[0])}
        for who, (free_steps, kill_steps, failure) in kills.items():
            add(f"{who} free wall", training_wall(free_steps))
            add(f"{who} kill wall", training_wall(kill_steps))
            add(f"{who} lost", training_wall(kill_steps) - training_wall(free_steps))
            add(f"{who} recomputed", recomputed(kill_steps))
            for key, value in failure_figures(kill_steps).items():
                # from the launcher or supervisor noticing the failure
                add(f"{who} {key}", value - failure["detected_unix"] if key in ("back", "past") else value)
        add("ty process lost", ty_kill_wall - ty_free_wall)
        add("ddp process lost", kill.wall_s - free.wall_s)
        add("ty recovery", outcome.recoveries[0]["recovery_seconds"] if outcome.recoveries else math.nan)
        add("ty step ms", step_ms(ty_free))
        add("ddp plain wall", training_wall(plain.steps))
        add("ddp step ms", step_ms(plain.steps))
        add("ddp resumed from", kill.resumed_from_step[0])
        print(
            f"  repeat {repeat + 1}: time lost Trainyard {samples['ty lost'][-1]:.2f} s, baseline "
            f"{samples['ddp lost'][-1]:.2f} s; Trainyard's survivor: stall {samples['ty stall'][-1]:.2f} s, "
            f"{samples['ty before'][-1]:.0f} steps/s before, {samples['ty during'][-1]:.1f} during recovery",
            flush=True,
        )
    return samples, every, calibration


# --- report ---------------------------------------------------------------------------------------


def detection_settings() -> str:
    """The failure-detection constants in force, read from the modules (so they follow changes)."""
    from datetime import timedelta

    from trainyard import launch
    from trainyard.training import supervisor, trainer

    parts, seen = [], set()
    for module in (launch, trainer, supervisor):
        for name, value in vars(module).items():
            wanted = name.isupper() and any(w in name for w in ("TIMEOUT", "SECONDS", "_MS")) and name not in seen
            if wanted and not name.endswith("_ENV"):
                seen.add(name)  # supervisor imports trainer's PG_TIMEOUT: once is enough
                shown = f"{value.total_seconds():g} s" if isinstance(value, timedelta) else f"{value}"
                parts.append(f"{module.__name__.rsplit('.', 1)[1]}.{name}={shown}")
    return ", ".join(parts)


def report(bench: Bench, samples: dict[str, list[float]], every: int, calibration: dict, wall: float) -> None:
    from importlib.metadata import version

    from rich.console import Console
    from rich.table import Table

    def med(key: str) -> float:  # over the repeats that have the figure
        values = [v for v in samples[key] if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    def worst(key: str) -> float:
        return max((v for v in samples[key] if not math.isnan(v)), default=math.nan)

    args, console = bench.args, Console(width=200)
    overhead = med("ddp free wall") / med("ddp plain wall") - 1
    if calibration:
        chosen = (
            f"save {calibration['save_s'] * 1000:.0f} ms ({calibration['bytes'] / 2**20:.1f} MiB to S3), step "
            f"{calibration['step_s'] * 1000:.1f} ms: {CHECKPOINT_BUDGET:.0%} at {calibration['raw']:.0f} steps, "
            "rounded up"
        )
    else:
        chosen = "--checkpoint-every"
    facts = [
        ("machine", f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end"),
        (
            "system",
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"torch {version('torch')}, torchft {version('torchft')}",
        ),
        (
            "job",
            f"mlp-classifier {args.hidden}, {ROWS} rows x {FEATURES} features, global batch {BATCH} over 2 "
            f"workers (1 thread each), {args.steps} steps; worker 1 killed after committing step {args.fail_at}",
        ),
        ("failure detection", detection_settings()),
        ("baseline checkpoints", f"every K={every} steps ({chosen}); measured cost {overhead:+.1%} of training wall"),
        ("repeats", f"{args.repeats}, run order alternating; medians"),
    ]
    for key, value in facts:
        console.print(f"[bold]{key}:[/] {value}", highlight=False)

    lost_cut = 1 - med("ty lost") / med("ddp lost") if med("ddp lost") > 0 else math.nan
    in_run_cut = 1 - med("ty in-run lost") / med("ddp in-run lost")
    ty_keep, ddp_keep = med("ty during") / med("ty before"), med("ddp during") / med("ddp before")
    rows = [
        ("training wall, failure-free s", "free wall", ".2f", f"x{med('ty free wall') / med('ddp free wall'):.2f}"),
        ("training wall, one failure s", "kill wall", ".2f", ""),
        ("time lost per failure s", "lost", ".2f", f"{lost_cut:.1%} less"),
        ("  the same, whole processes (start-up included) s", "process lost", ".2f", ""),
        ("  from the failure run alone (see the docstring) s", "in-run lost", ".2f", f"{in_run_cut:.1%} less"),
        ("failure noticed -> restarted worker's first commit s", "back", ".2f", ""),
        ("failure noticed -> first commit of a new step s", "past", ".2f", ""),
        ("survivor steps/s before the failure", "before", ".0f", ""),
        ("survivor steps/s during recovery", "during", ".1f", f"{ty_keep:.1%} vs {ddp_keep:.1%} of before"),
        ("survivor stall (longest gap between its commits) s", "stall", ".2f", ""),
    ]
    table = Table(title="One killed worker: Trainyard vs a torchrun-style restart from S3 checkpoints (medians)")
    for column in ("figure", "Trainyard", f"restart baseline (K={every})", "Trainyard vs baseline"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for label, key, fmt, note in rows:
        table.add_row(label, format(med(f"ty {key}"), fmt), format(med(f"ddp {key}"), fmt), note)
    table.add_row("recovery s (Trainyard: outcome.recoveries)", f"{med('ty recovery'):.2f}", "", "")
    ty_recomputed, ddp_recomputed = worst("ty recomputed"), worst("ddp recomputed")
    resumed = f"{ddp_recomputed:.0f} (resumed at step {med('ddp resumed from'):.0f})"
    table.add_row("steps recomputed (worst repeat)", f"{ty_recomputed:.0f}", resumed, "")
    ratio = med("ty step ms") / med("ddp step ms")
    per_step = ("per step, failure-free ms (median; baseline without checkpoints)", "ty step ms", "ddp step ms")
    table.add_row(*per_step[:1], f"{med(per_step[1]):.2f}", f"{med(per_step[2]):.2f}", f"x{ratio:.2f} (torchft)")
    console.print(table)
    for key in (
        "ty lost",
        "ddp lost",
        "ty in-run lost",
        "ddp in-run lost",
        "ty stall",
        "ty during",
        "ty back",
        "ddp past",
        "ty step ms",
        "ddp step ms",
    ):
        console.print(f"  {key} per repeat: {', '.join(f'{v:.2f}' for v in samples[key])}", highlight=False)
    unseen = sum(math.isnan(v) for v in samples["ty back"])
    if unseen:
        console.print(
            f"[yellow]warning:[/] in {unseen} repeat(s) Trainyard's restarted group never committed a step (the "
            "survivor finished the job first): recovery figures are over the other repeats; use more --steps."
        )
    if bench.busy_runs:
        console.print(
            f"[yellow]warning:[/] during {bench.busy_runs} run(s) other processes used more than {BUSY_SHARE} CPU s "
            "per s: those timings are inflated and noisy; rerun on an idle machine before concluding from them."
        )
    targets = [
        Target(
            "time lost at least 93% below the restart baseline",
            lost_cut >= 0.93,
            f"{med('ty lost'):.2f} s vs {med('ddp lost'):.2f} s, {lost_cut:.1%} less (target >= 93%)"
            + ("; the baseline lost no time in this run: no ratio" if math.isnan(lost_cut) else "")
            + f"; judged from the failure runs alone {med('ty in-run lost'):.2f} s vs {med('ddp in-run lost'):.2f} s, "
            f"{in_run_cut:.1%} less",
        ),
        Target(
            "no committed step recomputed",
            ty_recomputed == 0,
            f"{ty_recomputed:.0f} step(s) in the worst repeat; the baseline recomputed {ddp_recomputed:.0f}",
        ),
        Target(
            "survivors keep at least 90% of their throughput during recovery",
            ty_keep >= 0.9,
            f"{med('ty during'):.1f} vs {med('ty before'):.0f} steps/s before the failure, {ty_keep:.1%} "
            "(target >= 90%)",
        ),
        Target(
            "survivors' stall at a failure at most 1 s",
            med("ty stall") <= 1.0,
            f"{med('ty stall'):.2f} s (worst repeat {worst('ty stall'):.2f} s; target <= 1 s)",
        ),
    ]
    for target in targets:
        console.print(target.line())
    console.print(f"whole benchmark run: {wall:.0f} s")


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3200, help="steps a run (a multiple of 16, the steps an epoch)")
    parser.add_argument(
        "--fail-at",
        type=int,
        default=None,
        help="worker 1 dies after this step (default: half-way between two checkpoints, about 25%% in)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind")
    parser.add_argument("--hidden", default="256,256", help="hidden layer widths of the mlp-classifier")
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="baseline's K (default: chosen from a measurement)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 1,600 steps, 1 repeat")
    parser.add_argument("--workdir", type=Path, default=None, help="where logs and data go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 1600, 1
    args.steps = max(32, -(-args.steps // 16) * 16)
    args.hidden = [int(w) for w in args.hidden.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    import boto3
    import numpy as np

    from trainyard.local_s3 import LocalS3

    args = parse_args(argv)
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="trainyard-recovery-", dir=args.workdir))
    os.environ.update({"TRAINYARD_HOME": str(workdir / "home"), "TRAINYARD_STEP_LOG": "1", "TRAINYARD_PROGRESS": "0"})
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = (x @ np.linspace(1.0, -0.5, FEATURES) > 0).astype(np.int64)  # an easy two-class problem
    np.savez(workdir / "train.npz", x=x, y=y)
    hyperparameters = {
        "epochs": args.steps // (ROWS // BATCH),
        "batch_size": BATCH,
        "learning_rate": 1e-3,
        "hidden_sizes": args.hidden,
    }
    spec = {
        "name": "recovery-bench",
        "algorithm": {"builtin": "mlp-classifier"},
        "hyperparameters": hyperparameters,
        "inputs": {"train": {"s3_uri": "s3://unused/train/", "label": "label"}},
        "output": {"s3_uri": "s3://unused/output/"},
        "resources": {"replicas": 2},
    }
    server = LocalS3().start()
    try:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            **server.env,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        os.environ.update(server.env)
        boto3.client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=BUCKET)
        bench = Bench(args, workdir, env, workdir / "train.npz", spec, server._proc.pid if server._proc else None)
        samples, every, calibration = measure(bench)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report(bench, samples, every, calibration, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
