"""A run of a job id that earlier runs ran: their energy counted with its own, its carbon budget already spent,
or the job already registered by one of them (a retry of a run killed after its registration), which ends the job
without training it again."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from flows import job_summary
from tasks._reporting import best_effort
from tasks.registry import one_gate_at_a_time
from trainyard import energy_journal, outputs, registry, registry_admin
from trainyard.errors import TrainyardError
from trainyard.home import write_json_atomic
from trainyard.spec import TrainingJob
from trainyard.training import accounting


def registered_earlier(
    job: TrainingJob, job_id: str, job_dir: Path, run: str, log, stages: dict, logger
) -> dict | str | None:
    """What a rerun of a job id that an earlier run registered ends with: the job's summary to publish again (the
    earlier run's, or, where that run was killed before writing one, made now from its energy journals here and
    the version), nothing trained; or why this run is refused. Training again would upload another model over the
    registered one's outputs while the version, registered once per job id, kept the first. None for a job id
    with no registered version (its first run, or one that never got that far). A version whose promotion gate an
    earlier run never reached (stopped between the two) is gated now. ``log`` ends as the job does; ``run``: this
    run's journal name."""
    model = registry.finish_gate(job, job_id, one_gate_at_a_time)
    if model is None:
        return None
    try:  # the job has ended: what fails from here refuses this run, and publishes nothing over the job's end
        return _finished(job, job_id, job_dir, run, log, stages, logger, model)
    except TrainyardError as exc:
        return (
            f"job {job_id} was registered as {job.model_name} v{model['version']} by an earlier run, and this run "
            f"could not read what that run left ({exc}); that model and its outputs stand: run the job id again "
            "once that is mended"
        )


def _finished(job: TrainingJob, job_id: str, job_dir: Path, run: str, log, stages: dict, logger, model: dict):
    """``registered_earlier``'s answer for a job id whose version is ``model``."""
    version = model["version"]
    written = job_dir / "summary.json"
    # the job folder's, else the one it uploaded (its folder's copy is best effort: a full disk)
    summary = json.loads(written.read_text()) if written.exists() else outputs.published_summary(job, job_id)
    said = f"registered by an earlier run as {job.model_name} v{version}"
    if summary is not None and (summary.get("model") or {}).get("version") == version:
        logger.info("job %s was %s: nothing is trained again", job_id, said)
        summary["model"] = model  # as it stands now (an earlier run stopped before its gate: gated above)
        if summary["status"] != "Completed":  # it ended inside its registration (a signal, an outage): now finished
            now = datetime.now(UTC).isoformat(timespec="milliseconds")
            done = {"status": "Completed", "start_time": now, "end_time": now}
            summary["secondary_status_transitions"].append(done | {"message": f"registered: {model['gate']}"})
            summary |= {"status": "Completed", "failure_reason": None}
        last = summary["secondary_status_transitions"][-1]["status"]
        log.finish(summary["status"], last, f"{said}: nothing was trained again")
        return summary
    record = registry_admin.version_record(job.model_name, version)
    if summary is not None and _before(summary, record):
        summary = None  # a run's before the one that registered it (a failed one's, uploaded), not the job's end
    if summary is None and energy_journal.kept_of(job_dir, _run_id(record["flow_run_id"]), run):
        # killed after its registration, before its summary: the job is done, and without a summary it had no
        # ledger line either. Made now: the runs' energy from their journals here, the metrics the version holds.
        logger.info("job %s was %s, which ended before its summary: it is written now", job_id, said)
        computed = accounting.work_done(job_dir)  # what its groups computed, as their files here say
        history: list[dict] = computed["history"]
        # as registered (the model's epoch: its best, where the job restored it), and how many were trained
        metrics = record["metrics"] | {"epochs": history[-1]["epoch"] if history else 0}
        log.finish("Completed", "Completed", f"{said}, which ended before its summary: nothing was trained again")
        made = job_summary.summary(job, job_id, log, stages, None, model, [], computed, logger)
        made["metrics"] = metrics
        if made["carbon"] is not None:  # (this run's emissions per point: it trained nothing)
            made["carbon"]["g_per_val_accuracy_point"] = None
        return made
    ended = (  # failed after the version (its gate, say), or killed before its summary on another machine
        f"which ended {summary['status']} after registering it ({summary.get('failure_reason')}); this run "
        "finished its registration"
        if summary is not None
        else "which ended before its summary, on another machine (its energy is not known here)"
    )
    return (
        f"job {job_id} was registered as {job.model_name} v{version} by an earlier run, {ended}; that model and its "
        f"outputs stand ({model['gate']}), and a rerun would train another under the same id: submit the job under "
        "a new id to train it again"
    )


