"""How the registry's failures reach the user: MLflow's and its artifact stores' errors as a ``RegistryError``
that names what failed, told apart as unavailable (transient: retried), not found, or refused."""

from __future__ import annotations

from trainyard.errors import RegistryError, StorageError, TrainyardError
from trainyard.redaction import redact_text

# MLflow error codes after which the same request may succeed (the server or its database was away).
_TRANSIENT_CODES = {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "DEADLINE_EXCEEDED"}


class RegistryUnavailable(RegistryError, StorageError):
    """The tracking server or its artifact store did not answer, or failed: trying again may help.

    A ``StorageError`` with ``transient`` True, so the registry task's retry condition retries it.
    """

    def __init__(self, message: str):
        super().__init__(message, transient=True)


class ModelNotFound(RegistryError, LookupError):
    """No such registered model, version or alias; the message names it."""


def service_errors() -> tuple[type[BaseException], ...]:
    """What the MLflow client and its artifact stores raise when a request fails."""
    from alembic.util.exc import CommandError  # MLflow's migrations of a database store
    from botocore.exceptions import BotoCoreError, ClientError
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError  # a database tracking URI's store: a file it cannot open, say

    # ModuleNotFoundError: a tracking URI whose database driver is not installed (postgresql:// without psycopg2)
    return (MlflowException, OSError, BotoCoreError, ClientError, SQLAlchemyError, ModuleNotFoundError, CommandError)


def translate(
    exc: BaseException, what: str, uri: str, registering: bool = True, ungated: tuple[str, str] | None = None
) -> RegistryError:
    """A ``RegistryError`` naming what failed: unavailable (transient), not found, or refused.
    ``registering``: the failure interrupted a registration (its message says how to finish it);
    ``ungated``: ``(name, version)`` where the version was made before it failed, not yet gated."""
    from mlflow.exceptions import MlflowException

    uri = redact_text(uri)  # a password in the tracking URI stays out of messages (MLflow's own quote it too)
    if isinstance(exc, TrainyardError):
        return exc if isinstance(exc, RegistryError) else RegistryError(f"{what} in {uri} failed: {exc}")
    if isinstance(exc, ModuleNotFoundError):
        return RegistryError(
            f"{what}: the tracking URI {uri} needs the Python package {exc.name!r}, which is not installed here; "
            "install it (pip install ...) or set MLFLOW_TRACKING_URI to a store this machine can reach"
        )
    if isinstance(exc, MlflowException):
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return ModelNotFound(f"{what}: {redact_text(exc.message)}")
        if exc.error_code not in _TRANSIENT_CODES and exc.get_http_status_code() < 500:
            return RegistryError(f"{what} in {uri} was refused: {redact_text(exc.message)}")
        detail = redact_text(exc.message)
    else:
        detail = redact_text(f"{type(exc).__name__}: {exc}")
    if "_alembic_tmp_" in detail or type(exc).__name__ == "CommandError":
        return RegistryError(
            f"{what}: the tracking store {uri} was left part-way through a schema migration (a process killed while "
            "MLflow migrated it, or two that migrated it at once); an embedded store's file: move it aside to start "
            f"a new one, or restore it from a backup; a database server's: `mlflow db upgrade <uri>` ({detail})"
        )
    finish = ""
    if ungated:
        finish = (
            f" Version {ungated[1]} of {ungated[0]!r} is registered and may not be gated yet: `trainyard models gate "
            f"{ungated[0]} {ungated[1]}` runs its gate (so does registering the same job id again)."
        )
    elif registering:
        finish = " No version was left half-made; registering the same job again finishes it without a second version."
    return RegistryUnavailable(f"{what} failed: MLflow at {uri} is unavailable ({detail}).{finish}")
