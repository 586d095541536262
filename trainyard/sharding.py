"""Disjoint, deterministic shares of a channel for ``distribution: sharded``.

A channel's rows are grouped into units: its objects, or, when there are too few objects or they
are too unequal in size to balance the groups, its parquet row groups, or else equal row ranges
(see ``balanced``). Units go to groups largest
first, each to the least loaded group (ties by unit id), so every group computes the same
assignment on its own, shares never overlap, together they cover every row, and the assignment is
recomputed when the number of groups changes.
"""

from __future__ import annotations

import numpy as np

# Below this many objects per group, shard by row group instead: a share is then within a row
# group's size of every other.
MIN_OBJECTS_PER_GROUP = 2
# How far apart shares may be, as a fraction of the mean share. Every group takes as many steps an
# epoch as the largest share needs, walking a smaller share round again to fill them; so this is also
# the most that some rows are seen more often than others within an epoch.
BALANCE_TOLERANCE = 0.05


def units_for(layout: list[dict], num_groups: int) -> list[tuple[str, int, int]]:
    """The ``(id, start_row, end_row)`` units to shard over, at the coarsest granularity that balances.

    ``layout`` is one dict per object: ``{"id", "start", "end", "row_groups": [rows, ...]}``.
    """
    objects = [(o["id"], o["start"], o["end"]) for o in layout if o["end"] > o["start"]]
    if len(objects) >= MIN_OBJECTS_PER_GROUP * num_groups and balanced(assign(objects, num_groups)):
        return objects
    row_groups = row_group_units(layout)
    if len(row_groups) >= num_groups and balanced(assign(row_groups, num_groups)):
        return row_groups
    total = layout[-1]["end"] if layout else 0
    edges = np.linspace(0, total, num_groups + 1).astype(int)
    return [(f"rows[{a}:{b}]", int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def balanced(shares: list[list[tuple[str, int, int]]]) -> bool:
    """Whether the shares' sizes are within ``BALANCE_TOLERANCE`` of the mean share (or a row) of each other."""
    loads = [sum(end - start for _, start, end in share) for share in shares]
    return max(loads) - min(loads) <= max(1.0, BALANCE_TOLERANCE * sum(loads) / len(loads))


def row_group_units(layout: list[dict]) -> list[tuple[str, int, int]]:
    """Every parquet row group as a unit: ``("<object id>#rg<i>", start_row, end_row)``."""
    units = []
    for o in layout:
        start = o["start"]
        for i, rows in enumerate(o.get("row_groups") or [o["end"] - o["start"]]):
            if rows:
                units.append((f"{o['id']}#rg{i}", start, start + rows))
            start += rows
    return units


def assign(units: list[tuple[str, int, int]], num_groups: int) -> list[list[tuple[str, int, int]]]:
    """Each group's units: largest first to the least loaded group; deterministic and disjoint."""
    shares: list[list[tuple[str, int, int]]] = [[] for _ in range(num_groups)]
    load = [0] * num_groups
    for unit in sorted(units, key=lambda u: (-(u[2] - u[1]), u[0])):
        group = min(range(num_groups), key=lambda g: (load[g], g))
        shares[group].append(unit)
        load[group] += unit[2] - unit[1]
    return shares


def share_rows(layout: list[dict], num_groups: int, group: int) -> np.ndarray:
    """The row indices of group ``group``'s share, in unit order."""
    share = assign(units_for(layout, num_groups), num_groups)[group]
    if not share:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.arange(start, end, dtype=np.int64) for _, start, end in sorted(share)])
