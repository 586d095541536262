"""Staging against two S3 endpoints over HTTP on 127.0.0.1 (moto's server mode and ``rclone serve s3``),
with a fault-injecting proxy for throttling, dropped connections and corrupted bytes."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from botocore.config import Config

from tests import s3_endpoints
from tests.unit.objects import MULTIPART, put_big, put_parquet, stage
from trainyard import cache, integrity, listing, raw_layout, s3, staging
from trainyard.errors import DataError, StorageError
from trainyard.spec import Channel

s3_endpoint = s3_endpoints.s3_endpoint
fault_proxy = s3_endpoints.fault_proxy


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
    folder = raw_layout.mirror(raw, tmp_path / "mirror")
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
    assert fault_proxy.applied == {"throttle": 3, "deny": 0, "drop": 1, "drop_mid_body": 2, "corrupt": 0}
    assert Path(m.objects[-1].path).read_bytes() == big
    assert all(o.verified_by for o in m.objects)


def test_small_objects_are_never_fetched_more_than_the_bound_at_once(s3_endpoint, fault_proxy, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    for i in range(80):
        client.put_object(Bucket=bucket, Key=f"ch/{i:02d}.bin", Body=bytes(50_000))
    m = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert m.objects_downloaded == 80
    assert 1 < fault_proxy.most_in_flight <= listing.MAX_CONCURRENT_OBJECTS  # concurrent, and bounded


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
    assert client.most > 1  # they did overlap
    assert client.most + listing.MAX_CONCURRENT_OBJECTS <= s3.client().meta.config.max_pool_connections, client.most


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


def test_a_prefix_of_more_keys_than_one_listing_answer_is_listed_whole(s3_endpoint):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    keys = [f"ch/part-{i:05d}.bin" for i in range(1_005)]  # S3 answers at most 1,000 keys a page
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda key: client.put_object(Bucket=bucket, Key=key, Body=b"x"), keys))
    listed = listing.list_channel("train", Channel(s3_uri=f"s3://{bucket}/ch/", format="raw"))
    assert sorted(o.key for o in listed.objects) == keys


def test_part_sizes_come_from_heads_where_get_object_attributes_is_refused():
    # a read-only role (GetObject, ListBucket) is refused GetObjectAttributes: the part HEADs GetObject allows
    # were never tried, and a multipart object's composite checksum went unchecked (its size alone)
    from botocore.exceptions import ClientError

    class ReadOnly:
        heads_refused = False

        def get_object_attributes(self, **kwargs):
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "GetObjectAttributes")

        def head_object(self, **kwargs):
            if self.heads_refused:
                raise ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadObject")
            return {"ContentLength": 5 << 20 if kwargs["PartNumber"] < 3 else 9}

    client = ReadOnly()
    obj = listing.StagedObject("b", "k", 2 * (5 << 20) + 9, "0" * 32 + "-3")
    assert staging._part_sizes(client, obj) == [5 << 20, 5 << 20, 9]
    client.heads_refused = True
    assert staging._part_sizes(client, obj) is None  # nothing says: the size alone is checked, as before
