"""``trainyard models``: the registered models, for people (list, show, approve, reject, promote).

Works on the MLflow store the environment names (``MLFLOW_TRACKING_URI``; unset, the embedded SQLite
store under ``TRAINYARD_HOME``). An unknown model, version or alias exits 2 with a message; an
unreachable server exits 1; neither prints a traceback.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table

from trainyard import registry_admin, tracking_store
from trainyard.cli_text import out, plain, say
from trainyard.errors import TrainyardError
from trainyard.redaction import redact_text
from trainyard.registry_errors import ModelNotFound

models_app = typer.Typer(
    help="Registered models: list versions, show one's lineage, approve or reject it, promote it to champion, "
    "run the gate of a version that missed it.\n\n"
    "A version is named by its number (3) or an alias (champion, candidate). New versions start as "
    "PendingManualApproval; the promotion gate (registry.promote_if) moves champion automatically, "
    "'promote' moves it by hand.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
err = Console(stderr=True)
# A person waits on these commands: MLflow's own defaults (7 retries, backing off) made an unreachable
# server a 4-minute wait before the error. A job's registration keeps MLflow's defaults.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


@models_app.callback()
def _interactive() -> None:
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)  # the user's own setting wins


Name = Annotated[str, typer.Argument(help="Registered model name (registry.model_name, default the job name).")]
Ref = Annotated[str, typer.Argument(help="Version number, or an alias such as champion or candidate.")]


@models_app.command("list")
def list_(
    name: Annotated[str | None, typer.Argument(help="Only this registered model (default: all).")] = None,
) -> None:
    """List registered versions, newest first: aliases, approval status, final metrics and the gate's decision."""
    rows = _call(registry_admin.list_versions, name)
    if not rows:
        where = redact_text(tracking_store.tracking_uri())
        say(out(), f"{name} has no versions in {where}" if name else f"no registered models in {where}")
        return
    table = Table(title=f"registered models ({redact_text(tracking_store.tracking_uri())})")
    for column in ("model", "version", "aliases", "approval", "metrics", "job", "gate"):
        # a narrow terminal wraps a job id or an approval status rather than cut it short with an ellipsis
        table.add_column(column, justify="right" if column == "version" else "left", overflow="fold")
    for r in rows:
        aliases = ", ".join(r["aliases"])
        metrics = ", ".join(f"{k} {v}" for k, v in r["metrics"].items())  # to compare versions at a glance
        row = (r["name"], str(r["version"]), aliases, r["approval_status"], metrics, r["job_id"] or "", r["gate"] or "")
        table.add_row(*plain(*row))
    out().print(table)


@models_app.command()
def show(name: Name, version: Ref) -> None:
    """Show one version: its lineage tags (data, code, job spec, compute, carbon, metrics) and model card."""
    info = _call(registry_admin.describe, name, version)
    aliases = f" ({', '.join(info['aliases'])})" if info["aliases"] else ""
    (title,) = plain(f"{name} version {info['version']}{aliases}: {info['approval_status']}")
    table = Table(title=title)
    table.add_column("tag")
    table.add_column("value", overflow="fold")
    for key, value in sorted(info["tags"].items()):
        table.add_row(*plain(key, value if len(value) <= 300 else value[:300] + "..."))
    out().print(table)
    say(out(), f"source: {info['source']}  run: {info['run_id']}")
    if info["card"]:
        console = out()
        if console.is_terminal:  # headings and tables drawn; into a file or a pipe, the Markdown itself
            console.print(Markdown(info["card"]))
        else:
            console.print(info["card"], markup=False, highlight=False)


Reason = Annotated[
    str | None, typer.Option("--reason", help="Why (the approval_status.reason tag; SageMaker's ApprovalDescription).")
]


@models_app.command()
def approve(name: Name, version: Ref, reason: Reason = None) -> None:
    """Mark a version Approved (approval_status tag, SageMaker's value; who and when as approval_status.by and .at)."""
    info = _call(registry_admin.set_approval, name, version, "Approved", reason)
    say(out(), f"{name} version {info['version']}: Approved")


@models_app.command()
def reject(name: Name, version: Ref, reason: Reason = None) -> None:
    """Mark a version Rejected. A rejected champion stays champion until another version replaces it: one
    promoted by hand, or, under a registry.promote_if gate, the next version the gate passes. A version
    rejected before its gate ran is not judged by it."""
    info = _call(registry_admin.set_approval, name, version, "Rejected", reason)
    say(out(), f"{name} version {info['version']}: Rejected")
    if "champion" in info["aliases"]:
        say(err, f"note: version {info['version']} is still the champion; promote another version", "yellow")


@models_app.command()
def promote(
    name: Name,
    version: Ref,
    force: Annotated[bool, typer.Option("--force", help="Promote even a Rejected version.")] = False,
) -> None:
    """Move the champion alias to a version by hand, whatever the gate decided."""
    info = _call(registry_admin.promote, name, version, force)
    say(out(), f"{name}@champion -> version {info['version']} ({info['approval_status']})")


@models_app.command()
def gate(name: Name, version: Ref) -> None:
    """Run the promotion gate of a version that missed it (its job failed, or gave up waiting for the gate,
    after registering it): by its job's registry.promote_if, as the job would have."""
    info = _call(registry_admin.gate, name, version)
    say(out(), f"{name} version {info['version']}: {info['gate']}")


def _call(fn, *args):
    """Run a registry function; a mistake exits 2, a service failure exits 1, without a traceback."""
    try:
        return fn(*args)
    except (ModelNotFound, registry_admin.VersionRejected) as exc:
        say(err, exc, "red")
        raise typer.Exit(2) from None
    except TrainyardError as exc:
        say(err, exc, "red")
        raise typer.Exit(1) from None
