"""The ``trainyard`` command line (typer + rich).

User mistakes (a bad spec, bad data, an unreachable service) print a clear message and exit 2
(spec) or 1 (job), without a traceback. ``run`` and ``demo`` exit 0 only when the job completed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from trainyard import prefect_profile, prefect_template
from trainyard.cli_infra import infra_app
from trainyard.cli_jobs import jobs_app
from trainyard.cli_models import models_app
from trainyard.cli_report import report_app
from trainyard.cli_spec import SetOption, SpecArgument, entrypoint_problem, load, warn
from trainyard.cli_text import out, say
from trainyard.errors import SpecError, TrainyardError
from trainyard.home import home, new_job_id, write_json_atomic
from trainyard.spec import TrainingJob, parse_job
from trainyard.spec.sections import MOST_REPLICAS
from trainyard.status import LAST_EPOCH_SIFTING

app = typer.Typer(
    help="Trainyard: managed ML training as Prefect pipelines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",  # a help text's paragraphs re-wrapped to the terminal, not cut at its lines
)
console = Console(stderr=True)


def _version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        print(f"trainyard {version('trainyard')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print Trainyard's version and exit.")
    ] = False,
) -> None:
    """Trainyard: managed ML training as Prefect pipelines."""


app.add_typer(models_app, name="models")
app.add_typer(jobs_app, name="jobs")
app.add_typer(infra_app, name="infra")
app.add_typer(report_app, name="report")

SummaryOption = Annotated[Path | None, typer.Option("--summary-out", help="Write the job summary JSON here.")]


@app.command()
def validate(spec: SpecArgument, set_: SetOption = None) -> None:
    """Check a job spec without running it: prints each problem with the field and the fix.

    Every field is checked at once; the checks across sections (a label the spec must name for a
    built-in, a drill's group among the replicas) run once the fields they read are valid, so fixing a
    field can bring one of those to light on the next try. S3 is not read: a missing bucket or object, a
    label that is not a column, or sifting settings too large for the rows are found by `run`, before any
    training.
    """
    job = load(spec, set_)
    say(
        out(), f"{spec}: valid job {job.name!r}, {job.resources.replicas} replica group(s)", "green"
    )  # the result: stdout
    warn(job)


@app.command()
def run(spec: SpecArgument, set_: SetOption = None, summary_out: SummaryOption = None) -> None:
    """Run one job in this process against the S3, MLflow and Prefect the environment names
    (`trainyard jobs submit` queues it on a deployment instead)."""
    job = load(spec, set_)
    _check_summary_out(summary_out)
    problem = entrypoint_problem(job)
    if problem:  # this process trains the job: an entrypoint it cannot import fails before any compute
        say(console, f"{spec}: {problem}", "red")
        raise typer.Exit(2)
    raise typer.Exit(_run_job(job, summary_out))


@app.command()
def demo(
    rows: Annotated[int, typer.Option(min=100, help="Rows of generated data.")] = 20_000,
    epochs: Annotated[int, typer.Option(min=1, help="Training epochs.")] = 8,
    replicas: Annotated[int, typer.Option(min=1, max=MOST_REPLICAS, help="Replica groups.")] = 2,
    summary_out: SummaryOption = None,
) -> None:
    """The whole pipeline on the embedded default: generated churn data in a local S3 endpoint on
    127.0.0.1, Prefect's ephemeral API, MLflow on SQLite under TRAINYARD_HOME."""
    from trainyard import demo as demo_data
    from trainyard.local_s3 import local_s3_env

    _check_summary_out(summary_out)
    with local_s3_env() as server:
        say(console, f"local S3 endpoint: {server.endpoint_url}")
        uris = demo_data.upload_demo_data(rows)
        job = parse_job(demo_data.demo_job(uris, epochs=epochs, replicas=replicas))
        code = _run_job(job, summary_out)
    raise typer.Exit(code)


@app.command()
def scale(
    job_id: Annotated[str, typer.Argument(help="The job's id (its folder under TRAINYARD_HOME/jobs).")],
    replicas: Annotated[int, typer.Argument(help="Replica groups to run: min_replicas..max_replicas.")],
) -> None:
    """Grow or shrink a running job without stopping it.

    New groups heal from a live group and join the next step; removed groups (the newest first) leave
    at their next step boundary, as on a spot interruption notice. The next epoch's data is dealt to
    the groups then running.
    """
    from trainyard.training import scaling

    try:
        console.print(scaling.request(job_id, replicas))
    except TrainyardError as exc:
        say(console, exc, "red")
        raise typer.Exit(2) from None


@app.command()
def stop(
    job_id: Annotated[str, typer.Argument(help="The job's id (its folder under TRAINYARD_HOME/jobs).")],
) -> None:
    """Stop a job training on this machine, keeping what it learnt.

    Every replica group stops within a few steps, at a step they agree on; the model trained so far is
    uploaded with the job's outputs, the summary is written, and the job ends Stopped (not registered: only
    a completed job is). For a job on a Prefect API, `trainyard jobs stop RUN_ID --graceful` does the same.
    """
    from trainyard.training import user_stop

    try:
        console.print(user_stop.request(job_id))
    except TrainyardError as exc:
        say(console, exc, "red")
        raise typer.Exit(2) from None


def _embedded_defaults(job_id: str) -> None:
    """Without a Prefect API (in the environment, or in the active Prefect profile), give this process a Prefect
    home of its own (no network, no telemetry).

    The ephemeral API keeps its SQLite database in PREFECT_HOME; two ``trainyard run`` processes
    sharing one would lock each other out, so each job gets ``TRAINYARD_HOME/prefect/<job id>``,
    which also keeps that job's flow-run records for inspection afterwards.
    """
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect gives its ephemeral API 20 s to start; on a busy 2-core machine (a laptop also running
    # the S3 endpoint and MLflow) its first start, database migrations included, can take longer.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if not os.environ.get("PREFECT_API_URL") and not os.environ.get("PREFECT_HOME"):
        configured = prefect_profile.configured_api_url()  # `prefect config set PREFECT_API_URL=...`: that server
        if configured:
            os.environ["PREFECT_API_URL"] = configured  # (read by what starts and stops an ephemeral API)
            return
        prefect_home = home() / "prefect" / job_id
        prefect_home.mkdir(parents=True, exist_ok=True)  # Prefect creates only the last level
        # its database already migrated: the ephemeral API starts in seconds, not 20
        templates = prefect_template.templates_dir(fallback=home() / "prefect")
        prefect_template.seed(prefect_home, templates, announce=lambda message: say(console, message, "dim"))
        os.environ["PREFECT_HOME"] = str(prefect_home)


def _run_job(job: TrainingJob, summary_out: Path | None) -> int:
    job_id = new_job_id(job.name)
    _embedded_defaults(job_id)
    from flows.ephemeral_api import start_ephemeral_api, stop_ephemeral_api
    from flows.training_pipeline import training_pipeline
    from trainyard.home import job_dir

    # SIGTERM ends this process by an exception, not at once, so that what it started (the local S3
    # endpoint, the ephemeral API) is stopped on the way out. During the flow Prefect handles the signal
    # first (the flow writes its summary as Stopped), then passes it on to this handler.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    spec_problem = False  # one found only against the data (sifting's draw against the rows): exit 2
    failure: TrainyardError | None = None  # said under the summary's table, or alone where there is none
    returned = None
    try:
        start_ephemeral_api()  # here, not in the flow: its watchdog stops it should this process be killed
        returned = training_pipeline(job, job_id=job_id)
    except TrainyardError as exc:
        failure = exc
        spec_problem = isinstance(exc, SpecError) or isinstance(exc.__cause__, SpecError)
    except RuntimeError as exc:
        # Prefect's own words, without its traceback: the job never started, so there is no summary.
        if "ephemeral Prefect API" in str(exc):
            advice = (
                "Start a Prefect server (`prefect server start`) and set PREFECT_API_URL, "
                "or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS."
            )
        elif str(exc).startswith("Failed to reach API at "):  # the profile's or the environment's API is down
            advice = (
                "Start that Prefect server, or point PREFECT_API_URL at a running one; to run on an API of the "
                "job's own instead, unset it (`prefect config unset PREFECT_API_URL`, and in the environment)."
            )
        else:
            raise
        say(console, exc, "red")
        say(console, advice)
        return 1
    except BaseException:
        # SIGTERM or Ctrl-C: the flow wrote its summary as Stopped. Exiting on a signal skips the hook
        # that stops Prefect's ephemeral API, which would outlive the job.
        stop_ephemeral_api()
        written = job_dir(job_id) / "summary.json"
        if summary_out is not None and written.exists():
            write_json_atomic(summary_out, json.loads(written.read_text()))
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary_path = job_dir(job_id) / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
    elif isinstance(returned, dict):  # the job folder's copy not written (a full disk): the one the flow returned
        summary = returned
    else:
        if failure is not None:
            say(console, failure, "red")
        say(console, f"job {job_id} produced no summary; see the logs above", "red")
        return 2 if spec_problem else 1
    if failure is not None and not summary.get("failure_reason"):
        say(console, failure, "red")
    if summary_out is not None:
        write_json_atomic(summary_out, summary)
    print_summary(summary)
    return 0 if summary["status"] == "Completed" else 2 if spec_problem else 1


def _check_summary_out(path: Path | None) -> None:
    """Make sure ``--summary-out`` can be written before the job runs (its folder made where missing): a
    path found wrong after training cost the job's whole run a traceback and its summary table."""
    if path is None:
        return
    if path.is_dir():
        say(console, f"--summary-out {path}: is a folder; give the file to write, e.g. {path / 'summary.json'}", "red")
        raise typer.Exit(2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "a file is in the way" if isinstance(exc, FileExistsError | NotADirectoryError) else exc.strerror or exc
        say(console, f"--summary-out {path}: its folder cannot be made ({why})", "red")
        raise typer.Exit(2) from None
    if not os.access(path.parent, os.W_OK):
        say(console, f"--summary-out {path}: its folder {path.parent} cannot be written to", "red")
        raise typer.Exit(2)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


@app.command()
def clean(
    job_ids: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[JOB_ID]...", help="Remove these jobs' folders, whatever their age (never a running one)."
        ),
    ] = None,
    older_than: Annotated[
        float,
        typer.Option(
            "--older-than",
            min=0.05,  # 72 minutes at least: a job staging a large channel writes nothing to its folder meanwhile
            help="Days since anything was written to a job's folders (0.05 at least: 72 minutes).",
        ),
    ] = 30,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would go; remove nothing.")] = False,
) -> None:
    """Remove the folders of jobs idle for --older-than days, or of the jobs named: TRAINYARD_HOME's
    jobs/JOB_ID (manifests, logs, every group's model) and prefect/JOB_ID (a job run without a Prefect API).

    A running job is never removed. Registered models and their lineage stay in MLflow, outputs in S3;
    the cache keeps its own cap (TRAINYARD_CACHE_MAX_BYTES). Exit 1 when a folder could not all be deleted
    (each said, the others still removed); 2 when a job named cannot be (nothing removed).
    """
    from trainyard import housekeeping

    if not job_ids:
        found = housekeeping.old_jobs(older_than * 86_400)
        failed = _remove(found, f"jobs idle for {older_than:g} days or more", dry_run, lock=True)
    else:
        try:
            # their run locks held until they are gone: a rerun of one cannot start in its folder meanwhile
            with housekeeping.named_jobs(job_ids) as found:
                failed = _remove(found, "the jobs named", dry_run)
        except TrainyardError as exc:  # nothing is removed when one of them cannot be
            say(console, exc, "red")
            raise typer.Exit(2) from None
    if failed:  # (said above, each with why; a script's `clean && ...` must not take it as done)
        raise typer.Exit(1)


def _remove(found: list, which: str, dry_run: bool, lock: bool = False) -> int:
    """Remove the folders of ``found`` (``housekeeping.OldJob``), listing them; ``lock``: each under its run
    lock, kept if a run of it has started since it was found. Returns how many could not be removed."""
    from trainyard import housekeeping

    if not found:
        say(console, f"nothing to remove: no {which}", "green")
        return 0
    table = Table(title=f"{'would remove' if dry_run else 'removed'}: {which}")
    for column, justify in (("job", "left"), ("idle (days)", "right"), ("MiB", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    removed, failed = [], 0
    for job in found:
        try:
            if not dry_run and not housekeeping.remove(job, lock=lock):
                say(console, f"kept {job.job_id}: a run of it has started", "yellow")
                continue
        except TrainyardError as exc:  # (the others are still removed)
            say(console, exc, "red")
            failed += 1
            continue
        removed.append(job)
        table.add_row(job.job_id, f"{job.idle_seconds / 86_400:.1f}", f"{job.size / 2**20:.1f}")
    out().print(table)
    say(console, f"{len(removed)} job(s), {sum(job.size for job in removed) / 2**20:.1f} MiB", "green")
    return failed


def _cell(value) -> str:
    return "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def print_summary(summary: dict) -> None:
    """The end-of-job table."""
    table = Table(title=f"{summary['job_id']}: {summary['status']}", show_header=True)
    table.add_column("what")
    table.add_column("value", justify="right")
    # the model's epoch's: the last, or the best where the job restored it
    restored = (summary.get("training") or {}).get("restored_epoch")
    for key, value in (summary.get("metrics") or {}).items():
        label = f"epoch {restored}" if restored else "last epoch"
        table.add_row(f"{key} ({label})" if key in LAST_EPOCH_SIFTING else key, _cell(value))
    if restored:
        table.add_row("model from epoch", f"{restored} (the best)")
    sifting = summary.get("sifting") or {}
    if sifting.get("enabled"):  # the job's, over every epoch (the summary's ``sifting`` has them by epoch)
        online = sifting.get("online") or {}
        table.add_row("kept fraction (job)", _cell(sifting.get("kept_fraction")))
        if "pruned_fraction" in online:
            table.add_row("pruned fraction (job)", _cell(online["pruned_fraction"]))
    compute = summary.get("compute") or {}  # (a section the summary could not make is null: summary_errors)
    table.add_row("FLOPs", f"{compute.get('flops_total', 0):.3e}")
    table.add_row("steps", str(compute.get("steps", 0)))
    carbon = summary.get("carbon") or {}
    table.add_row("energy (kWh)", f"{carbon.get('energy_kwh', 0):.3g}")
    table.add_row("emissions (kgCO2e)", f"{carbon.get('emissions_kg', 0):.3g}")
    for stage, seconds in (summary.get("timings") or {}).items():
        table.add_row(f"{stage} (s)", f"{seconds:.1f}")
    model = summary.get("model") or {}
    if model:
        table.add_row("model", f"{model['uri']} {model['aliases']}")
    out().print(table)
    if summary.get("failure_reason"):  # under the table, as text: right-aligned in a cell it wrapped unreadably
        say(out(), f"{summary['status']}: {summary['failure_reason']}", "red")
    for error in summary.get("summary_errors") or ():  # a section left out of the summary: a bug to report
        say(out(), f"summary incomplete: {error}", "yellow")


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except TrainyardError as exc:
        say(console, exc, "red")
        sys.exit(1)


if __name__ == "__main__":
    main()
