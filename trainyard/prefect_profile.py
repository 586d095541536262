"""The Prefect API a user configured outside the environment: in the active Prefect profile (``prefect config set
PREFECT_API_URL=...``, ``prefect cloud login``), or a ``prefect.toml``, ``.env`` or ``pyproject.toml`` where the
command runs. ``trainyard run`` decides whether to run its own ephemeral API before Prefect is imported (importing
it fixes its settings, and the ephemeral API's home is set in the environment first), so it asks Prefect itself, in
a child process, rather than read those files as Prefect might.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Only where such a file exists is Prefect asked (a second or two for its import).
_PROJECT_FILES = ("prefect.toml", ".env", "pyproject.toml")
_ASK = "from prefect.settings import get_current_settings; print(get_current_settings().api.url or '')"
ASK_TIMEOUT_SECONDS = 60


def configured_api_url() -> str | None:
    """The API URL Prefect's settings resolve to in this environment, from a profile or a project file; None where
    none is configured, or where it cannot be told (Prefect's own error: the job then runs on an API of its own)."""
    profiles = os.environ.get("PREFECT_PROFILES_PATH") or str(Path("~/.prefect/profiles.toml").expanduser())
    if not Path(profiles).is_file() and not any(Path(name).is_file() for name in _PROJECT_FILES):
        return None
    try:
        asked = subprocess.run(  # noqa: S603 - this interpreter, a fixed one-liner
            [sys.executable, "-c", _ASK], capture_output=True, text=True, timeout=ASK_TIMEOUT_SECONDS, check=True
        )
    except (subprocess.SubprocessError, OSError):
        return None
    url = asked.stdout.strip().splitlines()[-1] if asked.stdout.strip() else ""
    return url or None
