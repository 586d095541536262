"""The restart baseline of ``benchmarks/recovery.py``: plain gloo DDP restarted from S3 checkpoints.

What a ``torchrun --nproc-per-node 2 --max-restarts 1`` job does, with its launcher written out here
so that every moment of it can be timed: ``run_ddp`` starts one worker process per rank with the
variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ``OMP_NUM_THREADS``), polls them every ``MONITOR_INTERVAL_SECONDS``
(torchrun's default), and when one fails stops the others (SIGTERM, then SIGKILL after a grace
period) and starts every rank again. A worker (``python benchmarks/_recovery_baseline.py CONFIG``)
joins an ``env://`` gloo process group, trains the same model on the same rows per step as a
Trainyard replica group (``torch.nn.parallel.DistributedDataParallel``), has rank 0 save model and
optimizer state to S3 every K steps, and on a restart loads the newest checkpoint from S3 and
continues from its step. Each rank appends ``{"step", "unix"}`` per step to
``<out>/attempt-<a>/rank-<r>.jsonl``, the format of Trainyard's ``steps.jsonl``.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script: make ``trainyard`` importable

MONITOR_INTERVAL_SECONDS = 0.1  # torchrun --monitor-interval default
STOP_GRACE_SECONDS = 5.0  # SIGTERM, then SIGKILL (torchrun waits up to 30 s; a blocked worker dies at once)
SEED_STRIDE = 1_000_003  # as trainyard.training.sampling: the same permutation of rows each epoch


@dataclass
class DdpRun:
    """One baseline job: every rank's committed steps per attempt, and what the launcher saw."""

    wall_s: float  # launcher start to the last worker's exit
    steps: dict[int, list[list[tuple[int, float]]]]  # rank -> attempt -> [(step, unix)]
    failures: list[dict] = field(default_factory=list)  # {"rank", "exit_code", "detected_unix"}
    resumed_from_step: list[int] = field(default_factory=list)  # checkpoint step each restart loaded
    checkpoint_seconds: list[float] = field(default_factory=list)  # rank 0's save times (serialise + upload)


def run_ddp(config: dict, out: Path, env: dict[str, str], world_size: int = 2, max_restarts: int = 1) -> DdpRun:
    """Run the DDP job described by ``config`` (see ``worker``) as torchrun would; raise if it fails for good."""
    from trainyard.servers import free_port

    out.mkdir(parents=True)
    config_path = out / "config.json"
    config_path.write_text(json.dumps({**config, "out": str(out)}))
    failures: list[dict] = []
    started = time.perf_counter()
    for attempt in range(max_restarts + 1):
        port = free_port()  # torchrun's c10d rendezvous hands out a new store each round too
        procs = []
        for rank in range(world_size):
            worker_env = {
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RESTART_COUNT": str(attempt),
                "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world_size)),
            }
            log = open(out / f"worker-{attempt}-{rank}.log", "wb")  # noqa: SIM115 - owned by the child
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(config_path)], env=worker_env, stdout=log, stderr=subprocess.STDOUT
                )
            )
            log.close()
        failed = _monitor(procs)
        done = [(out / f"attempt-{attempt}" / f"done-{rank}").exists() for rank in range(world_size)]
        if failed is not None and all(done):
            # Every rank had finished training: a crash while tearing down gloo is not a failure to recover from.
            print(f"  note: DDP rank {failed[0]} exited {failed[1]} after training to the end", flush=True)
            _stop(procs)
            failed = None
        if failed is None:
            break
        failures.append({"rank": failed[0], "exit_code": failed[1], "detected_unix": time.time()})
        _stop(procs)
        if attempt == max_restarts:
            tail = (out / f"worker-{attempt}-{failed[0]}.log").read_text(errors="replace")[-3000:]
            at = read_steps(out / f"attempt-{attempt}" / f"rank-{failed[0]}.jsonl")[-1:]
            raise RuntimeError(
                f"DDP rank {failed[0]} failed (exit {failed[1]}) after {attempt} restart(s), last step {at}:\n{tail}"
            )
    wall = time.perf_counter() - started
    steps = {
        rank: [read_steps(out / f"attempt-{a}" / f"rank-{rank}.jsonl") for a in range(attempt + 1)]
        for rank in range(world_size)
    }
    resumed = [json.loads(p.read_text())["step"] for p in sorted(out.glob("attempt-*/resumed.json"))]
    saves = out / "attempt-0" / "checkpoints.jsonl"
    seconds = [json.loads(line)["seconds"] for line in saves.read_text().splitlines()] if saves.exists() else []
    return DdpRun(wall, steps, failures, resumed, seconds)


