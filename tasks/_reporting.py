"""Reports to the Prefect and MLflow APIs made around a job's work (progress, plots, artifacts, its summary):
best effort, so that one such API failing past its client's retries never fails the job itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from trainyard.redaction import redact_text

T = TypeVar("T")


def best_effort(logger, failed: str, call: Callable[..., T], *args) -> T | None:
    """``call(*args)``, and what it returns; if it raises, ``failed`` (a %-format of one ``%s``, the error) is
    logged as a warning, None returned, and the job goes on. It failed a training stage, shutting its groups down
    and losing a trained model, for a progress bar or a plot, and ended a completed, registered job's run Failed for
    an artifact."""
    try:
        return call(*args)
    except Exception as exc:  # noqa: BLE001 - reporting only
        logger.warning(failed, redact_text(str(exc)))  # (MLflow's and boto's errors may quote a URI, password and all)
        return None
