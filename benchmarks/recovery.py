"""Recovery benchmark: one replica group killed mid-job, Trainyard against a torchrun-style restart.

Run from the repository root::

    .venv/bin/python benchmarks/recovery.py            # 3,200 steps a run, 3 repeats (about 6 minutes)
    .venv/bin/python benchmarks/recovery.py --quick    # a small smoke run

The same job throughout: the built-in ``mlp-classifier`` (hidden sizes 256, 256) on 4,096 rows of 16
features, a global batch of 256 over 2 workers, AdamW, the same number of steps, the same rows at
every step, one worker killed (SIGKILL, by itself) when it has committed ``--fail-at`` steps. In the
same run, for each repeat:

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
From those logs: the training wall (first to last committed step of the job), time lost per
failure (wall with the failure minus the failure-free wall, per repeat, median), steps recomputed
(step numbers a worker committed twice, over its attempts), the survivor's throughput (group 0's
committed steps a second) between the failure (the killed worker's last commit) and the restarted
worker's first commit, against the same length of time just before the failure, and its stall (the
longest gap between its consecutive commits from 1 s before the failure to 1 s after the restart's
first commit). Recovery seconds: Trainyard's ``outcome.recoveries`` (the supervisor noticing the
failure to the restarted group's first commit); for the baseline, the launcher noticing it to the
first commit after the restart. Per-step time: the median gap between consecutive commits, failure-
free. Figures are medians over the repeats; the order of the runs alternates between repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [p for p in (str(REPO), str(REPO / "benchmarks")) if p not in sys.path]

from _recovery_baseline import DdpRun, checkpoint_bytes, run_ddp  # noqa: E402

BUCKET = "bench"
ROWS, FEATURES, BATCH = 4096, 16, 256
CHECKPOINT_BUDGET = 0.03  # a user's rule: checkpoints cost at most this share of training time
BUSY_SHARE = 0.25  # a run is flagged when other processes used more than this many CPU s per s of it
Timeline = dict[int, list[list[tuple[int, float]]]]  # worker -> attempt -> [(step, unix)] committed


@dataclass
class Target:
    name: str
    met: bool
    detail: str


@dataclass
class Bench:
    args: argparse.Namespace
    workdir: Path
    env: dict[str, str]  # the endpoint's AWS variables, for the DDP workers
    data: Path
    spec: dict
    moto_pid: int | None
    busy_runs: int = 0


# --- one run of each kind -------------------------------------------------------------------------


def trainyard_run(bench: Bench, fail_at: int | None) -> tuple[Timeline, object, float]:
    """One Trainyard job, no Prefect: its step timeline, its ``TrainingOutcome``, its process wall."""
    from trainyard import launch
    from trainyard.home import job_dir, new_job_id
    from trainyard.spec import parse_job
    from trainyard.training import supervisor
    from trainyard.training.plan import TrainingPlan

    faults = [{"replica": 1, "at_step": fail_at, "kind": "kill"}] if fail_at else []
    job = parse_job({**bench.spec, "elastic": {"fault_injection": faults}})
    job_id = new_job_id(job.name)
    folder = job_dir(job_id)
    plan = TrainingPlan(job_id, job.model_dump(mode="json"), str(bench.data), None, SCHEMA, 2, "")
    started = time.perf_counter()
    handle = launch.launch(job_id, folder, job.resources)
    plan.lighthouse_addr = handle.lighthouse_addr
    try:
        outcome = supervisor.train(handle, plan, job)
    finally:
        launch.shutdown(handle)
    wall = time.perf_counter() - started
    timeline: Timeline = {}
    for replica in (0, 1):
        attempts = sorted(folder.glob(f"replicas/{replica}/attempt-*"), key=lambda p: int(p.name.split("-")[1]))
        timeline[replica] = [read_steps(a / "steps.jsonl") for a in attempts]
        if not all(timeline[replica]):
            raise RuntimeError(f"no steps.jsonl in {attempts}: does the trainer honour TRAINYARD_STEP_LOG=1?")
    shutil.rmtree(folder)
    return timeline, outcome, wall


SCHEMA = {"num_outputs": 2, "classes": [0, 1], "task": "classification"}


def ddp_run(bench: Bench, name: str, every: int, fail_at: int | None) -> DdpRun:
    config = {"job": bench.spec, "data": str(bench.data), "steps": bench.args.steps, "checkpoint_every": every}
    config |= {"fail_at": fail_at, "bucket": BUCKET, "prefix": f"{name}/"}
    return run_ddp(config, bench.workdir / name, bench.env)


def read_steps(path: Path) -> list[tuple[int, float]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [(r["step"], r["unix"]) for r in map(json.loads, lines) if r]


# --- figures from step timelines ------------------------------------------------------------------


def commits(timeline: Timeline) -> list[float]:
    return sorted(u for attempts in timeline.values() for steps in attempts for _, u in steps)


def training_wall(timeline: Timeline) -> float:
    times = commits(timeline)
    return times[-1] - times[0]


def step_ms(timeline: Timeline, worker: int = 0) -> float:
    """Median gap between a worker's consecutive commits, in ms."""
    times = [u for steps in timeline[worker] for _, u in steps]
    return 1000 * statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def recomputed(timeline: Timeline) -> int:
    """Steps of the job computed again: per worker, step numbers committed more than once; the most."""
    counts = []
    for attempts in timeline.values():
        numbers = [s for steps in attempts for s, _ in steps]
        counts.append(len(numbers) - len(set(numbers)))
    return max(counts)


