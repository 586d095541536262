"""What ``trainyard models`` does to registered versions by hand: list them, show one, approve or reject it
(SageMaker's ``ModelApprovalStatus``), promote it to ``champion``, run the gate of a version whose job
stopped before it. Registration and the automatic gate are ``registry`` and ``promotion``."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime

from trainyard import model_card, promotion
from trainyard.errors import RegistryError, TrainyardError
from trainyard.home import Locked, flocked
from trainyard.registry import APPROVAL_STATUSES, APPROVAL_TAG, gate_lock, model_summary
from trainyard.registry_errors import ModelNotFound, service_errors, translate
from trainyard.tracking_store import embedded_store, tracking_uri


def list_versions(name: str | None = None) -> list[dict]:
    """Every registered version (of ``name``, or of every model), newest first, as ``model`` summaries."""
    import mlflow

    uri = tracking_uri()
    if _nothing_registered():
        if name is not None:
            raise ModelNotFound(f"{name}: no such registered model (nothing is registered in {uri} yet)")
        return []
    try:
        client = mlflow.MlflowClient(uri)  # inside: a malformed URI fails here
        if name is not None:
            client.get_registered_model(name)  # an unknown name is a mistake, not an empty list
        found = client.search_model_versions(f"name='{name}'" if name else None)
        rows = [
            model_summary(client, v.name, v, uri) | {"metrics": model_card.tagged_metrics(v.tags or {})} for v in found
        ]
        # search_model_versions leaves out the aliases: the registered model holds them
        aliases = {n: client.get_registered_model(n).aliases or {} for n in {r["name"] for r in rows}}
    except service_errors() as exc:
        wrong = _named_wrong(exc, name or "")
        raise wrong or translate(exc, f"listing {name or 'registered models'}", uri, registering=False) from exc
    for row in rows:
        row["aliases"] = sorted(a for a, v in aliases[row["name"]].items() if int(v) == row["version"])
    return sorted(rows, key=lambda r: (r["name"], -r["version"]))


def _nothing_registered() -> bool:
    """Whether the tracking store is the embedded one and nothing has created it yet. It is not created just to be
    found empty: nor outside ``ensure_store``'s lock, which a job starting at the same time takes to create it."""
    store = embedded_store()
    return store is not None and not store.exists()


def describe(name: str, ref: str) -> dict:
    """One version (``ref``: a number or an alias): its summary, every tag and its model card."""
    return _with_version(name, ref, "reading", lambda client, v: None)


def set_approval(name: str, ref: str, status: str, reason: str | None = None) -> dict:
    """Set a version's ``approval_status`` (SageMaker's values), with who set it and when (and why, where
    given: SageMaker's ApprovalDescription) as ``approval_status.by``, ``.at`` and ``.reason``; return its summary."""
    if status not in APPROVAL_STATUSES:
        raise ValueError(f"approval status must be one of {APPROVAL_STATUSES}, not {status!r}")
    record = {  # the status last: one written beside an earlier decision's who, when and why would be misread
        f"{APPROVAL_TAG}.by": _who(),
        f"{APPROVAL_TAG}.at": datetime.now(UTC).isoformat(timespec="seconds"),
        f"{APPROVAL_TAG}.reason": reason or "",  # (an earlier decision's reason does not stay beside this one)
        APPROVAL_TAG: status,
    }

    def judge(client, version) -> None:
        for key, value in record.items():
            client.set_model_version_tag(name, version.version, key, value)

    def judged(client, version) -> None:
        # A rejection waits for a job's gate in progress: landing between the gate's look at the version and its
        # move of the alias, it was not seen, and the rejected version became champion.
        if status != "Rejected":
            judge(client, version)
            return
        with _gate_held(name):
            judge(client, version)

    return _with_version(name, ref, f"setting {APPROVAL_TAG} of", judged)


