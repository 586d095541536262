"""Stage 6, registry: log the model with its lineage to MLflow, register a version, gate promotion.

The embedded default is SQLite under ``TRAINYARD_HOME`` (``MLFLOW_TRACKING_URI`` overrides it).
The model is logged as pt2 with a dynamic batch dimension (the input example has several rows),
so the registered model predicts on any batch size. Registration is keyed by the job id: running
it again for the same job returns the version it already made instead of adding one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from trainyard.errors import RegistryError
from trainyard.home import home
from trainyard.spec import METRICS, TrainingJob

JOB_ID_TAG = "trainyard.job_id"
APPROVAL_TAG = "approval_status"


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the embedded SQLite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"


def ensure_store(uri: str | None = None) -> str:
    """Create the tracking database once, before concurrent writers could race to migrate it."""
    import mlflow

    uri = uri or tracking_uri()
    try:
        mlflow.MlflowClient(uri).search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - any failure means the store is unusable
        raise RegistryError(f"MLflow tracking store {uri} is not usable: {exc}") from exc
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
    """Log ``model`` in an MLflow run of the job's experiment and register it; return the ``model`` summary."""
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = ensure_store()
    client = mlflow.MlflowClient(uri)
    name = job.model_name
    try:
        existing = client.search_model_versions(f"name='{name}' and tag.`{JOB_ID_TAG}`='{job_id}'")
        if existing:
            return _model_summary(client, name, existing[0], uri)
        mlflow.set_tracking_uri(uri)
        experiment_id = _experiment(client, job.name, uri)
        with mlflow.start_run(experiment_id=experiment_id, run_name=job_id, tags={JOB_ID_TAG: job_id, **tags}) as run:
            mlflow.log_params(params)
            for entry in history:
                metrics = {k: v for k, v in entry.items() if k in METRICS and v is not None}
                mlflow.log_metrics(metrics, step=entry["epoch"])
            for artifact in artifacts.values():
                mlflow.log_artifact(str(artifact))
            info = _log_model(model, example)
        version = client.create_model_version(
            name=_ensure_registered(client, name),
            source=info.model_uri,
            run_id=run.info.run_id,
            tags={JOB_ID_TAG: job_id, APPROVAL_TAG: "PendingManualApproval", **tags},
        )
        _gate(client, job, name, version, history[-1] if history else {})
        return _model_summary(client, name, client.get_model_version(name, version.version), uri)
    except MlflowException as exc:
        raise RegistryError(f"registering {name!r} in {uri} failed: {exc.message}") from exc


def log_summary(run_id: str, summary: dict) -> None:
    """Attach the final job summary to the job's MLflow run."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "summary.json"
        path.write_text(json.dumps(summary, indent=2, default=str))
        client.log_artifact(run_id, str(path))


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
    except Exception:  # noqa: BLE001 - a model torch.export cannot trace is still logged, pickled
        return mlflow.pytorch.log_model(model, serialization_format="pickle", **kwargs)


def _experiment(client, name: str, uri: str) -> str:
    found = client.get_experiment_by_name(name)
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
    except MlflowException:
        client.create_registered_model(name, tags={"managed_by": "trainyard"})
    return name


def _gate(client, job: TrainingJob, name: str, version, final_metrics: dict) -> None:
    """Move ``champion`` to the new version when it beats the current one, else mark it ``candidate``."""
    from mlflow.exceptions import MlflowException

    gate = job.registry.promote_if
    metric = gate.metric if gate else None
    try:
        champion = client.get_model_version_by_alias(name, "champion")
    except MlflowException:
        champion = None
    wins = champion is None
    if not wins and metric is not None and metric in final_metrics:
        theirs = client.get_run(champion.run_id).data.metrics.get(metric)
        ours = final_metrics[metric]
        gain = (ours - theirs) if gate.mode == "max" else (theirs - ours)
        wins = theirs is None or gain > gate.min_gain
    client.set_registered_model_alias(name, "champion" if wins else "candidate", version.version)


def _model_summary(client, name: str, version, uri: str) -> dict:
    aliases = list(getattr(version, "aliases", []) or [])
    return {
        "name": name,
        "version": int(version.version),
        "uri": f"models:/{name}/{version.version}",
        "source": version.source,
        "run_id": version.run_id,
        "tracking_uri": uri,
        "aliases": aliases,
        "approval_status": (version.tags or {}).get(APPROVAL_TAG, "PendingManualApproval"),
    }