def failure_figures(timeline: Timeline, failed: int = 1, survivor: int = 0) -> dict[str, float]:
    """The survivor's throughput and stall around the failure of worker ``failed``."""
    t_fail = timeline[failed][0][-1][1]  # its last commit; it dies at the top of the next step
    t_back = timeline[failed][1][0][1]  # the restarted worker's first commit
    own = [u for _, u in timeline[survivor][0]]  # the survivor's original process
    window = max(t_back - t_fail, 1.0)
    before = sum(t_fail - window < u <= t_fail for u in own) / window
    during = sum(t_fail < u < t_back for u in own) / (t_back - t_fail)
    every = sorted(u for steps in timeline[survivor] for _, u in steps)
    gaps = [b - a for a, b in zip(every, every[1:], strict=False) if b > t_fail - 1.0 and a < t_back + 1.0]
    return {"before": before, "during": during, "stall": max(gaps), "back_s": t_back - t_fail}


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
                every, calibration = choose_k(bench, step_ms(runs["ddp plain"].steps) / 1000)
            cpu = cpu_snapshot(bench)
            if kind.startswith("ddp"):
                fail_at = args.fail_at if kind == "ddp kill" else None
                runs[kind] = ddp_run(bench, f"{kind.replace(' ', '-')}-{repeat}", 0 if kind == "ddp plain" else every, fail_at)
            else:
                runs[kind] = trainyard_run(bench, args.fail_at if kind == "ty kill" else None)
            share = other_cpu_share(bench, cpu)
            bench.busy_runs += share > BUSY_SHARE
            print(f"  repeat {repeat + 1}/{args.repeats}: {kind} done; other processes' CPU {share:.2f} s/s", flush=True)

        plain, free, kill = runs["ddp plain"], runs["ddp free"], runs["ddp kill"]
        (ty_free, _, ty_free_wall), (ty_kill, outcome, ty_kill_wall) = runs["ty free"], runs["ty kill"]
        if outcome.steps != args.steps or len(outcome.recoveries) != 1:
            print(f"  warning: Trainyard ran {outcome.steps} steps, recoveries {outcome.recoveries}", flush=True)
        add("ty free wall", training_wall(ty_free))
        add("ty kill wall", training_wall(ty_kill))
        add("ty lost", training_wall(ty_kill) - training_wall(ty_free))
        add("ty process lost", ty_kill_wall - ty_free_wall)
        add("ty recovery", outcome.recoveries[0]["recovery_seconds"] if outcome.recoveries else math.nan)
        add("ty recomputed", recomputed(ty_kill))
        add("ty step ms", step_ms(ty_free))
        add("ddp plain wall", training_wall(plain.steps))
        add("ddp free wall", training_wall(free.steps))
        add("ddp kill wall", training_wall(kill.steps))
        add("ddp lost", training_wall(kill.steps) - training_wall(free.steps))
        add("ddp process lost", kill.wall_s - free.wall_s)
        add("ddp recovery", kill.steps[1][1][0][1] - kill.failures[0]["detected_unix"])
        add("ddp recomputed", recomputed(kill.steps))
        add("ddp resumed from", kill.resumed_from_step[0])
        add("ddp step ms", step_ms(plain.steps))
        add("ddp checkpoint s", statistics.median(free.checkpoint_seconds or [math.nan]))
        for who, timeline in (("ty", ty_kill), ("ddp", kill.steps)):
            for key, value in failure_figures(timeline).items():
                add(f"{who} {key}", value)
        print(
            f"  repeat {repeat + 1}: time lost Trainyard {samples['ty lost'][-1]:.2f} s, baseline "
            f"{samples['ddp lost'][-1]:.2f} s; survivor stall {samples['ty stall'][-1]:.2f} s, steps/s "
            f"{samples['ty before'][-1]:.0f} before, {samples['ty during'][-1]:.1f} during recovery",
            flush=True,
        )
    return samples, every, calibration


