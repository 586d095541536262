"""The MLflow tracking store Trainyard registers to: the one ``MLFLOW_TRACKING_URI`` names, else the embedded
SQLite store under ``TRAINYARD_HOME``; created once, under a lock, before concurrent writers could race."""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from pathlib import Path

from trainyard.home import flocked, home
from trainyard.registry_errors import service_errors, translate


def embedded_store() -> Path | None:
    """The embedded SQLite store's file, or ``None`` where ``MLFLOW_TRACKING_URI`` names another store."""
    return None if os.environ.get("MLFLOW_TRACKING_URI") else home() / "mlflow.db"


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the embedded SQLite store (``embedded_store``)."""
    # MLflow prints each run's URL to stdout (past Prefect's log capture, into worker and pod logs), a
    # password in the tracking URI included; Trainyard's own messages name runs without it.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # "Creating initial MLflow database tables..." at INFO, on every new store: MLflow's business, not the job's
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    store = embedded_store()
    return f"sqlite:///{store}" if store else os.environ["MLFLOW_TRACKING_URI"]


def ensure_store(uri: str | None = None) -> str:
    """Create the tracking database once, before concurrent writers could race to migrate it. The embedded
    store is created (or migrated by a newer MLflow) under a lock: two jobs starting at once on a fresh
    home both ran MLflow's migrations into one SQLite file, one failed, and a store could be left half
    migrated for every later job."""
    import mlflow

    uri = uri or tracking_uri()
    store = embedded_store()
    lock = flocked(home() / "locks" / "mlflow-store.lock") if store and uri == f"sqlite:///{store}" else nullcontext()
    try:
        with lock:
            mlflow.MlflowClient(uri).search_experiments(max_results=1)
    except service_errors() as exc:
        raise translate(exc, "checking the tracking store", uri, registering=False) from exc
    return uri
