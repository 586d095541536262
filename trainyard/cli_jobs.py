"""``trainyard jobs list|describe|stop``: jobs submitted to a Prefect API (``PREFECT_API_URL``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from trainyard.errors import TrainyardError

jobs_app = typer.Typer(help="Jobs on the Prefect API named by PREFECT_API_URL.", no_args_is_help=True)
console = Console(stderr=True)
RunId = Annotated[str, typer.Argument(help="The job's flow run id (trainyard jobs list shows it).")]


@jobs_app.command("list")
def list_jobs(limit: Annotated[int, typer.Option(help="How many, newest first.")] = 20) -> None:
    """Recent training-pipeline runs and their status."""
    from trainyard import client

    rows = _call(client.jobs, limit)
    table = Table(title="Training jobs")
    for column in ("job", "status", "prefect state", "started", "flow run"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["job_id"] or "", r["status"], r["prefect_state"] or "", r["started"] or "", r["flow_run_id"])
    Console().print(table)


@jobs_app.command()
def describe(run_id: RunId) -> None:
    """A job's status and its secondary status transitions, as JSON."""
    from trainyard import client

    Console().print_json(json.dumps(_call(client.status, run_id)))


@jobs_app.command()
def stop(run_id: RunId) -> None:
    """Cancel a job: its pipeline run and every replica group run. Groups leave at a step boundary."""
    from trainyard import client

    cancelled = _call(client.stop, run_id)
    console.print(f"cancelled {len(cancelled)} run(s)" if cancelled else "nothing to stop: the job has ended")


def _call(fn, *args):
    try:
        return fn(*args)
    except TrainyardError as exc:  # a run id that is not one, or that the API does not know (client.py)
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    except Exception as exc:  # noqa: BLE001 - the API unreachable: say so, no traceback
        console.print(f"[red]{type(exc).__name__}: {exc}[/red] (is PREFECT_API_URL right?)")
        raise typer.Exit(1) from None
