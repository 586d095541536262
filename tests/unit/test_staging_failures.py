"""What staging refuses, and the failures it names: keys that would escape the staging folder or cannot be
laid out as files, a missing bucket, prefix or object, denied requests and missing credentials, a full disk, and
requests that time out (transient, so retried by the task)."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError, ReadTimeoutError
from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceeded

from tests import s3_endpoints
from tests.unit.objects import put_big, stage
from trainyard import cache, integrity, listing, s3, staging
from trainyard.errors import DataError, StorageError

s3_endpoint = s3_endpoints.s3_endpoint


def test_traversal_keys_are_refused(s3_endpoint, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    try:
        client.put_object(Bucket=bucket, Key="ch//escape.parquet", Body=b"x")
    except ClientError as exc:
        pytest.skip(f"{s3_endpoint.name} refuses such keys itself: {exc}")
    with pytest.raises(DataError, match="unsafe key"):
        stage(f"s3://{bucket}/ch/", tmp_path)


def test_unsafe_relative_keys():
    for rel in ("../etc/passwd", "a/./b", "a\x00b", "/abs", "a\\..\\b", "", "a//b"):
        with pytest.raises(DataError, match="unsafe key"):
            listing.check_relative_key(rel, f"s3://b/ch/{rel}")
    listing.check_relative_key("sub/part-0.parquet", "s3://b/ch/sub/part-0.parquet")


def test_a_key_that_is_a_folder_of_another_is_named_before_anything_is_laid_out(tmp_path):
    source = tmp_path / "object"
    source.write_bytes(b"x")
    objects = [listing.StagedObject("b", f"ch/{rel}", 1, "etag", rel, path=str(source)) for rel in ("a", "a/b", "c")]
    manifest = listing.ChannelManifest("train", "s3://b/ch/", "raw", objects)
    with pytest.raises(DataError, match="s3://b/ch/a and s3://b/ch/a/b: the first would be laid out as a file"):
        staging.mirror(manifest, tmp_path / "mirror")
    assert not (tmp_path / "mirror").exists()


def test_a_channel_laid_out_again_holds_only_what_its_manifest_lists(tmp_path):
    # a retried staging task or a rerun of the job id, after an object was deleted in S3: the entrypoint saw it still
    source = tmp_path / "object"
    source.write_bytes(b"x")

    def manifest(*rels):
        objects = [listing.StagedObject("b", f"ch/{rel}", 1, "etag", rel, path=str(source)) for rel in rels]
        return listing.ChannelManifest("extra", "s3://b/ch/", "raw", objects)

    folder = staging.mirror(manifest("vocab.txt", "old/config.json", "old/notes.txt"), tmp_path / "mirror")
    staging.mirror(manifest("vocab.txt", "old/notes.txt"), folder)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == ["old", "old/notes.txt", "vocab.txt"]
    staging.mirror(manifest("vocab.txt"), folder)
    assert [p.name for p in folder.iterdir()] == ["vocab.txt"]  # the emptied folder too


def test_a_key_too_long_for_a_file_name_is_named_not_a_traceback(tmp_path):
    source = tmp_path / "object"
    source.write_bytes(b"x")
    rel = "L" * 300 + ".bin"  # S3 keys may be 1,024 bytes; a file name here 255
    objects = [listing.StagedObject("b", f"ch/{rel}", 1, "etag", rel, path=str(source))]
    manifest = listing.ChannelManifest("extra", "s3://b/ch/", "raw", objects)
    with pytest.raises(DataError, match=f"s3://b/ch/{rel}: cannot be laid out as a file.*rename it in S3"):
        staging.mirror(manifest, tmp_path / "mirror")
    # a local failure (here the cached file is gone) is not the key's: no advice to rename it
    gone = [listing.StagedObject("b", "ch/a.bin", 1, "etag", "a.bin", path=str(tmp_path / "evicted"))]
    with pytest.raises(StorageError, match="s3://b/ch/a.bin: laying it out under .* failed"):
        staging.mirror(listing.ChannelManifest("extra", "s3://b/ch/", "raw", gone), tmp_path / "mirror2")


def test_missing_bucket_prefix_and_empty_channel_are_named(s3_endpoint, tmp_path):
    with pytest.raises(StorageError, match="s3://no-such-bucket-here/x/: bucket does not exist"):
        stage("s3://no-such-bucket-here/x/", tmp_path)
    bucket = s3_endpoint.new_bucket()
    with pytest.raises(DataError, match=f"no objects under s3://{bucket}/empty/"):
        stage(f"s3://{bucket}/empty/", tmp_path)
    # a prefix with only a job's side files (a Spark job that wrote nothing) is empty too
    s3_endpoint.client().put_object(Bucket=bucket, Key="markers/_SUCCESS", Body=b"")
    s3_endpoint.client().put_object(Bucket=bucket, Key="markers/part_$folder$", Body=b"")  # EMR's folder marker
    with pytest.raises(DataError, match=f"no objects under s3://{bucket}/markers/"):
        stage(f"s3://{bucket}/markers/", tmp_path)


def test_a_uri_that_is_an_object_and_a_prefix_is_refused_not_half_staged(s3_endpoint, tmp_path):
    if s3_endpoint.name == "rclone":
        pytest.skip("rclone serves a file system: 'odd/train' cannot be a file and a folder at once")
    client, bucket = s3_endpoint.client(), s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="odd/train", Body=b"an object")
    client.put_object(Bucket=bucket, Key="odd/train/", Body=b"")  # a folder marker alone is no ambiguity
    assert [o.key for o in stage(f"s3://{bucket}/odd/train", tmp_path, format="raw").objects] == ["odd/train"]
    client.put_object(Bucket=bucket, Key="odd/train/part-0", Body=b"and one under it")
    with pytest.raises(DataError, match=rf"s3://{bucket}/odd/train is an object and also a prefix of objects"):
        stage(f"s3://{bucket}/odd/train", tmp_path, format="raw")
    assert [o.key for o in stage(f"s3://{bucket}/odd/train/", tmp_path, format="raw").objects] == ["odd/train/part-0"]


def test_a_single_object_stages_for_a_role_that_may_not_list_its_bucket(s3_endpoint, tmp_path, monkeypatch):
    from botocore.exceptions import ClientError

    client, bucket = s3_endpoint.client(), s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="d/only.bin", Body=b"readable, not listable")

    def denied(**kwargs):  # s3:GetObject on the key, no s3:ListBucket
        raise ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "List")

    monkeypatch.setattr(s3.client(), "list_objects_v2", denied)
    assert [o.key for o in stage(f"s3://{bucket}/d/only.bin", tmp_path, format="raw").objects] == ["d/only.bin"]


def test_denied_request_is_clear(s3_endpoint, tmp_path, monkeypatch):
    s3_endpoint.skip_unless("sigv4_enforced")
    bucket = s3_endpoint.new_bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match=f"s3://{bucket}/x/: access denied"):
        stage(f"s3://{bucket}/x/", tmp_path)


def test_no_credentials_are_named_as_such_and_not_retried_as_a_network_error(s3_endpoint, tmp_path, monkeypatch):
    bucket = s3_endpoint.new_bucket()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageError, match=f"s3://{bucket}/x/: no AWS credentials") as failed:
        stage(f"s3://{bucket}/x/", tmp_path)
    assert not failed.value.transient


@pytest.mark.parametrize("size", ["small", "large"])
def test_a_full_disk_is_named_not_retried_and_leaves_no_partial_file(s3_endpoint, tmp_path, monkeypatch, size):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    if size == "small":
        client.put_object(Bucket=bucket, Key="ch/a.bin", Body=b"x" * 1000)
    else:
        put_big(client, bucket, "ch/a.bin", tmp_path)
    writes = []

    def no_space(self, data):
        writes.append(len(data))
        raise OSError(errno.ENOSPC, "No space left on device")

    # where each path writes what it fetched: the small GET's digest-then-write, the transfer manager's file
    writer = (integrity.Digester, "update") if size == "small" else (integrity.FollowingDigest, "write")
    monkeypatch.setattr(*writer, no_space)
    with pytest.raises(StorageError, match=f"s3://{bucket}/ch/a.bin: the disk is full") as failed:
        stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert not failed.value.transient
    assert len(writes) == 1  # not tried again
    etag = client.head_object(Bucket=bucket, Key="ch/a.bin")["ETag"].strip('"')
    assert not cache.path_for(bucket, "ch/a.bin", etag).exists()
    assert not list(cache.objects_dir().rglob(f"*{cache.PART_SUFFIX}"))  # nothing half-written kept


@pytest.mark.parametrize("failing", ["head_object", "download_fileobj"])
def test_a_large_objects_requests_timing_out_or_dropped_are_named_and_transient(
    s3_endpoint, tmp_path, monkeypatch, failing
):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    put_big(client, bucket, "ch/a.bin", tmp_path)

    def timed_out(*args, **kwargs):  # botocore's timeouts are OSErrors as well as BotoCoreErrors
        raise ReadTimeoutError(endpoint_url=s3_endpoint.endpoint_url)

    def retried_out(*args, **kwargs):  # s3transfer's retries, ended on a raw socket error
        raise TransferRetriesExceeded(ConnectionResetError(104, "Connection reset by peer"))

    monkeypatch.setattr(s3.client(), failing, timed_out if failing == "head_object" else retried_out)
    with pytest.raises(StorageError, match=f"s3://{bucket}/ch/a.bin: could not reach S3") as failed:
        stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert failed.value.transient
