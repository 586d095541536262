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


def _per_row_cross_entropy(out, y):
    return torch.nn.functional.cross_entropy(out, y, reduction="none")


def batch_norm_build(num_features, num_outputs, hyperparameters):
    """An MLP with BatchNorm: buffers its forward pass updates, from each group's own rows."""
    model = torch.nn.Sequential(
        torch.nn.Linear(num_features, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, num_outputs)
    )
    return model, _per_row_cross_entropy


def flaky_heal_build(num_features, num_outputs, hyperparameters):
    """``slow_build``'s model, in a restarted group (attempt 1 on) whose first fetch of a peer's state breaks while
    ``heal_breaks_once`` (a path) exists, which it removes: a connection reset mid-heal."""
    import os
    import sys

    attempt = sys.argv[sys.argv.index("--attempt") + 1] if "--attempt" in sys.argv else "0"
    if attempt == "0":  # a first group may heal too (from one that took the first step alone)
        return slow_build(num_features, num_outputs, hyperparameters)

    from trainyard.training.heal_transport import HealTransport

    marker, fetch = hyperparameters["heal_breaks_once"], HealTransport.recv_checkpoint

    def recv_checkpoint(self, *args, **kwargs):
        if os.path.exists(marker):
            if not hyperparameters.get("heal_always_breaks"):
                os.remove(marker)
            raise ConnectionResetError("connection reset by peer (a test's)")
        return fetch(self, *args, **kwargs)

    HealTransport.recv_checkpoint = recv_checkpoint
    return slow_build(num_features, num_outputs, hyperparameters)


def slow_validation_build(num_features, num_outputs, hyperparameters):
    """A linear model whose first validation in each process takes ``validation_seconds``."""
    import time

    class SlowToValidate(torch.nn.Linear):
        validated = False

        def forward(self, x):
            if not self.training and not SlowToValidate.validated:
                SlowToValidate.validated = True
                time.sleep(hyperparameters["validation_seconds"])
            return super().forward(x)

    return SlowToValidate(num_features, num_outputs), _per_row_cross_entropy


def stop_while_validating_build(num_features, num_outputs, hyperparameters):
    """A linear model whose group 1, in its first validation, waits a second and then asks the job to stop (as
    `trainyard stop` does): group 0, quicker to validate, is in the next step's quorum by then."""
    import sys
    import time
    from pathlib import Path

    from trainyard.training.plan import request_stop

    group = sys.argv[sys.argv.index("--replica") + 1] if "--replica" in sys.argv else None
    job_dir = Path(sys.argv[sys.argv.index("--job-dir") + 1]) if "--job-dir" in sys.argv else None

    class StopsTheJob(torch.nn.Linear):
        def forward(self, x):
            if not self.training and group == "1" and job_dir is not None and not (job_dir / "stop.json").exists():
                time.sleep(1.0)
                request_stop(job_dir, "Stopped", "asked while group 1 validated")
            return super().forward(x)

    return StopsTheJob(num_features, num_outputs), _per_row_cross_entropy


def stop_then_slow_validation_build(num_features, num_outputs, hyperparameters):
    """A linear model whose first validation asks the job to stop (as `trainyard stop` does), then validates for
    ``validation_seconds``: longer than the stop's grace. (Not at the forward in eval mode before training starts.)"""
    import sys
    import time
    from pathlib import Path

    from trainyard.training.attempt_files import job_step
    from trainyard.training.plan import request_stop

    job_dir = Path(sys.argv[sys.argv.index("--job-dir") + 1]) if "--job-dir" in sys.argv else None

    class StopsThenValidates(torch.nn.Linear):
        def forward(self, x):
            validating = not self.training and job_dir is not None and job_step(job_dir) > 0
            if validating and not (job_dir / "stop.json").exists():
                request_stop(job_dir, "Stopped", "asked as the group validated")
                time.sleep(hyperparameters["validation_seconds"])
            return super().forward(x)

    return StopsThenValidates(num_features, num_outputs), _per_row_cross_entropy


def slow_upload_build(num_features, num_outputs, hyperparameters):
    """A linear model whose group's checkpoint uploads each take ``upload_seconds`` longer (a large state)."""
    import time

    from trainyard.training import checkpoint

    put = checkpoint.Checkpointer._put

    def slow_put(self, *args, **kwargs):
        time.sleep(hyperparameters["upload_seconds"])
        return put(self, *args, **kwargs)

    checkpoint.Checkpointer._put = slow_put
    return torch.nn.Linear(num_features, num_outputs), _per_row_cross_entropy


def stop_at_step_build(num_features, num_outputs, hyperparameters):
    """A linear model whose group asks the job to stop (as `trainyard stop` does) at its ``stop_at_step``-th training
    forward pass (about that step: the heartbeat a step is read by lags fast steps)."""
    import sys
    from pathlib import Path

    from trainyard.training.plan import request_stop

    job_dir = Path(sys.argv[sys.argv.index("--job-dir") + 1]) if "--job-dir" in sys.argv else None

    class StopsAtAStep(torch.nn.Linear):
        forwards = 0

        def forward(self, x):
            StopsAtAStep.forwards += self.training
            if job_dir is not None and StopsAtAStep.forwards == hyperparameters["stop_at_step"]:
                request_stop(job_dir, "Stopped", f"asked at step {hyperparameters['stop_at_step']}")
            return super().forward(x)

    return StopsAtAStep(num_features, num_outputs), _per_row_cross_entropy
