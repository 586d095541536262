"""Messages on the command line: printed as they are, never read as rich markup.

A message quotes the user's own values (a job name, a column, a path), and ``[/b]`` or ``[c]`` in one
would be taken for markup: dropped from the text, or raising rich's MarkupError in place of the message.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.text import Text


def say(console: Console, message: object, style: str | None = None) -> None:
    """Print ``message`` in ``style``, literally, one line however long (a problem stays on its line
    when the output is a file or a pipe, where rich would wrap it at 80 columns)."""
    console.print(Text(str(message), style=style or ""), soft_wrap=True)


def plain(*values: object) -> list[Text]:
    """Table cells (or a title) shown as they are: a tag's value, a reason given with ``--reason``, an error
    quoted in a job's reason. Given as ``str``, rich reads them as markup (``[/docs]`` raised MarkupError,
    ``[leak]`` vanished from the cell)."""
    return [Text(str(value)) for value in values]


# Wider than any table prints: a table is drawn at its own width, never padded out to this.
_UNWRAPPED = 10_000


def out() -> Console:
    """The console for a command's results (tables) on stdout: as wide as the terminal; in a file or a
    pipe as wide as each table needs, where rich's default of 80 columns would wrap run ids and URIs
    (``COLUMNS`` set still sets the width)."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=_UNWRAPPED)
