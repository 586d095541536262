"""One Prefect test harness (a real ephemeral API on SQLite) for every flow test in the session.

Package-scoped: it stops once the last flow test has run. An idle Prefect 3.9 server keeps about a
fifth of a core busy (its docket worker polls every 250 ms), which the rest of the suite, CPU-bound
on 2 cores, would otherwise pay until the session ends."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def prefect_api(trainyard_home):
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        yield


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri
