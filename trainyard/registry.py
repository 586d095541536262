"""Stage 6, registry: log the model with its lineage to MLflow, register a version, gate promotion.

The embedded default is SQLite under ``TRAINYARD_HOME`` (``MLFLOW_TRACKING_URI`` overrides it, for
example an ``mlflow server`` on a database with artifacts on S3). The model is logged as pt2 with a
dynamic batch dimension (the input example has several rows), so the registered model predicts on any
batch size.

Exactly once per job: the version is created in one call that carries the job id tag, and only after
the model's artifacts are confirmed in the store, so no version points at a missing artifact. Running
``register`` again for the same job (a Prefect retry, a crash mid-registration) finds that version and
finishes what is left (the promotion gate) instead of adding one; runs a failed attempt left without a
version are deleted. Gate decisions are recorded on the version (``trainyard.gate``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from trainyard import model_card, promotion
from trainyard.home import home
from trainyard.redaction import redact_spec, redact_text
from trainyard.registry_errors import ModelNotFound, RegistryUnavailable, service_errors, translate
from trainyard.spec import METRICS, TrainingJob

log = logging.getLogger(__name__)

JOB_ID_TAG = "trainyard.job_id"
APPROVAL_TAG = "approval_status"
APPROVAL_STATUSES = ("PendingManualApproval", "Approved", "Rejected")  # SageMaker's ModelApprovalStatus


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the embedded SQLite store."""
    # MLflow prints each run's URL to stdout (past Prefect's log capture, into worker and pod logs), a
    # password in the tracking URI included; Trainyard's own messages name runs without it.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"


def ensure_store(uri: str | None = None) -> str:
    """Create the tracking database once, before concurrent writers could race to migrate it."""
    import mlflow

    uri = uri or tracking_uri()
    try:
        mlflow.MlflowClient(uri).search_experiments(max_results=1)
    except service_errors() as exc:
        raise translate(exc, "checking the tracking store", uri, registering=False) from exc
    return uri


def register(
    model: torch.nn.Module,
    job: TrainingJob,
    job_id: str,
    example: np.ndarray,
    history: list[dict],
    params: dict,
    tags: dict[str, str],
    artifacts: dict[str, Path],
) -> dict:
    """Log ``model`` in an MLflow run of the job's experiment and register it; return the ``model`` summary.

    ``tags`` is the pipeline's lineage (data, compute, carbon, Prefect run); the version also gets the
    code version, the job spec and the final metrics, and a model card as its description.
    """
    import mlflow

    uri = ensure_store()
    client = mlflow.MlflowClient(uri)
    name = job.model_name
    try:
        version = _version_of_job(client, name, job_id)
        if version is None:
            version = _create_version(client, uri, model, job, job_id, example, history, params, tags, artifacts)
        if promotion.GATE_TAG not in (version.tags or {}):  # new, or an earlier attempt stopped before the gate
            promotion.gate(client, job.gate, name, version)
        return model_summary(client, name, client.get_model_version(name, version.version), uri)
    except service_errors() as exc:
        raise translate(exc, f"registering {name!r} for job {job_id}", uri) from exc


def job_version(name: str, job_id: str) -> int | None:
    """The version of ``name`` that job ``job_id`` registered, None if it has none (yet)."""
    import mlflow

    uri = ensure_store()
    try:
        version = _version_of_job(mlflow.MlflowClient(uri), name, job_id)
    except service_errors() as exc:
        raise translate(exc, f"looking up the version of job {job_id}", uri, registering=False) from exc
    return None if version is None else int(version.version)


