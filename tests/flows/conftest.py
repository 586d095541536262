"""One Prefect test harness (a real ephemeral API on SQLite) for every flow test in the session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_api(trainyard_home):
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        yield


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri
