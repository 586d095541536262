"""The engine's exceptions: one root, narrow subclasses that also inherit the matching builtin.

A ``TrainyardError`` is a user-facing failure (bad spec, bad data, unreachable service): the CLI
prints its message without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class TrainyardError(Exception):
    """Root of every error Trainyard raises on purpose."""


class SpecError(TrainyardError, ValueError):
    """The job spec is invalid. ``problems`` holds one ``"field: message"`` line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid job spec ({len(self.problems)} problem(s)):\n{lines}")


class DataError(TrainyardError, ValueError):
    """Input data is missing, unreadable or unusable; the message names the object."""


class StorageError(TrainyardError, OSError):
    """S3 (or another store) refused or failed a request; the message names the URI.

    ``transient`` is True when trying again may help (network, throttling, 5xx), False when the
    request itself is wrong (no such bucket, access denied).
    """

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class TrainingError(TrainyardError, RuntimeError):
    """A replica group failed beyond its retries, or training produced no usable model.

    ``failures``: each replica group failure seen before training gave up (as the summary lists them).
    """

    failures: list[dict] = []


class RegistryError(TrainyardError, RuntimeError):
    """The model could not be logged or registered in MLflow."""
