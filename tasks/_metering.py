"""What every stage task shares: wall time and energy of the stage, and which failures to retry."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from trainyard import carbon
from trainyard.errors import StorageError, TrainyardError
from trainyard.spec import TrainingJob


@contextmanager
def stage_meter(stage: str, job: TrainingJob) -> Iterator[dict]:
    """Time and meter the enclosed stage; the yielded dict gets ``seconds`` and ``energy`` on exit."""
    record: dict = {"stage": stage}
    started = time.monotonic()
    with carbon.meter(stage, job.carbon) as energy:
        record["meter"] = energy  # live readings while the stage runs
        try:
            yield record
        finally:
            record["seconds"] = time.monotonic() - started
            del record["meter"]
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
