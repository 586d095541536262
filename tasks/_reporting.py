"""Reports to the Prefect and MLflow APIs made around a job's work (progress, plots, artifacts, its summary):
best effort, so that one such API failing past its client's retries never fails the job itself."""

from __future__ import annotations

from collections.abc import Callable

from trainyard.redaction import redact_text


def best_effort(logger, failed: str, call: Callable[..., object], *args) -> None:
    """``call(*args)``; if it raises, ``failed`` (a %-format of one ``%s``, the error) is logged as a warning and
    the job goes on. It failed a training stage, shutting its groups down and losing a trained model, for a
    progress bar or a plot, and ended a completed, registered job's run Failed for an artifact."""
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 - reporting only
        logger.warning(failed, redact_text(str(exc)))  # (MLflow's and boto's errors may quote a URI, password and all)
