"""Progress bars (rich) for long work; ``TRAINYARD_PROGRESS=0`` turns them off."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

PROGRESS_ENV = "TRAINYARD_PROGRESS"


@contextmanager
def bar(description: str, total: float, unit: str = "items") -> Iterator[Callable[[float], None]]:
    """A progress bar; yields ``advance(n)``. ``unit="bytes"`` shows sizes."""
    if os.environ.get(PROGRESS_ENV, "1") == "0":
        yield lambda n: None
        return
    count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    with Progress(TextColumn("{task.description}"), BarColumn(), count, TimeElapsedColumn(), transient=False) as prog:
        task = prog.add_task(description, total=total)
        yield lambda n: prog.advance(task, n)
