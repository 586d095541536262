"""Keeping secrets out of what Trainyard records: MLflow tags and artifacts, model cards, summaries, messages.

A job spec travels into lineage that everyone with read access to the registry sees. Its own fields
hold no secrets, but ``resources.job_variables`` (environment variables and other settings for the
work pool) may: there, a value under a secret-looking name (``env.HF_TOKEN``, ``DB_PASSWORD``) is
masked, as Prefect, Airflow and MLflow mask such names in their UIs. Elsewhere names are left alone,
so that a channel called ``tokenizer`` or a hyperparameter ``max_tokens`` stays in the lineage. A
URL's password (``https://user:pw@host``) is masked wherever a URL is recorded or quoted in a message.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

MASK = "***"

# Names whose values are secrets by convention (AWS_SECRET_ACCESS_KEY, HF_TOKEN, DB_PASSWORD,
# WANDB_API_KEY, GOOGLE_APPLICATION_CREDENTIALS, SENTRY_DSN, ...): one of these words as a whole part of the
# name; or a name ending in PASSWORD / PASSWD run together (PGPASSWORD, the PostgreSQL clients' own).
SECRET_NAME = re.compile(
    r"(^|[_.-])(secret|token|password|passwd|pwd|credentials?|private_?key|api_?key|access_?key|auth|session|cookie"
    r"|dsn|connection_?string)s?($|[_.-])|(password|passwd)$",
    re.I,
)

# The password of a URL's userinfo: scheme://user:password@host. The password runs to the last "@"
# before the path, as URL parsers (botocore's among them) read an unencoded "@" in it, and stops at a
# quote or bracket (a URL inside JSON or markup).
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/@\s:]*):(?P<password>[^/\s\"'<>]+)@")
# A URL whose userinfo is a token alone (https://ghp_...@github.com, a Sentry DSN's key): no user name
# is that long and mixed, and one that is stays readable up to its masked part.
_URL_TOKEN = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<token>(?=[^/@\s:]*\d)[A-Za-z0-9_-]{20,})@")
# A secret-named query parameter (?password=, &token=, a presigned URL's X-Amz-Signature and
# X-Amz-Security-Token), or a connection string's key (AccountKey=...;, Password=...;).
_SECRET_PARAMETER = re.compile(
    r"(?P<head>(?:[?&;]|\b)(?:[\w.-]*?)(?:password|passwd|pwd|secret|token|signature|credential|accountkey"
    r"|sharedaccesskey|api_?key)=)(?P<value>[^&;\s\"'<>]+)",
    re.I,
)


def redact_text(text: str) -> str:
    """``text`` with the password of every URL in it masked (the user name is kept: it says who), a URL's
    token-only userinfo, and the values of secret-named query parameters and connection-string keys."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}:{MASK}@", text)
    text = _URL_TOKEN.sub(lambda m: f"{m['head']}{MASK}@", text)
    return _SECRET_PARAMETER.sub(lambda m: f"{m['head']}{MASK}", text)


def redact_url(url: str) -> str:
    """One URL with its password masked, written with a scheme or without (``user:pw@host:port``)."""
    scheme, sep, rest = url.partition("://") if "://" in url else ("", "", url)
    authority, slash, path = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if at and ":" in userinfo:
        userinfo = f"{userinfo.split(':', 1)[0]}:{MASK}"
    return f"{scheme}{sep}{userinfo}{at}{host}{slash}{path}"


def redact_spec(spec: dict) -> dict:
    """A copy of a job spec (``model_dump(mode="json")``) fit for lineage: secret-named values under
    ``resources.job_variables`` masked, URL passwords masked everywhere."""
    return redact_job_variables(redact(spec))


def redact_job_variables(spec: dict) -> dict:
    """A copy of a job spec with the secret-named values under ``resources.job_variables`` masked."""
    variables = (spec.get("resources") or {}).get("job_variables")
    if not isinstance(variables, dict):
        return spec
    return spec | {"resources": spec["resources"] | {"job_variables": redact(variables, by_name=True)}}


def redact(value: Any, by_name: bool = False) -> Any:
    """A copy of a JSON-like value with URL passwords masked; with ``by_name``, secret-named entries too."""
    if isinstance(value, dict):
        return {
            key: MASK
            if by_name and isinstance(key, str) and SECRET_NAME.search(key) and item not in (None, "")
            else redact(item, by_name)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):  # (a tuple stays one: an exception's arguments)
        return type(value)(redact(item, by_name) for item in value)
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_exception(exc: BaseException) -> BaseException:
    """``exc`` with URL passwords masked in its message and in every exception chained to it, in place,
    so that its traceback is kept: for a bug's exception, which Prefect logs whole (message, chain and
    traceback) where a stage fails. Masked through ``args``, which most exceptions' messages come from,
    and an ``OSError``'s ``strerror`` and file names; one whose ``__str__`` reads something else keeps
    its message."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        with contextlib.suppress(AttributeError, TypeError):  # args that cannot be set: left as they are
            current.args = tuple(redact(a) for a in current.args)
        # attributes some exceptions' messages come from: OSError's "[Errno N] strerror: 'filename'",
        # CalledProcessError's command, urllib's HTTPError's url and msg
        for name in ("strerror", "filename", "filename2", "cmd", "url", "msg", "reason"):
            with contextlib.suppress(AttributeError, TypeError):
                if isinstance(getattr(current, name, None), str | list | tuple):
                    setattr(current, name, redact(getattr(current, name)))
        with contextlib.suppress(AttributeError, TypeError):
            if isinstance(getattr(current, "__notes__", None), list):
                current.__notes__ = [redact(note) for note in current.__notes__]
        if isinstance(current, BaseExceptionGroup):
            pending += list(current.exceptions)
        pending += [current.__cause__, current.__context__]
    return exc
