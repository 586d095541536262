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
import hashlib
import json
import logging
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import numpy as np
import torch

from trainyard import model_card, promotion
from trainyard.errors import RegistryError
from trainyard.home import home
from trainyard.redaction import redact_spec, redact_text
from trainyard.registry_errors import RegistryUnavailable, service_errors, translate
from trainyard.spec import METRICS, TrainingJob
from trainyard.status import final_metrics
from trainyard.tracking_store import ensure_store, tracking_uri

log = logging.getLogger(__name__)

JOB_ID_TAG = "trainyard.job_id"
APPROVAL_TAG = promotion.APPROVAL_TAG
IO_METADATA_KEY = "trainyard"  # in the MLmodel file's metadata: the model's input columns and output classes
APPROVAL_STATUSES = ("PendingManualApproval", "Approved", "Rejected")  # SageMaker's ModelApprovalStatus


def register(
    model: torch.nn.Module,
    job: TrainingJob,
    job_id: str,
    example: np.ndarray,
    history: list[dict],
    params: dict,
    tags: dict[str, str],
    artifacts: dict[str, Path],
    one_gate_at_a_time: Callable[[str], AbstractContextManager] = nullcontext,
    schema: dict | None = None,
    model_epoch: int | None = None,
) -> dict:
    """Log ``model`` in an MLflow run of the job's experiment and register it; return the ``model`` summary.

    ``tags`` is the pipeline's lineage (data, compute, carbon, Prefect run); the version also gets the
    code version, the job spec and the final metrics, and a model card as its description.
    ``one_gate_at_a_time(model name)``: held while the promotion gate runs, so that two jobs of one model
    name finishing together are judged one after the other (MLflow has no compare-and-set for aliases).
    ``schema``: the training plan's (features in input order, label, task, classes in output order), in the
    model's MLflow metadata and its card, so that whoever loads it knows what its columns and outputs are.
    ``model_epoch``: the epoch whose parameters ``model`` holds, where not the last (a restored best epoch):
    the version's final metrics are that epoch's; ``history`` still logs every epoch.
    """
    import mlflow

    uri = ensure_store()
    client = mlflow.MlflowClient(uri)
    name = job.model_name
    version = None
    try:
        version = _one_version_of_job(client, name, job_id)
        if version is None:
            version = _create_version(
                client, uri, model, job, job_id, example, history, params, tags, artifacts, schema, model_epoch
            )  # (known before the look-up below, which may fail too: the message then names it as made, ungated)
            version = _one_version_of_job(client, name, job_id) or version
        _gate_once(client, job, version, one_gate_at_a_time)
        return model_summary(client, name, client.get_model_version(name, version.version), uri)
    except service_errors() as exc:
        ungated = (name, str(version.version)) if version is not None else None
        raise translate(exc, f"registering {name!r} for job {job_id}", uri, ungated=ungated) from exc


GATE_LOCK_PREFIX = "trainyard-gate-"  # also the name of the gate's Prefect concurrency limit (tasks/registry.py)
LONGEST_NAME_IN_LOCK = 200  # under 255 bytes with the prefix and suffix (names are ASCII: MODEL_NAME_PATTERN)


def gate_lock(name: str) -> Path:
    """The lock file that one machine's promotion gates of model ``name`` take one at a time. A name too long
    for a file's (model names go to 255 characters, a file name's bytes too) is cut and given its digest."""
    if len(name) > LONGEST_NAME_IN_LOCK:
        name = f"{name[: LONGEST_NAME_IN_LOCK - 17]}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    return home() / "locks" / f"{GATE_LOCK_PREFIX}{name}.lock"


def finish_gate(
    job: TrainingJob, job_id: str, one_gate_at_a_time: Callable[[str], AbstractContextManager] = nullcontext
) -> dict | None:
    """The ``model`` summary of the version job ``job_id`` registered, its promotion gate run first where an
    earlier run was stopped between the version and the gate (None: the job registered none)."""
    import mlflow

    uri = ensure_store()
    name = job.model_name
    version = None
    try:
        client = mlflow.MlflowClient(uri)
        version = _one_version_of_job(client, name, job_id)  # an earlier run may have died before its clean-up
        if version is None:
            return None
        _gate_once(client, job, version, one_gate_at_a_time)
        return model_summary(client, name, client.get_model_version(name, version.version), uri)
    except service_errors() as exc:
        ungated = (name, str(version.version)) if version is not None else None
        raise translate(exc, f"finishing the registration of {name!r} for job {job_id}", uri, ungated=ungated) from exc


