"""What each run of a job spent, written down as it spends it, so that a rerun of the job id counts it.

The carbon ledger keeps one line per job id (``carbon-ledger/<job id>.csv``), written by the run that
ends and replaced by the next run of the id. A run that failed wrote its line, which the rerun then
replaced with its own energy alone; a run killed outright (SIGKILL, out of memory, a lost node) wrote
none. Either way the energy those runs spent was counted nowhere.

Each run of a job keeps a journal at ``<job folder>/energy/<run>.json``: every stage's energy when it
ends (or fails), and the running stage's energy so far, rewritten every few seconds while it runs. A run
adds every other run's journal of the job id to its own figures as one more stage, ``earlier runs``
(``earlier``), so the job's summary, its ESG report, its ledger line and its carbon budget count the
energy of every run of it on this machine. A run killed outright loses at most the last few seconds
before its last write. What its groups on other machines drew (a GPU pool's nodes: outside this machine's
meters, added to the training stage as it ends) a run killed in training never added: a rerun adds it
(``settle_killed``) from the energy files those groups wrote, by the launch and machine the journal names.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from trainyard.carbon import StageEnergy, drawn_elsewhere
from trainyard.home import write_json_atomic
from trainyard.training.accounting import energy_elsewhere

EARLIER_STAGE = "earlier runs"
FIELDS = StageEnergy.ADDED


def _folder(job_dir: Path | str) -> Path:
    return Path(job_dir) / "energy"


class Journal:
    """One run's journal. ``ended`` and ``running`` rewrite it (atomically: a kill mid-write leaves the
    last whole one); safe to call from the stage's sampling thread and the flow's."""

    def __init__(self, job_dir: Path | str, run: str):
        self.run = run
        self.path = _folder(job_dir) / f"{run}.json"
        self._stages: dict[str, dict] = {}
        self._running: dict | None = None
        self._launch: dict = {}
        self._lock = threading.Lock()

    def ended(self, stage: str, energy: dict) -> None:
        """A stage's energy when it ended or failed (every attempt of a retried stage task)."""
        with self._lock:
            self._stages[stage] = {k: float(energy.get(k) or 0.0) for k in FIELDS}
            self._stages[stage]["measurement_mode"] = energy.get("measurement_mode", "unknown")
            self._running = None
            self._write()

    def running(
        self, stage: str, energy_kwh: float, emissions_kg: float, seconds: float, devices: dict | None = None
    ) -> None:
        """The running stage's figures so far (its earlier failed attempts are already ``ended``); ``devices``:
        its energy by device so far (``cpu_energy_kwh``...), so a killed run's split adds up to its total."""
        with self._lock:
            self._running = {"stage": stage, "energy_kwh": energy_kwh, "emissions_kg": emissions_kg}
            self._running |= {"duration_seconds": seconds, **(devices or {})}
            self._write()

    def launched(self, launch: str, machine: str) -> None:
        """The groups' launch (their energy files name it) and the machine whose meters this journal reads:
        should this run be killed in training, a rerun adds what its groups on other machines drew."""
        with self._lock:
            self._launch = {"launch": launch, "machine": machine}
            self._write()

    def _write(self) -> None:
        write_json_atomic(
            self.path,
            {"run": self.run, "written_unix": time.time(), "stages": self._stages, "running": self._running}
            | self._launch,
        )


def kept_of(job_dir: Path | str, flow_run_id: str | None, run: str) -> bool:
    """Whether a journal of flow run ``flow_run_id`` (a try of it other than ``run``) is in the job's folder: its
    runs' journals are named ``<flow run id>-<try>``, ``local-<try>`` for one run in-process (``flow_run_id``
    None)."""
    prefix = f"{flow_run_id or 'local'}-"
    return any(p.stem.startswith(prefix) and p.stem != run for p in _folder(job_dir).glob("*.json"))


def earlier(job_dir: Path | str, run: str) -> dict | None:
    """Every other run's journal of the job, added up as a stage record (``stage``, ``seconds``,
    ``energy``: ``StageEnergy``'s fields, and ``runs``: how many); None when there is none."""
    totals = dict.fromkeys(FIELDS, 0.0)
    runs, modes = 0, set()
    for path in sorted(_folder(job_dir).glob("*.json")):
        if path.stem == run:
            continue
        try:
            journal = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # not a journal this module wrote (they are written whole)
        runs += 1
        for figures in [
            *journal.get("stages", {}).values(),
            journal.get("running") or {},
            journal.get("elsewhere") or {},
        ]:
            for field in FIELDS:
                totals[field] += float(figures.get(field) or 0.0)
            modes |= {figures["measurement_mode"]} if "measurement_mode" in figures else set()
    if not runs:
        return None
    mode = ";".join(sorted(modes)) or "unknown"  # a run killed in its first stage recorded none
    energy = {"stage": EARLIER_STAGE, "measurement_mode": mode, **totals}
    return {"stage": EARLIER_STAGE, "seconds": totals["duration_seconds"], "energy": energy, "runs": runs}


def settle_killed(job_dir: Path | str, run: str, pue: float) -> int:
    """Add to each other run's journal that was killed in training (its training stage still running) what its
    groups on other machines drew (``accounting.energy_elsewhere`` of its launch, ``carbon.drawn_elsewhere`` at
    ``pue`` and the stage's grid intensity so far, as for a stage that ends), once, as the
    journal's ``elsewhere``; returns how many. Call it holding the job's ``RunLock`` (no run of the job is then
    writing a journal), before the killed run's folder is set aside: those groups' files are found among the last
    few set aside too, but not past them."""
    settled = 0
    for path in sorted(_folder(job_dir).glob("*.json")):
        try:
            journal = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        running = journal.get("running") or {}
        if path.stem == run or running.get("stage") != "training" or "launch" not in journal or "elsewhere" in journal:
            continue
        try:
            settled += _settle(Path(job_dir), path, journal, running, pue)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # that run's meter's figures stand; the others go on
            logging.getLogger(__name__).warning("could not add what the groups of %s drew elsewhere: %r", path, exc)
    return settled


def _settle(job_dir: Path, path: Path, journal: dict, running: dict, pue: float) -> bool:
    drawn = energy_elsewhere(job_dir, journal["machine"], journal["launch"])
    if drawn is None:
        return False
    journal["elsewhere"] = drawn_elsewhere(drawn, pue, running) | {
        "measurement_mode": f"other machines' groups: {drawn['measurement_mode']}",
        "attempts": drawn["attempts"],
    }
    write_json_atomic(path, journal)
    return True
