"""A real ``prefect server`` on 127.0.0.1 for the integration tests (one per module: each test module
sets up its own pools and deployments)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from trainyard.servers import free_port, stop_process, wait_until_answering

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))


@contextmanager
def prefect_server_in(home: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """``prefect server start`` with its database in ``home``; yields (API URL, environment for clients)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_UI_ENABLED": "false",
        # Scheduled runs are created within 5 s of a schedule appearing (default 60 s).
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
    }
    with open(home / "server.log", "wb") as log:
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        problem = wait_until_answering(f"{url}/health", server, timeout_seconds=90)
        assert problem is None, f"prefect server {problem}: {(home / 'server.log').read_text()[-2000:]}"
        yield url, env
    finally:
        stop_process(server, timeout_seconds=30)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory, s3_server):
    """A module's own server: (API URL, environment for clients and workers, its folder)."""
    home = tmp_path_factory.mktemp("prefect-server")
    with prefect_server_in(home) as (url, env):
        yield url, env, home
