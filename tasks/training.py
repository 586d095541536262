"""Training task: release the replica groups, supervise them, upload the model."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

from tasks import _events as events
from tasks._metering import in_background, stage_meter
from tasks._reporting import best_effort
from trainyard import carbon, plots, progress
from trainyard.carbon_probe import machine_id
from trainyard.launch import LaunchHandle
from trainyard.live_metrics import LiveRun, live_status
from trainyard.spec import TrainingJob
from trainyard.status import PROGRESS_EVENT, final_metrics, with_last_validation
from trainyard.training import accounting, supervisor, user_stop
from trainyard.training.plan import TrainingPlan, request_stop


@task(name="training", cache_policy=NO_CACHE)
def train(job: TrainingJob, handle: LaunchHandle, plan: TrainingPlan, spent: tuple[float, float] = (0.0, 0.0)) -> dict:
    """Run the replica groups to the job's stopping condition; return the outcome (model path, history).

    ``spent``: (kWh, kgCO2e) of the earlier stages, so the live figures and the budget are the job's.
    """
    logger = get_run_logger()
    with stage_meter("training", job) as record, progress.bar("training epochs", job.hyperparameters.epochs) as advance:
        failed = "creating the progress artifact failed (%s); the job goes on without it"
        created = best_effort(logger, failed, create_progress_artifact, 0.0, None, f"{plan.job_id}: training")
        artifact: UUID | None = created  # type: ignore[assignment]  # called sync, it returns the id (typed: or a coroutine)
        percent, epochs_done, reported, told_through = 0.0, 0, 0.0, 0
        untold: tuple[int, dict | None] | None = None  # the last epoch not logged yet, and its metrics
        validated: dict | None = None  # the last validated epoch's metrics (stopping.validate_every_epochs)
        last_sample: dict | None = None
        # live metrics are reporting: MLflow down as training starts (hours after its check) must not fail the job
        failed = "starting the live MLflow run failed (%s); the job trains without live metrics in MLflow"
        live = best_effort(logger, failed, LiveRun, job, plan.job_id)

        def on_sample(sample: dict) -> None:
            nonlocal last_sample
            last, last_sample = last_sample, sample
            rate = 0.0
            if last is not None and sample["seconds"] > last["seconds"]:
                rate = (sample["emissions_kg"] - last["emissions_kg"]) * 3.6e6 / (sample["seconds"] - last["seconds"])
            text = f"{sample['energy_kwh']:.4g} kWh, {sample['emissions_kg']:.4g} kgCO2e so far ({rate:.3g} g/h)"
            if artifact is not None:
                update_progress_artifact(artifact, percent, description=f"{plan.job_id}: {text}")
            metrics = {"energy_kwh": sample["energy_kwh"], "emissions_kg": sample["emissions_kg"]}
            if live is not None:
                live.log(metrics | {"emissions_rate_g_per_h": rate}, step=round(sample["seconds"]))

        def on_budget(kg: float) -> None:
            message = f"emissions {kg:.4g} kgCO2e passed carbon.budget_kg={job.carbon.budget_kg}"
            logger.warning("%s: stopping every replica group", message)
            request_stop(Path(handle.job_dir), "CarbonBudgetExceeded", message)

        def on_progress(epochs: int, metrics: dict | None) -> None:
            nonlocal percent, epochs_done, untold, validated
            advance(epochs - epochs_done)
            if metrics and "val_loss" in metrics:
                validated = metrics
            epochs_done, untold = epochs, (epochs, metrics)
            percent = 100.0 * epochs / job.hyperparameters.epochs
            # Told at most once a second (a log line and the artifact, both calls to the API): epochs of
            # milliseconds once flooded the API with a line each. A line covers every epoch since the last.
            if time.monotonic() - reported >= 1.0 or epochs == job.hyperparameters.epochs:
                tell()

        def tell() -> None:
            nonlocal reported, told_through, untold
            if untold is None:
                return
            (epochs, metrics), untold = untold, None
            if artifact is not None:
                failed = "updating the progress artifact failed (%s); the job goes on"
                best_effort(logger, failed, update_progress_artifact, artifact, percent)
            # an epoch between validations is shown with the last validation's metrics, and that epoch's number
            metrics = with_last_validation(metrics, validated) if metrics else metrics
            shown = {k: round(v, 5) if isinstance(v, float) else v for k, v in (metrics or {}).items()}
            span = f"epoch {epochs}" if epochs == told_through + 1 else f"epochs {told_through + 1}-{epochs}"
            logger.info("%s: %s", span, shown)
            # for services following the job (flows.client.status's "progress")
            events.emit(
                PROGRESS_EVENT,
                plan.job_id,
                {
                    "epochs_done": epochs,
                    "epochs": job.hyperparameters.epochs,
                    "metrics": final_metrics([shown]),  # as the summary's: no bookkeeping (steps, FLOPs)
                },
            )
            reported, told_through = time.monotonic(), epochs

        def on_event(kind: str, payload: dict) -> None:
            # One Prefect event per failure, restart, recovery, arrival and departure of a replica
            # group (its resource), and per change of size (the job's).
            events.emit(f"trainyard.{kind}", plan.job_id, payload, replica=payload.get("replica"))
            level = (
                logging.WARNING
                if kind in ("replica.failed", "replica.queued", "job.scale_refused", "job.waiting_for_workers")
                else logging.INFO
            )
            logger.log(level, "%s: %s", kind, payload)

        # A live reading (and budget check) at every power reading, at most once a second.
        interval = max(1.0, job.carbon.measure_power_secs)
        watch = carbon.LiveWatch(record["meter"], interval, *spent, job.carbon.budget_kg, on_sample, on_budget)
        try:
            with watch, _stop_when_tagged(Path(handle.job_dir), logger):
                record["outcome"] = supervisor.train(handle, plan, job, on_progress, on_event)
            tell()  # the last epochs, which the once-a-second rule may have held back
            # Every job that trained gets its curves (loss, metrics, kept fraction), stopped ones included:
            # only a completed job is registered, with its own copy.
            if record["outcome"].history:
                path = Path(plan.train_data).parent / "training_curves.png"
                outcome = record["outcome"]
                # (a plot failing, say on a full disk, must not lose the model the groups have trained)
                failed = "plotting the training curves failed (%s); the job goes on without them"
                curves = best_effort(
                    logger, failed, plots.plot_history, outcome.history, path, plan.job_id, outcome.restored_epoch
                )
                if curves is not None and live is not None:
                    failed = "logging the training curves to MLflow failed (%s); the job goes on"
                    best_effort(logger, failed, live.log_file, curves)
        finally:
            # groups on other nodes: outside this machine's meter, added to the stage (stopped or failed too)
            record["elsewhere"] = _energy_elsewhere(Path(handle.job_dir), handle.launch_id, logger)
            if live is not None:  # ended as the training did: a stopped, diverged or failed job's run said FINISHED
                ended = live_status(record.get("outcome"))
                best_effort(logger, "closing the live MLflow run failed (%s); the job goes on", live.close, ended)
        record["carbon_live"] = watch.samples
    outcome = record["outcome"]
    logger.info(
        "training stopped (%s) after %d steps, %d failure(s)", outcome.stop_reason, outcome.steps, len(outcome.failures)
    )
    _say_restored(job, outcome, logger)
    return record


def _say_restored(job: TrainingJob, outcome, logger) -> None:
    """Which epoch's parameters the model holds, where the job restores its best (``stopping.restore_best``)."""
    if not job.stopping.restores_best or not outcome.history or outcome.best_epoch is None:
        return
    last, watched = outcome.history[-1]["epoch"], job.stopping.watched_metric
    if outcome.restored_epoch is not None:
        best = outcome.history[outcome.restored_epoch - 1].get(watched)
        logger.info(
            "the model is epoch %d's, the best (%s %.5g); training ran to epoch %d",
            outcome.restored_epoch,
            watched,
            best,
            last,
        )
    elif outcome.best_epoch != last:
        logger.warning(
            "epoch %d was the best (%s) but no replica group's copy of its parameters was found: the model is the "
            "last epoch's (%d)",
            outcome.best_epoch,
            watched,
            last,
        )


