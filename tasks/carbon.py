"""Carbon task: roll the stages' energy and emissions up into the job's carbon record."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks._metering import stage_meter
from trainyard import carbon, esg, status
from trainyard.spec import TrainingJob


@task(name="carbon", cache_policy=NO_CACHE)
def account(job: TrainingJob, stage_energy: list[dict], outcome=None, prefilter=None) -> dict:
    """Sum the stages measured so far (this one included) into the summary's ``carbon`` section: the
    job's ESG report (``trainyard.esg``)."""
    logger = get_run_logger()
    with stage_meter("carbon", job) as record:
        pass  # the roll-up itself is instant; the meter records this stage's share for completeness
    records = [carbon.StageEnergy(**e) for e in [*stage_energy, record["energy"]]]
    metrics = status.final_metrics(outcome.history, outcome.restored_epoch) if outcome else {}
    record["carbon"] = esg.report(carbon.rollup(records, job.carbon), job.carbon, outcome, prefilter, metrics)
    c = record["carbon"]
    logger.info(
        "energy %.3g kWh, emissions %.3g kgCO2e (%s)", c["energy_kwh"], c["emissions_kg"], c["measurement_mode"]
    )
    return record
