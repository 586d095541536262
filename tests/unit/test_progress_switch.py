"""``TRAINYARD_PROGRESS`` turns the bars off with any of the switch words Trainyard's other switches take, and a value
that is neither is refused naming it (it turned the bars on)."""

from __future__ import annotations

import pytest

from trainyard import progress
from trainyard.errors import TrainyardError


@pytest.mark.parametrize(
    ("value", "shown"),
    [("", True), ("1", True), ("on", True), ("0", False), ("false", False), ("OFF", False), ("no", False)],
)
def test_the_bars_follow_the_switch(monkeypatch, capsys, value, shown):
    monkeypatch.setenv(progress.PROGRESS_ENV, value)
    with progress.bar("scoring rows", 3) as advance:
        advance(3)
    assert ("scoring rows" in capsys.readouterr().out) is shown


def test_a_value_that_is_neither_on_nor_off_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_ENV, "quiet")
    with (
        pytest.raises(TrainyardError, match="TRAINYARD_PROGRESS='quiet' is neither on nor off"),
        progress.bar("scoring rows", 3),
    ):
        pass
