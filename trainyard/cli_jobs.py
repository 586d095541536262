"""``trainyard jobs submit|list|describe|logs|stop``: jobs on a Prefect API (``PREFECT_API_URL``)."""

from __future__ import annotations

import functools
import json
import signal
from datetime import datetime
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from flows.client import DEFAULT_DEPLOYMENT  # the client imports Prefect only when it is called
from trainyard.cli_spec import SetOption, SpecArgument, load, warn
from trainyard.cli_text import out, plain, say
from trainyard.errors import TrainyardError

jobs_app = typer.Typer(
    help="Jobs on the Prefect API named by PREFECT_API_URL.", no_args_is_help=True, rich_markup_mode="markdown"
)
console = Console(stderr=True)
RunId = Annotated[str, typer.Argument(help="The job's flow run id (trainyard jobs list shows it).")]
WaitOption = Annotated[bool, typer.Option("--wait", help="Follow the job to its end; exit 0 only if it completed.")]


@jobs_app.command()
def submit(
    spec: SpecArgument,
    set_: SetOption = None,
    deployment: Annotated[
        str, typer.Option(help="The training-pipeline deployment to run it (prefect.yaml's, or your own).")
    ] = DEFAULT_DEPLOYMENT,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Submitting twice with the same key queues one job (safe to retry).")
    ] = None,
    wait: WaitOption = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            min=1,
            help="With --wait: stop waiting after this many seconds (exit 124; the job goes on). A job no "
            "worker picks up stays Scheduled for as long as none does.",
        ),
    ] = None,
) -> None:
    """Queue a job on a deployment, validated here first (a bad spec queues nothing); prints its flow run id.

    The pipeline runs where the deployment's work pool has a worker. Without --wait this returns at once:
    `trainyard jobs describe RUN_ID` follows the job, `trainyard jobs stop RUN_ID` stops it.
    """
    from flows import client

    job = load(spec, set_)
    warn(job)
    if timeout is not None and not wait:
        say(console, "--timeout is how long --wait waits; without --wait it does nothing", "yellow")
    run_id = _call(client.submit, job, deployment, idempotency_key)
    print(run_id)  # stdout, alone: RUN_ID=$(trainyard jobs submit job.yaml)
    if not wait:
        return
    say(console, f"job {job.name!r} queued on {deployment}, flow run {run_id}: waiting for it to end")
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM as Ctrl-C: said, not silent
    try:
        final = _call(functools.partial(client.wait, timeout_seconds=timeout, on_transition=_print_transition), run_id)
    except client.WaitTimeout as exc:
        say(console, f"{exc}; stopped waiting, the job goes on: `trainyard jobs describe {run_id}`", "yellow")
        raise typer.Exit(124) from None
    except KeyboardInterrupt:
        say(
            console,
            f"stopped waiting; the job goes on: `trainyard jobs describe {run_id}` follows it, "
            f"`trainyard jobs stop {run_id}` stops it",
            "yellow",
        )
        raise typer.Exit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    colour = "green" if final["status"] == "Completed" else "red"
    say(console, f"job {final['job_id']}: {final['status']} ({final['secondary_status']})", colour)
    raise typer.Exit(0 if final["status"] == "Completed" else 1)


def _print_transition(transition: dict) -> None:
    """``07:17:32  Training  Training the model``: one line per secondary status, as the job enters it."""
    say(console, f"{_clock(transition['start_time'])}  {transition['status']:<12} {transition.get('message', '')}")


def _clock(iso: str) -> str:
    """An ISO timestamp (the API's are UTC) as this machine's local clock time."""
    return datetime.fromisoformat(iso).astimezone().strftime("%H:%M:%S")


@jobs_app.command("list")
def list_jobs(limit: Annotated[int, typer.Option(min=1, help="How many, newest first.")] = 20) -> None:
    """Recent training-pipeline runs and their status."""
    from flows import client

    rows = _call(client.jobs, limit)
    table = Table(title="Training jobs")
    for column in ("job", "status", "prefect state", "started", "flow run", "reason"):
        table.add_column(column, overflow="fold")  # ids whole, wrapped, in a narrow terminal
    for r in rows:
        # a run not started yet has no job id: its spec's name, and when it is due
        job = r["job_id"] or (f"{r['job_name']} (not started)" if r["job_name"] else "")
        started = r["started"] or (f"due {r['expected_start']}" if r["expected_start"] else "")
        reason = r["reason"] or ""
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
        table.add_row(*plain(job, r["status"], r["prefect_state"] or "", started, r["flow_run_id"], reason))
    out().print(table)


@jobs_app.command()
def describe(run_id: RunId) -> None:
    """A job's status and its secondary status transitions, as JSON."""
    from flows import client

    Console().print_json(json.dumps(_call(client.status, run_id)))


@jobs_app.command()
def logs(
    run_id: RunId,
    groups: Annotated[bool, typer.Option(help="Also the replica groups' runs (on a work pool).")] = True,
) -> None:
    """A job's logs, oldest first: its pipeline run's and its replica groups' (those run on a work pool)."""
    from flows import client

    for line in _call(client.logs, run_id, groups):
        where = f"{line['run']}/{line['task']}" if line.get("task") else line["run"]
        print(f"{_clock(line['time'])} {line['level']:<7} {where}: {line['message']}")


@jobs_app.command()
def stop(
    run_id: RunId,
    graceful: Annotated[
        bool,
        typer.Option(
            "--graceful",
            help="Keep what the job learnt: every group stops at its next step boundary, the model trained so "
            "far is uploaded and the job ends Stopped (not registered). A job not training yet stops before "
            "its first step, with no model.",
        ),
    ] = False,
) -> None:
    """Stop a job. By default its pipeline run and every replica group run are cancelled: the groups leave at
    a step boundary and nothing is uploaded. With --graceful the job stops itself and keeps its model."""
    from flows import client

    done = _call(client.stop, run_id, graceful)
    if not done:
        say(console, "nothing to stop: the job has ended")
    elif graceful:
        say(console, f"asked run {run_id} to stop at its next step boundary, keeping its model so far")
    else:
        say(console, f"cancelled {len(done)} run(s)")


def _call(fn, *args):
    try:
        return fn(*args)
    except TimeoutError:  # client.WaitTimeout: the caller says the job goes on
        raise
    except ConnectionError as exc:  # prefect_api.ApiUnreachable: a service problem, not the command's (exit 1)
        say(console, exc, "red")
        raise typer.Exit(1) from None
    except TrainyardError as exc:  # a run id that is not one, or that the API does not know (client.py)
        say(console, exc, "red")
        raise typer.Exit(2) from None
    except Exception as exc:  # noqa: BLE001 - the API unreachable: say so, no traceback
        say(console, f"{type(exc).__name__}: {exc} (is PREFECT_API_URL right?)", "red")
        raise typer.Exit(1) from None