def _who() -> str:
    """The person (this machine's user) who approves or rejects a version."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for the uid (a container's arbitrary user)
        return f"uid {os.getuid()}"


BY_HAND = "champion: promoted by hand"


class VersionRejected(RegistryError):
    """A Rejected version asked to be promoted without ``force``: the person's mistake, not the service's."""


def promote(name: str, ref: str, force: bool = False) -> dict:
    """Point ``champion`` at a version by hand (``candidate`` leaves it); return its summary. A Rejected version
    only with ``force`` (``VersionRejected`` otherwise)."""

    def move(client, version) -> None:
        with _gate_held(name):  # not between a job's gate reading the champion and moving it
            # read again under the lock a rejection takes: one landing since the version was looked up is seen
            version = client.get_model_version(name, version.version)
            if not force and (version.tags or {}).get(APPROVAL_TAG) == promotion.REJECTED:
                raise VersionRejected(f"{name} version {version.version} is Rejected; approve it first, or use --force")
            promotion.make_champion(client, name, version)
        gate = (version.tags or {}).get(promotion.GATE_TAG)
        if not (gate or "").startswith(BY_HAND):  # the gate's own decision is kept beside it, for the record
            gate = BY_HAND + (f" (the gate had said: {gate})" if gate else "")
        client.set_model_version_tag(name, version.version, promotion.GATE_TAG, gate)

    return _with_version(name, ref, "promoting", move)


def gate(name: str, ref: str) -> dict:
    """Run the promotion gate of a version that has not been through it (its job failed or gave up waiting
    for the gate after registering it), by the rule of the job spec it was registered with (its
    ``trainyard.job_spec`` tag); return its summary. Under the gate's lock of this machine, as a job's gate."""
    from trainyard.spec import TrainingJob

    def judge(client, version) -> None:
        tags = version.tags or {}
        if promotion.GATE_TAG in tags:
            raise RegistryError(
                f"{name} version {version.version} has been through the gate: {tags[promotion.GATE_TAG]}"
            )
        if model_card.JOB_SPEC_TAG not in tags:
            raise RegistryError(
                f"{name} version {version.version} has no {model_card.JOB_SPEC_TAG} tag (not registered by a "
                "Trainyard job): there is no gate rule to run; promote it by hand (trainyard models promote)"
            )
        try:
            job = TrainingJob.model_validate(json.loads(tags[model_card.JOB_SPEC_TAG]))
        except (ValueError, TrainyardError) as exc:  # (pydantic's ValidationError and json's are ValueErrors)
            raise RegistryError(
                f"{name} version {version.version}: its {model_card.JOB_SPEC_TAG} no longer validates as a job spec "
                f"here ({str(exc).splitlines()[0]}); judge it by hand (trainyard models promote)"
            ) from None
        with _gate_held(name):
            fresh = client.get_model_version(name, version.version)  # a job's gate may have run meanwhile
            if promotion.GATE_TAG not in (fresh.tags or {}):
                promotion.gate(client, job.gate, name, fresh)

    return _with_version(name, ref, "gating", judge)


GATE_WAIT_SECONDS = 60.0  # a person waits at most this long for a job's gate of the same model name


@contextlib.contextmanager
def _gate_held(name: str) -> Iterator[None]:
    """The machine's gate lock of model ``name`` (a job's gate holds it for seconds), or a ``RegistryError``
    saying who has it. One machine's: a job on another machine of a shared Prefect API takes the API's
    concurrency limit too, which these commands (no Prefect) do not."""
    try:
        with flocked(gate_lock(name), wait_seconds=GATE_WAIT_SECONDS):
            yield
    except Locked:
        raise RegistryError(
            f"the promotion gate of {name!r} stayed held by a job of this machine for {GATE_WAIT_SECONDS:g} s "
            f"(lock {gate_lock(name)}); try again once it has registered"
        ) from None


def _with_version(name: str, ref: str, what: str, action) -> dict:
    import mlflow

    uri = tracking_uri()
    number = ref.isascii() and ref.isdigit()  # "²" is a digit to str.isdigit, and no number to int()
    label = f"{name} version {ref}" if number else f"{name}@{ref}"
    if number and int(ref) >= 2**63:  # past the store's integers: no such version, not a failing service
        raise ModelNotFound(f"{label}: no such registered model version")
    if _nothing_registered():
        raise ModelNotFound(f"{label}: no such registered model (nothing is registered in {uri} yet)")
    try:
        client = mlflow.MlflowClient(uri)  # inside: a malformed URI fails here
        version = client.get_model_version(name, ref) if number else promotion.alias_version(client, name, ref)
        if version is None:
            raise ModelNotFound(f"{label}: no such registered model or alias")
        action(client, version)
        version = client.get_model_version(name, version.version)
    except service_errors() as exc:
        raise _named_wrong(exc, label) or translate(exc, f"{what} {label}", uri, registering=False) from exc
    return {**model_summary(client, name, version, uri), "tags": dict(version.tags or {}), "card": version.description}


def _named_wrong(exc: BaseException, label: str) -> ModelNotFound | None:
    """A name MLflow refuses as no model's ("a/b", ""): the command's mistake, said as not found (exit 2), where it
    read as a refusal by the service (exit 1)."""
    from mlflow.exceptions import MlflowException

    # (the name's: "Invalid model name 'a/b'", "Missing value for required parameter 'name'"; the same code also
    # says a tracking URI has no registry, which is the service's)
    if isinstance(exc, MlflowException) and exc.error_code == "INVALID_PARAMETER_VALUE" and "name" in exc.message:
        return ModelNotFound(f"{label}: no such registered model ({exc.message})")
    return None


def version_record(name: str, version: int) -> dict:
    """What version ``version`` of ``name`` says of the run that registered it, for a summary made after the fact
    (``flows.reruns``): its final ``metrics`` (its ``metrics.<name>`` tags, to 6 significant digits), the Prefect
    ``flow_run_id`` it ran under (``"none"`` in-process) and when it was ``created`` (UTC)."""
    import mlflow

    uri = tracking_uri()
    try:
        found = mlflow.MlflowClient(uri).get_model_version(name, str(version))
    except service_errors() as exc:
        raise translate(exc, f"reading {name} v{version}", uri, registering=False) from exc
    tags = found.tags or {}
    return {
        "metrics": {k: int(v) if v.isdigit() else float(v) for k, v in model_card.tagged_metrics(tags).items()},
        "flow_run_id": tags.get("prefect.flow_run_id", "none"),
        "created": datetime.fromtimestamp(found.creation_timestamp / 1000, UTC),
    }