def load_champion(name: str) -> tuple[torch.nn.Module, str] | None:
    """The current ``champion`` of ``name`` as a torch module, and ``"<name> v<N>"``; None if there is none.

    Used as the prefilter's reference model (``sifting.prefilter.reference: champion``).
    """
    import mlflow

    uri = ensure_store()
    client = mlflow.MlflowClient(uri)
    try:
        version = promotion.alias_version(client, name, promotion.CHAMPION)
        if version is None:
            return None
        # A models:/ URI is resolved in MLflow's process-wide store, which is ./mlflow.db in a process
        # that has not set it (not the embedded store); the version the alias named, not the alias again.
        mlflow.set_tracking_uri(uri)
        # A pickled model would run whatever it holds in this process (whoever can register a version or
        # write the artifact store could). Unless the operator allows it, only a pt2 archive MLflow finds
        # free of pickles loads; a pickled champion (one torch.export could not trace) is refused, and
        # the prefilter falls back to its own reference models, saying why.
        with _environment("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false"):
            model = mlflow.pytorch.load_model(f"models:/{name}/{version.version}", map_location="cpu")
    except service_errors() as exc:
        raise translate(exc, f"loading the champion of {name!r}", uri, registering=False) from exc
    return model, f"{name} v{version.version}"


def log_summary(run_id: str, summary: dict) -> None:
    """Attach the final job summary to the job's MLflow run, and give its registered version the job's
    final carbon figures.

    The version's ``carbon.*`` tags and card were written during registration, before the registry
    stage's own energy was known; they now take the summary's (and the ledger's) totals, so every place
    shows one figure. The figure the promotion gate's ceiling judged stays as ``carbon.emissions_kg_at_gate``.
    """
    import mlflow

    client = mlflow.MlflowClient(tracking_uri())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "summary.json"
        path.write_text(json.dumps(summary, indent=2, default=str))
        client.log_artifact(run_id, str(path))
    model, carbon = summary.get("model"), summary.get("carbon") or {}
    if not model or carbon.get("energy_kwh") is None:
        return
    name, number = model["name"], str(model["version"])
    tags = dict(client.get_model_version(name, number).tags or {})
    final = {}
    if promotion.EMISSIONS_TAG in tags and "carbon.emissions_kg_at_gate" not in tags:
        # first: a process killed after the gate's figure is overwritten would lose it for good
        final["carbon.emissions_kg_at_gate"] = tags[promotion.EMISSIONS_TAG]
    final["carbon.energy_kwh"] = f"{carbon['energy_kwh']:.6g}"
    final["carbon.emissions_kg"] = f"{carbon['emissions_kg']:.6g}"
    for key, value in final.items():
        client.set_model_version_tag(name, number, key, value)
        client.set_tag(run_id, key, value)
    card = model_card.render(name, tags.get(JOB_ID_TAG, summary.get("job_id", "")), tags | final)
    client.update_model_version(name, number, description=card)
    client.log_text(run_id, card, "model_card.md")


def list_versions(name: str | None = None) -> list[dict]:
    """Every registered version (of ``name``, or of every model), newest first, as ``model`` summaries."""
    import mlflow

    uri = tracking_uri()
    try:
        client = mlflow.MlflowClient(uri)  # inside: a malformed URI fails here
        if name is not None:
            client.get_registered_model(name)  # an unknown name is a mistake, not an empty list
        found = client.search_model_versions(f"name='{name}'" if name else None)
        rows = [model_summary(client, v.name, v, uri) for v in found]
        # search_model_versions leaves out the aliases: the registered model holds them
        aliases = {n: client.get_registered_model(n).aliases or {} for n in {r["name"] for r in rows}}
    except service_errors() as exc:
        raise translate(exc, f"listing {name or 'registered models'}", uri, registering=False) from exc
    for row in rows:
        row["aliases"] = sorted(a for a, v in aliases[row["name"]].items() if int(v) == row["version"])
    return sorted(rows, key=lambda r: (r["name"], -r["version"]))


def describe(name: str, ref: str) -> dict:
    """One version (``ref``: a number or an alias): its summary, every tag and its model card."""
    return _with_version(name, ref, "reading", lambda client, v: None)


