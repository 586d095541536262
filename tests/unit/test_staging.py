"""Staging against two S3 endpoints over HTTP on 127.0.0.1 (moto's server mode and ``rclone serve s3``),
with a fault-injecting proxy for throttling, dropped connections and corrupted bytes."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError, ReadTimeoutError
from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceeded

from tests import s3_endpoints
from tests.conftest import blobs_table
from trainyard import cache, integrity, listing, s3, staging
from trainyard.errors import DataError, StorageError
from trainyard.spec import Channel

s3_endpoint = s3_endpoints.s3_endpoint
fault_proxy = s3_endpoints.fault_proxy
MULTIPART = TransferConfig(multipart_threshold=8 * 2**20, multipart_chunksize=8 * 2**20)
BIG = 20 * 2**20  # over staging's 16 MiB threshold: fetched by the transfer manager in ranged parts


def put_parquet(client, bucket: str, key: str, rows: int = 20, seed: int = 0) -> None:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(blobs_table(rows, seed), buf)
    client.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())


def put_big(client, bucket: str, key: str, tmp_path: Path, seed: int = 0) -> bytes:
    data = hashlib.sha256(str(seed).encode()).digest() * (BIG // 32)
    path = tmp_path / f"big-{seed}"
    path.write_bytes(data)
    client.upload_file(str(path), bucket, key, Config=MULTIPART)  # a multipart upload
    return data


def stage(uri: str, tmp_path: Path, **channel) -> listing.ChannelManifest:
    return staging.stage_channels({"train": Channel(s3_uri=uri, **channel)}, tmp_path)["train"]


def test_small_objects_and_a_multipart_object_are_staged_and_verified(s3_endpoint, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    for i in range(40):
        put_parquet(client, bucket, f"ch/part-{i:03d}.parquet", seed=i)
    big = put_big(client, bucket, "ch/zz-big.bin", tmp_path)
    # Spark's side files and folders, which a table's channel skips: a marker, an uncommitted task's
    # output, a checksum file (see test_a_raw_channel_keeps_what_a_tables_channel_skips_as_side_files)
    for key in ("ch/_SUCCESS", "ch/_temporary/0/task/part-000.parquet", "ch/.part-000.parquet.crc"):
        client.put_object(Bucket=bucket, Key=key, Body=b"")
    m = stage(f"s3://{bucket}/ch/", tmp_path)
    assert len(m.objects) == 41 and m.objects[-1].key == "ch/zz-big.bin"
    assert m.bytes == m.bytes_downloaded == sum(o.size for o in m.objects)
    assert m.objects_downloaded == 41
    assert Path(m.objects[-1].path).read_bytes() == big
    for obj in m.objects[:-1]:
        assert Path(obj.path).read_bytes() == client.get_object(Bucket=bucket, Key=obj.key)["Body"].read()
        assert obj.verified_by == "size+crc32"  # boto3 uploads with a CRC32, which both endpoints keep
    assert json.loads((tmp_path / "train.json").read_text())["digest"] == m.digest
    # staged again, unchanged: nothing moves, the lineage digest is the same
    again = stage(f"s3://{bucket}/ch/", tmp_path)
    assert (again.bytes_downloaded, again.objects_downloaded, again.digest) == (0, 0, m.digest)
    # and the manifest still has each object's checksum, and how it was checked when it was fetched
    assert [o.checksum for o in again.objects] == [o.checksum for o in m.objects]
    assert again.objects[0].checksum and again.objects[0].verified_by == "cache (size+crc32)"


def test_a_raw_channel_keeps_what_a_tables_channel_skips_as_side_files(s3_endpoint, tmp_path):
    # A custom entrypoint's files may start with '_' or '.': a raw channel mirrors every object under
    # the prefix, as SageMaker does, but folder markers (an empty "folder" in a console, EMR's).
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    put_parquet(client, bucket, "ch/part-000.parquet")
    kept = ("ch/_config.json", "ch/.vocab/words.txt", "ch/_SUCCESS")
    # (rclone keeps "empty/" as a folder on its disk and lists it back as the key "ch/empty", 0 bytes)
    markers = ("ch/old_$folder$", "ch/empty/") if s3_endpoint.name == "moto" else ("ch/old_$folder$",)
    for key in (*kept, *markers):
        client.put_object(Bucket=bucket, Key=key, Body=key.encode() if key in kept else b"")
    raw = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert [o.rel for o in raw.objects] == [".vocab/words.txt", "_SUCCESS", "_config.json", "part-000.parquet"]
    folder = staging.mirror(raw, tmp_path / "mirror")
    assert (folder / "_config.json").read_bytes() == b"ch/_config.json"
    assert (folder / ".vocab/words.txt").read_bytes() == b"ch/.vocab/words.txt"
    table = stage(f"s3://{bucket}/ch/", tmp_path, format="parquet")
    assert [o.rel for o in table.objects] == ["part-000.parquet"]


def test_an_object_changed_in_place_is_fetched_again(s3_endpoint, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    put_parquet(client, bucket, "ch/a.parquet", seed=1)
    put_parquet(client, bucket, "ch/b.parquet", seed=2)
    first = stage(f"s3://{bucket}/ch/", tmp_path)
    put_parquet(client, bucket, "ch/b.parquet", rows=21, seed=3)
    changed = stage(f"s3://{bucket}/ch/", tmp_path)
    b = next(o for o in changed.objects if o.key == "ch/b.parquet")
    assert changed.bytes_downloaded == b.size and changed.objects_downloaded == 1
    assert changed.digest != first.digest


@pytest.mark.parametrize("algorithm", integrity.ALGORITHMS)
def test_flexible_checksums_are_verified(s3_endpoint, fault_proxy, tmp_path, algorithm):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    data = hashlib.sha256(algorithm.encode()).digest() * 40
    hasher = integrity._Hasher(algorithm)  # its agreement with botocore's is test_integrity's
    hasher.update(data)
    # the value given, as an SDK that computed it would send it: botocore computes no MD5 itself (and
    # moto keeps a value only when the algorithm is named too)
    sent = {"ChecksumAlgorithm": algorithm, f"Checksum{algorithm}": hasher.b64digest()}
    client.put_object(Bucket=bucket, Key="ch/a.bin", Body=data, **sent)
    kept = client.head_object(Bucket=bucket, Key="ch/a.bin", ChecksumMode="ENABLED").get(f"Checksum{algorithm}")
    if kept != hasher.b64digest():
        pytest.skip(f"the {s3_endpoint.name} S3 endpoint does not keep an object's {algorithm} checksum")
    m = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert m.objects[0].checksum["algorithm"] == algorithm
    assert m.objects[0].verified_by == f"size+{algorithm.lower()}"  # not the MD5 as well: one digest is enough
    client.put_object(Bucket=bucket, Key="ch/b.bin", Body=data, **sent)
    fault_proxy.corrupt(2, method="GET", key="ch/b.bin")  # served bytes that differ from it, twice
    with pytest.raises(DataError, match=rf"s3://{bucket}/ch/b.bin: downloaded bytes do not match.*{algorithm} "):
        stage(f"s3://{bucket}/ch/", tmp_path, format="raw")


def test_corrupted_bytes_are_fetched_again_then_the_object_is_named(s3_endpoint, fault_proxy, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    put_parquet(client, bucket, "ch/a.parquet")
    fault_proxy.corrupt(1, method="GET", key="ch/a.parquet")
    m = listing.list_channel("train", Channel(s3_uri=f"s3://{bucket}/ch/"))
    shown = []  # what a progress bar is told
    staging.fetch_channel(m, shown.append)  # one bad copy: fetched again, then good
    assert fault_proxy.applied["corrupt"] == 1 and m.objects[0].verified_by == "size+crc32"
    assert sum(shown) == m.objects[0].size and m.bytes_downloaded == 2 * m.objects[0].size  # shown once, moved twice
    # uploaded with no flexible checksum: the single-part ETag's MD5 is what catches it
    plain = s3_endpoint.client(Config(request_checksum_calculation="when_required"))
    put_parquet(plain, bucket, "ch/b.parquet", seed=5)
    fault_proxy.corrupt(2, method="GET", key="ch/b.parquet")
    with pytest.raises(DataError, match=rf"s3://{bucket}/ch/b.parquet: downloaded bytes do not match.*MD5"):
        stage(f"s3://{bucket}/ch/", tmp_path)
    fault_proxy.clear_faults()
    assert stage(f"s3://{bucket}/ch/", tmp_path).objects[1].verified_by == "size+md5"
    assert not list(cache.objects_dir().glob("*/.*.part"))  # nothing half-written is left


def test_a_single_object_outside_any_channel_is_fetched_verified(s3_endpoint, fault_proxy, tmp_path):
    # what the disaster fallback reads a checkpoint with
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    data = hashlib.sha256(b"state").digest() * 4000
    client.put_object(Bucket=bucket, Key="ck/step-1.pt", Body=data)
    fault_proxy.corrupt(1, method="GET", key="ck/step-1.pt")
    obj = staging.fetch_object(f"s3://{bucket}/ck/step-1.pt", tmp_path / "ck.pt")
    assert fault_proxy.applied["corrupt"] == 1 and obj.verified_by == "size+crc32"
    assert (tmp_path / "ck.pt").read_bytes() == data and obj.size == len(data)
    fault_proxy.corrupt(2, method="GET", key="ck/step-1.pt")
    with pytest.raises(DataError, match=rf"s3://{bucket}/ck/step-1.pt: downloaded bytes do not match"):
        staging.fetch_object(f"s3://{bucket}/ck/step-1.pt", tmp_path / "again.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]  # nothing half-written is left
    with pytest.raises(StorageError, match=rf"s3://{bucket}/ck/missing.pt"):
        staging.fetch_object(f"s3://{bucket}/ck/missing.pt", tmp_path / "missing.pt")


@pytest.mark.parametrize("mib, corruptions", [(20, 8), (10, 2)])
def test_corrupted_multipart_download_is_detected(s3_endpoint, fault_proxy, tmp_path, mib, corruptions):
    # 20 MiB: fetched by the transfer manager in ranged parts; 10 MiB (two parts of 8 MiB): under staging's
    # 16 MiB threshold, fetched with one GET, and its composite checksum checked once its part sizes are known
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    path = tmp_path / "blob"
    path.write_bytes(hashlib.sha256(str(mib).encode()).digest() * (mib * 2**20 // 32))
    client.upload_file(str(path), bucket, "ch/big.bin", Config=MULTIPART)
    # moto: multipart ETag, composite CRC32 (checked part by part); rclone: the ETag is the whole MD5
    fault_proxy.corrupt(corruptions, lambda method, target: method == "GET" and target.endswith("/ch/big.bin"))
    with pytest.raises(DataError, match=rf"s3://{bucket}/ch/big.bin: downloaded bytes do not match"):
        stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    fault_proxy.clear_faults()
    before = fault_proxy.applied["corrupt"]
    fault_proxy.corrupt(1, lambda method, target: method == "GET" and target.endswith("/ch/big.bin"))
    m = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")  # one bad copy: fetched again, then good
    assert fault_proxy.applied["corrupt"] == before + 1
    assert m.objects[0].verified_by in ("size+crc32-composite", "size+md5")
    assert m.bytes_downloaded == 2 * m.objects[0].size
    assert Path(m.objects[0].path).read_bytes() == path.read_bytes()


def test_a_multipart_object_replaced_during_its_download_is_not_staged(s3_endpoint, tmp_path, monkeypatch):
    # No checksum and a multipart ETag (moto): only the size could be checked, and the replacement has the
    # same size. rclone gives the same upload a whole-object MD5 ETag, which catches it anyway.
    plain = s3_endpoint.client(Config(request_checksum_calculation="when_required"))
    bucket = s3_endpoint.new_bucket()
    put_big(plain, bucket, "ch/big.bin", tmp_path, seed=1)
    listed_etag = plain.head_object(Bucket=bucket, Key="ch/big.bin")["ETag"].strip('"')
    client = s3.client()
    real = type(client).download_fileobj

    def replaced_first(self, *args, **kwargs):
        put_big(plain, bucket, "ch/big.bin", tmp_path, seed=2)  # same size, other bytes
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(client), "download_fileobj", replaced_first)
    with pytest.raises((StorageError, DataError), match=rf"s3://{bucket}/ch/big.bin: (changed in S3|downloaded bytes)"):
        stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert not cache.path_for(bucket, "ch/big.bin", listed_etag).exists()  # nothing cached under the old ETag


def test_a_small_object_replaced_after_listing_is_not_cached_under_its_old_etag(s3_endpoint, tmp_path):
    # moto answers the conditional GET with 412; rclone ignores If-Match and sends the new bytes with their
    # own (valid) checksum: the ETag it sends with them gives the replacement away.
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="ch/a.bin", Body=b"first" * 100, ChecksumAlgorithm="CRC32")
    manifest = listing.list_channel("train", Channel(s3_uri=f"s3://{bucket}/ch/", format="raw"))
    client.put_object(Bucket=bucket, Key="ch/a.bin", Body=b"other" * 100, ChecksumAlgorithm="CRC32")
    with pytest.raises(StorageError, match=rf"s3://{bucket}/ch/a.bin: changed in S3") as failed:
        staging.fetch_channel(manifest)
    assert failed.value.transient  # the job's retry stages the new version
    assert not cache.path_for(bucket, "ch/a.bin", manifest.objects[0].etag).exists()


def test_the_progress_bar_counts_bytes_and_objects(s3_endpoint, tmp_path, monkeypatch, capsys):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    for i in range(3):
        client.put_object(Bucket=bucket, Key=f"ch/{i}.bin", Body=bytes(2000))
    stage(f"s3://{bucket}/ch/0.bin", tmp_path, format="raw")  # one of them cached already
    monkeypatch.setenv("TRAINYARD_PROGRESS", "1")
    capsys.readouterr()
    stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    shown = capsys.readouterr().out
    assert "staging train" in shown and "6.0/6.0 kB" in shown and "3/3 objects" in shown


def test_throttling_and_dropped_connections_are_survived(s3_endpoint, fault_proxy, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    for i in range(6):
        put_parquet(client, bucket, f"ch/p{i}.parquet", seed=i)
    big = put_big(client, bucket, "ch/zbig.bin", tmp_path, seed=3)
    fault_proxy.throttle(2, method="GET")
    fault_proxy.throttle(1, method="HEAD")
    fault_proxy.drop(1, method="GET")
    fault_proxy.drop_mid_body(1, lambda method, target: method == "GET" and "p1.parquet" in target)
    fault_proxy.drop_mid_body(1, lambda method, target: method == "GET" and target.endswith("zbig.bin"))
    m = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert fault_proxy.applied == {"throttle": 3, "drop": 1, "drop_mid_body": 2, "corrupt": 0}
    assert Path(m.objects[-1].path).read_bytes() == big
    assert all(o.verified_by for o in m.objects)


def test_small_objects_are_never_fetched_more_than_the_bound_at_once(s3_endpoint, fault_proxy, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    for i in range(80):
        client.put_object(Bucket=bucket, Key=f"ch/{i:02d}.bin", Body=bytes(50_000))
    m = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert m.objects_downloaded == 80
    assert fault_proxy.most_in_flight <= listing.MAX_CONCURRENT_OBJECTS


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


def test_part_heads_stay_within_the_connection_pool_however_many_objects_need_them():
    # An endpoint that answers GetObjectAttributes without the parts (moto) has each part HEADed, and up to
    # MAX_CONCURRENT_OBJECTS small objects ask at once: bounded per object only, their HEADs overflowed the
    # client's connection pool (urllib3's "Connection pool is full, discarding connection").
    class PartsUnlisted:
        def __init__(self):
            self.lock, self.in_flight, self.most = threading.Lock(), 0, 0

        def get_object_attributes(self, **kwargs):
            return {"ObjectParts": {"TotalPartsCount": 4}}

        def head_object(self, **kwargs):
            with self.lock:
                self.in_flight += 1
                self.most = max(self.most, self.in_flight)
            time.sleep(0.05)  # long enough for every object's HEADs to overlap
            with self.lock:
                self.in_flight -= 1
            return {"ContentLength": 5 << 20 if kwargs["PartNumber"] < 4 else 1 << 19}

    client = PartsUnlisted()
    objects = [
        listing.StagedObject("b", f"k{i}", 15 * 2**20 + 2**19, "0" * 32 + "-4")
        for i in range(listing.MAX_CONCURRENT_OBJECTS)
    ]
    with ThreadPoolExecutor(max_workers=listing.MAX_CONCURRENT_OBJECTS) as pool:
        sizes = list(pool.map(lambda obj: staging._part_sizes(client, obj), objects))
    assert sizes == [[5 << 20] * 3 + [1 << 19]] * len(objects)
    # room for them beside the objects' GETs
    assert client.most + listing.MAX_CONCURRENT_OBJECTS <= s3._client_config().max_pool_connections, client.most


def test_the_parts_of_an_object_with_over_a_thousand_are_listed_page_by_page_not_headed():
    # S3 lists at most 1,000 parts an answer: an object of 2,500 parts has its sizes in three pages, not
    # from 2,500 HEADs.
    class Paged:
        def __init__(self):
            self.pages, self.heads = [], 0

        def get_object_attributes(self, MaxParts, PartNumberMarker=0, **kwargs):
            self.pages.append(PartNumberMarker)
            numbers = range(PartNumberMarker + 1, min(PartNumberMarker + MaxParts, 2500) + 1)
            parts = [{"PartNumber": n, "Size": 5 << 20 if n < 2500 else 7} for n in numbers]
            more = numbers[-1] < 2500
            return {"ObjectParts": {"Parts": parts, "IsTruncated": more, "NextPartNumberMarker": numbers[-1]}}

        def head_object(self, **kwargs):
            self.heads += 1
            raise AssertionError("listed parts need no HEAD")

    client = Paged()
    obj = listing.StagedObject("b", "k", 2499 * (5 << 20) + 7, "0" * 32 + "-2500")
    assert staging._part_sizes(client, obj) == [5 << 20] * 2499 + [7]
    assert client.pages == [0, 1000, 2000] and client.heads == 0
