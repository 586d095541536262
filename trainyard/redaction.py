"""Keeping secrets out of what Trainyard records: MLflow tags and artifacts, model cards, summaries, messages.

A job spec travels into lineage that everyone with read access to the registry sees, so a value
under a secret-looking name (``resources.job_variables.env.HF_TOKEN``) is masked there, as Prefect,
Airflow and MLflow mask such names in their UIs. A URL's password (``https://user:pw@host``) is
masked wherever a URL is recorded or quoted in a message.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

# Names whose values are secrets by convention (AWS_SECRET_ACCESS_KEY, HF_TOKEN, DB_PASSWORD,
# WANDB_API_KEY, GOOGLE_APPLICATION_CREDENTIALS, ...). No field of the job spec itself matches.
SECRET_NAME = re.compile(r"secret|token|passw|pwd|credential|private|api_?key|access_?key|auth|session|cookie", re.I)

# The password of a URL's userinfo: scheme://user:password@host
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/@\s:]*):(?P<password>[^/@\s]+)@")


def redact_text(text: str) -> str:
    """``text`` with the password of every URL in it masked (the user name is kept: it says who)."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}:{MASK}@", text)


def redact(value: Any) -> Any:
    """A copy of a JSON-like value with secret-named entries masked and URL passwords removed."""
    if isinstance(value, dict):
        return {
            key: MASK if isinstance(key, str) and SECRET_NAME.search(key) and item not in (None, "") else redact(item)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(item) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value
