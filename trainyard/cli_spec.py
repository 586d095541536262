"""Reading a job spec on the command line, for ``trainyard validate``, ``run`` and ``jobs submit``: the
``--set`` option, a spec problem as a message and exit status 2, and the warnings a valid spec can earn."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from trainyard.cli_text import say
from trainyard.errors import SpecError
from trainyard.spec import TrainingJob, ignored_settings, load_job

console = Console(stderr=True)
SpecArgument = Annotated[Path, typer.Argument(help="The job spec (YAML).")]
SetOption = Annotated[
    list[str] | None, typer.Option("--set", help="Override a spec field: key.path=value (YAML value).")
]


def load(spec: Path, overrides: list[str] | None) -> TrainingJob:
    """The job, or every problem with it printed and exit status 2."""
    try:
        return load_job(spec, overrides or [])
    except SpecError as exc:
        say(console, f"{spec}: {exc}", "red")
        raise typer.Exit(2) from None


def warn(job: TrainingJob) -> None:
    """Print what a valid job sets that will not do what it seems to, and an entrypoint that does not
    import here (only a warning: the job may be meant for workers where its package is installed)."""
    for setting in ignored_settings(job):
        say(console, f"warning: {setting}", "yellow")
    problem = entrypoint_problem(job)
    if problem:
        say(console, f"warning: {problem} (it must import where the job runs, not necessarily here)", "yellow")


def entrypoint_problem(job: TrainingJob) -> str | None:
    """Why the job's entrypoint cannot be imported in this process, or None (a built-in, or it imports)."""
    if not job.algorithm.entrypoint:
        return None
    from trainyard.algorithms import resolve_entrypoint  # torch: only when there is an entrypoint to check

    try:
        resolve_entrypoint(job.algorithm.entrypoint)
    except SpecError as exc:
        return exc.problems[0]
    return None
