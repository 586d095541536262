"""A benchmark's target, met or not, and its line in the report (``staging.py``, ``recovery.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Target:
    name: str
    met: bool
    detail: str

    def line(self) -> str:
        """``target met: <name>: <detail>`` (or ``NOT MET``), in rich markup."""
        return f"target {'[green]met[/]' if self.met else '[red]NOT MET[/]'}: {self.name}: {self.detail}"
