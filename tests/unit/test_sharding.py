"""Sharding: disjoint, deterministic shares that cover every row, for 1..8 groups."""

from __future__ import annotations

import numpy as np
import pytest

from trainyard import sharding


def layout(objects: int, rows_per_object: int = 100, row_groups: int = 4) -> list[dict]:
    out, start = [], 0
    for i in range(objects):
        per_rg = [rows_per_object // row_groups] * row_groups
        per_rg[-1] += rows_per_object - sum(per_rg)
        out.append({"id": f"s3://b/k/part-{i}", "start": start, "end": start + rows_per_object, "row_groups": per_rg})
        start += rows_per_object
    return out


@pytest.mark.parametrize("objects", [1, 3, 17])
@pytest.mark.parametrize("groups", range(1, 9))
def test_shares_are_disjoint_and_cover_everything(objects, groups):
    lay = layout(objects)
    shares = [sharding.share_rows(lay, groups, g) for g in range(groups)]
    rows = np.concatenate(shares)
    assert len(rows) == len(set(rows.tolist())) == objects * 100  # disjoint, covering
    assert all(len(s) > 0 for s in shares)
    # deterministic: computed again (as another group would), the same
    assert all(np.array_equal(s, sharding.share_rows(lay, groups, g)) for g, s in enumerate(shares))


def test_granularity_follows_the_number_of_objects():
    assert all("#rg" not in u[0] for u in sharding.units_for(layout(16), 8))  # enough objects
    assert all("#rg" in u[0] for u in sharding.units_for(layout(3), 4))  # too few: row groups
    one_rg = [{"id": "a", "start": 0, "end": 10, "row_groups": None}]
    assert [u[0] for u in sharding.units_for(one_rg, 3)] == ["rows[0:3]", "rows[3:6]", "rows[6:10]"]


def test_shares_are_balanced_and_adapt_to_a_new_group_count():
    lay = layout(40, rows_per_object=50)
    for groups in (3, 4, 5):
        sizes = [len(sharding.share_rows(lay, groups, g)) for g in range(groups)]
        assert max(sizes) - min(sizes) <= 50  # within one unit
    # A fifth group joins: the 2,000 rows are shared out again among five, evenly (8 objects each), and
    # the newcomer's share is taken from every earlier group's.
    before = [set(sharding.share_rows(lay, 4, g).tolist()) for g in range(4)]
    after = [set(sharding.share_rows(lay, 5, g).tolist()) for g in range(5)]
    assert [len(s) for s in before] == [500] * 4 and [len(s) for s in after] == [400] * 5
    assert len(set().union(*after)) == 2000  # disjoint (5 x 400) and covering
    assert all(before[g] & after[4] for g in range(4))


def test_one_large_object_among_small_ones_is_cut_so_that_shares_stay_even():
    # 1,000 rows in one row group and three objects of 10: dealt by object, one group would have
    # 1,000 rows and the other 30, walked 33 times an epoch to keep up.
    lay, start = [], 0
    for i, rows in enumerate([1000, 10, 10, 10]):
        lay.append({"id": f"s3://b/k/{i}", "start": start, "end": start + rows, "row_groups": [rows]})
        start += rows
    shares = [sharding.share_rows(lay, 2, g) for g in range(2)]
    assert [len(s) for s in shares] == [515, 515]
    assert sorted(np.concatenate(shares).tolist()) == list(range(1030))


def test_balanced_allows_a_spread_of_five_percent_of_a_share():
    assert sharding.balanced([[("a", 0, 105)], [("b", 105, 205)]])  # 105 and 100: 5 of a mean 102.5
    assert not sharding.balanced([[("a", 0, 110)], [("b", 110, 210)]])
    assert sharding.balanced([[("a", 0, 2)], [("b", 2, 3)]])  # a row apart is as even as it gets
