"""The registry's current ``champion`` of a model name, loaded as a torch module: the prefilter's reference
model (``sifting.prefilter.reference: champion``). Never unpickled unless the operator allows it; one that
cannot be loaded here is ``ChampionUnloadable``, on which the prefilter falls back to its own reference models."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from trainyard import promotion, tracking_store
from trainyard.errors import RegistryError
from trainyard.redaction import redact_text
from trainyard.reference_losses import Champion
from trainyard.registry import IO_METADATA_KEY
from trainyard.registry_errors import service_errors, translate


class ChampionUnloadable(RegistryError):
    """The champion was fetched but cannot be loaded here: pickled, damaged, or saved by another torch."""


def load(name: str) -> Champion | None:
    """The current ``champion`` of ``name``: its torch module, ``"<name> v<N>"`` and the inputs and outputs it was
    logged with; None if there is none; ``ChampionUnloadable`` for one that cannot be loaded here or was Rejected.

    Used as the prefilter's reference model (``sifting.prefilter.reference: champion``).
    """
    import mlflow

    uri = tracking_store.ensure_store()
    client = mlflow.MlflowClient(uri)
    try:
        version = promotion.alias_version(client, name, promotion.CHAMPION)
        if version is None:
            return None
        if (version.tags or {}).get(promotion.APPROVAL_TAG) == promotion.REJECTED:
            # a person judged it unfit: its losses are no better a reference than its predictions
            raise ChampionUnloadable(f"the champion {name} v{version.version} is Rejected; not used as a reference")
        # A models:/ URI is resolved in MLflow's process-wide store, which is ./mlflow.db in a process
        # that has not set it (not the embedded store); the version the alias named, not the alias again.
        mlflow.set_tracking_uri(uri)
        with tempfile.TemporaryDirectory(prefix="trainyard-champion-") as folder:
            # fetched, then loaded: a failure to fetch is the registry's (unavailable, or not found), one to
            # load is the archive's (damaged, pickled, or saved by a torch this one cannot read)
            local = mlflow.artifacts.download_artifacts(f"models:/{name}/{version.version}", dst_path=folder)
            label = f"{name} v{version.version}"
            return Champion(_load_reference(mlflow, local, label), label, _logged_io(mlflow, local))
    except service_errors() as exc:
        raise translate(exc, f"loading the champion of {name!r}", uri, registering=False) from exc


def _logged_io(mlflow, local: str) -> dict | None:
    """The columns and classes the version was logged with (``registry.IO_METADATA_KEY``), None where not said."""
    try:
        metadata = mlflow.models.Model.load(local).metadata
    except Exception:  # noqa: BLE001 - an MLmodel file MLflow cannot read: judged by its outputs' shape instead
        return None
    io = (metadata or {}).get(IO_METADATA_KEY)
    return io if isinstance(io, dict) else None


def _load_reference(mlflow, local: str, label: str) -> torch.nn.Module:
    """The champion's model from its fetched folder; ``ChampionUnloadable`` when it cannot be loaded here, a
    pickled one included.

    A pickled model would run whatever it holds in this process (whoever can register a version or
    write the artifact store could). Unless the operator allows it, only a pt2 archive MLflow finds
    free of pickles loads; a pickled champion (one torch.export could not trace) is refused.
    """
    try:
        with _refusing_pickles(mlflow, local):
            return mlflow.pytorch.load_model(local, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - MLflow's refusal or torch's error on this archive: not the job's bug
        raise ChampionUnloadable(
            f"the champion {label} could not be loaded here ({type(exc).__name__}: {redact_text(str(exc))[:400]})"
        ) from exc


def _on_python_path(path: str) -> bool:
    """Whether ``path`` is under an entry of ``sys.path`` (MLflow 3.18's test, for models that may run code)."""
    where = Path(path).resolve()
    return any(where.is_relative_to(Path(entry or os.getcwd()).resolve()) for entry in sys.path)


# MLflow's switches for loading a pickled model: the first since MLflow 3.18 (which warns that the second, the
# only one before it, is deprecated and will go)
_PICKLE_SWITCHES = ("MLFLOW_ALLOW_MODEL_CODE_EXECUTION", "MLFLOW_ALLOW_PICKLE_DESERIALIZATION")


@contextlib.contextmanager
def _refusing_pickles(mlflow, local: str) -> Iterator[None]:
    """MLflow set to refuse pickled models for the block, by the switch this MLflow reads, unless the operator
    set either switch (their choice stands). The newer switch also refuses any model in a folder on
    ``sys.path`` (a worker's folder, where the temporary folder is under it): there, the older one, which 3.18
    still reads (warning of it)."""
    if any(name in os.environ for name in _PICKLE_SWITCHES):
        yield
        return
    known = [name for name in _PICKLE_SWITCHES if hasattr(mlflow.environment_variables, name)]
    older = _PICKLE_SWITCHES[-1]
    # (an MLflow without the older one: the newer, refusing this champion, rather than a switch none reads)
    name = older if not known or (older in known and _on_python_path(local)) else known[0]
    os.environ[name] = "false"
    try:
        yield
    finally:
        os.environ.pop(name, None)
