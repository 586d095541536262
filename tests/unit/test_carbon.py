"""Carbon accounting with codecarbon's offline tracker: per-stage records and the job roll-up."""

from __future__ import annotations

import socket
import time

import pytest
from codecarbon.input import DataSource

from trainyard import carbon
from trainyard.spec import Carbon


@pytest.fixture
def no_network(monkeypatch):
    """Fail the test if anything tries to connect beyond loopback."""
    real_connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (host.startswith("127.") or host in ("localhost", "::1")):
            raise AssertionError(f"network call attempted to {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def test_meter_records_energy_offline(no_network):
    with carbon.meter("training", Carbon(country_iso_code="IRL", pue=1.2)) as record:
        busy(1.2)
    assert record.stage == "training"
    assert record.energy_kwh > 0 and record.emissions_kg > 0
    assert record.duration_seconds >= 1.2
    assert "cpu:" in record.measurement_mode


def test_rollup_adds_up_and_uses_the_grid_intensity():
    settings = Carbon(country_iso_code="IRL", pue=1.2)
    records = []
    for stage in ("staging", "training"):
        with carbon.meter(stage, settings) as record:
            busy(0.6)
        records.append(record)
    report = carbon.rollup(records, settings)
    assert report["energy_kwh"] == pytest.approx(sum(s["energy_kwh"] for s in report["by_stage"].values()))
    assert report["emissions_kg"] == pytest.approx(sum(s["emissions_kg"] for s in report["by_stage"].values()))
    grid = DataSource().get_global_energy_mix_data()["IRL"]["carbon_intensity"]
    assert report["intensity_g_per_kwh"] == pytest.approx(grid, rel=1e-6)
    assert report["emissions_kg"] == pytest.approx(report["energy_kwh"] * grid / 1000, rel=1e-6)
    assert report["pue"] == 1.2
    assert report["scope2_market_based_kg"] is None
    assert set(report["by_stage"]) == {"staging", "training"}
