"""Reading a job's log lines from the Prefect API in pages (``flows.job_runs.log_lines``)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from flows import job_runs

START = datetime(2026, 12, 7, tzinfo=UTC)


class Api:
    """``read_logs`` as Prefect's server answers it: the filter's flow runs and ``timestamp.after_`` (inclusive),
    sorted by timestamp alone. Lines of one instant come in another order at each request (the database gives no
    order among equal keys), and ``arriving`` lines land after the first request (a group's batch sent late)."""

    def __init__(self, lines: list, arriving: list | None = None):
        self.lines, self.arriving, self.requests = list(lines), list(arriving or []), 0

    def read_logs(self, log_filter, limit, offset, sort):
        if self.requests == 1:
            self.lines += self.arriving
        self.requests += 1
        after = log_filter.timestamp.after_ if log_filter.timestamp else None
        runs = set(log_filter.flow_run_id.any_)
        chosen = [x for x in self.lines if x.flow_run_id in runs and (after is None or x.timestamp >= after)]
        flip = -1 if self.requests % 2 else 1  # ties ordered one way, then the other
        chosen.sort(key=lambda x: (x.timestamp, flip * x.n))
        return chosen[offset : offset + limit]


def line(n: int, at: timedelta, run) -> SimpleNamespace:
    return SimpleNamespace(id=uuid.uuid4(), n=n, timestamp=START + at, flow_run_id=run, message=f"line {n}")


def test_every_line_comes_once_in_time_order_across_pages():
    # by offset, a line at a page's edge came twice or not at all: three lines an instant, pages of 200
    run, other = uuid.uuid4(), uuid.uuid4()
    lines = [line(n, timedelta(milliseconds=n // 3), run) for n in range(650)]
    lines += [line(1000 + n, timedelta(milliseconds=n), other) for n in range(50)]  # another run's: not asked
    late = [line(2000 + n, timedelta(milliseconds=10 + n), run) for n in range(5)]  # among the first page's
    api = Api(lines, arriving=late)
    read = job_runs.log_lines(api, [run])
    numbers = [x.n for x in read]
    assert len(numbers) == len(set(numbers)), "a line came twice"
    # lines landing behind the page read (before its start) are for the next read; none shifts what was there
    assert set(range(650)) <= set(numbers) <= set(range(650)) | {x.n for x in late}, "lines missing, or another run's"
    assert [x.timestamp for x in read] == sorted(x.timestamp for x in read)
    assert api.requests == 4  # 650 lines: pages of 200, each but the first starting with its tie of up to 3 read


def test_a_page_of_one_instant_is_stepped_through():
    run = uuid.uuid4()
    # a whole page at one instant: the next starts there again, so it goes on by offset
    lines = [line(n, timedelta(0), run) for n in range(450)] + [
        line(450 + n, timedelta(seconds=1), run) for n in range(3)
    ]
    stable = SimpleNamespace(requests=0)  # (ties in one order here: stepping through an instant needs that)

    def read_logs(log_filter, limit, offset, sort):
        stable.requests += 1
        after = log_filter.timestamp.after_
        chosen = sorted((x for x in lines if after is None or x.timestamp >= after), key=lambda x: (x.timestamp, x.n))
        return chosen[offset : offset + limit]

    read = job_runs.log_lines(SimpleNamespace(read_logs=read_logs), [run])
    assert [x.n for x in read] == list(range(453)) and stable.requests == 4