def _gate_once(client, job: TrainingJob, version, one_gate_at_a_time) -> None:
    """The promotion gate for ``version``, unless it has run (an earlier attempt may have stopped before it)."""
    if promotion.GATE_TAG in (version.tags or {}):
        return
    entered = False
    try:
        with one_gate_at_a_time(job.model_name):
            entered = True
            fresh = client.get_model_version(job.model_name, version.version)  # another attempt's gate may have run
            if promotion.GATE_TAG not in (fresh.tags or {}):
                promotion.gate(client, job.gate, job.model_name, fresh)
    except RegistryError as exc:
        if entered:
            raise
        # the gate could not be had (held too long, or its API unreachable): which version waits, and the command
        name, number = job.model_name, version.version
        raise type(exc)(f"{exc}; it is version {number}: `trainyard models gate {name} {number}` gates it") from exc


def registered(name: str, job_id: str) -> dict | None:
    """The ``model`` summary of the version of ``name`` that job ``job_id`` registered, as it stands (gated or
    not), or None: it registered none (yet). What a job that ended inside its registration (a signal, an
    outage) left, for its summary to say."""
    import mlflow

    uri = tracking_uri()
    try:
        client = mlflow.MlflowClient(uri)
        version = _version_of_job(client, name, job_id)
        if version is None:
            return None
        # read again: a search leaves out the aliases (the SQL store's search gives none), and a gate may have set one
        return model_summary(client, name, client.get_model_version(name, version.version), uri)
    except service_errors() as exc:
        raise translate(exc, f"looking up the version of job {job_id}", uri, registering=False) from exc


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
    gated = promotion.GATE_TAG in tags  # (a job that ended inside its registration leaves its version ungated)
    if gated and promotion.EMISSIONS_TAG in tags and "carbon.emissions_kg_at_gate" not in tags:
        # first: a process killed after the gate's figure is overwritten would lose it for good. A version not yet
        # gated gets none: its gate (models gate, a rerun) judges the final figure, which it has from here on
        final["carbon.emissions_kg_at_gate"] = tags[promotion.EMISSIONS_TAG]
    final["carbon.energy_kwh"] = f"{carbon['energy_kwh']:.6g}"
    final["carbon.emissions_kg"] = f"{carbon['emissions_kg']:.6g}"
    for key, value in final.items():
        client.set_model_version_tag(name, number, key, value)
        client.set_tag(run_id, key, value)
    card = model_card.render(name, tags.get(JOB_ID_TAG, summary.get("job_id", "")), tags | final, _io(name, number))
    client.update_model_version(name, number, description=model_card.description(card))
    client.log_text(run_id, card, "model_card.md")


# Each epoch's metrics logged to the run: the ones a job can stop or promote on, and sifting's
# (candidate_loss: the job's model's mean loss over every candidate ranked, to compare with an unsifted run's
# train_loss, none with score: proxy;
# pruned_fraction: the share of the epoch's rows sifting.prune left out).
LOGGED_METRICS = (*METRICS, "candidate_loss", "kept_fraction", "mean_keep_probability", "pruned_fraction")