def set_approval(name: str, ref: str, status: str) -> dict:
    """Set a version's ``approval_status`` (SageMaker's values); return its summary."""
    if status not in APPROVAL_STATUSES:
        raise ValueError(f"approval status must be one of {APPROVAL_STATUSES}, not {status!r}")
    return _with_version(
        name,
        ref,
        f"setting {APPROVAL_TAG} of",
        lambda c, v: c.set_model_version_tag(name, v.version, APPROVAL_TAG, status),
    )


def promote(name: str, ref: str) -> dict:
    """Point ``champion`` at a version by hand (``candidate`` leaves it); return its summary."""

    def move(client, version) -> None:
        client.set_registered_model_alias(name, promotion.CHAMPION, version.version)
        candidate = promotion.alias_version(client, name, promotion.CANDIDATE)
        if candidate is not None and str(candidate.version) == str(version.version):
            client.delete_registered_model_alias(name, promotion.CANDIDATE)
        client.set_model_version_tag(name, version.version, promotion.GATE_TAG, "champion: promoted by hand")

    return _with_version(name, ref, "promoting", move)


def _with_version(name: str, ref: str, what: str, action) -> dict:
    import mlflow

    uri = tracking_uri()
    label = f"{name} version {ref}" if ref.isdigit() else f"{name}@{ref}"
    if ref.isdigit() and int(ref) >= 2**63:  # past the store's integers: no such version, not a failing service
        raise ModelNotFound(f"{label}: no such registered model version")
    try:
        client = mlflow.MlflowClient(uri)  # inside: a malformed URI fails here
        version = client.get_model_version(name, ref) if ref.isdigit() else promotion.alias_version(client, name, ref)
        if version is None:
            raise ModelNotFound(f"{label}: no such registered model or alias")
        action(client, version)
        version = client.get_model_version(name, version.version)
    except service_errors() as exc:
        raise translate(exc, f"{what} {label}", uri, registering=False) from exc
    return {**model_summary(client, name, version, uri), "tags": dict(version.tags or {}), "card": version.description}


# Each epoch's metrics logged to the run: the ones a job can stop or promote on, and sifting's
# (candidate_loss: the mean loss of every candidate ranked, to compare with an unsifted run's train_loss;
# pruned_fraction: the share of the epoch's rows sifting.prune left out).
LOGGED_METRICS = (*METRICS, "candidate_loss", "kept_fraction", "mean_keep_probability", "pruned_fraction")


def _create_version(client, uri, model, job, job_id, example, history, params, tags, artifacts):
    import mlflow

    mlflow.set_tracking_uri(uri)
    experiment_id = _experiment(client, job.name, uri)
    _discard_unregistered_runs(client, experiment_id, job_id)
    final = model_card.final_metrics(history, METRICS)
    lineage = {JOB_ID_TAG: job_id, **model_card.lineage_tags(job, final), **tags}
    card = model_card.render(job.model_name, job_id, lineage)
    run_tags = {k: v for k, v in lineage.items() if k != model_card.JOB_SPEC_TAG}  # run tags hold 8000 chars
    with mlflow.start_run(experiment_id=experiment_id, run_name=job_id, tags=run_tags) as run:
        mlflow.log_params(params)
        for entry in history:
            metrics = {k: v for k, v in entry.items() if k in LOGGED_METRICS and v is not None}
            mlflow.log_metrics(metrics, step=entry["epoch"])
        for artifact in artifacts.values():
            mlflow.log_artifact(str(artifact))
        mlflow.log_dict(redact_spec(job.model_dump(mode="json")), "job_spec.json")
        mlflow.log_text(card, "model_card.md")
        info = _log_model(model, example)
        _check_artifacts(info.model_uri)
    return client.create_model_version(
        name=_ensure_registered(client, job.model_name),
        source=info.model_uri,
        model_id=info.model_id,  # a tracking server refuses a models:/ source without it
        run_id=run.info.run_id,
        tags={APPROVAL_TAG: "PendingManualApproval", **lineage},
        description=card,
    )


