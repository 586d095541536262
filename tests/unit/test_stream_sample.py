"""Which row groups of a streamed channel staging reads as its scaling sample (``trainyard.stream_sample``)."""

from __future__ import annotations

from tests import s3_endpoints
from trainyard import stream_sample, table_checks

s3_endpoint = s3_endpoints.s3_endpoint


def test_the_sample_is_spread_through_the_channel_not_its_first_rows():
    picked = stream_sample.spread([100] * 10, 250)  # a channel written in time order: ten days of 100 rows
    assert picked == [2, 5, 7]  # the middle day's, then those a quarter and three quarters in
    # row groups of uneven size: enough rows, every part of the channel
    counts = [5000, 10, 10, 10, 10, 10, 10, 10, 10, 5000]
    picked = stream_sample.spread(counts, 2000)
    assert sum(counts[i] for i in picked) >= 2000 and picked[0] == 0 and picked[-1] == 9
    assert stream_sample.spread([30, 0, 20], 100) == [0, 2]  # no more rows than asked: every row group with rows
    assert stream_sample.spread([0, 0], 100) == []
    many = stream_sample.spread([7] * 10_000, 20_000)  # small row groups: as many as the rows need, twice at most
    assert 20_000 <= 7 * len(many) <= 2 * 20_000 and many[0] < 5 and many[-1] > 9_990
    # a few large row groups among many small ones: one large one, not as many as the small ones' size asks for
    assert stream_sample.spread([1_000_000] * 200 + [10] * 100_000, 20_000) == [100]


def test_the_sample_names_its_row_groups_and_a_bad_row_by_its_objects_own_data_row():
    layout = [
        {"id": "s3://b/day1.parquet", "start": 0, "end": 300, "row_groups": [100, 100, 100]},
        {"id": "s3://b/day2.parquet", "start": 300, "end": 600, "row_groups": [100, 100, 100]},
    ]
    sample_layout = stream_sample.pick(
        layout, 150
    )  # rows 300, then 150 and 450: day2's first, day1's and day2's middle
    assert [e.get("sampled") for e in layout] == [[1], [0, 1]]
    assert stream_sample.sampled_units(layout) == {f"s3://b/day{d}.parquet#rg{i}" for d, i in ((1, 1), (2, 0), (2, 1))}
    # the sample's table: day1's rows 101-200, then day2's rows 1-200 (counting from 1)
    assert table_checks.first_in(sample_layout, 0).endswith("day1.parquet (its data row 101, counting from 1)")
    assert table_checks.first_in(sample_layout, 99).endswith("day1.parquet (its data row 200, counting from 1)")
    assert table_checks.first_in(sample_layout, 100).endswith("day2.parquet (its data row 1, counting from 1)")
    assert table_checks.first_in(sample_layout, 250).endswith("day2.parquet (its data row 151, counting from 1)")
    assert table_checks.first_in(sample_layout, 300) == ""


def test_the_first_epoch_starts_with_the_row_groups_staging_read(s3_endpoint, tmp_path, monkeypatch):
    # they are in the groups' cache: the first batches need no read from S3 (it started with the rows below
    # SAMPLE_ROWS, the row groups the sample held when it was the channel's first rows)
    from tests.unit.test_streaming import numbered_rows_job
    from trainyard import streaming
    from trainyard.training.sampling import StreamSampler

    monkeypatch.setattr(streaming, "SAMPLE_ROWS", 100)
    job, plan = numbered_rows_job(s3_endpoint, tmp_path)  # 400 rows in row groups of 50: rows 200, 100 and 300's
    sampled = stream_sample.sampled_units(plan.train_layout)
    assert sorted(int(u.rpartition("#rg")[2]) for u in sampled) == [2, 4, 6]
    sampler = StreamSampler(job, plan, tmp_path / "cache")
    first = []
    for slot in range(2):  # two groups: each starts with the sampled row groups its share holds
        read = [u in sampled for u, *_ in sampler._order(0, 2, slot)[0]]
        assert read == sorted(read, reverse=True), read
        first += [u for u, *_ in sampler._order(0, 2, slot)[0][: sum(read)]]
    assert sorted(first) == sorted(sampled)
    later = [sampler._order(epoch, 1, 0)[0][0][0] for epoch in range(1, 9)]  # later epochs: shuffled as any
    assert set(later) - sampled, later
