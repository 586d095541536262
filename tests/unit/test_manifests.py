"""Manifest channels (``s3_data_type: manifest``): JSON and JSON-lines lists of objects, SageMaker's prefix
form, pinned object versions, and each malformed manifest named for what is wrong (both endpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import s3_endpoints
from tests.unit.objects import put_big, stage
from trainyard import listing, raw_layout
from trainyard.errors import DataError, StorageError

s3_endpoint = s3_endpoints.s3_endpoint


def test_a_manifest_entry_that_would_escape_the_folder_is_refused_as_unsafe(s3_endpoint, tmp_path):
    # Manifests are written by hand: their entries can carry keys that no endpoint would store. Each is
    # refused as unsafe before any request (S3 would otherwise answer "no such object" and hide why).
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="files/a.bin", Body=b"a")
    for entries in (
        [{"prefix": f"s3://{bucket}/files/"}, "a.bin", "../other/x.bin"],
        [f"s3://{bucket}/files/a.bin", f"s3://{bucket}/files/sub/../../x.bin"],
        [{"prefix": f"s3://{bucket}/files/"}, "sub//x.bin"],
    ):
        client.put_object(Bucket=bucket, Key="m.json", Body=json.dumps(entries).encode())
        # named as the manifest's entry to fix, not as an object to rename
        with pytest.raises(DataError, match=rf"^s3://{bucket}/m.json: its entry .* has an unsafe key .*fix the entry"):
            stage(f"s3://{bucket}/m.json", tmp_path, s3_data_type="manifest", format="raw")


def test_manifest_channels_and_raw_mirrors(s3_endpoint, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    for name in ("a/1.bin", "a/2.bin", "b/3.bin"):
        client.put_object(Bucket=bucket, Key=f"files/{name}", Body=name.encode())
    sagemaker = [{"prefix": f"s3://{bucket}/files/"}, "a/1.bin", "b/3.bin"]
    client.put_object(Bucket=bucket, Key="m.json", Body=json.dumps(sagemaker).encode())
    lines = "\n".join(json.dumps(f"s3://{bucket}/files/{n}") for n in ("a/2.bin", "b/3.bin"))
    client.put_object(Bucket=bucket, Key="m.jsonl", Body=lines.encode())
    m = stage(f"s3://{bucket}/m.json", tmp_path, s3_data_type="manifest", format="raw")
    assert [o.rel for o in m.objects] == ["a/1.bin", "b/3.bin"]
    folder = raw_layout.mirror(m, tmp_path / "mirror")
    assert (folder / "a/1.bin").read_bytes() == b"a/1.bin" and (folder / "b/3.bin").read_bytes() == b"b/3.bin"
    # a prefix without its closing slash is joined to the entries as written, as SageMaker joins them
    no_slash = [{"prefix": f"s3://{bucket}/files"}, "/a/1.bin", "/b/3.bin"]
    client.put_object(Bucket=bucket, Key="no-slash.json", Body=json.dumps(no_slash).encode())
    m1 = stage(f"s3://{bucket}/no-slash.json", tmp_path, s3_data_type="manifest", format="raw")
    assert [o.key for o in m1.objects] == [o.rel for o in m1.objects] == ["files/a/1.bin", "files/b/3.bin"]
    m2 = stage(f"s3://{bucket}/m.jsonl", tmp_path, s3_data_type="manifest", format="raw")
    assert [o.key for o in m2.objects] == ["files/a/2.bin", "files/b/3.bin"]
    assert m2.objects_downloaded == 1  # b/3.bin came from the cache
    twice = [f"s3://{bucket}/files/a/1.bin", f"s3://{bucket}/files/b/3.bin", f"s3://{bucket}/files/a/1.bin"]
    client.put_object(Bucket=bucket, Key="twice.json", Body=json.dumps(twice).encode())
    with pytest.raises(DataError, match=f"lists s3://{bucket}/files/a/1.bin more than once"):
        stage(f"s3://{bucket}/twice.json", tmp_path, s3_data_type="manifest", format="raw")
    client.put_object(Bucket=bucket, Key="bad.jsonl", Body=json.dumps(f"s3://{bucket}/files/nope.bin").encode())
    with pytest.raises(StorageError, match=f"s3://{bucket}/files/nope.bin: no such object"):
        stage(f"s3://{bucket}/bad.jsonl", tmp_path, s3_data_type="manifest", format="raw")
    client.put_object(Bucket=bucket, Key="nobucket.jsonl", Body=json.dumps("s3://no-such-bucket-x/a.bin").encode())
    with pytest.raises(StorageError, match="s3://no-such-bucket-x/a.bin: bucket 'no-such-bucket-x' does not exist"):
        stage(f"s3://{bucket}/nobucket.jsonl", tmp_path, s3_data_type="manifest", format="raw")
    client.put_object(Bucket=bucket, Key="latin1.json", Body=f'["s3://{bucket}/files/\xe9"]'.encode("latin-1"))
    with pytest.raises(DataError, match=f"s3://{bucket}/latin1.json: a manifest must be UTF-8"):
        stage(f"s3://{bucket}/latin1.json", tmp_path, s3_data_type="manifest", format="raw")


def test_a_manifest_can_pin_object_versions(s3_endpoint, tmp_path):
    s3_endpoint.skip_unless("versioning")
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="d/before.bin", Body=b"from before versioning")  # its version is "null"
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    client.put_object(Bucket=bucket, Key="d/before.bin", Body=b"a later version")
    small_v1 = client.put_object(Bucket=bucket, Key="d/a.bin", Body=b"version one")["VersionId"]
    client.put_object(Bucket=bucket, Key="d/a.bin", Body=b"version two")
    big_v1 = put_big(client, bucket, "d/big.bin", tmp_path, seed=1)  # ranged parts, each asked of that version
    big_v1_id = client.list_object_versions(Bucket=bucket, Prefix="d/big.bin")["Versions"][0]["VersionId"]
    put_big(client, bucket, "d/big.bin", tmp_path, seed=2)
    lines = [
        f"s3://{bucket}/d/a.bin?versionId={small_v1}",
        {"s3_uri": f"s3://{bucket}/d/big.bin", "version_id": big_v1_id},
        f"s3://{bucket}/d/before.bin?versionId=null",
    ]
    client.put_object(Bucket=bucket, Key="m.jsonl", Body="\n".join(json.dumps(line) for line in lines).encode())

    m = stage(f"s3://{bucket}/m.jsonl", tmp_path, s3_data_type="manifest", format="raw")
    assert [(o.key, o.version_id) for o in m.objects] == [
        ("d/a.bin", small_v1),
        ("d/before.bin", "null"),
        ("d/big.bin", big_v1_id),
    ]
    assert Path(m.objects[1].path).read_bytes() == b"from before versioning"
    assert Path(m.objects[0].path).read_bytes() == b"version one" and Path(m.objects[2].path).read_bytes() == big_v1
    assert all(o.verified_by.startswith("size+") for o in m.objects)
    assert json.loads((tmp_path / "train.json").read_text())["objects"][0]["version_id"] == small_v1
    again = stage(f"s3://{bucket}/m.jsonl", tmp_path, s3_data_type="manifest", format="raw")
    assert (again.bytes_downloaded, again.digest) == (0, m.digest)
    # the same objects unpinned are the latest versions: other bytes, another lineage digest
    client.put_object(Bucket=bucket, Key="latest.json", Body=json.dumps([f"s3://{bucket}/d/a.bin"]).encode())
    latest = stage(f"s3://{bucket}/latest.json", tmp_path, s3_data_type="manifest", format="raw")
    assert Path(latest.objects[0].path).read_bytes() == b"version two" and latest.objects[0].version_id == ""
    unpinned = listing.lineage_digest([listing.StagedObject(o.bucket, o.key, o.size, o.etag) for o in m.objects])
    assert m.digest != unpinned  # the version is part of the lineage

    client.put_object(
        Bucket=bucket, Key="gone.json", Body=json.dumps([f"s3://{bucket}/d/a.bin?versionId=nope"]).encode()
    )
    with pytest.raises(StorageError, match=rf"s3://{bucket}/d/a.bin\?versionId=nope: the object has no version 'nope'"):
        stage(f"s3://{bucket}/gone.json", tmp_path, s3_data_type="manifest", format="raw")
    with pytest.raises(DataError, match=rf"d/a.bin\?versionId={small_v1}: mode stream reads the latest version"):
        stage(f"s3://{bucket}/m.jsonl", tmp_path, s3_data_type="manifest", format="parquet", mode="stream")


def test_a_pinned_version_the_endpoint_does_not_have_is_refused_not_replaced_by_the_latest(s3_endpoint, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="d/a.bin", Body=b"latest")
    # SageMaker's prefix form, with the version on the key; rclone keeps no versions and answers for the latest
    pinned = [{"prefix": f"s3://{bucket}/d/"}, "a.bin?versionId=3HL4kqtJlcpXroDTDmJ%2BrmSpXd3d"]
    client.put_object(Bucket=bucket, Key="m.json", Body=json.dumps(pinned).encode())
    with pytest.raises(
        StorageError, match=rf"s3://{bucket}/d/a.bin\?versionId=3HL4kqtJlcpXroDTDmJ\+rmSpXd3d"
    ) as failed:
        stage(f"s3://{bucket}/m.json", tmp_path, s3_data_type="manifest", format="raw")
    assert not failed.value.transient


def test_a_manifest_saved_with_a_byte_order_mark_is_read(s3_endpoint, tmp_path):
    client, bucket = s3_endpoint.client(), s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="d/a.bin", Body=b"data")
    client.put_object(
        Bucket=bucket, Key="m.json", Body=b"\xef\xbb\xbf" + json.dumps([f"s3://{bucket}/d/a.bin"]).encode()
    )
    assert [o.key for o in stage(f"s3://{bucket}/m.json", tmp_path, s3_data_type="manifest", format="raw").objects] == [
        "d/a.bin"
    ]


def test_a_manifest_whose_prefix_or_entries_are_malformed_is_named(s3_endpoint, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    prefix = f"s3://{bucket}/p/"
    for entries, message in (
        ([{"prefix": 5}, "a.bin"], "the manifest's prefix 5 is not an s3:// URI"),
        ([{"prefix": prefix}, f"{prefix}a.bin"], f"manifest entry '{prefix}a.bin' is a full URI, but after"),
        ([{"prefix": prefix}, "sub/"], "manifest entry 'sub/' is a folder; a manifest lists objects"),
        ([f"{prefix}sub/"], f"manifest entry '{prefix}sub/' is a folder"),
        (["p/a.bin"], "manifest entry 'p/a.bin' is a key, but the manifest has no prefix entry to say where"),
        ([{"prefix": prefix}], "the manifest has a prefix entry and no objects after it"),
    ):
        client.put_object(Bucket=bucket, Key="m.json", Body=json.dumps(entries).encode())
        with pytest.raises(DataError, match=f"s3://{bucket}/m.json: {message}"):
            stage(f"s3://{bucket}/m.json", tmp_path, s3_data_type="manifest", format="raw")
