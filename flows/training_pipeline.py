"""The ``training-pipeline`` flow: staging -> launch -> filtering -> training -> carbon -> registry.

Its one parameter is the ``TrainingJob`` spec, so the Prefect UI renders the job as a form. The
job summary is written to the job folder, uploaded to ``output.s3_uri``, attached to the flow run
as an artifact and to the MLflow run. A failed job fails the flow run after its summary is written;
a user's mistake (a ``TrainyardError``) is logged as its message, without a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from uuid import UUID, uuid4

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State
from pydantic import Field

from flows import job_summary, reruns
from flows.job_summary import UPLOADING
from tasks import _events as events
from tasks._metering import journal, stage_meter
from tasks._reporting import best_effort
from tasks.carbon import account
from tasks.filtering import filter_samples
from tasks.launch import launch_groups
from tasks.pool_launcher import CANCEL_CONFIRM_SECONDS, CANCEL_CONFIRM_SECONDS_ENV, check_deployment
from tasks.registry import register_model
from tasks.staging import stage_inputs
from tasks.training import train
from trainyard import (
    cache,
    env_settings,
    job_folder,
    launch,
    outputs,
    progress,
    registry,
    status,
    tracking_store,
)
from trainyard.carbon_probe import machine_id
from trainyard.errors import TrainyardError
from trainyard.home import JOB_ID_PATTERN, new_job_id, write_json_atomic
from trainyard.home import job_dir as make_job_dir
from trainyard.redaction import redact_exception, redact_text
from trainyard.servers import advertised_host
from trainyard.spec import TrainingJob, ignored_settings
from trainyard.training import preflight
from trainyard.training.plan import TrainingPlan
from trainyard.training.restarts import silent_seconds_limit


class JobFailed(TrainyardError):
    """The job ended Failed; its summary holds the reason."""


@flow(name="training-pipeline", log_prints=True)
def training_pipeline(
    job: TrainingJob, job_id: Annotated[str, Field(pattern=f"^$|{JOB_ID_PATTERN}")] | None = None
) -> dict | State:
    """Run one training job end to end and return its summary (a Failed state, raising ``JobFailed``
    when the flow is called, for a job that failed).

    Args:
        job: one training job: its data, algorithm and hyperparameters, and each stage's settings.
        job_id: the id to run under (letters, digits, '.', '_' and '-': a folder and an S3 key segment); a
            new one is made when empty.
    """
    progress.outlive_closed_output()  # a worker that shut down mid-job takes no job with it
    logger = get_run_logger()
    if not job_id:  # started from the UI or a schedule: the run takes the job's id as its name
        job_id = _run_job_id(job.name)
    job_dir = make_job_dir(job_id)
    try:
        lock = job_folder.RunLock(job_dir)
    except TrainyardError as exc:  # another run of the job id runs here: its summary and ledger line stand
        refused = JobFailed(f"job {job_id} not run: {exc}")
        return Failed(message=str(refused), data=refused)
    log = status.StatusLog(on_transition=lambda t: _emit_status(job_id, t))
    log.enter("Starting", "Job spec validated; preparing the job")
    for setting in ignored_settings(job):
        logger.warning("%s", setting)
    stages: dict[str, dict] = {}
    handle, outcome, model, carbon_section = None, None, None, None
    registering = False  # the registry stage began: a version of the job may exist whatever ended it
    republished = False  # a rerun of a registered job: its summary is being published again
    error: BaseException | None = None  # a TrainyardError (the user's to fix) or a bug's, raised at the end
    failed_groups: list[dict] = []  # a training stage that gave up: its group failures, for the summary
    terminated: TerminationSignal | KeyboardInterrupt | None = None
    # a new name per run: a flow run that Prefect retries keeps its id, and each try spends its own energy
    run = f"{flow_run.get_id() or 'local'}-{uuid4().hex[:8]}"
    # the lock held to the end; each stage's energy written down as it is spent: a rerun counts this run
    with lock, journal(job_dir, run) as energy_log:
        try:
            # first: a run failing below (a bad setting, MLflow down) publishes a summary and ledger line that replace
            # the earlier runs', and without their energy it said 0 kWh for a job that trained for hours
            reruns.count_earlier_runs(job, stages, job_dir, run, logger)
            _check_settings()  # a bad TRAINYARD_* value fails the job here, not after staging has downloaded it all
            tracking_store.ensure_store()  # fails fast, and creates the MLflow database before any writer races for it
            republished = True  # (a signal from here ends the run, not a job an earlier run may have ended)
            earlier = reruns.registered_earlier(job, job_id, job_dir, run, log, stages, logger)
            republished = isinstance(earlier, dict)
            if isinstance(earlier, str):  # registered by an earlier run, which this one cannot finish
                refused = JobFailed(earlier)
                log.finish("Failed", "Failed", str(refused), failure_reason=str(refused))
                return Failed(message=str(refused), data=refused)
            if earlier is not None:  # a rerun of a job an earlier run registered: nothing trained again
                return reruns.publish_again(job, job_id, job_dir, earlier, logger)
            reruns.check_budget_left(job, stages)  # past its budget already: nothing run, the earlier run's left as is
            if (aside := job_folder.set_aside_earlier_run(job_dir)) is not None:
                logger.info("what an earlier run of job %s left in its folder is now in %s", job_id, aside)
            # an earlier run's model (stopped, or killed mid-upload) is not this run's, folder here or not
            outputs.remove_model(job, job_id)
            outputs.check_destination(job)  # before any compute: the model is uploaded there at the end
            if job.resources.work_pool != "local":  # before any compute: the groups' runs are of its deployment
                check_deployment(job.resources.work_pool, job.resources.gpus_per_replica, pipeline_here=True)
            log.enter("Downloading", "Downloading input data")
            stages["staging"] = stage_inputs(job, str(job_dir))
            staged = stages["staging"]["staged"]
            # before any compute: a user's algorithm on a first batch; sifting's draw and the warm-up against the rows
            if job.algorithm.entrypoint:
                preflight.check_algorithm(job, staged.train_data, staged.schema["num_outputs"], staged.extra_channels)
            preflight.check_rows(job, staged.rows["train"])
            log.enter("Training", "Launching replica groups")
            stages["launch"] = launch_groups(job, job_id, str(job_dir))
            handle = stages["launch"]["handle"]
            # killed in training, a rerun adds what its groups on other machines drew (energy_journal.settle_killed)
            best_effort(
                logger, "could not write the energy journal: %s", energy_log.launched, handle.launch_id, machine_id()
            )
            stages["filtering"] = filter_samples(job, staged, job_id)
            report = stages["filtering"]["report"]
            if report.sifting is not None:  # sifting.noisy_share: the online rule the labels called for
                job = job.model_copy(update={"sifting": report.sifting})
            if report.dropped or report.sifting is not None:  # after the stage is recorded (its compute counts)
                picked = report.sifting is not None
                preflight.check_rows(job, report.kept, "rows the prefilter kept", picked)
            plan = TrainingPlan(
                job_id=job_id,
                job=job.model_dump(mode="json"),
                train_data=report.train_data,
                validation_data=staged.validation_data,
                schema=staged.schema,
                num_replicas=job.resources.replicas,
                lighthouse_addr=handle.lighthouse_addr,
                launch_id=handle.launch_id,
                train_layout=report.train_layout if report.train_layout is not None else staged.train_layout,
                streamed=staged.streamed,
                extra_channels=staged.extra_channels,
            )
            log.enter("Training", "Training in progress")
            spent = [s["energy"] for s in stages.values()]
            stages["training"] = train(
                job, handle, plan, (sum(e["energy_kwh"] for e in spent), sum(e["emissions_kg"] for e in spent))
            )
            outcome = stages["training"]["outcome"]
            primary, secondary = status.primary_status(outcome.stop_reason)
            if outcome.steps > 0 or primary == "Completed":
                log.enter("Uploading", "Uploading the trained model")
                with stage_meter(UPLOADING, job) as uploaded:  # a large model's upload takes its time and energy
                    model_uri = outputs.upload_model(job, job_id, Path(outcome.model_path), staged.schema)
                stages[UPLOADING] = uploaded  # (failed, it is the exception's stage_record: _add_failed_stage)
            else:  # stopped (or out of time) before a first step: its parameters are the initial ones
                logger.warning("job %s ended before its first training step: no model is uploaded", job_id)
                outputs.remove_model(job, job_id)  # nor is an earlier run's left as this one's
            stages["carbon"] = account(job, [s["energy"] for s in stages.values()], outcome, report)
            carbon_section = stages["carbon"]["carbon"]
            if primary == "Completed":
                tags = job_summary.lineage_tags(job_id, stages, outcome, carbon_section, model_uri)
                files = {"filtered_manifest": report.manifest} if report.manifest else {}
                files |= stages["staging"].get("lineage_files", {})
                registering = True
                stages["registry"] = register_model(job, job_id, plan, outcome, tags, files)
                model = stages["registry"]["model"]
            log.finish(
                primary,
                secondary,
                f"Training stopped: {outcome.stop_reason}",
                None if primary == "Completed" else status.failure_reason(outcome.stop_reason, outcome.history),
            )
        except reruns.BudgetSpent as exc:
            log.finish("Stopped", "Stopped", str(exc), failure_reason="CarbonBudgetExceeded")
        except TrainyardError as exc:
            # masked: it may quote the user's code's own error (an entrypoint's build failing on a URL with its
            # password), and it goes to the summary, the Prefect run's state and artifacts
            error = redact_exception(exc)
            message = redact_text(str(exc))
            log.finish("Failed", "Failed", message, failure_reason=message)
            failed_groups = getattr(exc, "failures", [])
            _add_failed_stage(stages, exc)
        except (TerminationSignal, KeyboardInterrupt) as exc:
            if republished:  # the job ended Completed and its summary went out: nothing to end again
                raise
            # SIGTERM (`trainyard jobs stop` through a worker, or the process told to end), or Ctrl-C: the job still
            # ends with its summary, as Stopped; the signal is raised again below for Prefect to finish the run
            terminated = exc
            if isinstance(exc, KeyboardInterrupt):
                log.finish("Stopped", "Stopped", "the job was interrupted (Ctrl-C)", failure_reason="Interrupted")
            elif _cancelled():  # a person's (or a service's) stop, told apart from a worker shut down or a reclaim
                log.finish("Stopped", "Stopped", CANCELLED_MESSAGE, failure_reason="Cancelled")
            else:
                log.finish(
                    "Stopped", "Stopped", "the job's process was told to stop (SIGTERM)", failure_reason="Terminated"
                )
            _add_failed_stage(stages, exc)
        except Exception as exc:
            # a bug, not the user's mistake: the job still ends Failed with its summary, and the
            # traceback is kept (raised below)
            error = redact_exception(exc)  # where a bug quotes a URL: raised below, for Prefect to log
            reason = redact_text(f"internal error: {exc!r}; please report it")
            log.finish("Failed", "Failed", reason, failure_reason=reason)
            _add_failed_stage(stages, exc)
        finally:
            if handle is not None:
                launch.shutdown(handle)
        if registering and model is None:  # ended inside its registration (a signal, an outage): a version made?
            model = _version_left(job, job_id, log, logger)
        summary = job_summary.summary(job, job_id, log, stages, outcome, model, failed_groups, logger=logger)
        # best effort: a full disk must not keep the summary from S3 and the callers, nor replace the job's end
        unwritten = "could not write the summary to the job's folder (%s); it is published all the same"
        best_effort(logger, unwritten, write_json_atomic, job_dir / "summary.json", summary)
        job_summary.publish(job, job_id, summary, model, logger)
        best_effort(logger, unwritten, write_json_atomic, job_dir / "summary.json", summary)  # with summary_uri
    if terminated is not None:
        raise terminated
    if error is not None and not isinstance(error, TrainyardError):
        raise error
    if error is not None:
        # Returned, not raised: the run ends Failed with the message, and Prefect logs no traceback for
        # what is the user's to fix (its message says what). Calling the flow still raises JobFailed.
        failed = JobFailed(f"job {job_id} failed: {error}")
        failed.__cause__ = error
        return Failed(message=str(failed), data=failed)
    if summary["status"] == "Failed":  # a job that failed without an error raised: training diverged
        failed = JobFailed(f"job {job_id} failed: {summary.get('failure_reason')}")
        return Failed(message=str(failed), data=failed)
    if summary["status"] == "Stopped":
        # Completed for Prefect (nothing crashed), named as the job ended: what `trainyard jobs list`, the UI
        # and automations see, without reading the job's status events
        return Completed(name="Stopped", message=f"job {job_id} stopped: {summary.get('failure_reason')}", data=summary)
    return summary


def _check_settings() -> None:
    """Read every ``TRAINYARD_*`` setting a later stage reads, so a bad value is refused before any work."""
    env_settings.count(env_settings.THREADS_ENV, 1)
    env_settings.seconds(CANCEL_CONFIRM_SECONDS_ENV, CANCEL_CONFIRM_SECONDS)
    silent_seconds_limit()
    cache.max_bytes()
    env_settings.flag(cache.CACHE_VERIFY_ENV)
    env_settings.flag(progress.PROGRESS_ENV, default=True)
    advertised_host()  # TRAINYARD_HOST


def _version_left(job: TrainingJob, job_id: str, log, logger) -> dict | None:
    """The version a job that ended inside its registration left, said in its summary (``model``) and its
    failure reason, with how to finish it: its summary said no model beside a registered, ungated version."""
    try:
        model = registry.registered(job.model_name, job_id)
    except TrainyardError as exc:  # the registry's outage that ended the job, say: its message names the version
        logger.warning("could not look up the version of job %s: %s", job_id, exc)
        return None
    if model is not None and not model["gate"]:
        name, number = model["name"], model["version"]
        said = f"{name} v{number} is registered and not gated: `trainyard models gate {name} {number}`"
        log.failure_reason = (
            f"{log.failure_reason or 'ended in its registration'}; {said} (or a rerun of job {job_id}) gates it"
        )
    return model


def _add_failed_stage(stages: dict, exc: BaseException) -> None:
    """The stage that failed, with the time and energy it spent (``stage_meter``), so that the summary
    and the ledger count them: a failed job's footprint is not only the stages that finished."""
    record = getattr(exc, "stage_record", None)
    if record is not None and record["stage"] not in stages:
        stages[record["stage"]] = record


