"""Filtering task: choose the training samples worth their compute."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks._metering import stage_meter
from trainyard import filtering, outputs
from trainyard.champion import ChampionUnloadable
from trainyard.champion import load as load_champion
from trainyard.datasets import StagedData
from trainyard.errors import RegistryError
from trainyard.spec import TrainingJob


@task(name="filtering", cache_policy=NO_CACHE)
def filter_samples(job: TrainingJob, staged: StagedData, job_id: str) -> dict:
    """Filter the staged training set; return the report and the data the groups will train on."""
    logger = get_run_logger()
    with stage_meter("filtering", job) as record:
        champion = _champion(job) if filtering.wants_champion(job.sifting, staged.streamed) else None
        report = record["report"] = filtering.filter_samples(
            staged, job.sifting, job.algorithm.task, champion, job.algorithm, job.hyperparameters
        )
        if report.manifest:  # with the job's outputs: which rows of which objects training read, and why not the rest
            report.manifest_uri = outputs.upload_file(
                job, job_id, Path(report.manifest), "filtering/train.filtered.manifest.json"
            )
    if job.sifting.prefilter_on and staged.streamed:
        logger.info("prefilter skipped: a streamed train channel is not read whole before training")
    if report.label_noise:
        noise = report.label_noise
        measured = "not measured (too few rows)" if noise["above_chance"] is None else f"{noise['above_chance']:.1%}"
        logger.info(
            "label noise: rows a held-out reference finds less likely than chance %s (noisy above %g): online "
            "sifting uses %s",
            measured,
            noise["noisy_share"],
            noise["online_rule"],
        )
        if "note" in noise:
            logger.info("the labels' pick: %s", noise["note"])
    if report.reference:
        logger.info("prefilter losses from %s", report.reference)
    logger.info(
        "filtering kept %d of %d samples (%.1f%%); dropped %s",
        report.kept,
        report.total,
        100 * report.kept_fraction,
        report.dropped or "nothing",
    )
    if report.kept_for_balance:
        logger.info("class balance guard: kept %d rows the loss-based drops would have taken", report.kept_for_balance)
    return record


def _champion(job: TrainingJob) -> filtering.Champion:
    """The registry's champion of the job's model name; a missing one or an unreachable registry is
    not fatal: the prefilter falls back to its own reference models and says why."""
    try:
        found = load_champion(job.model_name)
    except ChampionUnloadable as exc:
        return filtering.Champion(None, str(exc))
    except RegistryError as exc:
        return filtering.Champion(None, f"the registry could not be read ({exc})")
    if found is None:
        return filtering.Champion(None, f"{job.model_name!r} has no champion yet")
    return found
