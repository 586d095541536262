"""The job summary (the public contract README describes), the registered version's lineage tags, and where the
summary goes once the job has ended: S3, the carbon ledger, the flow run's artifacts, the MLflow run and a Prefect
event for services that follow the job."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run

from flows import job_events
from tasks import _events as events
from tasks._reporting import best_effort
from trainyard import STAGES, carbon, esg, outputs, registry, status
from trainyard.home import job_dir as make_job_dir
from trainyard.redaction import redact_text
from trainyard.spec import TrainingJob
from trainyard.training import accounting

UPLOADING = "uploading"  # the model's upload, between training and carbon: timed and metered as a stage is
TIMED = (*STAGES[:4], UPLOADING, *STAGES[4:])  # the summary's timings, in the order they run


def _emit_ended(job_id: str, summary: dict, model: dict | None) -> None:
    """The job's outcome as one Prefect event, after its last status: what ``trainyard jobs describe`` and
    other services read (``flows.client.status``) without reaching the S3 the summary is in."""
    events.emit("trainyard.job.ended", job_id, {"ended": job_events.outcome(summary | {"model": model})})


def summary(
    job: TrainingJob,
    job_id: str,
    log,
    stages: dict,
    outcome,
    model,
    failed_groups: list[dict],
    done: dict | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
) -> dict:
    """The job summary. ``failed_groups``: the group failures of a training stage that gave up (no outcome).
    ``done``: what the job's groups computed (``accounting.work_done``), where it has no outcome.

    Each section is made apart: one that cannot be made (a bug of ours on a job's unusual outcome) is ``null``
    (``carbon``: the stages' energy rolled up without the ESG report's figures), said in ``summary_errors`` and
    logged with its traceback to ``logger``. The job has ended by now: one raised here failed its run after that
    end, with no summary, ledger line or ended event for the callers waiting on it."""
    errors: list[str] = []
    logger = logger or logging.getLogger(__name__)

    def made(name: str, make: Callable[[], Any], fallback: Callable[[], Any] = lambda: None) -> Any:
        try:
            return make()
        except Exception as exc:  # noqa: BLE001 - logged with its traceback, and said in the summary
            logger.exception("could not make the %s section of job %s's summary (please report it)", name, job_id)
            errors.append(redact_text(f"{name}: internal error: {exc!r}; please report it"))  # (a URL's password)
            try:
                return fallback()
            except Exception:  # noqa: BLE001 - the fallback's failure is the same bug: already said
                return None

    report = stages.get("filtering", {}).get("report")
    # a stage that gave up or was stopped: its compute, and the last epoch's metrics (as SageMaker's final
    # metrics of a stopped job)
    # (only once this run launched groups: before, the job folder may still hold an earlier run's)
    if done is None and outcome is None and "launch" in stages:
        done = made("compute (the groups' files)", lambda: accounting.work_done(make_job_dir(job_id)))
    metrics = made(
        "metrics",
        lambda: (
            status.final_metrics(outcome.history, outcome.restored_epoch)
            if outcome
            else status.final_metrics((done or {}).get("history", []))
        ),
        dict,
    )
    rollup = made(
        "carbon", lambda: carbon.rollup([carbon.StageEnergy(**s["energy"]) for s in stages.values()], job.carbon)
    )
    summary = {
        "job_id": job_id,
        "job_name": job.name,
        "status": log.status,
        "secondary_status_transitions": log.transitions,
        "metrics": metrics,
        "compute": made(
            "compute", lambda: status.compute_section(outcome, report.scoring_flops if report else 0, done)
        ),
        "sifting": made("sifting", lambda: status.sifting_section(job, report, outcome, done)),
        "elastic": made("elastic", lambda: _elastic(job, outcome, failed_groups)),
        "carbon": made("carbon", lambda: esg.report(rollup, job.carbon, outcome, report, metrics), lambda: rollup)
        if rollup is not None
        else None,
        "training": made("training", lambda: _training(outcome)),
        "data": {"channels": stages.get("staging", {}).get("channels", {})},
        "model": model,
        "timings": {name: round(stages[name]["seconds"], 3) for name in TIMED if name in stages},
        "output_uri": str(outputs.job_prefix(job, job_id)) + "/",
        "prefect_flow_run_id": flow_run.get_id(),
    }
    if log.failure_reason:
        summary["failure_reason"] = log.failure_reason
    if errors:
        summary["summary_errors"] = errors
    return summary


def _elastic(job: TrainingJob, outcome, failed_groups: list[dict]) -> dict:
    return {
        "replicas_min": job.resources.min_replicas,
        "replicas_max": job.resources.max_replicas,
        "failures": len(outcome.failures) if outcome else len(failed_groups),
        "failure_details": outcome.failures if outcome else failed_groups,
        "recoveries": outcome.recoveries if outcome else [],
        "departures": outcome.departures if outcome else [],
        "joins": outcome.joins if outcome else [],
        "scaling": outcome.scaling if outcome else [],
        "withdrawn": outcome.withdrawn if outcome else [],
    }


def _training(outcome) -> dict | None:
    if outcome is None:
        return None
    return {
        "stop_reason": outcome.stop_reason,
        "restored_epoch": outcome.restored_epoch,
        "steps_per_epoch": outcome.steps_per_epoch,
        "first_batch_seconds": outcome.first_batch_seconds,
        "replicas_finished": outcome.replicas_finished,
    }


def lineage_tags(job_id: str, stages: dict, outcome, carbon_section: dict, model_uri: str) -> dict[str, str]:
    tags = {f"data.{name}.manifest_digest": c["manifest_digest"] for name, c in stages["staging"]["channels"].items()}
    tags |= {f"data.{name}.uri": c["uri"] for name, c in stages["staging"]["channels"].items()}
    report = stages["filtering"]["report"]
    compute = status.compute_section(outcome, report.scoring_flops if report else 0)
    tags |= {
        "compute.flops_total": str(compute["flops_total"]),
        "compute.flops_scoring_forward": str(compute["flops_scoring_forward"]),
        "compute.flops_prefilter": str(compute["flops_prefilter"]),
        "carbon.energy_kwh": f"{carbon_section['energy_kwh']:.6g}",
        "carbon.emissions_kg": f"{carbon_section['emissions_kg']:.6g}",
        "output.model_uri": model_uri,
        "prefect.flow_run_id": str(flow_run.get_id()),
    }
    tags["sifting.prefilter_dropped"] = json.dumps(report.dropped or {}, sort_keys=True)
    if report and report.manifest_digest:  # which rows training read, when the prefilter chose them
        tags["sifting.filtered_manifest_digest"] = report.manifest_digest
    if report and report.manifest_uri:
        tags["sifting.filtered_manifest_uri"] = report.manifest_uri
    if outcome.sifting and outcome.sifting["kept_fraction"] is not None:  # None: the job ended within the delay
        tags["sifting.kept_fraction"] = f"{outcome.sifting['kept_fraction']:.4f}"
    if outcome.sifting and "pruned_fraction" in outcome.sifting:  # sifting.prune: the share of the rows left out
        tags["sifting.pruned_fraction"] = f"{outcome.sifting['pruned_fraction']:.4f}"
    return tags


def publish(job: TrainingJob, job_id: str, summary: dict, model: dict | None, logger) -> None:
    """Summary to S3, to the flow run as an artifact, and to the MLflow run. Each is best effort, its failure
    logged: the job is over and its summary written, and one raised here (a Prefect API's 500 on an artifact)
    ended a completed, registered job's run Failed, with no ended event for the callers waiting on it.

    A SIGTERM or Ctrl-C arriving meanwhile (the worker shut down, a second stop) skips what is left but the ended
    event, then is raised again: it went past every step, and callers waited on an event that never came."""
    interrupted: list[BaseException] = []

    def report(failed: str, call) -> None:
        if interrupted:
            return
        try:
            best_effort(logger, failed, call)
        except (TerminationSignal, KeyboardInterrupt) as exc:
            interrupted.append(exc)
            logger.warning("told to stop while publishing the summary of job %s: sending its ended event", job_id)

    if (summary["sifting"] or {}).get("warning"):
        logger.warning(summary["sifting"]["warning"])

    # Each apart (a summary refused by S3 cost the job its ledger line too), the ledger first: the summary uploaded
    # says where both are, as its local, MLflow and artifact copies do (the S3 copy said neither)
    def ledger() -> None:
        summary["carbon"]["ledger_uri"] = esg.write_ledger_row(job.output.s3_uri, esg.ledger_row(summary))

    def uploaded() -> None:
        summary["summary_uri"] = outputs.summary_uri(job, job_id)
        try:
            outputs.upload_summary(job, job_id, summary)
        except BaseException:
            del summary["summary_uri"]  # not there
            raise

    report("could not write the carbon ledger row: %s", ledger)
    report("could not upload the summary: %s", uploaded)
    report(
        "could not create the carbon artifact: %s",
        lambda: create_markdown_artifact(
            key=f"carbon-{job.name.lower()}", markdown=esg.markdown(job_id, summary["carbon"])
        ),
    )
    if model is not None:
        run_id = model["run_id"]  # (MLflow's hex id: no % to read as a format)
        report(
            f"could not attach the summary to MLflow run {run_id}: %s", lambda: registry.log_summary(run_id, summary)
        )
    # sent whatever came before it: a caller waiting on the job reads its end from this event alone
    best_effort(logger, "could not send the job's ended event: %s", lambda: _emit_ended(job_id, summary, model))
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary["metrics"].items())
    report(
        "could not create the summary artifact: %s",
        lambda: create_markdown_artifact(
            key=f"{job_events.SUMMARY_ARTIFACT}{job.name.lower()}",
            markdown=f"# {job_id}: {summary['status']}\n\n| metric | value |\n|---|---|\n{rows}\n\n"
            f"```json\n{json.dumps(summary, indent=2, default=str)}\n```",
            description=f"Trainyard job summary of {job_id}",
        ),
    )
    if interrupted:
        raise interrupted[0]