def _energy_elsewhere(job_dir: Path, launch: str, logger) -> dict | None:
    """``accounting.energy_elsewhere`` of this launch's groups for this machine, said in the log; None (and a
    warning) if it cannot be read: the stage's own figures stand."""
    try:
        elsewhere = accounting.energy_elsewhere(job_dir, machine_id(), launch)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("could not read the energy of groups on other machines: %s", exc)
        return None
    if elsewhere:
        logger.info(
            "%d group attempt(s) ran on other machines: their %.4g kWh (at PUE 1) count in the training stage",
            elsewhere["attempts"],
            elsewhere["energy_kwh"],
        )
    return elsewhere


STOP_POLL_SECONDS = 5.0


@contextmanager
def _stop_when_tagged(job_dir: Path, logger) -> Iterator[None]:
    """While it trains, a pipeline run tagged ``user_stop.RUN_TAG`` (``trainyard jobs stop --graceful``, from
    any machine that reaches the Prefect API) asks its groups to stop, keeping the model: looked for at once
    (a run tagged before its training started) and every ``STOP_POLL_SECONDS``. ``logger``: the task's (a
    thread has no run context to find it by)."""
    run_id = flow_run.get_id()
    if run_id is None:
        yield
        return

    def watch(done: threading.Event) -> None:
        warned = False
        while not done.is_set():
            try:
                # a short timeout: a hung API holds up only this thread, which the stage does not wait long for
                with get_client(sync_client=True, httpx_settings={"timeout": STOP_POLL_SECONDS}) as client:
                    tags = client.read_flow_run(UUID(run_id)).tags
                    if user_stop.RUN_TAG in tags and not done.is_set():
                        logger.info("%s", user_stop.request_in(job_dir))
                        # acted on: a Prefect retry of this run (the same run, its tags kept) trains again
                        client.update_flow_run(UUID(run_id), tags=[t for t in tags if t != user_stop.RUN_TAG])
                        return
            except Exception as exc:  # noqa: BLE001 - an API hiccup must not stop training; tried again
                if not warned:
                    logger.warning("could not read the run's tags for a stop request: %s", exc)
                    warned = True
            done.wait(STOP_POLL_SECONDS)

    # a call in flight to a hung API is left to end by itself (a daemon)
    with in_background(watch, "trainyard-stop-request", join_seconds=1.0):
        yield
