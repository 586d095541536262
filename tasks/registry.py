"""Registry task: log the model with its lineage to MLflow and register a version."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks._metering import retry_transient, stage_meter
from trainyard import plots, registry
from trainyard.spec import TrainingJob
from trainyard.training.plan import TrainingPlan
from trainyard.training.supervisor import TrainingOutcome, load_model


@task(name="registry", retries=2, retry_delay_seconds=3, retry_condition_fn=retry_transient, cache_policy=NO_CACHE)
def register_model(job: TrainingJob, job_id: str, plan: TrainingPlan, outcome: TrainingOutcome, tags: dict) -> dict:
    """Register the trained model (idempotent per job id); return the summary's ``model`` section."""
    logger = get_run_logger()
    with stage_meter("registry", job) as record:
        model = load_model(outcome, job, plan)
        example = np.load(plan.validation_data or plan.train_data)["x"][:5]
        plot = plots.plot_history(outcome.history, Path(plan.train_data).parent / "training_curves.png", job_id)
        params = {f"hp.{k}": v for k, v in job.hyperparameters.model_dump().items()}
        params |= {"algorithm": job.algorithm.builtin or job.algorithm.entrypoint, "replicas": job.resources.replicas}
        record["model"] = registry.register(
            model, job, job_id, example, outcome.history, params, tags, {"training_curves": plot}
        )
    m = record["model"]
    logger.info("registered %s version %s (aliases %s)", m["name"], m["version"], m["aliases"])
    return record