def _monitor(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Wait until every worker exits 0 (None) or one fails: (rank, exit code)."""
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                return rank, code
        if all(code == 0 for code in codes):
            return None
        time.sleep(MONITOR_INTERVAL_SECONDS)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def read_steps(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    return [(r["step"], r["unix"]) for r in map(json.loads, path.read_text().splitlines()) if r]


def choose_checkpoint_every(
    spec: dict, data_path: Path, bucket: str, step_s: float, budget: float
) -> tuple[int, dict[str, float]]:
    """K as a user would pick it: the round number of steps (1, 2 or 5 times a power of ten) at which
    saving a checkpoint to S3 (timed here, median of 5) costs at most ``budget`` of the training time."""
    import boto3
    import numpy as np
    import torch

    from trainyard import algorithms
    from trainyard.spec import TrainingJob

    job = TrainingJob.model_validate(spec)
    data = np.load(data_path)
    model, loss_fn = algorithms.build(job.algorithm, job.hyperparameters, data["x"], data["y"], 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.hyperparameters.learning_rate)
    n = job.hyperparameters.batch_size
    loss_fn(model(torch.from_numpy(data["x"][:n])), torch.from_numpy(data["y"][:n])).mean().backward()
    optimizer.step()  # the optimizer's state exists, as in a checkpoint mid-training
    s3, times = boto3.client("s3"), []
    for i in range(5):
        began = time.perf_counter()
        body = checkpoint_bytes({"step": i, "model": model.state_dict(), "optim": optimizer.state_dict()})
        s3.put_object(Bucket=bucket, Key=f"calibration/{i}.pt", Body=body)
        times.append(time.perf_counter() - began)
    save_s = sorted(times)[2]
    raw = save_s / (budget * step_s)
    k = min(m * 10**e for e in range(12) for m in (1, 2, 5) if m * 10**e >= raw)
    return k, {"save_s": save_s, "step_s": step_s, "raw": raw, "bytes": len(body)}


def checkpoint_bytes(state: dict) -> bytes:
    """Model and optimizer state serialised as a torch.save checkpoint."""
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


# --- the worker -----------------------------------------------------------------------------------


def worker(config_path: str) -> None:
    """One DDP rank. ``config``: job (a TrainingJob dict), data (npz), steps, checkpoint_every (0: never),
    fail_at (None: never; rank 1 of the first attempt SIGKILLs itself before that step), bucket, prefix, out."""
    import boto3
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainyard import algorithms
    from trainyard.spec import TrainingJob

    config = json.loads(Path(config_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    out = Path(config["out"]) / f"attempt-{attempt}"
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))

    job = TrainingJob.model_validate(config["job"])
    hp = job.hyperparameters
    data = np.load(config["data"])
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    model, loss_fn = algorithms.build(job.algorithm, hp, x.numpy(), y.numpy(), int(y.max()) + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay)
    s3 = boto3.client("s3")
    bucket, prefix, every = config["bucket"], config["prefix"], config["checkpoint_every"]

    start = 0
    if attempt > 0 and every:
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
        if keys:
            body = s3.get_object(Bucket=bucket, Key=max(keys))["Body"].read()
            state = torch.load(io.BytesIO(body), weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])
            start = state["step"]
        (out / "resumed.json").write_text(json.dumps({"step": start}))
    ddp = DistributedDataParallel(model)

    steps_per_epoch = math.ceil(len(x) / hp.batch_size)
    perm: tuple[int, torch.Tensor] = (-1, torch.empty(0))
    log = (out / f"rank-{rank}.jsonl").open("a", buffering=1)
    saves = (out / "checkpoints.jsonl").open("a", buffering=1) if rank == 0 else None
    for step in range(start, config["steps"]):
        if step == config["fail_at"] and attempt == 0 and rank == 1:  # a step number, or None
            os.kill(os.getpid(), signal.SIGKILL)
        epoch, index = divmod(step, steps_per_epoch)
        if perm[0] != epoch:  # Trainyard's replicated sampling: one permutation an epoch, cut into ranks
            perm = (
                epoch,
                torch.randperm(len(x), generator=torch.Generator().manual_seed(hp.seed * SEED_STRIDE + epoch)),
            )
        rows = torch.tensor_split(perm[1][index * hp.batch_size : (index + 1) * hp.batch_size], world)[rank]
        optimizer.zero_grad()
        loss_fn(ddp(x[rows]), y[rows]).mean().backward()
        optimizer.step()
        log.write(json.dumps({"step": step + 1, "unix": time.time()}) + "\n")
        if every and (step + 1) % every == 0 and rank == 0:
            began = time.perf_counter()
            state = {"step": step + 1, "model": model.state_dict(), "optim": optimizer.state_dict()}
            s3.put_object(Bucket=bucket, Key=f"{prefix}step-{step + 1:010d}.pt", Body=checkpoint_bytes(state))
            saves.write(json.dumps({"step": step + 1, "seconds": time.perf_counter() - began}) + "\n")
    (out / f"done-{rank}").touch()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1])
