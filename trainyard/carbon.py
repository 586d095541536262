"""Stage 5, carbon: energy and emissions per stage (codecarbon's offline tracker), rolled up per job.

Each stage runs inside ``meter(stage, settings)``, one offline tracker (no network) in
machine mode: it measures the whole machine, so the replica group processes the training stage
waits on are inside the training stage's figure, and stages never overlap, so nothing is counted
twice. ``rollup`` turns the per-stage records into the summary's ``carbon`` section.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from trainyard.spec import Carbon

MEASURE_POWER_SECONDS = 1.0


@dataclass(slots=True)
class StageEnergy:
    """What one stage drew and emitted."""

    stage: str
    energy_kwh: float = 0.0
    emissions_kg: float = 0.0
    duration_seconds: float = 0.0
    measurement_mode: str = "unknown"

    def to_dict(self) -> dict:
        return asdict(self)


@contextmanager
def meter(stage: str, settings: Carbon) -> Iterator[StageEnergy]:
    """Measure the enclosed work with codecarbon's offline tracker; fill the yielded record on exit."""
    from codecarbon import OfflineEmissionsTracker

    # codecarbon logs a warning per tracker about concurrent instances; they are ours and expected.
    logging.getLogger("codecarbon").setLevel(logging.ERROR)
    record = StageEnergy(stage=stage)
    kwargs = {"region": settings.region} if settings.region else {}
    tracker = OfflineEmissionsTracker(
        country_iso_code=settings.country_iso_code,
        pue=settings.pue,
        measure_power_secs=MEASURE_POWER_SECONDS,
        tracking_mode="machine",
        save_to_file=False,
        log_level="error",
        project_name=f"trainyard-{stage}",
        **kwargs,
    )
    started = time.monotonic()
    tracker.start()
    try:
        yield record
    finally:
        tracker.stop()
        data = tracker.final_emissions_data
        record.energy_kwh = float(data.energy_consumed)
        record.emissions_kg = float(data.emissions)
        record.duration_seconds = time.monotonic() - started
        record.measurement_mode = measurement_mode(tracker)


def measurement_mode(tracker) -> str:
    """How the CPU / GPU power was obtained: RAPL or NVML readings, or a TDP / load-model estimate."""
    modes = []
    for hw in getattr(tracker, "_hardware", []):
        kind = type(hw).__name__
        if kind == "CPU":
            modes.append(f"cpu:{getattr(hw, '_mode', 'unknown')}")
        elif kind == "GPU":
            modes.append("gpu:nvml")
        elif kind == "RAM":
            modes.append("ram:estimate")
    return ",".join(modes) or "unknown"


def rollup(records: list[StageEnergy], settings: Carbon) -> dict:
    """The job's ``carbon`` summary from its per-stage records."""
    energy = sum(r.energy_kwh for r in records)
    emissions = sum(r.emissions_kg for r in records)
    # codecarbon multiplies energy by the PUE; the grid intensity is what remains.
    intensity = emissions / energy * 1000.0 if energy > 0 else None
    modes = sorted({r.measurement_mode for r in records})
    return {
        "energy_kwh": energy,
        "emissions_kg": emissions,
        "measurement_mode": modes[0] if len(modes) == 1 else ";".join(modes),
        "country_iso_code": settings.country_iso_code,
        "region": settings.region,
        "intensity_g_per_kwh": intensity,
        "intensity_source": "codecarbon offline energy-mix data",
        "pue": settings.pue,
        "scope2_location_based_kg": emissions,
        "scope2_market_based_kg": None,  # no supplier emission factor in the spec: not invented
        "budget_kg": settings.budget_kg,
        "by_stage": {r.stage: {"energy_kwh": r.energy_kwh, "emissions_kg": r.emissions_kg} for r in records},
        "merge": "one machine-wide tracker per stage in the orchestrating process; stages never overlap",
    }
