"""Shared fixtures: a local S3 endpoint (moto's server mode over HTTP on 127.0.0.1), a private
TRAINYARD_HOME, and helpers that upload small datasets."""

from __future__ import annotations

import contextvars
import io
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# Before anything imports Prefect: no telemetry, no network, no progress bars in test logs.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ["TRAINYARD_PROGRESS"] = "0"
# Output goes to a pipe, as in CI: tables drawn as wide as they need. pytest-xdist's workers set COLUMNS=80,
# which a command's console would take for a terminal's width (trainyard.cli_text.out).
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


# ``make test`` runs the suite on pytest-xdist workers (``--dist loadfile``), each taking whole groups: a test
# file, or all of ``flows/``, whose Prefect harness (package-scoped) would else start again for each of its files
# on each worker. Longest first, so that no long file starts last and runs on alone (seconds on 2 cores, run
# alone or beside the other worker); the rest keep their order.
LONGEST_FIRST = (
    "tests/integration/test_deployment.py",  # ~560
    "tests/flows/",  # ~350, one harness
    "tests/unit/test_training.py",  # ~250
    "tests/unit/test_elastic.py",  # ~180
    "tests/integration/test_demo.py",  # ~130
)


def _group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "tests/flows/" if path.startswith("tests/flows/") else path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item.nodeid), len(rank)))  # stable: the rest as collected


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, for --dist loadfile
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, but with ``flows/`` as one unit. (``--dist loadgroup`` with ``xdist_group`` marks
    would say the same, but with pytest 9 and xdist 3.8 its groups are split: each test is sent on its own.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesWithFlowsAsOne(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return FilesWithFlowsAsOne(config, log)


@pytest.fixture(scope="session", autouse=True)
def trainyard_home(tmp_path_factory):
    """Every test's state (cache, jobs, MLflow, Prefect homes) lives in one temporary TRAINYARD_HOME."""
    path = tmp_path_factory.mktemp("trainyard-home")
    os.environ["TRAINYARD_HOME"] = str(path)
    # The user's cache (Prefect's migrated database, trainyard.prefect_template) is the session's own,
    # shared by every TRAINYARD_HOME the tests make (the CLI tests start each job in a fresh one).
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("user-cache"))
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    return path


@pytest.fixture(scope="session")
def s3_server(trainyard_home):
    """One moto S3 server process for the session; boto3 reaches it through the standard AWS variables."""
    from trainyard.local_s3 import local_s3_env

    with local_s3_env() as server:
        yield server


@pytest.fixture
def bucket(s3_server):
    """A fresh, empty bucket."""
    from trainyard import s3

    name = f"test-{uuid.uuid4().hex[:12]}"
    s3.client().create_bucket(Bucket=name)
    return name


def put_table(bucket: str, key: str, table: pa.Table) -> str:
    from trainyard import s3

    buf = io.BytesIO()
    pq.write_table(table, buf)
    s3.client().put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
    return f"s3://{bucket}/{key}"


def blobs_table(rows: int, seed: int = 0, features: int = 4) -> pa.Table:
    """An easy two-class problem: the label is the sign of a linear function of the features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features))
    y = (x @ np.linspace(1.0, -0.5, features) > 0).astype(np.int64)
    cols = {f"f{i}": x[:, i] for i in range(features)}
    return pa.table({**cols, "label": y})


def upload_dataset(bucket: str, rows: int = 600, seed: int = 0, shards: int = 2) -> dict[str, str]:
    """Train (in ``shards`` objects) and validation channels of ``blobs_table``; returns the URIs."""
    table = blobs_table(rows, seed)
    n_val = rows // 4
    put_table(bucket, "data/validation/part-0.parquet", table.slice(0, n_val))
    train = table.slice(n_val)
    step = -(-train.num_rows // shards)
    for i in range(shards):
        put_table(bucket, f"data/train/part-{i}.parquet", train.slice(i * step, step))
    return {
        "train": f"s3://{bucket}/data/train/",
        "validation": f"s3://{bucket}/data/validation/",
        "output": f"s3://{bucket}/output/",
    }


def job_dict(uris: dict[str, str], **overrides) -> dict:
    """A small, fast job spec over ``upload_dataset``'s channels."""
    job = {
        "name": "test-job",
        "algorithm": {"builtin": "mlp-classifier"},
        "hyperparameters": {"epochs": 3, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
        "inputs": {
            "train": {"s3_uri": uris["train"], "label": "label"},
            "validation": {"s3_uri": uris["validation"], "label": "label"},
        },
        "output": {"s3_uri": uris["output"]},
        "resources": {"replicas": 1},
        "carbon": {"country_iso_code": "IRL"},
    }
    for key, value in overrides.items():
        job[key] = value
    return job


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    """A test's own MLflow store (SQLite), as MLFLOW_TRACKING_URI."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def wait_for_step(path: Path, step: int, timeout: float = 120.0) -> None:
    """Until the attempt file ``path`` (a heartbeat, progress) says ``step`` or later; a test failure after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(path.read_text())["step"] >= step:
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    pytest.fail(f"{path} never reached step {step} in {timeout:g} s")


def rejoined(attempt: Path) -> bool:
    """Whether a restarted or added group's attempt (its folder) has committed a step with the others."""
    try:
        return "rejoined_at_step" in (json.loads((attempt / "progress.json").read_text())["recovery"] or {})
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return False


@contextmanager
def slow_until(hold: Path, ready: Callable[[], bool]) -> Iterator[str]:
    """Yields ``hold`` for ``slow_build``'s ``slow_while``: its steps are slow while ``hold`` exists,
    and ``hold`` goes once ``ready()`` (say, a restarted group is back), so what follows runs at full
    speed. The slow phase keeps the survivors training however long the restart takes on a busy
    machine; the job's remaining steps then take seconds, not minutes."""
    seen = False

    def slow() -> bool:
        nonlocal seen
        seen = seen or ready()
        return not seen

    with slow_while(hold, slow) as path:
        yield path


@contextmanager
def slow_while(hold: Path, slow: Callable[[], bool]) -> Iterator[str]:
    """Like ``slow_until``, for several slow phases: ``hold`` exists while ``slow()`` (looked at every
    50 ms; an error in it, say a file half written, counts as slow)."""
    done = threading.Event()
    context = contextvars.copy_context()  # the caller's settings (a Prefect API URL, say) for slow()

    def is_slow() -> bool:
        try:
            return context.run(slow)
        except Exception:  # noqa: BLE001 - not yet (no job yet, a file half written): asked again
            return True

    def watch() -> None:
        while not done.is_set():
            if is_slow():
                hold.touch()
            else:
                hold.unlink(missing_ok=True)
            done.wait(0.05)

    hold.touch()  # slow from the start, whatever the first look finds
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield str(hold)
    finally:
        done.set()
        watcher.join(timeout=5)
        hold.unlink(missing_ok=True)
