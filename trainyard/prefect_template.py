"""A migrated Prefect database to start each job's ephemeral API from.

Without a Prefect server, ``trainyard run`` gives each job a Prefect home of its own (two jobs sharing
one SQLite database would lock each other out). Prefect's ephemeral API then creates that database
by running every one of its migrations, about 16 s on a 2-core machine: more than the rest of a small
job's start. The migrations are run once per Prefect version, into ``$XDG_CACHE_HOME/trainyard/
.template-<version>/prefect.db`` (``~/.cache`` by default; ``TRAINYARD_HOME/prefect`` where that
cannot be written), and each job's home starts from a copy; the API finds the schema at its head and
goes straight on. No Prefect import here: it runs Prefect's own CLI.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

DATABASE = "prefect.db"
# Prefect's database settings (both spellings): where any is set, the user chose the database.
_DATABASE_SETTINGS = ("PREFECT_SERVER_DATABASE_", "PREFECT_API_DATABASE_")
# A first migration on a busy machine; past it the job just migrates its own database as before.
MIGRATE_TIMEOUT_SECONDS = 300


def templates_dir(fallback: Path) -> Path:
    """Where the migrated databases are kept: the user's cache (a pure function of Prefect's version, so
    every TRAINYARD_HOME shares it), or ``fallback`` where the cache cannot be written."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainyard"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        return fallback
    return cache if os.access(cache, os.W_OK) else fallback


def seed(prefect_home: Path, templates: Path, announce: Callable[[str], None] = lambda message: None) -> bool:
    """Copy the migrated database into ``prefect_home`` (making it under ``templates`` first if need be,
    which ``announce`` tells the user: it takes a while, once).

    Returns whether it did; on any failure the ephemeral API creates the database itself, as it would
    without this.
    """
    if (prefect_home / DATABASE).exists() or any(name.startswith(_DATABASE_SETTINGS) for name in os.environ):
        return False  # a database of the user's choosing (Postgres, another file): not ours to seed
    partial = prefect_home / f".{DATABASE}.{uuid.uuid4().hex}"
    try:
        template = templates / f".template-{version('prefect')}" / DATABASE
        if not template.exists():
            announce(f"preparing Prefect's database in {template.parent} (once per Prefect version, ~20 s)")
            if not _migrate(template.parent):
                return False
        shutil.copyfile(template, partial)
        partial.replace(prefect_home / DATABASE)  # whole or not there: never a half-copied database
        return True
    except OSError:  # a full disk, say: the API migrates its own database, as without a template
        return False
    finally:
        partial.unlink(missing_ok=True)


def _migrate(target: Path) -> bool:
    """Run Prefect's migrations into a fresh database and move it to ``target`` (a folder)."""
    work = target.with_name(f"{target.name}.{uuid.uuid4().hex}")
    work.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DATABASE_SETTINGS)}
    env |= {"PREFECT_HOME": str(work), "PREFECT_API_URL": ""}
    command = [sys.executable, "-m", "prefect", "server", "database", "upgrade", "--yes"]
    try:
        done = subprocess.run(command, env=env, capture_output=True, timeout=MIGRATE_TIMEOUT_SECONDS)
        if done.returncode != 0 or not (work / DATABASE).exists() or (work / f"{DATABASE}-wal").exists():
            return False  # failed, or its last writes still in a write-ahead log: not a database to copy
        for leftover in work.iterdir():  # only the database: no memo store or logs
            if leftover.name != DATABASE:
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        with contextlib.suppress(OSError):  # another job made it first: theirs is the same
            work.rename(target)
        return (target / DATABASE).exists()
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(work, ignore_errors=True)
