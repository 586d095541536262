"""Stage 5, carbon: energy and emissions per stage (codecarbon's offline tracker), rolled up per job.

Each stage runs inside ``meter(stage, settings)``, one offline tracker (no network) in
machine mode: it measures the whole machine, so the replica group processes the training stage
waits on are inside the training stage's figure, and a job's stages never overlap, so nothing of its
own is counted twice. Groups on other machines (a GPU pool's nodes) are outside it: their own
process-mode meters are added to the training stage (``add_elsewhere``). The machine-wide figure
includes whatever else runs on the machine (another job's stages). ``rollup`` turns the per-stage
records into the summary's ``carbon`` section.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainyard import carbon_probe, grid_data
from trainyard.home import write_json_atomic
from trainyard.spec import Carbon


@dataclass  # not slotted: a running meter puts a live ``reading`` on the record
class StageEnergy:
    """What one stage drew and emitted."""

    stage: str
    energy_kwh: float = 0.0
    emissions_kg: float = 0.0
    duration_seconds: float = 0.0
    measurement_mode: str = "unknown"
    cpu_energy_kwh: float = 0.0
    gpu_energy_kwh: float = 0.0
    ram_energy_kwh: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    ADDED = ("energy_kwh", "emissions_kg", "duration_seconds", "cpu_energy_kwh", "gpu_energy_kwh", "ram_energy_kwh")
    """The fields that add up across attempts and runs (all but ``stage`` and ``measurement_mode``)."""

    def reading(self) -> tuple[float, float]:
        """``(kWh, kgCO2e)`` so far, while the meter runs (the final figures after it stops)."""
        return self.energy_kwh, self.emissions_kg


@contextmanager
def meter(
    stage: str, settings: Carbon, tracking_mode: str = "machine", energy_only: bool = False
) -> Iterator[StageEnergy]:
    """Measure the enclosed work with codecarbon's offline tracker; fill the yielded record on exit.

    ``machine`` measures the whole machine (the orchestrating stages); ``process`` only this process
    and its children (a replica group's share). ``record.reading()`` gives the figures so far.
    ``energy_only`` leaves emissions at zero: no grid lookup, which would load codecarbon's data
    tables (pandas among them, ~0.3 s of CPU) in a process that only needs its kWh.
    """
    from codecarbon import OfflineEmissionsTracker

    tracker_class = _energy_only_tracker() if energy_only else OfflineEmissionsTracker
    # codecarbon logs a warning per tracker about concurrent instances; they are ours and expected.
    logging.getLogger("codecarbon").setLevel(logging.ERROR)
    record = StageEnergy(stage=stage)
    kwargs: dict[str, Any]
    if energy_only:  # no country, and a forced intensity of 0: nothing for codecarbon to look up
        kwargs = {"force_carbon_intensity_g_co2e_kwh": 0.0}
    else:
        kwargs = {"country_iso_code": settings.country_iso_code}
        kwargs |= {"region": settings.region} if settings.region else {}
    if tracking_mode == "process":
        # RAPL, which codecarbon prefers, reads the whole CPU package whatever the tracking mode: k groups of a
        # node would each count all of it. The load model (TDP x this process's share of the CPU time) is the
        # process's own; where codecarbon knows no TDP for the CPU it still falls back to RAPL.
        kwargs["force_mode_cpu_load"] = True
    if tracking_mode == "process" and carbon_probe.sees_no_gpu():
        # A CPU group's share. Left to itself codecarbon would count every GPU that NVML sees (it reads an
        # empty CUDA_VISIBLE_DEVICES as unset): on a GPU machine, the GPUs once per group of a CPU job.
        kwargs["gpu_ids"] = []
    tracker = tracker_class(
        pue=settings.pue,
        measure_power_secs=settings.measure_power_secs,
        tracking_mode=tracking_mode,
        save_to_file=False,
        log_level="error",
        project_name=f"trainyard-{stage}",
        **kwargs,
    )
    started = time.monotonic()
    began = time.perf_counter()  # codecarbon's clock
    serial = _serialize_readings(tracker)
    carbon_probe.seed(tracker)
    tracker.start()
    _count_from(tracker, began, serial)
    carbon_probe.save(tracker)

    reading = threading.Lock()  # the live watch and the energy journal each sample the running stage

    def live() -> tuple[float, float]:
        with reading:
            emissions = tracker.flush()  # measures now; with no output configured it writes nothing
            for device in ("cpu", "gpu", "ram"):  # the split so far, into the record (the final one replaces it)
                total = getattr(tracker, f"_total_{device}_energy", None)
                setattr(record, f"{device}_energy_kwh", float(total.kWh) if total is not None else 0.0)
            return float(tracker._total_energy.kWh), float(emissions or 0.0)  # codecarbon has no public getter

    record.reading = live  # type: ignore[method-assign]  # the live figures until the meter stops
    try:
        yield record
    finally:
        if getattr(tracker, "_start_time", None) is not None:
            with reading:
                tracker.flush()  # the emissions step's first-use setup, inside the measured time
        tracker.stop()  # its last reading covers up to here; its own emissions step is then warm
        del record.reading  # back to the final figures
        record.duration_seconds = time.monotonic() - started
        # codecarbon logs and swallows a failed start: then say so rather than report zero.
        # (No return in this finally: it would swallow the enclosed work's exception.)
        data = getattr(tracker, "final_emissions_data", None)
        record.measurement_mode = measurement_mode(tracker) if data is not None else "unavailable"
        if data is None:
            logging.getLogger(__name__).warning(
                "carbon: %s's energy could not be measured (codecarbon did not start; its log says why): "
                "its figures are 0, and nothing past a carbon.budget_kg was seen while it ran",
                stage,
            )
        if data is not None:
            record.energy_kwh = float(data.energy_consumed)
            record.emissions_kg = float(data.emissions)
            record.cpu_energy_kwh = float(data.cpu_energy or 0.0)
            record.gpu_energy_kwh = float(data.gpu_energy or 0.0)
            record.ram_energy_kwh = float(data.ram_energy or 0.0)


def _serialize_readings(tracker) -> threading.Lock:
    """One codecarbon reading at a time. Its timer thread and ``stop()``/``flush()`` otherwise can both
    read the same ``_last_measured_time`` and count one interval twice. codecarbon internals (3.x)."""
    lock = threading.Lock()
    measure = tracker._measure_power_and_energy

    def locked() -> None:
        with lock:
            measure()

    tracker._measure_power_and_energy = locked
    if getattr(tracker, "_scheduler", None) is not None:
        tracker._scheduler.function = locked  # the timer keeps the bound method it was built with
    return lock


def _count_from(tracker, began: float, serial: threading.Lock) -> None:
    """Make the tracker count from ``began`` (``time.perf_counter()``), as the stage's duration does.

    codecarbon opens its window after ``start()`` has probed the hardware (~1.5 s on a process's first
    tracker): without this, that time is in the duration and not in the energy (where power is estimated:
    RAM, and a CPU by its load; a RAPL or NVML counter's baseline is still read after the probe). And its
    ``stop()`` skips its last reading when the one before is under 50 ms old: a stage that short would count
    none of itself.
    """
    opened = getattr(tracker, "_start_time", None)
    if opened is None:
        return  # codecarbon did not start: nothing is measured
    with serial:
        tracker._last_measured_time -= max(0.0, opened - began)  # the next reading covers the gap, once
        tracker._start_time = began
    tracker._measure_power_and_energy_if_stale = functools.partial(
        type(tracker)._measure_power_and_energy_if_stale, tracker, min_interval_s=0.0
    )


@functools.cache  # one class per process, not one per meter
def _energy_only_tracker():
    """codecarbon's offline tracker without its emissions step, for a process that only needs kWh.

    Its emissions step resolves the country and the cloud through ``codecarbon.external.geography``,
    which imports requests and pycountry: ~50 ms of CPU at ``stop()``, on a replica group's way out
    and so on the job's critical path. These three hooks are codecarbon internals (3.x);
    tests/unit/test_carbon.py fails if one changes under them.
    """
    from types import SimpleNamespace

    from codecarbon import OfflineEmissionsTracker

    hooks = ("_update_emissions", "_get_geo_metadata", "_get_cloud_metadata", "_ensure_geo_metadata")
    if not all(callable(getattr(OfflineEmissionsTracker, hook, None)) for hook in hooks):
        return OfflineEmissionsTracker  # another codecarbon: measure as it always did, emissions step included

    class EnergyOnlyTracker(OfflineEmissionsTracker):
        def _update_emissions(self) -> None:  # emissions stay 0; energy is measured as ever
            self._ensure_geo_metadata()  # the emissions record still names a (here empty) place

        def _get_geo_metadata(self):
            return SimpleNamespace(country_name=None, country_iso_code=None, region=None, latitude=None, longitude=None)

        def _get_cloud_metadata(self):
            return SimpleNamespace(provider=None, region=None, is_on_private_infra=True)

    return EnergyOnlyTracker


def measurement_mode(tracker) -> str:
    """How the CPU / GPU power was obtained: RAPL or NVML readings, or a TDP / load-model estimate."""
    modes = []
    for hw in getattr(tracker, "_hardware", []):
        kind = type(hw).__name__
        if kind == "CPU":
            modes.append(f"cpu:{getattr(hw, '_mode', 'unknown')}")
        elif kind == "GPU" and getattr(hw, "gpu_ids", None) != []:  # []: tracked, counting none
            modes.append("gpu:nvml")
        elif kind == "RAM":
            modes.append("ram:estimate")
    return ",".join(modes) or "unknown"


def drawn_elsewhere(elsewhere: dict, pue: float, stage: dict) -> dict:
    """What work on other machines drew (``accounting.energy_elsewhere``, at PUE 1) as a stage's figures: its
    energy (and by device) times ``pue``, its emissions at ``stage``'s own grid intensity (the job's
    ``country_iso_code`` and ``region``, as every stage's; none where ``stage`` measured nothing)."""
    kwh = elsewhere["energy_kwh"] * pue
    intensity = stage["emissions_kg"] / stage["energy_kwh"] if stage.get("energy_kwh") else 0.0
    devices = {f"{device}_energy_kwh": elsewhere[f"{device}_energy_kwh"] * pue for device in ("cpu", "gpu", "ram")}
    return {"energy_kwh": kwh, "emissions_kg": kwh * intensity, **devices}


def add_elsewhere(stage: dict, elsewhere: dict, settings: Carbon) -> dict:
    """A stage's energy record (``StageEnergy.to_dict``) with what its work drew on other machines added
    (``drawn_elsewhere``)."""
    added = dict(stage)
    drawn = drawn_elsewhere(elsewhere, settings.pue, stage)
    if not (stage["energy_kwh"] > 0 and stage["emissions_kg"]):  # this machine's meter read nothing: no intensity
        logging.getLogger(__name__).warning(
            "carbon: %.4g kWh of groups on other machines added with no emissions: this machine's %s meter, "
            "whose grid intensity they take, measured nothing",
            drawn["energy_kwh"],
            stage["stage"],
        )
    for key, value in drawn.items():
        added[key] += value
    added["measurement_mode"] = f"{stage['measurement_mode']} (other machines' groups: {elsewhere['measurement_mode']})"
    return added


def rollup(records: list[StageEnergy], settings: Carbon) -> dict:
    """The job's ``carbon`` summary from its per-stage records."""
    energy = sum(r.energy_kwh for r in records)
    emissions = sum(r.emissions_kg for r in records)
    # codecarbon multiplies energy by the PUE; the grid intensity is what remains.
    intensity = emissions / energy * 1000.0 if energy > 0 else None
    modes = sorted({r.measurement_mode for r in records})
    regional = settings.region if settings.region and grid_data.regions(settings.country_iso_code) else None
    return {
        "energy_kwh": energy,
        "emissions_kg": emissions,
        "measurement_mode": modes[0] if len(modes) == 1 else ";".join(modes),
        "country_iso_code": settings.country_iso_code,
        "region": regional,
        "intensity_g_per_kwh": intensity,
        # the region only where codecarbon has a figure for it: elsewhere its national one was used (and warned of)
        "intensity_source": f"codecarbon offline energy mix for {settings.country_iso_code}"
        + (f"/{regional}" if regional else ""),
        "pue": settings.pue,
        "scope2_location_based_kg": emissions,
        "budget_kg": settings.budget_kg,
        "by_stage": {r.stage: {"energy_kwh": r.energy_kwh, "emissions_kg": r.emissions_kg} for r in records},
        "by_device_kwh": {
            "cpu": sum(r.cpu_energy_kwh for r in records),
            "gpu": sum(r.gpu_energy_kwh for r in records),
            "ram": sum(r.ram_energy_kwh for r in records),
        },
        "merge": "one machine-wide tracker per stage in the orchestrating process (stages never overlap), and "
        "the groups that ran on other machines' own trackers, added to the training stage",
    }


PARTIAL_RECORD_SECONDS = 30.0  # how often a group writes its energy so far (BackgroundMeter.keep_writing)


class BackgroundMeter:
    """A replica group's own tracker, in process mode (this process and its children), started in
    a thread so that a restarted group never waits on it before it heals. The hardware probe comes
    from the machine's earlier processes (``carbon_probe``); without one, codecarbon's own probe
    costs ~1.4 s of CPU. Only energy is kept; emissions follow from the job's grid intensity when
    the job is rolled up."""

    def __init__(self, name: str):
        # A reading every 10 s: the load model averages CPU use since the last reading, so a longer
        # interval loses no energy, and each reading takes the GIL from the training loop.
        self._context = meter(name, Carbon(measure_power_secs=10), tracking_mode="process", energy_only=True)
        self._record: StageEnergy | None = None
        self._thread = threading.Thread(target=self._start, name="trainyard-carbon", daemon=True)
        self._thread.start()
        self._writing: threading.Event = threading.Event()  # keep_writing's
        self._writer: threading.Thread | None = None

    def _start(self) -> None:
        try:
            self._record = self._context.__enter__()
        except Exception:  # noqa: BLE001 - metering must never stop training
            logging.getLogger(__name__).warning("carbon meter did not start", exc_info=True)

    def keep_writing(self, path: Path, extra: dict, every: float = PARTIAL_RECORD_SECONDS) -> None:
        """Write the group's figures so far to ``path`` every ``every`` seconds (``partial``: true), until
        ``stop``: a group killed outright (SIGKILL, the OOM killer, a silent group's kill) wrote nothing, and
        its energy was in no job total (a group on another machine's nowhere at all); now all but its last
        ``every`` seconds are. ``extra`` is added to each record (the machine)."""

        def write() -> None:
            while not self._writing.wait(every):
                record = self._partial()
                try:
                    if record is not None:
                        write_json_atomic(path, record | extra | {"partial": True})
                except OSError as exc:  # (a full disk): the final record is written all the same, if it can be
                    logging.getLogger(__name__).warning("carbon: the group's energy so far not written: %s", exc)

        self._writer = threading.Thread(target=write, name="trainyard-carbon-partial", daemon=True)
        self._writer.start()

    def _partial(self) -> dict | None:
        """The figures so far (the writer's; ``stop`` joins it before the meter stops)."""
        if self._record is None:
            return None
        try:
            kwh, _ = self._record.reading()  # (fills the record's split by device so far too)
        except Exception:  # noqa: BLE001 - metering must never stop training
            return None
        record = self._record.to_dict() | {"energy_kwh": kwh}
        del record["emissions_kg"]
        return record

    def stop(self) -> dict | None:
        """Stop the tracker; the energy record (no emissions), or None if it never started."""
        self._writing.set()
        if self._writer is not None:
            self._writer.join()
        self._thread.join()
        if self._record is None:
            return None
        self._context.__exit__(None, None, None)
        record = self._record.to_dict()
        del record["emissions_kg"]  # energy_only: never computed, and a zero would read as a figure
        return record


class LiveWatch:
    """Samples a running meter every ``interval`` seconds in a thread: ``on_sample(seconds, kWh,
    kgCO2e)`` with the job's totals so far (``spent_kg`` from earlier stages included), and
    ``on_budget(kg)`` once when they pass ``budget_kg``."""

    def __init__(self, record: StageEnergy, interval: float, spent_kwh: float, spent_kg: float,
                 budget_kg: float | None, on_sample, on_budget):  # fmt: skip
        self.record, self.interval, self.budget_kg = record, interval, budget_kg
        self.spent_kwh, self.spent_kg = spent_kwh, spent_kg
        self.on_sample, self.on_budget = on_sample, on_budget
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._over = False
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="trainyard-carbon-live", daemon=True)

    def __enter__(self) -> LiveWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(final=True)  # the stage's last figures, however short it was

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self, final: bool = False) -> None:
        """One reading to ``on_sample``; past the budget, ``on_budget`` once, unless training has ended
        (``final``): there is nothing left to stop, and the summary says the budget was exceeded."""
        kwh, kg = self.record.reading()
        sample = {
            "seconds": time.monotonic() - self._started,
            "energy_kwh": self.spent_kwh + kwh,
            "emissions_kg": self.spent_kg + kg,
        }
        self.samples.append(sample)
        try:
            self.on_sample(sample)
        except Exception:  # noqa: BLE001 - a failing reporter must not stop the watch
            logging.getLogger(__name__).warning("carbon live reporting failed", exc_info=True)
        # apart from the reporting: a Prefect or MLflow API that stays down must not leave the budget unwatched
        over = self.budget_kg is not None and sample["emissions_kg"] > self.budget_kg
        if over and not self._over and not final:
            try:
                self.on_budget(sample["emissions_kg"])
                self._over = True
            except Exception:  # noqa: BLE001 - tried again at the next sample
                logging.getLogger(__name__).warning("stopping the job at its carbon budget failed", exc_info=True)
