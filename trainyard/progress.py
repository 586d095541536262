"""Progress bars (rich) for long work; ``TRAINYARD_PROGRESS=0`` (or ``false``, ``no``, ``off``) turns them off.
And what a process does when the reader of its output goes away (``outlive_closed_output``)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from trainyard import env_settings

PROGRESS_ENV = "TRAINYARD_PROGRESS"


def _shown() -> bool:
    return env_settings.flag(PROGRESS_ENV, default=True)


@contextmanager
def bar(description: str, total: float) -> Iterator[Callable[[float], None]]:
    """A progress bar counting items; yields ``advance(n)``."""
    if not _shown():
        yield lambda n: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as prog:
        task = prog.add_task(description, total=total)
        yield lambda n: prog.advance(task, n)


@contextmanager
def transfer(description: str, total_bytes: int, total_objects: int) -> Iterator[tuple[Callable, Callable]]:
    """A bar of bytes moved with the objects done beside it; yields ``(advance_bytes(n), objects_done(n))``,
    both callable from any thread."""
    if not _shown():
        yield (lambda n: None), (lambda n=1: None)
        return
    objects = TextColumn("{task.fields[done]}/{task.fields[objects]} objects")
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), objects, TimeElapsedColumn())
    with Progress(*columns, transient=False) as prog:
        task = prog.add_task(description, total=total_bytes, done=0, objects=total_objects)
        lock, done = threading.Lock(), [0]

        def objects_done(n: int = 1) -> None:
            with lock:  # objects finish on several threads
                done[0] += n
                prog.update(task, done=done[0])

        yield (lambda n: prog.advance(task, n)), objects_done


def outlive_closed_output() -> None:
    """Let this process go on when the pipe its output goes to closes (the worker that streamed a flow run's
    output shut down), writing its output nowhere from then on.

    rich's answer to a closed pipe is to exit the process (``Console.on_broken_pipe``: SystemExit(1), raised from
    whatever logged a line, Prefect's console handler included): a job mid-training ended with no summary and
    its groups orphaned. rich leaves that to be changed this way. The run's logs still reach the Prefect API."""
    Console.on_broken_pipe = _output_gone  # type: ignore[method-assign,assignment]


def _output_gone(console: Console) -> None:
    console.quiet = True
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):  # so that later writes by anything else (print, torch) succeed too
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stream without a descriptor
            os.dup2(devnull, stream.fileno())
    os.close(devnull)
