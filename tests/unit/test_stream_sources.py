"""Stream mode's row-group source, as the replica groups read: the row groups it keeps in the machine's cache
(under the cache's one cap, shared by later jobs, left unkept on a full disk), the S3 file systems it reads with
(the bucket's region, refreshed credentials) and how it tells S3's failures from bad objects."""

from __future__ import annotations

import errno
import os
import time
import uuid

import numpy as np
import pytest

from tests import s3_endpoints
from tests.conftest import blobs_table
from tests.unit.streams import stream_one_object
from trainyard import cache as shared_cache
from trainyard import kept_rowgroups, streaming
from trainyard.errors import DataError, StorageError

s3_endpoint = s3_endpoints.s3_endpoint


def test_a_kept_row_group_reads_back_as_it_was_written(tmp_path):
    cases = [
        (np.arange(12, dtype=np.float32).reshape(4, 3), np.arange(4)),
        (np.zeros((0, 3), np.float32), np.zeros(0, np.int64)),  # an empty row group: nothing to map
        (np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)), np.array([0.5, 1.5], np.float32)),
    ]
    for i, (x, y) in enumerate(cases):  # (a name is one row group's arrays: a second save keeps the first's)
        path = tmp_path / f"unit{i}{kept_rowgroups.UNIT_SUFFIX}"
        kept_rowgroups.save(path, x, y)
        got_x, got_y = kept_rowgroups.load(path)
        np.testing.assert_array_equal(got_x, x)
        np.testing.assert_array_equal(got_y, y)
        assert got_x.shape == x.shape and got_y.dtype == y.dtype


def test_kept_row_groups_stay_under_the_cache_cap_and_an_evicted_one_is_read_again(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))  # a cache of its own, to count
    table = blobs_table(600, seed=7)
    bucket, _, staged = stream_one_object(s3_endpoint, tmp_path, table, 100)
    cache = shared_cache.rowgroups_dir()
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, cache)
    source.EVICT_EVERY_BYTES = 0
    source.load(f"s3://{bucket}/t/a.parquet#rg0")
    unit_bytes = next(cache.iterdir()).stat().st_size
    monkeypatch.setenv("TRAINYARD_CACHE_MAX_BYTES", str(2 * unit_bytes))
    reads = []
    real_read = streaming._read_row_group
    monkeypatch.setattr(streaming, "_read_row_group", lambda pf, i, *a: reads.append(i) or real_read(pf, i, *a))
    labels = table["label"].to_numpy()
    for i in range(1, 6):
        source.load(f"s3://{bucket}/t/a.parquet#rg{i}")
        assert sum(p.stat().st_size for p in cache.iterdir()) <= 2 * unit_bytes
    assert reads == [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(source.load(f"s3://{bucket}/t/a.parquet#rg5")[1], labels[500:])  # kept
    np.testing.assert_array_equal(source.load(f"s3://{bucket}/t/a.parquet#rg0")[1], labels[:100])  # evicted
    assert reads == [1, 2, 3, 4, 5, 0]


@pytest.mark.parametrize("damage", ["cut short", "empty"])
def test_a_damaged_kept_row_group_is_read_from_s3_again(s3_endpoint, tmp_path, monkeypatch, damage, caplog):
    # what a machine that lost power after the rename can leave: every later load failed on it until evicted
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    table = blobs_table(200, seed=9)
    bucket, _, staged = stream_one_object(s3_endpoint, tmp_path, table, 100)
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, shared_cache.rowgroups_dir())
    unit = f"s3://{bucket}/t/a.parquet#rg1"
    x, y = source.load(unit)
    (kept,) = [
        p for p in shared_cache.rowgroups_dir().iterdir() if p.name.endswith("-rg1" + kept_rowgroups.UNIT_SUFFIX)
    ]
    os.truncate(kept, kept.stat().st_size // 2 if damage == "cut short" else 0)
    again_x, again_y = source.load(unit)
    np.testing.assert_array_equal(again_x, x)
    np.testing.assert_array_equal(again_y, table["label"].to_numpy()[100:])
    assert "is damaged" in caplog.text and kept.stat().st_size > 0  # kept again, whole


def test_read_errors_say_whether_s3_failed_or_the_object_is_bad():
    network = OSError(
        "When reading information for key 'k' in bucket 'b': AWS Error NETWORK_CONNECTION during GetObject"
    )
    denied = OSError("When reading information for key 'k' in bucket 'b': AWS Error ACCESS_DENIED during HeadObject")
    corrupt = OSError("Couldn't deserialize thrift: TProtocolException: Invalid data")
    made = [streaming.read_error(e, "s3://b/k", "row group 3 cannot be read") for e in (network, denied, corrupt)]
    assert isinstance(made[0], StorageError) and made[0].transient  # tried again by the sampler and the retries
    assert isinstance(made[1], StorageError) and not made[1].transient
    assert isinstance(made[2], DataError) and not isinstance(made[2], StorageError)
    assert all(str(m).startswith("s3://b/k: row group 3 cannot be read") for m in made)


def test_a_streamed_groups_file_system_follows_refreshed_credentials(s3_endpoint, tmp_path, monkeypatch):
    from trainyard import s3

    monkeypatch.setattr(streaming, "SAMPLE_ROWS", 50)  # staging keeps only the first row group
    _, _, staged = stream_one_object(s3_endpoint, tmp_path, blobs_table(200, seed=1), 50)
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, tmp_path / "cache")
    units = [u for u, *_ in streaming.units(staged.train_layout)]
    source.load(units[1])
    first = dict(source._fs)
    source.load(units[2])
    assert first and all(source._fs[b] is fs for b, fs in first.items())  # the same credentials: the same one
    real = s3.credentials()
    refreshed = type(real)(real.access_key, real.secret_key, "a-refreshed-session-token")
    monkeypatch.setattr(s3, "credentials", lambda: refreshed)
    x, _ = source.load(units[3])  # (neither endpoint checks the session token itself)
    assert all(source._fs[b] is not fs for b, fs in first.items()) and len(x) == 50


