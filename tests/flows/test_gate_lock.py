"""Jobs of one model name finishing together are gated one at a time, through the Prefect API's global
concurrency limits (any machine of the API)."""

from __future__ import annotations

import threading
import time

from tasks.registry import one_gate_at_a_time


def _hold_together(names: list[str]) -> list[tuple[float, float]]:
    spans: list[tuple[float, float]] = []

    def hold(name: str) -> None:
        with one_gate_at_a_time(name):
            started = time.monotonic()
            time.sleep(1.0)
            spans.append((started, time.monotonic()))

    threads = [threading.Thread(target=hold, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(spans) == len(names)
    return sorted(spans)


def test_one_gate_per_model_name_at_a_time(prefect_api):
    from prefect.client.orchestration import get_client

    (a_start, a_end), (b_start, _) = _hold_together(["gate-test", "gate-test"])
    assert b_start >= a_end  # the second waited for the first
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("trainyard-gate-gate-test")
    assert (limit.limit, limit.active_slots) == (1, 0)  # one slot, released by both


def test_jobs_of_one_machine_each_with_a_prefect_api_of_its_own_are_gated_one_at_a_time(prefect_api, monkeypatch):
    # `trainyard run` gives each job its own ephemeral Prefect API: its limit is not the other job's
    import contextlib

    import prefect.concurrency.sync

    monkeypatch.setattr(prefect.concurrency.sync, "concurrency", lambda *a, **k: contextlib.nullcontext())
    (a_start, a_end), (b_start, _) = _hold_together(["gate-local", "gate-local"])
    assert b_start >= a_end  # the file lock under TRAINYARD_HOME held the second


def test_a_gate_held_too_long_is_named_with_its_fix_not_called_an_outage(prefect_api, monkeypatch):
    import pytest

    import tasks.registry
    from trainyard.errors import RegistryError
    from trainyard.home import flocked, home
    from trainyard.registry_errors import RegistryUnavailable

    monkeypatch.setattr(tasks.registry, "GATE_WAIT_SECONDS", 1.0)
    # another job of this machine in its gate: the file lock
    with (
        flocked(home() / "locks" / "trainyard-gate-held-here.lock"),
        pytest.raises(RegistryError, match="held by another job of this machine") as held,
        one_gate_at_a_time("held-here"),
    ):
        pytest.fail("the gate was had while another held it")
    assert not isinstance(held.value, RegistryUnavailable) and "trainyard models promote" in str(held.value)
    # another machine's job in its gate, or a holder that died within its lease: the limit's slot taken
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate

    limit = "trainyard-gate-held-elsewhere"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=limit, limit=1))
        client.update_global_concurrency_limit(limit, GlobalConcurrencyLimitUpdate(active_slots=1))
    with (
        pytest.raises(RegistryError, match=f"prefect gcl update {limit} --active-slots 0") as taken,
        one_gate_at_a_time("held-elsewhere"),
    ):
        pytest.fail("the gate was had while its slot was taken")
    assert not isinstance(taken.value, RegistryUnavailable)
