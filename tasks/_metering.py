"""What every stage task shares: wall time and energy of the stage, which failures to retry, and
how a failure is logged."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from trainyard import carbon
from trainyard.errors import StorageError, TrainyardError
from trainyard.redaction import redact_exception
from trainyard.spec import TrainingJob


@contextmanager
def stage_meter(stage: str, job: TrainingJob) -> Iterator[dict]:
    """Time and meter the enclosed stage; the yielded dict gets ``seconds`` and ``energy`` on exit.

    A stage that fails spent its time and energy all the same: the exception carries them as
    ``stage_record`` (``stage``, ``seconds``, ``energy``), for the job's summary and ledger.
    """
    record: dict = {"stage": stage}
    started = time.monotonic()
    energy = None
    try:
        with carbon.meter(stage, job.carbon) as energy:
            record["meter"] = energy  # live readings while the stage runs
            try:
                yield record
            finally:
                record["seconds"] = time.monotonic() - started
                del record["meter"]
    except BaseException as exc:  # a SIGTERM's TerminationSignal too: the stage spent what it spent
        redact_exception(exc)  # Prefect logs a failed task's exception, with what it quotes (a URL's password)
        if energy is not None:  # (None: the meter itself failed, or the signal came while it started)
            exc.stage_record = {  # type: ignore[attr-defined]  # read back with getattr where the job fails
                "stage": stage,
                "seconds": time.monotonic() - started,
                "energy": energy.to_dict(),
            }
        raise
    record["energy"] = energy.to_dict()


def retry_transient(task, task_run, state) -> bool:
    """Retry storage and service hiccups; never a mistake in the spec, the data or the algorithm."""
    try:
        state.result()
    except StorageError as exc:
        return exc.transient
    except TrainyardError:
        return False
    except Exception:  # noqa: BLE001 - anything else may be transient
        return True
    return False


class _KnownErrorsWithoutTraceback(logging.Filter):
    """Prefect logs a task that failed for good with its traceback. A ``TrainyardError`` (bad data, an
    unusable algorithm, a service that stayed down) says what to fix in its message, which the record
    keeps; its traceback would bury it. Any other exception is a bug and keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], TrainyardError):
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("prefect.task_runs").addFilter(_KnownErrorsWithoutTraceback())