def test_on_aws_with_no_region_configured_pyarrow_is_given_the_buckets_region(s3_endpoint, monkeypatch):
    # boto3 follows S3's redirect to a bucket in another region; pyarrow does not (a 301): file mode would
    # read a bucket that stream mode could not. Taken as AWS, moto answers HeadBucket with the region as S3 does.
    if s3_endpoint.name != "moto":
        pytest.skip("a bucket in another region, asked for its region as on AWS: moto's HeadBucket answers as S3's")
    from trainyard import s3

    here, europe = s3_endpoint.new_bucket("us"), f"eu-{uuid.uuid4().hex[:12]}"
    s3_endpoint.client().create_bucket(Bucket=europe, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    asked = []
    bucket_region = s3.bucket_region

    def counted(client, bucket: str) -> str | None:
        asked.append(bucket)
        return bucket_region(client, bucket)

    monkeypatch.setattr(s3, "bucket_region", counted)
    monkeypatch.setattr(streaming, "_bucket_regions", {})
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    # not AWS (MinIO, R2, moto): the region as configured, here none (us-east-1), and nothing asked
    assert streaming.arrow_filesystem(europe).region == "us-east-1" and asked == []
    monkeypatch.setattr(streaming, "_on_aws", lambda hostname: True)
    assert streaming.arrow_filesystem(europe).region == "eu-west-1"
    assert streaming.arrow_filesystem(europe).region == "eu-west-1"  # asked once per bucket
    assert streaming.arrow_filesystem(here).region == "us-east-1"
    assert asked == [europe, here]
    # a region configured: taken as it is, with no request (as boto3 does, until S3 redirects it)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    monkeypatch.setattr(streaming, "_bucket_regions", {})
    assert streaming.arrow_filesystem(europe).region == "ap-south-1" and asked == [europe, here]


def test_staging_and_the_groups_reads_make_file_systems_for_the_objects_bucket(s3_endpoint, tmp_path, monkeypatch):
    # (the bucket whose region arrow_filesystem asks for on AWS)
    made = []
    arrow_filesystem = streaming.arrow_filesystem

    def recorded(bucket: str | None = None):
        made.append(bucket)
        return arrow_filesystem(bucket)

    monkeypatch.setattr(streaming, "arrow_filesystem", recorded)
    monkeypatch.setattr(streaming, "SAMPLE_ROWS", 50)  # staging reads only the first row group
    bucket, _, staged = stream_one_object(s3_endpoint, tmp_path, blobs_table(200, seed=1), 50)
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, tmp_path / "cache")
    for unit, *_ in streaming.units(staged.train_layout)[1:]:
        source.load(unit)
    assert made == [bucket, bucket]  # one for describe, one for the group's reads