def publish_again(job: TrainingJob, job_id: str, job_dir: Path, summary: dict, logger) -> dict:
    """Publish ``registered_earlier``'s summary and write it to the job folder (best effort, as the pipeline's
    own: a full disk); a signal meanwhile is raised once the ended event is sent (``job_summary.publish``)."""
    try:
        job_summary.publish(job, job_id, summary, summary["model"], logger)
    finally:
        unwritten = "could not write the summary to the job's folder (%s)"
        best_effort(logger, unwritten, write_json_atomic, job_dir / "summary.json", summary)
    return summary


def _before(summary: dict, record: dict) -> bool:
    """Whether ``summary``, which does not record the version, is of a run before the one that registered it:
    another flow run's, or one that ended over a minute before the version was made (an earlier try of the same
    run; a minute for the clocks of the worker and the registry's server)."""
    if _run_id(summary.get("prefect_flow_run_id")) != _run_id(record["flow_run_id"]):
        return True
    transitions = summary.get("secondary_status_transitions") or [{}]
    try:
        return datetime.fromisoformat(transitions[-1]["start_time"]) < record["created"] - timedelta(minutes=1)
    except (KeyError, TypeError, ValueError):  # (no time, or one without its zone)
        return False


def _run_id(value) -> str | None:
    """A flow run id as the summary and the version's tag write it: None for a run outside Prefect (one wrote
    ``"none"``, the other ``str(None)``)."""
    return None if value in (None, "None", "none", "") else str(value)


def count_earlier_runs(job: TrainingJob, stages: dict, job_dir: Path, run: str, logger) -> None:
    """The energy of the job id's earlier runs (a failed one's, a killed one's: with what its groups on other
    machines drew, ``energy_journal.settle_killed``) as a stage of this run's, so that its summary, ledger line
    (which replaces theirs) and carbon budget count what every run spent."""
    energy_journal.settle_killed(job_dir, run, job.carbon.pue)  # (a journal it cannot settle: logged, left)
    record = energy_journal.earlier(job_dir, run)
    if record is not None:
        stages[energy_journal.EARLIER_STAGE] = record
        logger.info(
            "job %s ran %d time(s) before: their %.3g kWh are counted with this run's",
            job_dir.name,
            record["runs"],
            record["energy"]["energy_kwh"],
        )


class BudgetSpent(TrainyardError):
    """The job id's earlier runs spent its whole ``carbon.budget_kg``: this run stops before any compute."""


def check_budget_left(job: TrainingJob, stages: dict) -> None:
    """``BudgetSpent`` where the earlier runs' emissions (``count_earlier_runs``) are past the budget. Without
    this, the rerun staged, filtered and launched its groups before the first live reading stopped it."""
    earlier = stages.get(energy_journal.EARLIER_STAGE)
    budget = job.carbon.budget_kg
    if earlier is None or budget is None or earlier["energy"]["emissions_kg"] <= budget:
        return
    raise BudgetSpent(
        f"the earlier runs of this job id emitted {earlier['energy']['emissions_kg']:.4g} kgCO2e, past "
        f"carbon.budget_kg={budget:g}: nothing was run again; raise carbon.budget_kg, or submit the job under a "
        "new id"
    )
