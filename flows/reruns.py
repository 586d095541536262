"""A run of a job id that earlier runs ran: their energy counted with its own, its carbon budget already spent,
or the job already registered by one of them (a retry of a run killed after its registration), which ends the job
without training it again."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from flows import job_summary
from tasks.registry import one_gate_at_a_time
from trainyard import energy_journal, outputs, registry, registry_admin
from trainyard.errors import TrainyardError
from trainyard.home import write_json_atomic
from trainyard.spec import TrainingJob
from trainyard.training import accounting


def registered_earlier(job: TrainingJob, job_id: str, job_dir: Path, log, stages: dict, logger) -> dict | str | None:
    """What a rerun of a job id that an earlier run registered returns: the job's summary (the earlier run's,
    published again, or, where it was killed before writing one, made now from its energy journal and the
    version), nothing trained; or why this run is refused. Training again would upload another model over the
    registered one's outputs while the version, registered once per job id, kept the first. None for a job id
    with no registered version (its first run, or one that never got that far). A version whose promotion gate an
    earlier run never reached (stopped between the two) is gated now. ``log`` ends as the job does."""
    model = registry.finish_gate(job, job_id, one_gate_at_a_time)
    if model is None:
        return None
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
    elif summary is None and energy_journal.EARLIER_STAGE in stages:
        # killed after its registration, before its summary: the job is done, and without a summary it had no
        # ledger line either. Made now: the runs' energy from their journals here, the metrics the version holds.
        logger.info("job %s was %s, which ended before its summary: it is written now", job_id, said)
        log.finish("Completed", "Completed", f"{said}, which ended before its summary: nothing was trained again")
        computed = accounting.work_done(job_dir)  # what its groups computed, as their files here say
        summary = job_summary.summary(job, job_id, log, stages, None, model, [], computed)
        # as registered (the model's epoch: its best, where the job restored it), and how many were trained
        history: list[dict] = computed["history"]
        epochs = history[-1]["epoch"] if history else 0
        summary["metrics"] = registry_admin.version_metrics(job.model_name, version) | {"epochs": epochs}
    else:
        ended = (  # failed after the version (its gate, say), or killed before its summary on another machine
            f"which ended {summary['status']} after registering it ({summary.get('failure_reason')}); this run "
            "finished its registration"
            if summary is not None
            else "which ended before its summary, on another machine (its energy is not known here)"
        )
        return (
            f"job {job_id} was registered as {job.model_name} v{version} by an earlier run, {ended}; that model "
            f"and its outputs stand ({model['gate']}), and a rerun would train another under the same id: submit the "
            "job under a new id to train it again"
        )
    job_summary.publish(job, job_id, summary, model, logger)
    write_json_atomic(written, summary)
    return summary


def count_earlier_runs(stages: dict, job_dir: Path, run: str, logger) -> None:
    """The energy of the job id's earlier runs (a failed one's, a killed one's) as a stage of this run's, so
    that its summary, ledger line (which replaces theirs) and carbon budget count what every run spent."""
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
