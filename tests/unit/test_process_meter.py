"""A replica group's meter (``tracking_mode: process``) measures its own process, not the machine: codecarbon
prefers RAPL, which reads the whole CPU package whatever the tracking mode, so k groups on a node would each
count all of it."""

from __future__ import annotations

import time

from trainyard import carbon
from trainyard.spec import Carbon


def test_a_process_meter_takes_the_cpu_load_model_not_the_packages_counters(tmp_path, monkeypatch):
    from codecarbon.core import hardware_cache
    from codecarbon.core.resource_tracker import ResourceTracker

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))  # no probe saved by an earlier process
    monkeypatch.setattr(hardware_cache, "_plans", {})  # nor by an earlier tracker of this one
    asked = []

    def platform_counters(self) -> bool:  # where codecarbon would take RAPL (none on this machine)
        asked.append(self.tracker._tracking_mode)
        return False

    monkeypatch.setattr(ResourceTracker, "_try_platform_cpu_backend", platform_counters)
    with carbon.meter("replica-0", Carbon(measure_power_secs=10), tracking_mode="process", energy_only=True) as mine:
        time.sleep(0.2)
    assert asked == [] and "cpu:cpu_load" in mine.measurement_mode
    with carbon.meter("staging", Carbon(measure_power_secs=10), energy_only=True):  # a stage's: the machine's
        time.sleep(0.2)
    assert asked == ["machine"]  # (where it has them, RAPL is the machine's best measure)
