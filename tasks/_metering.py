"""What every stage task shares: wall time and energy of the stage, which failures to retry, and
how a failure is logged."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from prefect.context import TaskRunContext

from trainyard import carbon, energy_journal
from trainyard.errors import StorageError, TrainyardError
from trainyard.redaction import redact_exception
from trainyard.spec import TrainingJob

# The energy journal of the flow run whose stages run here (``journal``): each stage writes its figures
# to it as it runs, so that a rerun of the job id counts a run killed outright (``trainyard.energy_journal``).
_JOURNAL: ContextVar[energy_journal.Journal | None] = ContextVar("trainyard_energy_journal", default=None)
JOURNAL_SECONDS = 10.0  # how often a running stage's figures are written: at most this much is lost to a kill

# Failed attempts' time and energy, by task run: Prefect retries a task as the same run, and the attempt
# that ends it (in success or failure) counts every attempt's, not only its own. A task that failed for
# good leaves its entry (nothing says it will not be retried): the oldest go past EARLIER_KEPT, so that a
# worker process that runs job after job does not grow without end.
_EARLIER_ATTEMPTS: dict[Any, list[dict]] = {}
EARLIER_KEPT = 256


@contextmanager
def stage_meter(stage: str, job: TrainingJob) -> Iterator[dict]:
    """Time and meter the enclosed stage; the yielded dict gets ``seconds`` and ``energy`` on exit. The stage
    may put ``elsewhere`` on it (``accounting.energy_elsewhere``): work it waited on that this machine's meter
    did not see, added to its energy.

    A stage that fails spent its time and energy all the same: the exception carries them as
    ``stage_record`` (``stage``, ``seconds``, ``energy``), for the job's summary and ledger. In a Prefect
    task retried after a failure, both include the earlier attempts' (and ``attempts`` counts them).
    """
    context = TaskRunContext.get()
    run = context.task_run.id if context is not None else None
    earlier = _EARLIER_ATTEMPTS.get(run, []) if run is not None else []
    record: dict = {"stage": stage}
    started = time.monotonic()
    energy = None
    journal = _JOURNAL.get()
    try:
        with carbon.meter(stage, job.carbon) as energy:
            record["meter"] = energy  # live readings while the stage runs
            try:
                with _journaling(journal, stage, energy, started):
                    yield record
            finally:
                record["seconds"] = time.monotonic() - started
                del record["meter"]
    except BaseException as exc:  # a SIGTERM's TerminationSignal too: the stage spent what it spent
        redact_exception(exc)  # Prefect logs a failed task's exception, with what it quotes (a URL's password)
        if energy is not None:  # (None: the meter itself failed, or the signal came while it started)
            this = {"stage": stage, "seconds": time.monotonic() - started, "energy": _measured(record, energy, job)}
            # read back with getattr where the job fails
            exc.stage_record = _with_earlier(this, earlier)  # type: ignore[attr-defined]
            if run is not None:
                _EARLIER_ATTEMPTS[run] = [*earlier, this]
                while len(_EARLIER_ATTEMPTS) > EARLIER_KEPT:
                    del _EARLIER_ATTEMPTS[next(iter(_EARLIER_ATTEMPTS))]
            _journal_ended(journal, stage, exc.stage_record["energy"])  # type: ignore[attr-defined]
        raise
    record["energy"] = _measured(record, energy, job)
    record.update(_with_earlier(record, earlier))
    _EARLIER_ATTEMPTS.pop(run, None)
    _journal_ended(journal, stage, record["energy"])


def _measured(record: dict, energy: carbon.StageEnergy, job: TrainingJob) -> dict:
    """The stage's energy: its meter's, and what its work drew on other machines (``elsewhere``, which the
    training stage puts on its record: groups on a GPU pool's nodes), failed or not."""
    measured = energy.to_dict()
    elsewhere = record.pop("elsewhere", None)
    return carbon.add_elsewhere(measured, elsewhere, job.carbon) if elsewhere else measured


def _journal_ended(journal: energy_journal.Journal | None, stage: str, energy: dict) -> None:
    """A stage's figures to the journal. A journal that cannot be written (a full disk) is logged: it must
    neither fail a stage that worked nor take the place of the error a failed stage raises."""
    if journal is None:
        return
    try:
        journal.ended(stage, energy)
    except Exception:  # noqa: BLE001 - see above
        logging.getLogger(__name__).warning("could not write the energy journal", exc_info=True)


@contextmanager
def journal(job_dir, run: str) -> Iterator[energy_journal.Journal]:
    """Stages run inside write their figures to the run's energy journal, ``<job_dir>/energy/<run>.json``."""
    this = energy_journal.Journal(job_dir, run)
    token = _JOURNAL.set(this)
    try:
        yield this
    finally:
        _JOURNAL.reset(token)


@contextmanager
def _journaling(journal: energy_journal.Journal | None, stage: str, energy, started: float) -> Iterator[None]:
    """While the stage runs, its figures so far to the journal every ``JOURNAL_SECONDS`` (from the start)."""
    if journal is None:
        yield
        return

    def write(stop: threading.Event) -> None:
        while True:
            try:
                kwh, kg = energy.reading()  # (and the record's split by device so far)
                devices = {f"{d}_energy_kwh": getattr(energy, f"{d}_energy_kwh") for d in ("cpu", "gpu", "ram")}
                journal.running(stage, kwh, kg, time.monotonic() - started, devices)
            except Exception:  # noqa: BLE001 - the journal must never stop a stage
                logging.getLogger(__name__).warning("could not write the energy journal", exc_info=True)
            if stop.wait(JOURNAL_SECONDS):
                return

    with in_background(write, "trainyard-energy-journal"):
        yield


@contextmanager
def in_background(
    work: Callable[[threading.Event], None], name: str, join_seconds: float | None = None
) -> Iterator[None]:
    """``work(stop)`` in a daemon thread while the block runs; ``stop`` is set when the block ends, and the
    thread joined (for at most ``join_seconds``: one stuck in a call it cannot cut short is left to end)."""
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(join_seconds)


def _with_earlier(attempt: dict, earlier: list[dict]) -> dict:
    """``attempt``'s ``seconds`` and ``energy`` with the ``earlier`` attempts' added (and ``attempts``)."""
    if not earlier:
        return {k: attempt[k] for k in ("stage", "seconds", "energy")}
    energy = dict(attempt["energy"])
    for field in carbon.StageEnergy.ADDED:
        energy[field] = sum(a["energy"][field] for a in earlier) + attempt["energy"][field]
    seconds = sum(a["seconds"] for a in earlier) + attempt["seconds"]
    return {"stage": attempt["stage"], "seconds": seconds, "energy": energy, "attempts": len(earlier) + 1}


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
    keeps; its traceback would bury it. Any other exception is a bug and keeps its traceback.

    In a deployment's run, Prefect's engine then logs a failed flow's exception once more, as "Engine
    execution exited with unexpected exception" with its traceback, after "Finished in state Failed(...)"
    has said it: for a job that failed on a ``TrainyardError`` (``JobFailed``), that record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], TrainyardError):
            if record.msg == ENGINE_EXIT_MESSAGE:
                return False
            record.exc_info, record.exc_text = None, None
        return True


ENGINE_EXIT_MESSAGE = "Engine execution exited with unexpected exception"  # prefect.flow_engine.run_flow's
for _logger in ("prefect.task_runs", "prefect.flow_runs"):
    logging.getLogger(_logger).addFilter(_KnownErrorsWithoutTraceback())