def choose_k(bench: Bench, step_s: float) -> tuple[int, dict[str, float]]:
    """K as a user would pick it: a round number of steps at which checkpointing costs <= 3%."""
    import boto3
    import numpy as np
    import torch

    from trainyard import algorithms
    from trainyard.spec import TrainingJob

    job = TrainingJob.model_validate(bench.spec)
    data = np.load(bench.data)
    model, loss_fn = algorithms.build(job.algorithm, job.hyperparameters, data["x"], data["y"], 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.hyperparameters.learning_rate)
    x, y = torch.from_numpy(data["x"][:BATCH]), torch.from_numpy(data["y"][:BATCH])
    loss_fn(model(x), y).mean().backward()
    optimizer.step()  # the optimizer's state exists, as in a checkpoint mid-training
    s3, times = boto3.client("s3", endpoint_url=bench.env["AWS_ENDPOINT_URL_S3"]), []
    for i in range(5):
        began = time.perf_counter()
        body = checkpoint_bytes({"step": i, "model": model.state_dict(), "optim": optimizer.state_dict()})
        s3.put_object(Bucket=BUCKET, Key=f"calibration/{i}.pt", Body=body)
        times.append(time.perf_counter() - began)
    save_s = statistics.median(times)
    raw = save_s / (CHECKPOINT_BUDGET * step_s)
    k = min(m * 10**e for e in range(10) for m in (1, 2, 5) if m * 10**e >= raw)
    return k, {"save_s": save_s, "step_s": step_s, "raw": raw, "bytes": len(body)}


# --- machine load ---------------------------------------------------------------------------------


def cpu_snapshot(bench: Bench) -> tuple[float, float, float, float]:
    """(wall, CPU s used by the whole machine, by this process and its reaped children, by moto)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    machine = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
    try:
        stat = Path(f"/proc/{bench.moto_pid}/stat").read_text().rsplit(")", 1)[1].split()
        moto = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        moto = 0.0
    return time.perf_counter(), machine, own, moto


def other_cpu_share(bench: Bench, before: tuple[float, float, float, float]) -> float:
    """CPU s per s that processes other than this benchmark's used since ``before``."""
    after = cpu_snapshot(bench)
    wall, machine, own, moto = (a - b for a, b in zip(after, before, strict=True))
    return max(0.0, machine - own - moto) / wall


# --- report ---------------------------------------------------------------------------------------


def detection_settings() -> str:
    """The failure-detection constants in force, read from the modules (so they follow changes)."""
    from datetime import timedelta

    from trainyard import launch
    from trainyard.training import supervisor, trainer

    parts = []
    for module in (launch, trainer, supervisor):
        for name, value in vars(module).items():
            if name.isupper() and not name.endswith("_ENV") and any(w in name for w in ("TIMEOUT", "SECONDS", "_MS")):
                shown = f"{value.total_seconds():g} s" if isinstance(value, timedelta) else f"{value}"
                parts.append(f"{module.__name__.rsplit('.', 1)[1]}.{name}={shown}")
    return ", ".join(parts)