def _io(name: str, number: str) -> dict | None:
    """The inputs and outputs a registered version's model was logged with (``_log_model``), if any."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())  # a models:/ URI resolves in MLflow's process-wide store
    try:
        metadata = mlflow.models.get_model_info(f"models:/{name}/{number}").metadata
    except service_errors():  # its artifacts deleted by hand, say: the card goes without that section
        return None
    return (metadata or {}).get(IO_METADATA_KEY)


def _create_version(client, uri, model, job, job_id, example, history, params, tags, artifacts, schema, model_epoch):
    import mlflow

    mlflow.set_tracking_uri(uri)
    experiment_id = _experiment(client, job.name, uri)
    _discard_unregistered_runs(client, experiment_id, job_id)
    # the summary's reading (status.final_metrics): the model's epoch, validated or told with the last validation
    final = {k: float(v) for k, v in final_metrics(history, model_epoch).items() if k in METRICS and v is not None}
    lineage = {JOB_ID_TAG: job_id, **model_card.lineage_tags(job, final), **tags}
    io = model_card.io_metadata(schema) if schema else None
    card = model_card.render(job.model_name, job_id, lineage, io)
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
        info = _log_model(model, example, io)
        _check_artifacts(info.model_uri)
    return client.create_model_version(
        name=_ensure_registered(client, job.model_name),
        source=info.model_uri,
        model_id=info.model_id,  # a tracking server refuses a models:/ source without it
        run_id=run.info.run_id,
        tags={APPROVAL_TAG: "PendingManualApproval", **lineage},
        description=model_card.description(card),
    )


def _log_model(model: torch.nn.Module, example: np.ndarray, io: dict | None = None):
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
    if io:
        # A pt2 model's signature can only be tensors, without column names: the MLmodel file's metadata
        # (``model.metadata.metadata["trainyard"]`` once loaded) says which column is which, and which class
        # each output is.
        kwargs["metadata"] = {IO_METADATA_KEY: io}
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


def _versions_of_job(client, name: str, job_id: str) -> list:
    found = client.search_model_versions(f"name='{name}' and tag.`{JOB_ID_TAG}`='{job_id}'")
    return sorted(found, key=lambda v: int(v.version))


def _version_of_job(client, name: str, job_id: str):
    found = _versions_of_job(client, name, job_id)
    return found[0] if found else None


def _one_version_of_job(client, name: str, job_id: str):
    """The job's one version (None: it has none), every other version of the job deleted. MLflow's client
    retries a request, a POST too, after a read timeout or a 5xx a proxy sent for a create the server had
    done: the job would have two versions, one never gated. A run that died between the two creates and
    this clean-up leaves them both, for its rerun to find here."""
    from mlflow.exceptions import MlflowException

    found = _versions_of_job(client, name, job_id)
    if len(found) <= 1:
        return found[0] if found else None
    first, *others = found
    for extra in others:
        log.warning("job %s was registered twice (a retried request); deleting %s v%s", job_id, name, extra.version)
        try:
            client.delete_model_version(name, extra.version)
        except MlflowException as exc:  # another attempt of the job deleted it first
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
    return first


def _discard_unregistered_runs(client, experiment_id: str, job_id: str) -> None:
    """Delete the runs of earlier attempts of this job that never became a version, and the models they
    logged (a run killed mid-registration left one ready, which search and the UI list as the job's)."""
    from mlflow.exceptions import MlflowException

    for run in client.search_runs([experiment_id], f"tags.`{JOB_ID_TAG}` = '{job_id}'"):
        if client.search_model_versions(f"run_id = '{run.info.run_id}'"):
            continue  # a version's, under another name (renamed in MLflow, or a rerun naming another model)
        with contextlib.suppress(MlflowException):  # a server before MLflow 3 has no logged models
            for logged in client.search_logged_models([experiment_id], f"source_run_id = '{run.info.run_id}'"):
                client.delete_logged_model(logged.model_id)
        client.set_terminated(run.info.run_id, "KILLED")
        client.delete_run(run.info.run_id)


def _experiment(client, name: str, uri: str) -> str:
    """The id of the job's experiment (named after the job), made where missing. One deleted in MLflow
    (in its trash, where a tidy of the UI puts it) is restored: MLflow refuses runs in a deleted
    experiment, which failed every later job of that name after its training."""
    from mlflow.exceptions import MlflowException

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
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException as exc:  # another job of this name made it between our look and our create
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def _ensure_registered(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        try:
            client.create_registered_model(name, tags={"managed_by": "trainyard"})
        except MlflowException as created:  # another job of this name registered it first: as good
            if created.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
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
