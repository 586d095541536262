"""Which row groups of a streamed channel staging reads (its scaling sample, ``streaming.describe``): spread
evenly through the channel's rows, not its first ones. The built-in models scale their features by the sample's
moments, and the first epoch starts with its row groups (already in the groups' cache); a channel written in time
order (a log partitioned by day, a table appended to) scaled its features by its earliest period's."""

from __future__ import annotations

from itertools import accumulate

import numpy as np


def spread(counts: list[int], rows: int) -> list[int]:
    """Indices into ``counts`` (each row group's rows, in the channel's order) of row groups spread evenly through
    its rows, whose rows add up to at least ``rows``; every row group with rows where the channel has no more.
    Picked level by level: the row group holding the middle row, then those holding the rows at a quarter and
    three quarters, then the eighths..., each level whole (so the picks stay spread), until they hold enough. By
    rows, not row groups: a channel of a few large row groups among many small ones reads a large one or two."""
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    if total <= rows:
        return [i for i, count in enumerate(counts) if count]
    picked: set[int] = set()
    held, level = 0, 0
    while held < rows:  # (ends: once 2**level passes the rows, every row group with rows has been picked)
        positions = (2 * np.arange(1 << level) + 1) * total / (2 << level)
        for i in set(np.searchsorted(ends, positions, side="right").tolist()) - picked:
            picked.add(i)
            held += counts[i]
        level += 1
    return sorted(picked)


def pick(layout: list[dict], rows: int) -> list[dict]:
    """Mark the row groups of a streamed channel's ``layout`` (its objects' entries, ``row_groups`` their rows) that
    its sample takes, about ``rows`` rows spread through it (``spread``), in each entry's ``sampled`` (their indices);
    return the sample's own layout: an entry per row group, in the channel's order, where its rows lie in the
    sample's table. Each ``start`` is set so that ``table_checks.first_in`` names a row as its object's own data
    row: it may lie before the entry's rows, which the entries before it cover (they are read in order)."""
    flat = [  # (entry, row group, its rows, the rows before it in its object)
        (entry, i, count, before)
        for entry in layout
        for i, (count, before) in enumerate(
            zip(entry["row_groups"], accumulate(entry["row_groups"], initial=0), strict=False)
        )
    ]
    sample_layout, at = [], 0
    for j in spread([count for _, _, count, _ in flat], rows):
        entry, i, count, before = flat[j]
        entry.setdefault("sampled", []).append(i)
        sample_layout.append({"id": entry["id"], "start": at - before, "end": at + count})
        at += count
    return sample_layout


def sampled_units(layout: list[dict]) -> set[str]:
    """The row groups (``"<object id>#rg<i>"``, the sampler's unit ids) a streamed channel's layout says staging
    read (``sampled``); none for a layout staged before it said so."""
    return {f"{entry['id']}#rg{i}" for entry in layout for i in entry.get("sampled", ())}
