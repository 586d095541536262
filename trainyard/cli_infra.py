"""``trainyard infra``: make a Prefect server ready for Trainyard (``infra/``, applied by ``infra.apply``).

``apply`` creates or updates the work pools and their base job templates, the GPU pool's concurrency
limit, the block types the templates use and the zombie-run automation; run twice, the second run
changes nothing. Options that cannot be applied exit 2; an unreachable API exits 1; neither prints a
traceback. Prefect is imported only when a command runs.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from trainyard.cli_text import out, say
from trainyard.errors import TrainyardError

infra_app = typer.Typer(
    help="Set up a Prefect server for Trainyard: work pools (process, Kubernetes or ECS GPU templates from infra/), "
    "the GPU pool's concurrency limit, block types, and the automation that marks zombie flow runs Crashed.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
err = Console(stderr=True)
_STYLE = {"created": "green", "updated": "yellow", "unchanged": "dim"}
_WOULD = {"created": "would create", "updated": "would update"}  # a dry run's actions


@infra_app.callback()
def _group() -> None:
    """Set up a Prefect server for Trainyard (keeps ``infra`` a group of commands, as more come)."""


@infra_app.command()
def apply(
    api_url: Annotated[
        str | None, typer.Option("--api-url", help="The Prefect API (default: PREFECT_API_URL).")
    ] = None,
    kind: Annotated[str, typer.Option("--kind", help="The GPU pool's worker type: process, kubernetes or ecs.")] = (
        "process"
    ),
    gpu_pool: Annotated[str, typer.Option("--gpu-pool", help="Name of the GPU pool.")] = "trainyard-gpu",
    gpus_per_pool: Annotated[
        int | None,
        typer.Option(
            "--gpus-per-pool",
            min=1,
            help="GPUs the GPU pool's workers have in all: its concurrency limit becomes this many replica groups "
            "of --gpus-per-group GPUs. Groups beyond it wait (Scheduled), they do not fail. Unset: leave the limit.",
        ),
    ] = None,
    gpus_per_group: Annotated[int, typer.Option("--gpus-per-group", min=1, help="GPUs of one replica group.")] = 1,
    heartbeat_seconds: Annotated[
        int,
        typer.Option(
            "--heartbeat-seconds",
            min=30,
            help="Flow run heartbeat interval set in the pools' env; a run silent for three is marked Crashed.",
        ),
    ] = 30,
    image: Annotated[
        str | None, typer.Option("--image", help="Default image of a kubernetes or ecs pool (infra/worker.Dockerfile).")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would change; change nothing.")] = False,
    reset_defaults: Annotated[
        bool,
        typer.Option(
            "--reset-defaults",
            help="Put the pools' variable defaults back to infra/'s templates. Without it, those set on a pool since "
            "(an EFS id, a namespace, env entries, the image) are kept, and listed where they differ.",
        ),
    ] = False,
) -> None:
    """Create or update the pools, concurrency limit, block types and zombie automation (idempotent)."""
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    infra = _infra_module()
    try:
        changes = infra.apply(
            api_url=api_url,
            kind=kind,
            gpu_pool=gpu_pool,
            gpus_per_pool=gpus_per_pool,
            gpus_per_group=gpus_per_group,
            heartbeat_seconds=heartbeat_seconds,
            image=image,
            dry_run=dry_run,
            reset_defaults=reset_defaults,
        )
    except infra.InfraError as exc:
        say(err, exc, "red")
        raise typer.Exit(2) from None
    except TrainyardError as exc:
        say(err, exc, "red")
        raise typer.Exit(1) from None
    table = Table(title="trainyard infra apply" + (" (dry run: nothing changed)" if dry_run else ""))
    for column in ("kind", "name", "action", "detail"):
        table.add_column(column, overflow="fold")
    for c in changes:
        action = _WOULD.get(c.action, c.action) if dry_run else c.action
        table.add_row(c.kind, c.name, f"[{_STYLE[c.action]}]{action}[/]", c.detail)
    out().print(table)
    changed = [c for c in changes if c.action != "unchanged"]
    say(out(), f"{len(changed)} change(s){' to make' if dry_run else ''}" if changed else "no changes")


def _infra_module():
    """``infra.apply``, imported when used (it is the Prefect-facing side)."""
    from infra import apply as module

    return module
