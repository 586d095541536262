"""Calls run a few at a time in threads, their results in order, stopping soon after the first failure."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def in_threads(fn: Callable[[T], R], items: Iterable[T], workers: int) -> Iterator[R]:
    """``fn(item)`` for each of ``items``, ``workers`` calls at a time in threads, yielded in the items' order.

    At most twice ``workers`` calls are queued ahead of the result being waited for, and once one fails (or
    the caller is interrupted, or stops reading) those not started are cancelled before the error is raised.
    The executor's own ``map`` queues every item at once and, on leaving its ``with`` block, runs each queued
    call to the end first: one object S3 refused, early in a channel of 100,000, was reported only after the
    rest had downloaded (and Ctrl-C seemed to hang as long)."""
    window: deque[Future[R]] = deque()
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        try:
            for item in items:
                window.append(pool.submit(fn, item))
                if len(window) >= 2 * max(1, workers):
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        except BaseException:
            for pending in window:
                pending.cancel()  # (those already running finish: leaving the block waits for them)
            raise


def map_in_threads(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """``in_threads``' results as a list."""
    return list(in_threads(fn, items, workers))
