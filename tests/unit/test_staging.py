"""Staging against a real S3 endpoint over HTTP (moto's server mode on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import blobs_table, put_table
from trainyard import s3, staging
from trainyard.errors import DataError, StorageError
from trainyard.spec import Channel


def test_stages_every_object_and_records_a_manifest(bucket, tmp_path):
    for i in range(5):
        put_table(bucket, f"ch/part-{i}.parquet", blobs_table(20, seed=i))
    s3.client().put_object(Bucket=bucket, Key="ch/_SUCCESS", Body=b"")
    manifests = staging.stage_channels({"train": Channel(s3_uri=f"s3://{bucket}/ch/", label="label")}, tmp_path)
    m = manifests["train"]
    assert [o.key for o in m.objects] == [f"ch/part-{i}.parquet" for i in range(5)]
    assert m.bytes == m.bytes_downloaded == sum(o.size for o in m.objects) > 0
    assert m.digest.startswith("sha256:")
    assert (tmp_path / "train.json").exists()
    for obj in m.objects:
        assert Path(obj.path).read_bytes() == s3.client().get_object(Bucket=bucket, Key=obj.key)["Body"].read()


def test_second_staging_transfers_nothing_and_a_changed_object_is_fetched_again(bucket, tmp_path):
    put_table(bucket, "ch/a.parquet", blobs_table(20, seed=1))
    put_table(bucket, "ch/b.parquet", blobs_table(20, seed=2))
    channel = {"train": Channel(s3_uri=f"s3://{bucket}/ch/")}
    first = staging.stage_channels(channel, tmp_path)["train"]
    again = staging.stage_channels(channel, tmp_path)["train"]
    assert again.bytes_downloaded == 0
    assert again.digest == first.digest
    put_table(bucket, "ch/b.parquet", blobs_table(21, seed=3))
    changed = staging.stage_channels(channel, tmp_path)["train"]
    b = next(o for o in changed.objects if o.key == "ch/b.parquet")
    assert changed.bytes_downloaded == b.size
    assert changed.digest != first.digest


def test_single_object_uri(bucket, tmp_path):
    put_table(bucket, "one/file.parquet", blobs_table(10))
    m = staging.stage_channels({"train": Channel(s3_uri=f"s3://{bucket}/one/file.parquet")}, tmp_path)["train"]
    assert [o.key for o in m.objects] == ["one/file.parquet"]


def test_missing_bucket_is_named(s3_server, tmp_path):
    with pytest.raises(StorageError, match="s3://no-such-bucket-here/x/: bucket does not exist"):
        staging.stage_channels({"train": Channel(s3_uri="s3://no-such-bucket-here/x/")}, tmp_path)


def test_empty_channel_is_named(bucket, tmp_path):
    with pytest.raises(DataError, match=f"no objects under s3://{bucket}/empty/"):
        staging.stage_channels({"train": Channel(s3_uri=f"s3://{bucket}/empty/")}, tmp_path)


def test_unsafe_keys_are_refused(bucket, tmp_path):
    s3.client().put_object(Bucket=bucket, Key="ch//escape.parquet", Body=b"x")
    with pytest.raises(DataError, match="unsafe key"):
        staging.stage_channels({"train": Channel(s3_uri=f"s3://{bucket}/ch/")}, tmp_path)
    for rel in ("../etc/passwd", "a/./b", "a\x00b", "/abs", "a\\..\\b", ""):
        with pytest.raises(DataError, match="unsafe key"):
            staging.check_relative_key(rel, f"s3://b/ch/{rel}")
    staging.check_relative_key("sub/part-0.parquet", "s3://b/ch/sub/part-0.parquet")


def test_corrupt_download_is_detected(bucket, tmp_path, monkeypatch):
    """Bytes that differ from S3's checksum are re-fetched once, then the object is named."""
    put_table(bucket, "ch/a.parquet", blobs_table(10))
    real_client = s3.client
    calls = []

    def corrupting_client():
        client = real_client()
        download = client.download_file

        def corrupting_download(bucket_name, key, filename, **kwargs):
            calls.append(key)
            download(bucket_name, key, filename, **kwargs)
            with open(filename, "r+b") as f:  # flip one byte, as a faulty network path would
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 0xFF]))

        client.download_file = corrupting_download
        return client

    monkeypatch.setattr(s3, "client", corrupting_client)
    with pytest.raises(DataError, match=rf"s3://{bucket}/ch/a.parquet: downloaded bytes do not match.*MD5"):
        staging.stage_channels({"train": Channel(s3_uri=f"s3://{bucket}/ch/")}, tmp_path)
    assert calls == ["ch/a.parquet", "ch/a.parquet"]
    assert not list((tmp_path.parent).glob("**/*.part"))


def test_denied_request_is_clear(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(StorageError) as info:
        staging.stage_channels({"train": Channel(s3_uri="s3://some-bucket/x/")}, tmp_path)
    assert "s3://some-bucket/x/" in str(info.value)
