"""Registry task: log the model with its lineage to MLflow and register a version (exactly once per job).

An unreachable tracking server is a ``RegistryUnavailable`` (a transient ``StorageError``): the task
retries it; registering again for the same job never adds a second version.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run

from tasks._metering import retry_transient, stage_meter
from tasks._reporting import best_effort
from trainyard import model_card, plots, registry
from trainyard.errors import RegistryError
from trainyard.home import Locked, flocked
from trainyard.redaction import redact_text
from trainyard.registry_errors import RegistryUnavailable
from trainyard.spec import TrainingJob
from trainyard.training.plan import TrainingPlan
from trainyard.training.supervisor import TrainingOutcome, load_model


@task(name="registry", retries=2, retry_delay_seconds=3, retry_condition_fn=retry_transient, cache_policy=NO_CACHE)
def register_model(
    job: TrainingJob,
    job_id: str,
    plan: TrainingPlan,
    outcome: TrainingOutcome,
    tags: dict,
    files: dict[str, str] | None = None,
) -> dict:
    """Register the trained model (idempotent per job id); return the summary's ``model`` section.

    Args:
        job: the job spec.
        job_id: the job's id; the version is keyed by it.
        plan: where the training and validation arrays are (the input example comes from them).
        outcome: the training stage's result (model file, history, recoveries).
        tags: the pipeline's lineage tags (data, compute, carbon); Prefect's run and deployment are added.
        files: more files for the version's run, by name (the filtered manifest), beside the training curves.
    """
    logger = get_run_logger()
    with stage_meter("registry", job) as record:
        model = load_model(outcome, job, plan)
        example = np.load(plan.validation_data or plan.train_data)["x"][:5]
        curves = Path(plan.train_data).parent / "training_curves.png"
        failed = "plotting the training curves failed (%s); the version is registered without them"
        plot = best_effort(logger, failed, plots.plot_history, outcome.history, curves, job_id, outcome.restored_epoch)
        params = {f"hp.{k}": v for k, v in job.hyperparameters.model_dump().items()}
        params |= {"algorithm": job.algorithm.builtin or job.algorithm.entrypoint, "replicas": job.resources.replicas}
        lineage = {**model_card.training_tags(outcome, job.sifting.enabled), **_prefect_tags(), **tags}
        record["model"] = registry.register(
            model,
            job,
            job_id,
            example,
            outcome.history,
            params,
            lineage,
            ({"training_curves": plot} if plot is not None else {})
            | {name: Path(path) for name, path in (files or {}).items()},
            one_gate_at_a_time,
            plan.schema,
            outcome.restored_epoch,
        )
    m = record["model"]
    logger.info("registered %s version %s (aliases %s; %s)", m["name"], m["version"], m["aliases"], m["gate"])
    return record


def _prefect_tags() -> dict[str, str]:
    """The Prefect flow run and deployment this registration ran under ("none" when run in-process)."""
    return {
        "prefect.flow_run_id": str(flow_run.get_id() or "none"),
        "prefect.deployment_id": str(deployment.get_id() or "none"),
        "prefect.deployment_name": str(deployment.name or "none"),
    }


GATE_WAIT_SECONDS = 600.0  # a gate takes seconds; a lease of a holder that died runs out in 5 minutes


@contextmanager
def one_gate_at_a_time(model_name: str) -> Iterator[None]:
    """Hold the model name's promotion gate, so that jobs of one name finishing together are judged one after
    the other (each against the champion the one before it left): a file lock under ``TRAINYARD_HOME`` for
    the jobs of this machine (``trainyard run`` gives each job a Prefect API of its own), and a Prefect
    global concurrency limit of one slot for those of every machine of a shared Prefect API. The limit's
    lease outlives a holder killed mid-gate by at most five minutes.

    Not had within ``GATE_WAIT_SECONDS``: a ``RegistryError`` naming the lock and how to free it (not retried:
    whatever holds it holds it still); a Prefect API that does not answer: ``RegistryUnavailable`` (retried).
    Either way the version stays registered, ungated, and a rerun of the job id gates it."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    limit = f"{registry.GATE_LOCK_PREFIX}{model_name}"
    lock = registry.gate_lock(model_name)
    with ExitStack() as held:
        try:
            held.enter_context(flocked(lock, wait_seconds=GATE_WAIT_SECONDS))
            # (ObjectAlreadyExists: another job of the name made it between the upsert's look and its create)
            with get_client(sync_client=True) as client, suppress(ObjectAlreadyExists):
                client.upsert_global_concurrency_limit_by_name(limit, 1)
            held.enter_context(concurrency(limit, occupy=1, timeout_seconds=GATE_WAIT_SECONDS, strict=True))
        except Locked as exc:
            raise RegistryError(
                f"the promotion gate of {model_name!r} stayed held by another job of this machine for "
                f"{GATE_WAIT_SECONDS:g} s (lock {lock}); the version is registered but not gated: once that job "
                "has ended, gate it (trainyard models gate, or run this job again), or judge it by hand (trainyard "
                "models promote)"
            ) from exc
        except TimeoutError as exc:  # prefect's AcquireConcurrencySlotTimeoutError
            raise RegistryError(
                f"the promotion gate of {model_name!r} (the Prefect global concurrency limit {limit}) stayed held "
                f"for {GATE_WAIT_SECONDS:g} s; the version is registered but not gated. If no other job of the "
                f"model is registering, free it (prefect gcl update {limit} --active-slots 0) and gate the version "
                "(trainyard models gate, or run this job again), or judge it by hand (trainyard models promote)"
            ) from exc
        except (httpx.HTTPError, ConcurrencySlotAcquisitionError) as exc:  # the latter: httpx's, while waiting
            raise RegistryUnavailable(
                f"the Prefect API did not answer while taking the promotion gate of {model_name!r} "
                f"({type(exc).__name__}: {redact_text(str(exc))}); the version is registered but not gated, "
                "and a rerun of this job gates it"
            ) from exc
        yield
