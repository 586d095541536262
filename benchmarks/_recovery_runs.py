"""The job of ``benchmarks/recovery.py`` and one run of each kind, Trainyard's and the restart baseline's,
with the figures read from a run's step timeline (every worker's committed steps, per attempt), and the CPU
that other processes on the machine used during a run.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from _recovery_baseline import DdpRun, read_steps, run_ddp

BUCKET = "bench"
ROWS, FEATURES, BATCH = 4096, 16, 256
CHECKPOINT_BUDGET = 0.03  # a user's rule: checkpoints cost at most this share of training time
SCHEMA = {"num_outputs": 2, "classes": [0, 1], "task": "classification"}
BUSY_SHARE = 0.25  # a run is flagged when other processes used more than this many CPU s per s of it
Timeline = dict[int, list[list[tuple[int, float]]]]  # worker -> attempt -> [(step, unix)] committed


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
    outcome, _ = supervisor.launch_and_train(job, plan, folder)
    wall = time.perf_counter() - started
    timeline: Timeline = {}
    for replica in (0, 1):
        attempts = sorted(folder.glob(f"replicas/{replica}/attempt-*"), key=lambda p: int(p.name.split("-")[1]))
        timeline[replica] = [read_steps(a / "steps.jsonl") for a in attempts]
        if not (attempts[0] / "steps.jsonl").exists():
            raise RuntimeError(f"no steps.jsonl in {attempts[0]}: does the trainer honour TRAINYARD_STEP_LOG=1?")
    shutil.rmtree(folder)
    return timeline, outcome, wall


def ddp_run(bench: Bench, name: str, every: int, fail_at: int | None) -> DdpRun:
    config = {"job": bench.spec, "data": str(bench.data), "steps": bench.args.steps, "checkpoint_every": every}
    config |= {"fail_at": fail_at, "bucket": BUCKET, "prefix": f"{name}/"}
    return run_ddp(config, bench.workdir / name, bench.env)


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
    """Around the failure of worker ``failed``: when it was back, and the survivor's throughput and stall."""
    fail_step, t_fail = timeline[failed][0][-1]  # its last commit; it dies at the top of the next step
    restarted = next((steps for steps in timeline[failed][1:] if steps), None)
    if restarted is None:  # it never committed: the survivor finished the job first
        return dict.fromkeys(("before", "during", "stall", "back", "past", "in-run lost"), math.nan)
    t_back = restarted[0][1]  # the restarted worker's first commit
    t_past = next(u for s, u in restarted if s > fail_step)  # ... of a step the job had not done
    own = timeline[survivor][0]  # the survivor's original process
    window = min(max(t_back - t_fail, 1.0), t_fail - own[0][1])  # as long as the recovery, if it ran that long
    before = sum(s <= fail_step and u > t_fail - window for s, u in own) / window
    during = sum(s > fail_step and u < t_back for s, u in own) / (t_back - t_fail)
    every = sorted(u for steps in timeline[survivor] for _, u in steps)
    gaps = [b - a for a, b in zip(every, every[1:], strict=False) if b > t_fail - 1.0 and a < t_back + 1.0]
    # Time lost judged from this run alone, immune to load drift between runs: the window from the
    # failure to the first commit of a new step, less the progress made in it at this run's step time.
    progress = max([s - fail_step for s, u in own if u < t_past] + [0])
    steps = max(s for attempts in timeline.values() for a in attempts for s, _ in a)
    step_s = (training_wall(timeline) - (t_past - t_fail)) / (steps - progress)
    in_run = t_past - t_fail - progress * step_s
    return {
        "before": before,
        "during": during,
        "stall": max(gaps),
        "back": t_back,
        "past": t_past,
        "in-run lost": in_run,
    }


# --- machine load ---------------------------------------------------------------------------------


def cpu_snapshot(bench: Bench) -> tuple[float, float, float, float]:
    """(wall, CPU s used by the whole machine, by this process and its reaped children, by moto)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    machine = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = sum(
        getattr(resource.getrusage(w), f)
        for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for f in ("ru_utime", "ru_stime")
    )
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