def report(bench: Bench, samples: dict[str, list[float]], every: int, calibration: dict, wall: float) -> None:
    import torch
    import torchft
    from rich.console import Console
    from rich.table import Table

    def med(key: str) -> float:
        return statistics.median(samples[key])

    args, console = bench.args, Console(width=200)
    facts = [
        ("machine", f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end"),
        ("system", f"{platform.system()} {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}, torchft {getattr(torchft, '__version__', '?')}"),
        ("job", f"mlp-classifier {args.hidden}, {ROWS} rows x {FEATURES} features, global batch {BATCH} over 2 workers (1 thread each), {args.steps} steps, worker 1 killed after committing step {args.fail_at}"),
        ("failure detection", detection_settings()),
        ("checkpoints", f"every K={every} steps" + (f" (save {calibration['save_s'] * 1000:.0f} ms of {calibration['bytes'] / 2**20:.1f} MiB to S3, step {calibration['step_s'] * 1000:.1f} ms: {CHECKPOINT_BUDGET:.0%} cost at {calibration['raw']:.0f} steps, rounded up)" if calibration else " (--checkpoint-every)") + f"; measured overhead {med('ddp free wall') / med('ddp plain wall') - 1:+.1%} of the training wall"),
        ("repeats", f"{args.repeats}, run order alternating; medians"),
    ]
    for key, value in facts:
        console.print(f"[bold]{key}:[/] {value}", highlight=False)
    table = Table(title="Recovery from one killed worker: Trainyard vs a torchrun-style restart from S3 checkpoints (medians)")
    for column in ("figure", "Trainyard", f"restart baseline (K={every})", "Trainyard vs baseline"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    lost_cut = 1 - med("ty lost") / med("ddp lost")
    table.add_row("training wall, failure-free s", f"{med('ty free wall'):.2f}", f"{med('ddp free wall'):.2f}", f"x{med('ty free wall') / med('ddp free wall'):.2f}")
    table.add_row("training wall, one failure s", f"{med('ty kill wall'):.2f}", f"{med('ddp kill wall'):.2f}", "")
    table.add_row("time lost per failure s", f"{med('ty lost'):.2f}", f"{med('ddp lost'):.2f}", f"{lost_cut:.0%} less")
    table.add_row("  (whole processes, start-up included) s", f"{med('ty process lost'):.2f}", f"{med('ddp process lost'):.2f}", "")
    table.add_row("recovery s (failure noticed -> restarted worker's first commit)", f"{med('ty recovery'):.2f}", f"{med('ddp recovery'):.2f}", "")
    table.add_row("steps recomputed (most over repeats)", f"{max(samples['ty recomputed']):.0f}", f"{max(samples['ddp recomputed']):.0f} (resumed at {med('ddp resumed from'):.0f})", "")
    ty_keep, ddp_keep = med("ty during") / med("ty before"), med("ddp during") / med("ddp before")
    table.add_row("survivor steps/s: before -> during recovery", f"{med('ty before'):.0f} -> {med('ty during'):.1f} ({ty_keep:.0%})", f"{med('ddp before'):.0f} -> {med('ddp during'):.1f} ({ddp_keep:.0%})", "")
    table.add_row("survivor stall (longest gap between its commits) s", f"{med('ty stall'):.2f}", f"{med('ddp stall'):.2f}", "")
    table.add_row("per step, failure-free ms (baseline: no checkpoints)", f"{med('ty step ms'):.2f}", f"{med('ddp step ms'):.2f}", f"x{med('ty step ms') / med('ddp step ms'):.2f} (torchft overhead)")
    console.print(table)
    for key in ("ty lost", "ddp lost", "ty stall", "ty during", "ty recovery", "ddp recovery", "ty step ms", "ddp step ms"):
        console.print(f"  {key} per repeat: {', '.join(f'{v:.2f}' for v in samples[key])}", highlight=False)
    if bench.busy_runs:
        console.print(f"[yellow]warning:[/] during {bench.busy_runs} run(s) other processes used more than {BUSY_SHARE} CPU s per s: those timings are inflated and noisy; rerun on an idle machine before concluding from small differences.")
    targets = [
        Target("time lost at least 93% below the restart baseline", lost_cut >= 0.93, f"{med('ty lost'):.2f} s vs {med('ddp lost'):.2f} s, {lost_cut:.1%} less (target >= 93%)"),
        Target("no committed step recomputed", max(samples["ty recomputed"]) == 0, f"{max(samples['ty recomputed']):.0f} step(s); the baseline recomputed {max(samples['ddp recomputed']):.0f}"),
        Target("survivors keep at least 90% of their throughput during recovery", ty_keep >= 0.9, f"{med('ty during'):.1f} vs {med('ty before'):.0f} steps/s before, {ty_keep:.1%} (target >= 90%)"),
        Target("survivors' stall at a failure at most 1 s", med("ty stall") <= 1.0, f"{med('ty stall'):.2f} s (worst repeat {max(samples['ty stall']):.2f} s; target <= 1 s)"),
    ]
    for target in targets:
        console.print(f"target {'[green]met[/]' if target.met else '[red]NOT MET[/]'}: {target.name}: {target.detail}")
    console.print(f"whole benchmark run: {wall:.0f} s")


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3200, help="steps a run (a multiple of 16, the steps an epoch)")
    parser.add_argument("--fail-at", type=int, default=None, help="worker 1 dies after this step (default: 40%% in)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind")
    parser.add_argument("--hidden", default="256,256", help="hidden layer widths of the mlp-classifier")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="baseline's K (default: chosen from a measurement)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 640 steps, 1 repeat")
    parser.add_argument("--workdir", type=Path, default=None, help="where logs and data go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 640, 1
    args.steps = max(32, -(-args.steps // 16) * 16)
    args.fail_at = args.fail_at or round(0.4 * args.steps)
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
    hyperparameters = {"epochs": args.steps // (ROWS // BATCH), "batch_size": BATCH, "learning_rate": 1e-3, "hidden_sizes": args.hidden}
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
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **server.env, "AWS_EC2_METADATA_DISABLED": "true"}
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