def _run_job_id(name: str) -> str:
    """The job id of a run started without one. A new one, the run named and tagged for it
    (``flows.prefect_api.job_id_of`` reads the tag); but the id an earlier try of this same run made, where it
    has one (Prefect runs a run again: rescheduled on SIGTERM, a retry): one job, registered once, and the
    status its callers read. A new id each try added a second tag, and ``status`` read the first try's job."""
    run_id = flow_run.get_id()
    if not run_id:
        return new_job_id(name)
    with get_client(sync_client=True) as client:
        tags = client.read_flow_run(UUID(run_id)).tags or []
        earlier = sorted(t.removeprefix(status.JOB_TAG) for t in tags if t.startswith(status.JOB_TAG))
        if earlier:
            return earlier[0]
        job_id = new_job_id(name)
        client.update_flow_run(UUID(run_id), name=job_id, tags=sorted({*tags, f"{status.JOB_TAG}{job_id}"}))
        return job_id


def _emit_status(job_id: str, transition: dict) -> None:
    """Each secondary status transition as a Prefect event (automations and the UI's event feed see it)."""
    events.emit(f"trainyard.job.{transition['status'].lower()}", job_id, transition)


CANCELLED_MESSAGE = "the job was cancelled (trainyard jobs stop, or Cancel in the Prefect UI or API)"


def _cancelled() -> bool:
    """Whether this run's SIGTERM is Prefect cancelling it: its state is Cancelling first (a ``trainyard run``'s
    is Running: nothing cancels it but a signal). False where the API cannot say."""
    run_id = flow_run.get_id()
    if run_id is None:
        return False
    try:
        with get_client(sync_client=True) as api:
            state = api.read_flow_run(UUID(str(run_id))).state
    except Exception:  # noqa: BLE001 - the API gone too: said as a plain SIGTERM
        return False
    return state is not None and state.type.value in ("CANCELLING", "CANCELLED")
