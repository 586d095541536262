"""``trainyard run`` uses the Prefect API the active Prefect profile names (``prefect config set PREFECT_API_URL``),
as Prefect's own commands and ``trainyard jobs`` do: it ran the job on an ephemeral API of its own, whose runs,
logs and artifacts the user's server never saw, and a pool's deployment was "not on this Prefect API"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainyard import prefect_profile

ROOT = Path(__file__).parents[2]
SHOW = (
    "import os; from trainyard import cli; cli._embedded_defaults('j'); "
    "print(os.environ.get('PREFECT_API_URL'), os.environ.get('PREFECT_HOME'))"
)


def test_trainyard_run_takes_the_api_of_the_active_prefect_profile(tmp_path):
    (tmp_path / ".prefect").mkdir()
    (tmp_path / ".prefect" / "profiles.toml").write_text(
        'active = "team"\n\n[profiles.team]\nPREFECT_API_URL = "http://127.0.0.1:9/api"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"HOME": str(tmp_path), "TRAINYARD_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    shown = subprocess.run([sys.executable, "-c", SHOW], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.split() == ["http://127.0.0.1:9/api", "None"]  # no Prefect home of its own: the profile's


def test_without_a_profile_or_project_file_prefect_is_not_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("PREFECT_PROFILES_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    asked = []
    monkeypatch.setattr(prefect_profile.subprocess, "run", lambda *a, **k: asked.append(a))
    assert prefect_profile.configured_api_url() is None and not asked  # (asking costs a second or two)
