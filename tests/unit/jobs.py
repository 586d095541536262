"""Helpers for the training tests: a two-group job on a small dataset (``make_job``), run by the supervisor with
real replica processes and a lighthouse (``run``), and ``slow_build``, an entrypoint whose steps take a set time
(``tests.unit.jobs:slow_build``), so that a survivor is still training when a restart comes back."""

from __future__ import annotations

import numpy as np
import torch

from tests.conftest import blobs_table
from trainyard.home import job_dir, new_job_id
from trainyard.spec import parse_job
from trainyard.training import supervisor
from trainyard.training.plan import TrainingPlan


def make_job(trainyard_home, **changes):
    spec = {
        "name": "train-test",
        "algorithm": {"builtin": "mlp-classifier"},
        "hyperparameters": {"epochs": 4, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
        "inputs": {
            "train": {"s3_uri": "s3://unused/t/", "label": "label"},
            "validation": {"s3_uri": "s3://unused/v/", "label": "label"},
        },
        "output": {"s3_uri": "s3://unused/o/"},
        "resources": {"replicas": 2},
    }
    spec.update(changes)
    job = parse_job(spec)
    job_id = new_job_id(job.name)
    folder = job_dir(job_id)
    table = blobs_table(800, seed=3).to_pandas()
    x = table.drop(columns="label").to_numpy(np.float32)
    y = table["label"].to_numpy(np.int64)
    (folder / "data").mkdir()
    np.savez(folder / "data" / "train.npz", x=x[200:], y=y[200:])
    np.savez(folder / "data" / "validation.npz", x=x[:200], y=y[:200])
    plan = TrainingPlan(
        job_id=job_id,
        job=job.model_dump(mode="json"),
        train_data=str(folder / "data/train.npz"),
        validation_data=str(folder / "data/validation.npz"),
        schema={"num_outputs": 2, "classes": [0, 1], "task": "classification"},
        num_replicas=job.resources.replicas,
        lighthouse_addr="",
    )
    return job, job_id, folder, plan


def run(job, job_id, folder, plan, events=None):
    on_event = (lambda kind, payload: events.append((kind, payload.get("replica")))) if events is not None else None
    return supervisor.launch_and_train(job, plan, folder, on_event)


def slow_build(num_features, num_outputs, hyperparameters):
    """A model whose steps take at least ``step_sleep`` seconds (10 ms), so a survivor is still training
    when a restart comes back. With ``slow_while`` (a path; see ``tests.conftest.slow_until``), only
    while that file exists; ``fast_step_sleep`` (0 s) while it does not. With ``build_waits_while`` (a
    path), the model is built only once that file is gone; with ``group_build_waits_while``, so in a replica
    group only (not in the pipeline's check of the algorithm), which touches ``<path>.reached`` as it waits."""
    import os
    import time

    pause, hold = hyperparameters.get("step_sleep", 0.01), hyperparameters.get("slow_while")
    fast = hyperparameters.get("fast_step_sleep", 0.0)
    gate = hyperparameters.get("build_waits_while")
    while gate and os.path.exists(gate):  # a test holding a group back before its first quorum
        time.sleep(0.05)
    # in a replica group only (the pipeline builds the model too, to check it), saying where it waits
    group_gate = hyperparameters.get("group_build_waits_while") if os.environ.get("TRAINYARD_PARENT_PID") else None
    if group_gate and os.path.exists(group_gate):
        open(f"{group_gate}.reached", "w").close()
    while group_gate and os.path.exists(group_gate):
        time.sleep(0.05)

    class Slow(torch.nn.Linear):
        def forward(self, x):
            time.sleep(pause if hold is None or os.path.exists(hold) else fast)
            return super().forward(x)

    return Slow(num_features, num_outputs), lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none")


def threads_recording_build(num_features, num_outputs, hyperparameters):
    """A linear model whose build records the process's torch threads in ``<threads_file>.<pid>``."""
    import os

    with open(f"{hyperparameters['threads_file']}.{os.getpid()}", "w") as f:
        f.write(str(torch.get_num_threads()))
    return torch.nn.Linear(num_features, num_outputs), lambda out, y: torch.nn.functional.cross_entropy(
        out, y, reduction="none"
    )
