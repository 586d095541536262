"""Calls a few at a time in threads (``parallel.map_in_threads``): staging's small objects and a manifest's HEADs."""

from __future__ import annotations

import threading

import pytest

from trainyard.errors import DataError
from trainyard.parallel import map_in_threads


def test_results_come_in_the_items_order():
    assert map_in_threads(lambda i: i * i, range(50), 3) == [i * i for i in range(50)]
    assert map_in_threads(lambda i: i, [], 3) == []


def test_a_failure_stops_the_calls_not_yet_started():
    # one object S3 refused, first of a channel of a thousand: raised once the calls queued ahead of it are done,
    # not after every object had been fetched
    started, lock = [], threading.Lock()

    def fetch(i: int) -> int:
        with lock:
            started.append(i)
        if i == 0:
            raise DataError("s3://b/0.csv: access denied")
        return i

    with pytest.raises(DataError, match="0.csv"):
        map_in_threads(fetch, range(1000), 4)
    assert 0 in started and len(started) <= 8  # at most twice the workers queued ahead of the one waited for
