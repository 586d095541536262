"""Stream mode's reading side against both S3 endpoints: footers, classes, row groups on demand (the groups'
row-group source's cache, file systems and read errors: test_stream_sources.py)."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests import s3_endpoints
from tests.conftest import blobs_table
from tests.unit.streams import put_parquet, schema_of, stream_one_object
from trainyard import kept_rowgroups, listing, staging, streaming
from trainyard.errors import DataError, StorageError
from trainyard.spec import Channel, parse_job
from trainyard.training.plan import TrainingPlan
from trainyard.training.sampling import StreamSampler, step_batch

s3_endpoint = s3_endpoints.s3_endpoint
fault_proxy = s3_endpoints.fault_proxy


def test_describe_reads_footers_and_classes_without_downloading(s3_endpoint, tmp_path):
    bucket = s3_endpoint.new_bucket()
    table = blobs_table(500, seed=2)
    put_parquet(s3_endpoint, bucket, "t/a.parquet", table.slice(0, 300), 100)
    put_parquet(s3_endpoint, bucket, "t/b.parquet", table.slice(300), 50)
    channel = Channel(s3_uri=f"s3://{bucket}/t/", label="label", mode="stream")
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    assert manifest.bytes_downloaded == 0 and all(o.path == "" for o in manifest.objects)
    staged = streaming.describe(manifest, channel, "classification", tmp_path / "data")
    assert [o["row_groups"] for o in staged.train_layout] == [[100, 100, 100], [50, 50, 50, 50]]
    assert staged.rows["train"] == 500 and staged.schema["classes"] == [0, 1] and staged.streamed
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, tmp_path / "cache")
    x, y = source.load(f"s3://{bucket}/t/b.parquet#rg2")
    want = table.slice(400, 50).to_pandas()
    np.testing.assert_allclose(x[:, 0], want["f0"].to_numpy(np.float32))
    np.testing.assert_array_equal(y, want["label"].to_numpy())
    etag = {o.uri: o.etag for o in manifest.objects}[f"s3://{bucket}/t/b.parquet"]
    assert list((tmp_path / "cache").iterdir()) == [
        kept_rowgroups.path(tmp_path / "cache", f"s3://{bucket}/t/b.parquet#rg2", etag, schema_of(staged))
    ]
    kept_x, kept_y = source.load(f"s3://{bucket}/t/b.parquet#rg2")  # kept for the next epoch: mapped, not read
    np.testing.assert_array_equal(kept_x, x)
    np.testing.assert_array_equal(kept_y, y)
    assert isinstance(kept_x, np.memmap) and not kept_x.flags.writeable and kept_x.dtype == np.float32


def test_row_groups_of_one_object_are_read_without_reading_its_footer_again(s3_endpoint, tmp_path, monkeypatch):
    bucket = s3_endpoint.new_bucket()
    table = blobs_table(500, seed=4)
    for key in ("a", "b", "c", "d", "e"):
        put_parquet(s3_endpoint, bucket, f"t/{key}.parquet", table.slice(0, 300), 100)
    channel = Channel(s3_uri=f"s3://{bucket}/t/", label="label", mode="stream")
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    staged = streaming.describe(manifest, channel, "classification", tmp_path / "data")
    opened = []
    real_open = streaming._open
    monkeypatch.setattr(streaming, "_open", lambda fs, path: opened.append(path) or real_open(fs, path))
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, tmp_path / "cache")
    for key in ("a", "b", "c", "d", "e"):
        for i in range(3):
            x, y = source.load(f"s3://{bucket}/t/{key}.parquet#rg{i}")
            np.testing.assert_array_equal(y, table["label"].to_numpy()[100 * i : 100 * (i + 1)])
    assert opened == [f"{bucket}/t/{key}.parquet" for key in ("a", "b", "c", "d", "e")]  # a footer each
    assert len(source._files) == source.OPEN_OBJECTS  # and only the last few objects kept open


@pytest.mark.parametrize("sample_rows, groups", [(50, [2]), (150, [1, 2, 3])])
def test_the_scaling_sample_is_row_groups_spread_through_the_channel_kept_for_the_first_epoch(
    s3_endpoint, tmp_path, monkeypatch, sample_rows, groups
):
    # (it was the first rows: a channel written in time order scaled its features by its earliest period's)
    monkeypatch.setattr(streaming, "SAMPLE_ROWS", sample_rows)
    bucket = s3_endpoint.new_bucket()
    table = blobs_table(500, seed=3)
    put_parquet(s3_endpoint, bucket, "t/a.parquet", table, 100)
    channel = Channel(s3_uri=f"s3://{bucket}/t/", label="label", mode="stream")
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    cache = tmp_path / "cache"
    staged = streaming.describe(manifest, channel, "classification", tmp_path / "data", cache)
    sample, rows = np.load(staged.train_data), np.concatenate([np.arange(100 * i, 100 * (i + 1)) for i in groups])
    rows = rows[np.linspace(0, len(rows) - 1, sample_rows).round().astype(int)]  # evenly through those read
    np.testing.assert_array_equal(sample["x"][:, 0], table["f0"].to_numpy()[rows].astype(np.float32))
    np.testing.assert_array_equal(sample["y"], table["label"].to_numpy()[rows])
    assert staged.train_layout[0]["sampled"] == groups
    # the whole row groups the sample came from are kept, exactly, for the first epoch
    etag = manifest.objects[0].etag
    units = [kept_rowgroups.path(cache, f"s3://{bucket}/t/a.parquet#rg{i}", etag, schema_of(staged)) for i in groups]
    assert sorted(cache.iterdir()) == sorted(units)
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, cache)
    for i in groups:
        x, y = source.load(f"s3://{bucket}/t/a.parquet#rg{i}")
        np.testing.assert_array_equal(x[:, 0], table["f0"].to_numpy()[100 * i : 100 * (i + 1)].astype(np.float32))
        np.testing.assert_array_equal(y, table["label"].to_numpy()[100 * i : 100 * (i + 1)])


def numbered_rows_job(s3_endpoint, tmp_path, objects: tuple[tuple[int, int], ...] = ((400, 50),)) -> tuple:
    """A streamed channel of 400 rows whose one feature is the row's number, in row groups of 50
    (or the ``(rows, row group size)`` objects given)."""
    bucket = s3_endpoint.new_bucket()
    total = sum(rows for rows, _ in objects)
    table = blobs_table(total, seed=3)
    table = table.append_column("row", pa.array(np.arange(total, dtype=np.float64)))
    start = 0
    for i, (rows, row_group) in enumerate(objects):
        put_parquet(s3_endpoint, bucket, f"t/{chr(97 + i)}.parquet", table.slice(start, rows), row_group)
        start += rows
    job = parse_job(
        {
            "name": "s",
            "algorithm": {"builtin": "mlp-classifier"},
            "hyperparameters": {"batch_size": 40},
            "inputs": {
                "train": {"s3_uri": f"s3://{bucket}/t/", "label": "label", "mode": "stream", "features": ["row"]}
            },
            "output": {"s3_uri": f"s3://{bucket}/o/"},
        }
    )
    manifest = staging.stage_channels(job.channels(), tmp_path)["train"]
    staged = streaming.describe(manifest, job.inputs.train, "classification", tmp_path / "data")
    plan = TrainingPlan(
        "j",
        job.model_dump(mode="json"),
        staged.train_data,
        None,
        staged.schema,
        2,
        "",
        staged.train_layout,
        streamed=True,
    )
    return job, plan


def test_stream_sampler_covers_each_share_once_per_epoch(s3_endpoint, tmp_path):
    job, plan = numbered_rows_job(s3_endpoint, tmp_path)
    sampler = StreamSampler(job, plan, tmp_path / "cache")
    assert sampler.steps_per_epoch(2) == 10  # 200 rows a slot, 20 a step
    seen = {0: [], 1: []}
    for slot in seen:
        for index in range(sampler.steps_per_epoch(2)):
            x, _ = sampler.slot_batch(0, index, 2, slot)
            seen[slot] += x[:, 0].int().tolist()
    assert sorted(seen[0] + seen[1]) == list(range(400))  # disjoint, and together everything
    again = StreamSampler(job, plan, tmp_path / "cache")  # another group: the same answer for the same step
    assert again.slot_batch(0, 3, 2, 0)[0].tolist() == sampler.slot_batch(0, 3, 2, 0)[0].tolist()
    # three groups in the quorum of an epoch dealt to two: the same rows, split three ways
    rows = [step_batch(sampler, 0, 3, 2, rank, 3) for rank in range(3)]
    assert {total for *_, total in rows} == {40}
    assert sorted(sum((x[:, 0].int().tolist() for x, *_ in rows), [])) == sorted(
        sampler.slot_batch(0, 3, 2, 0)[0][:, 0].int().tolist() + sampler.slot_batch(0, 3, 2, 1)[0][:, 0].int().tolist()
    )


def test_a_group_covering_many_slots_reads_each_row_group_once(s3_endpoint, tmp_path):
    # the epoch dealt to 8 groups, 7 of them gone: the one left covers every slot, a row group each; with room
    # for 4 shuffled row groups and 8 loads, every step dropped and read again those the other slots needed
    job, plan = numbered_rows_job(s3_endpoint, tmp_path, objects=((800, 25),))  # 32 row groups
    sampler = StreamSampler(job, plan, tmp_path / "cache")
    loads, real = [], sampler.source.load
    sampler.source.load = lambda unit: loads.append(unit) or real(unit)
    rows = []
    for index in range(sampler.steps_per_epoch(8)):
        x, _, _ = step_batch(sampler, 0, index, 8, 0, 1)
        rows += x[:, 0].int().tolist()
    assert sorted(rows) == list(range(800))
    assert len(loads) == len(set(loads)) == 32


def test_more_groups_than_row_groups_cut_the_rows_into_even_shares(s3_endpoint, tmp_path):
    job, plan = numbered_rows_job(s3_endpoint, tmp_path)  # 8 row groups of 50 rows
    sampler = StreamSampler(job, plan, tmp_path / "cache")
    slots = 12  # 400 rows: shares of 33 or 34, cut across row groups where a range needs
    seen = []
    for slot in range(slots):
        rows = []
        for index in range(sampler.steps_per_epoch(slots)):
            x, _ = sampler.slot_batch(0, index, slots, slot)
            rows += x[:, 0].int().tolist()
        assert len(rows) == 34 and len(set(rows)) in (33, 34), (slot, sorted(rows))  # a 33 walks one row again
        distinct = sorted(set(rows))
        assert distinct == list(range(distinct[0], distinct[-1] + 1))  # one range of the channel's rows
        seen.append(set(rows))
    assert sorted(r for rows in seen for r in rows) == list(range(400))  # disjoint, and together every row


def test_row_groups_too_unequal_to_deal_evenly_are_cut_into_even_shares(s3_endpoint, tmp_path):
    # one row group of 340 rows and three of 20: dealt whole, one slot would have 340 rows and the other 60
    job, plan = numbered_rows_job(s3_endpoint, tmp_path, objects=((340, 340), (60, 20)))
    sampler = StreamSampler(job, plan, tmp_path / "cache")
    seen = []
    for slot in range(2):
        rows = []
        for index in range(sampler.steps_per_epoch(2)):
            rows += sampler.slot_batch(0, index, 2, slot)[0][:, 0].int().tolist()
        assert len(rows) == len(set(rows)) == 200  # no row walked twice
        seen += rows
    assert sorted(seen) == list(range(400))


def test_an_object_deleted_since_staging_is_named_as_gone(s3_endpoint, tmp_path):
    job, plan = numbered_rows_job(s3_endpoint, tmp_path)
    bucket = job.inputs.train.s3_uri.split("/")[2]
    s3_endpoint.client().delete_object(Bucket=bucket, Key="t/a.parquet")
    sampler = StreamSampler(job, plan, tmp_path / "another-machine")  # nothing of it kept locally
    with pytest.raises(StorageError, match=rf"s3://{bucket}/t/a.parquet: no longer in S3") as info:
        for index in range(sampler.steps_per_epoch(1)):
            sampler.slot_batch(0, index, 1, 0)
    assert not info.value.transient


def test_a_failed_read_ahead_is_read_again_when_needed_and_a_second_failure_is_raised(s3_endpoint, tmp_path):
    job, plan = numbered_rows_job(s3_endpoint, tmp_path)
    sampler = StreamSampler(job, plan, tmp_path / "cache")
    load, failed = sampler.source.load, []
    broken = sampler._order(0, 2, 1)[0][-1][0]  # the last row group the second slot reads

    def flaky(unit_id):
        if unit_id not in failed or unit_id == broken:  # every row group fails once; that one every time
            failed.append(unit_id)
            raise StorageError(f"{unit_id}: connection reset", transient=True)
        return load(unit_id)

    sampler.source.load = flaky
    seen = []
    for index in range(10):  # the first slot's 4 row groups: each failed once (read ahead), then was read
        seen += sampler.slot_batch(0, index, 2, 0)[0][:, 0].int().tolist()
    assert len(set(seen)) == len(seen) == 200
    assert len(failed) == 4
    with pytest.raises(StorageError, match="connection reset"):
        for index in range(10):
            sampler.slot_batch(0, index, 2, 1)
    assert failed.count(broken) == 2  # tried once more, not again and again


def test_stream_needs_parquet(s3_endpoint, tmp_path):
    bucket = s3_endpoint.new_bucket()
    s3_endpoint.client().put_object(Bucket=bucket, Key="t/a.csv", Body=b"f0,label\n1,0\n")
    manifest = listing.list_channel("train", Channel(s3_uri=f"s3://{bucket}/t/", format="csv", label="label"))
    with pytest.raises(DataError, match="mode stream reads parquet"):
        streaming.describe(manifest, Channel(s3_uri=f"s3://{bucket}/t/", label="label"), "classification", tmp_path)


def test_objects_whose_keys_differ_only_by_slash_and_underscore_keep_their_own_rows(s3_endpoint, tmp_path):
    bucket = s3_endpoint.new_bucket()
    table = blobs_table(200, seed=4)
    put_parquet(s3_endpoint, bucket, "t/a_b.parquet", table.slice(0, 100), 50)
    put_parquet(s3_endpoint, bucket, "t/a/b.parquet", table.slice(100), 50)
    put_parquet(s3_endpoint, bucket, "t/" + "k" * 240 + ".parquet", table.slice(0, 50), 50)  # a long key
    channel = Channel(s3_uri=f"s3://{bucket}/t/", label="label", mode="stream")
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    staged = streaming.describe(manifest, channel, "classification", tmp_path / "data")
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, tmp_path / "cache")
    labels = table["label"].to_numpy()
    for _ in range(2):  # read from S3, then from the kept copies
        np.testing.assert_array_equal(source.load(f"s3://{bucket}/t/a_b.parquet#rg1")[1], labels[50:100])
        np.testing.assert_array_equal(source.load(f"s3://{bucket}/t/a/b.parquet#rg1")[1], labels[150:200])
        np.testing.assert_array_equal(source.load(f"s3://{bucket}/t/{'k' * 240}.parquet#rg0")[1], labels[:50])


def test_bytes_damaged_on_the_way_are_caught_by_the_pages_checksums_and_named(s3_endpoint, fault_proxy, tmp_path):
    # Uncompressed, so a flipped byte would decode as another value: only the pages' CRCs catch it.
    table = blobs_table(4000, seed=3)
    bucket = s3_endpoint.new_bucket()
    put_parquet(s3_endpoint, bucket, "t/a.parquet", table, 1000, compression="none", write_page_checksum=True)
    channel = Channel(s3_uri=f"s3://{bucket}/t/", label="label", mode="stream")
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    staged = streaming.describe(manifest, channel, "classification", tmp_path / "data")
    uri = f"s3://{bucket}/t/a.parquet"
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, tmp_path / "cache")
    source._parquet(uri)  # opened (footer read) first: the fault below hits a row-group read

    fault_proxy.corrupt(1, method="GET", key="t/a.parquet")
    with pytest.raises(DataError, match=rf"{uri}: row group 2 cannot be read \(.*(?i:checksum|crc)"):
        source.load(f"{uri}#rg2")
    assert fault_proxy.applied["corrupt"] == 1
    # Nothing damaged was kept: read again (as the sampler does once with a failed row group), the object's rows.
    x, y = source.load(f"{uri}#rg2")
    expected = table.slice(2000, 1000)
    features = np.column_stack([expected[f].to_numpy() for f in schema_of(staged).features]).astype(np.float32)
    np.testing.assert_array_equal(x, features)
    np.testing.assert_array_equal(y, expected["label"].to_numpy())


def test_an_object_changed_after_staging_is_named_not_read(s3_endpoint, tmp_path):
    table = blobs_table(200, seed=5)
    bucket, _, staged = stream_one_object(s3_endpoint, tmp_path, table, 50)
    put_parquet(s3_endpoint, bucket, "t/a.parquet", table.slice(0, 150), 50)  # rewritten, a row group fewer
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, tmp_path / "cache")
    with pytest.raises(DataError, match=rf"s3://{bucket}/t/a.parquet: changed since the channel was staged"):
        source.load(f"s3://{bucket}/t/a.parquet#rg3")


def test_an_object_replaced_by_one_of_the_same_size_and_row_groups_is_caught_by_its_etag(s3_endpoint, tmp_path):
    table = blobs_table(200, seed=5)

    def plain(t: pa.Table) -> bytes:  # uncompressed, no dictionary: other values of the same types, same size
        buf = io.BytesIO()
        pq.write_table(t, buf, row_group_size=50, compression="none", use_dictionary=False)
        return buf.getvalue()

    bucket, client = s3_endpoint.new_bucket(), s3_endpoint.client()
    client.put_object(Bucket=bucket, Key="t/a.parquet", Body=plain(table))
    channel = Channel(s3_uri=f"s3://{bucket}/t/", label="label", mode="stream")
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    staged = streaming.describe(manifest, channel, "classification", tmp_path / "data")
    other = plain(table.set_column(0, "f0", pa.array(table["f0"].to_numpy() + 1.0)))
    assert len(other) == len(plain(table)) and other != plain(table)
    client.put_object(Bucket=bucket, Key="t/a.parquet", Body=other)

    source = streaming.RowGroupSource(staged.train_layout, staged.schema, tmp_path / "cache")
    with pytest.raises(DataError, match=rf"s3://{bucket}/t/a.parquet: changed since the channel was staged \(now ETag"):
        source.load(f"s3://{bucket}/t/a.parquet#rg3")
    with pytest.raises(StorageError, match=rf"s3://{bucket}/t/a.parquet: changed since the channel was listed") as e:
        streaming.describe(manifest, channel, "classification", tmp_path / "data2")
    assert e.value.transient  # listed seconds ago: staging again finds the new version


def test_a_channel_sorted_by_label_finds_every_class_and_objects_without_a_column_are_named(
    s3_endpoint, tmp_path, monkeypatch
):
    monkeypatch.setattr(streaming, "SAMPLE_ROWS", 40)  # the sample holds one class only
    table = blobs_table(200, seed=6)
    table = table.take(pa.array(np.argsort(table["label"].to_numpy(), kind="stable")))
    bucket, channel, staged = stream_one_object(s3_endpoint, tmp_path, table, 50)
    assert staged.schema["classes"] == [0, 1]
    put_parquet(s3_endpoint, bucket, "t/b.parquet", table.drop_columns(["f2"]), 50)
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    with pytest.raises(DataError, match=rf"s3://{bucket}/t/b.parquet: no column 'f2' \(its columns are"):
        streaming.describe(manifest, channel, "classification", tmp_path / "data")
    put_parquet(s3_endpoint, bucket, "t/b.parquet", table.drop_columns(["label"]), 50)
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    lacks_label = rf"s3://{bucket}/t/b.parquet: no column 'label' \(its columns are \['f0', 'f1', 'f2', 'f3'\]\)"
    with pytest.raises(DataError, match=lacks_label):
        streaming.describe(manifest, channel, "classification", tmp_path / "data")
    # With the classes declared the label column is not read whole, and an object in the sample without
    # the label showed only as missing labels: the footers still name it.
    monkeypatch.setattr(streaming, "SAMPLE_ROWS", 10_000)
    declared = channel.model_copy(update={"classes": [0, 1]})
    with pytest.raises(DataError, match=lacks_label):
        streaming.describe(manifest, declared, "classification", tmp_path / "data")
    # a label no object has is the spec's mistake: the field is named, not an object
    misspelled = declared.model_copy(update={"label": "labl"})
    with pytest.raises(DataError, match=r"label column 'labl' not found.*set inputs.train.label"):
        streaming.describe(manifest, misspelled, "classification", tmp_path / "data")
    # an object naming a column twice is named, as file mode names it: which one is the feature would be a guess
    twice = pa.Table.from_arrays([table["f0"], table["f0"], table["label"]], names=["f0", "f0", "label"])
    put_parquet(s3_endpoint, bucket, "t/b.parquet", twice, 50)
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    with pytest.raises(DataError, match=rf"s3://{bucket}/t/b.parquet: column 'f0' appears 2 times in its header"):
        streaming.describe(manifest, declared, "classification", tmp_path / "data")


def test_a_missing_label_or_feature_in_a_streamed_channel_names_its_object(s3_endpoint, tmp_path):
    table = blobs_table(200, seed=8)
    bucket, channel, _ = stream_one_object(s3_endpoint, tmp_path, table, 50)
    holes = table.slice(0, 4).set_column(4, "label", pa.array([0, 1, None, 1]))
    put_parquet(s3_endpoint, bucket, "t/b.parquet", holes, 50)
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    with pytest.raises(DataError, match=rf"label 'label' has 1 missing.*s3://{bucket}/t/b.parquet \(its data row 3"):
        streaming.describe(manifest, channel, "classification", tmp_path / "data")
    # the classes declared, the labels are checked in the scaling sample (its row groups), as its features
    declared = channel.model_copy(update={"classes": [0, 1]})
    with pytest.raises(DataError, match=rf"label 'label' has 1 missing.*s3://{bucket}/t/b.parquet \(its data row 3"):
        streaming.describe(manifest, declared, "classification", tmp_path / "data")
    put_parquet(s3_endpoint, bucket, "t/a.parquet", table.append_column("flag", pa.array([True] * 200)), 50)
    flagged = table.slice(0, 4).append_column("flag", pa.array([True, None, True, True]))
    put_parquet(s3_endpoint, bucket, "t/b.parquet", flagged, 50)
    manifest = staging.stage_channels({"train": declared}, tmp_path)["train"]
    with pytest.raises(DataError, match=rf"feature 'flag' has 1 missing.*s3://{bucket}/t/b.parquet \(its data row 2"):
        streaming.describe(manifest, declared, "classification", tmp_path / "data")


def test_an_empty_pandas_shard_whose_columns_are_typed_null_is_streamed_as_file_mode_reads_it(s3_endpoint, tmp_path):
    import pandas as pd

    def shard(rows: int) -> bytes:
        rng = np.random.default_rng(rows)
        labels = pd.Series(np.where(np.arange(rows) % 2, "yes", "no"), dtype=object)
        frame = pd.DataFrame({"f1": rng.normal(size=rows), "label": labels})
        if rows == 0:  # pandas writes an empty object column as type null; a float one may be null too
            frame = frame.astype(object)
        out = io.BytesIO()
        frame.to_parquet(out, index=False)
        return out.getvalue()

    bucket = s3_endpoint.new_bucket()
    client = s3_endpoint.client()
    for i, rows in enumerate((0, 30, 20)):
        client.put_object(Bucket=bucket, Key=f"t/part-{i}.parquet", Body=shard(rows))
    assert pq.read_schema(io.BytesIO(shard(0))).field("label").type == pa.null()
    channel = Channel(s3_uri=f"s3://{bucket}/t/", format="parquet", label="label", mode="stream")
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    staged = streaming.describe(manifest, channel, "classification", tmp_path / "data")
    assert staged.schema["classes"] == ["no", "yes"] and staged.schema["features"] == ["f1"]
    assert staged.rows == {"train": 50}