def test_row_groups_are_shared_by_later_jobs_that_read_them_alike_under_the_caches_one_cap(
    s3_endpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    table = blobs_table(300, seed=8)
    bucket, _, staged = stream_one_object(s3_endpoint, tmp_path, table, 100)
    rows = shared_cache.rowgroups_dir()
    reads = []
    real_read = streaming._read_row_group
    monkeypatch.setattr(streaming, "_read_row_group", lambda pf, i, *a: reads.append(i) or real_read(pf, i, *a))
    units = [f"s3://{bucket}/t/a.parquet#rg{i}" for i in range(3)]
    for _ in range(2):  # a job, then a later one streaming the same objects with the same schema
        source = streaming.RowGroupSource(staged.train_layout, staged.schema, rows)
        for unit in units:
            source.load(unit)
        assert reads == [0, 1, 2]  # the later job read nothing from S3
    fewer = streaming.RowGroupSource(staged.train_layout, {**staged.schema, "features": ["f0", "f1"]}, rows)
    x, _ = fewer.load(units[0])  # other features: other arrays, read again
    assert x.shape == (100, 2) and reads == [0, 1, 2, 0]
    kept = list(rows.glob(f"*{kept_rowgroups.UNIT_SUFFIX}"))
    assert len(kept) == 4
    # one cap for downloaded objects and kept row groups, least recently used first, whichever the kind
    objects = {}
    for name, age in (("older", 1000), ("newer", -1000)):  # seconds before the row groups were last used
        path = shared_cache.objects_dir() / "ab" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1000)
        os.utime(path, (time.time() - age, time.time() - age))
        objects[name] = path
    row_bytes = sum(p.stat().st_size for p in kept)
    shared_cache.evict(limit=row_bytes + 1000)
    assert not objects["older"].exists() and objects["newer"].exists() and all(p.exists() for p in kept)
    shared_cache.evict(limit=1000)
    assert objects["newer"].exists() and not any(p.exists() for p in kept)


def test_a_full_disk_leaves_a_row_group_unkept_and_training_goes_on(s3_endpoint, tmp_path, monkeypatch):
    table = blobs_table(200, seed=9)
    bucket, _, staged = stream_one_object(s3_endpoint, tmp_path, table, 100)
    kept = tmp_path / "cache"
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, kept)

    writes = []

    def no_space(*args, **kwargs):
        writes.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np.lib.format, "write_array", no_space)
    x, y = source.load(f"s3://{bucket}/t/a.parquet#rg1")
    np.testing.assert_array_equal(y, table["label"].to_numpy()[100:])
    assert x.shape == (100, 4) and not list(kept.iterdir())  # not kept, and no partial file left
    source.load(f"s3://{bucket}/t/a.parquet#rg0")
    assert len(writes) == 1  # a full disk is not tried again for every row group


def test_a_row_group_being_kept_survives_an_eviction_while_it_is_written(tmp_path, monkeypatch):
    # another job's eviction (or this group's own, every 256 MB read) between the write and the link: the part
    # file is a live writer's, not one a killed job left, and must not be taken for that
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    real_link = os.link

    def evict_then_link(src, dst):  # (the part is linked into place under the kept name)
        shared_cache.evict(limit=10**12)
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", evict_then_link)
    path = shared_cache.rowgroups_dir() / f"unit{kept_rowgroups.UNIT_SUFFIX}"
    assert kept_rowgroups.save(path, np.ones((4, 3), np.float32), np.arange(4))
    assert kept_rowgroups.load(path)[1].tolist() == [0, 1, 2, 3]
    assert not list(path.parent.glob(f"*{shared_cache.PART_SUFFIX}*"))  # nor a part or claim file left


def test_an_object_deleted_between_listing_and_its_footer_is_transient(s3_endpoint, tmp_path):
    # staging's retry lists the channel again, without it (staging's own rule); it was a permanent error
    from tests.unit.streams import put_parquet
    from trainyard import listing
    from trainyard.spec import Channel

    bucket = s3_endpoint.new_bucket()
    put_parquet(s3_endpoint, bucket, "t/a.parquet", blobs_table(100, seed=5), 50)
    channel = Channel(s3_uri=f"s3://{bucket}/t/", label="label", mode="stream")
    manifest = listing.list_channel("train", channel)
    s3_endpoint.client().delete_object(Bucket=bucket, Key="t/a.parquet")
    with pytest.raises(StorageError, match=rf"s3://{bucket}/t/a.parquet: deleted from S3 while it was being staged"):
        streaming.describe(manifest, channel, "classification", tmp_path / "data")
    again = pytest.raises(StorageError, streaming.describe, manifest, channel, "classification", tmp_path / "data")
    assert again.value.transient
