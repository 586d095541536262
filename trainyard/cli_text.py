"""Messages on the command line: printed as they are, never read as rich markup.

A message quotes the user's own values (a job name, a column, a path), and ``[/b]`` or ``[c]`` in one
would be taken for markup: dropped from the text, or raising rich's MarkupError in place of the message.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


def say(console: Console, message: object, style: str | None = None) -> None:
    """Print ``message`` in ``style``, literally, one line however long (a problem stays on its line
    when the output is a file or a pipe, where rich would wrap it at 80 columns)."""
    console.print(Text(str(message), style=style or ""), soft_wrap=True)
