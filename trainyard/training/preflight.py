"""The checks a job's training passes before any compute is spent on it: the local GPUs its groups would take, and
its algorithm built and run, with its loss, on a first small batch here (a broken entrypoint fails in seconds,
named, not in every group after staging and the prefilter)."""

from __future__ import annotations

from trainyard import algorithms, sifting
from trainyard.errors import TrainingError, TrainyardError
from trainyard.spec import TrainingJob
from trainyard.training import device
from trainyard.training.epochs import check_warmup
from trainyard.training.plan import TrainingPlan, export_channels
from trainyard.training.trainer import load_arrays


def preflight(job: TrainingJob, plan: TrainingPlan) -> None:
    """Build the model and run one small batch here, so a broken algorithm fails before the groups train."""
    if job.resources.work_pool == "local":  # local groups see this machine's GPUs: check them here, once
        device.check(job.resources.gpus_per_replica, replica=0)
        device.check_fits(job.resources.replicas, job.resources.gpus_per_replica, device.visible_gpus())
    plan.export_channels()
    check_algorithm(job, plan.train_data, plan.schema["num_outputs"])


def check_rows(job: TrainingJob, rows: int, whose: str = "training rows", picked: bool = False) -> None:
    """Refuse, before any compute, what the channel's ``rows`` (staged, or those the prefilter kept: ``whose``)
    make of the job's settings: a sifting step that draws more candidates than there are rows, a warm-up as long
    as the run. ``picked``: the sifting rule is the one the labels picked (``sifting.check_fits``)."""
    hp = job.hyperparameters
    batch = hp.batch_size
    sifting.check_fits(job.sifting, batch, rows, whose, picked)
    beta = job.sifting.settled()[0] if job.sifting.enabled else 0.0
    prune = job.sifting.settled()[1] if job.sifting.prunes else None
    # each epoch's draw, as the groups' sampler deals it (StepData): pruning's epochs deal batch_factor times more
    dealt = [prune.dealt_batch(batch, epoch, hp.epochs) if prune else batch for epoch in range(hp.epochs)]
    check_warmup(hp, rows, [sifting.candidate_batch(beta, d) for d in dealt])


def check_algorithm(
    job: TrainingJob, train_data: str, num_outputs: int, extra_channels: dict[str, str] | None = None
) -> None:
    """Build the model and run it and its loss on a first small batch of ``train_data``, here: a broken
    algorithm (an entrypoint whose loss is reduced over the batch, say) fails before any compute is
    spent on the job, the prefilter's included. ``extra_channels`` are exported first, as the groups
    see them (an entrypoint may read one while it builds)."""
    export_channels(extra_channels or {})
    x, y = load_arrays(train_data)
    try:
        model, loss_fn = algorithms.build(job.algorithm, job.hyperparameters, x.numpy(), y.numpy(), num_outputs)
    except TrainyardError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's entrypoint failed: reported as such
        raise TrainingError(
            f"algorithm.entrypoint {job.algorithm.entrypoint}: failed to build: {type(exc).__name__}: {exc}"
        ) from exc
    n = min(4, len(x))
    try:
        out = model(x[:n])
    except Exception as exc:  # noqa: BLE001 - any failure here is the algorithm's, reported as such
        raise TrainingError(f"the model failed on a first batch: {type(exc).__name__}: {exc}") from exc
    algorithms.check_outputs(out, n, num_outputs, job.algorithm.task)
    try:
        losses = loss_fn(out, y[:n])
    except Exception as exc:  # noqa: BLE001
        raise TrainingError(f"the loss failed on a first batch: {type(exc).__name__}: {exc}") from exc
    algorithms.check_per_sample(losses, n)