def _log_model(model: torch.nn.Module, example: np.ndarray):
    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    model = model.eval()
    with torch.no_grad():
        out = model(torch.from_numpy(example))
    signature = ModelSignature(
        inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, example.shape[1]))]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, *out.shape[1:]))]),
    )
    # Pinning requirements skips MLflow's slow inference of them; "+cpu" is not on PyPI.
    requirements = [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "numpy"]
    kwargs = {"name": "model", "signature": signature, "input_example": example, "pip_requirements": requirements}
    try:
        return mlflow.pytorch.log_model(model, serialization_format="pt2", **kwargs)
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        # torch.export could not trace the model; it is still logged, pickled. Service failures
        # (MlflowException, OSError) are not caught here: they fail the attempt.
        return mlflow.pytorch.log_model(model, serialization_format="pickle", **kwargs)


def _check_artifacts(model_uri: str) -> None:
    """The model's files must be in the artifact store before a version may point at them."""
    import mlflow

    listed = {a.path.rsplit("/", 1)[-1] for a in mlflow.artifacts.list_artifacts(artifact_uri=model_uri)}
    if "MLmodel" not in listed:
        raise RegistryUnavailable(f"the model logged at {model_uri} is not in the artifact store (found {listed})")


def _version_of_job(client, name: str, job_id: str):
    found = client.search_model_versions(f"name='{name}' and tag.`{JOB_ID_TAG}`='{job_id}'")
    return min(found, key=lambda v: int(v.version)) if found else None


def _discard_unregistered_runs(client, experiment_id: str, job_id: str) -> None:
    """Delete the runs of earlier attempts of this job that never became a version, and the models they
    logged (a run killed mid-registration left one ready, which search and the UI list as the job's)."""
    from mlflow.exceptions import MlflowException

    for run in client.search_runs([experiment_id], f"tags.`{JOB_ID_TAG}` = '{job_id}'"):
        with contextlib.suppress(MlflowException):  # a server before MLflow 3 has no logged models
            for logged in client.search_logged_models([experiment_id], f"source_run_id = '{run.info.run_id}'"):
                client.delete_logged_model(logged.model_id)
        client.set_terminated(run.info.run_id, "KILLED")
        client.delete_run(run.info.run_id)


def _experiment(client, name: str, uri: str) -> str:
    """The id of the job's experiment (named after the job), made where missing. One deleted in MLflow
    (in its trash, where a tidy of the UI puts it) is restored: MLflow refuses runs in a deleted
    experiment, which failed every later job of that name after its training."""
    found = client.get_experiment_by_name(name)
    if found is not None and found.lifecycle_stage == "deleted":
        log.warning(
            "MLflow experiment %r (id %s) was deleted; restoring it to record this job's run "
            "(to retire the model, archive its registered versions instead)",
            name,
            found.experiment_id,
        )
        client.restore_experiment(found.experiment_id)
    if found is not None:
        return found.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        # Beside the database: without it MLflow would put artifacts under ./mlruns of whatever the
        # working folder is. A tracking server decides for itself.
        location = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts" / name).as_uri()
    return client.create_experiment(name, artifact_location=location)


def _ensure_registered(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        client.create_registered_model(name, tags={"managed_by": "trainyard"})
    return name


def model_summary(client, name: str, version, uri: str) -> dict:
    """The job summary's ``model`` section for one version."""
    tags = version.tags or {}
    return {
        "name": name,
        "version": int(version.version),
        "uri": f"models:/{name}/{version.version}",
        "source": version.source,
        "run_id": version.run_id,
        "tracking_uri": redact_text(uri),
        "aliases": sorted(getattr(version, "aliases", []) or []),
        "approval_status": tags.get(APPROVAL_TAG, "PendingManualApproval"),
        "gate": tags.get(promotion.GATE_TAG),
        "job_id": tags.get(JOB_ID_TAG),
    }


@contextlib.contextmanager
def _environment(name: str, default: str) -> Iterator[None]:
    """``name`` set to ``default`` for the block, unless already set (the operator's choice stands)."""
    if name in os.environ:
        yield
        return
    os.environ[name] = default
    try:
        yield
    finally:
        os.environ.pop(name, None)
