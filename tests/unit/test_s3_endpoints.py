"""The test S3 endpoints (moto, rclone serve s3) and the fault proxy do what tests rely on them for.

A fault that silently fails to fire, or an endpoint that quietly differs from its CAPABILITIES
entry, would make the tests that use them pass for the wrong reason; these tests catch that.
"""

from __future__ import annotations

import hashlib
import os
import uuid

import boto3
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError

from tests import s3_endpoints
from tests.fault_proxy import FaultProxy
from tests.s3_endpoints import CAPABILITIES, S3Endpoint, environment, probe_capabilities, s3_client

# The shared fixtures, bound by assignment so pytest finds them here (an import would trip F811).
s3_endpoint = s3_endpoints.s3_endpoint
fault_proxy = s3_endpoints.fault_proxy

MiB = 2**20
# Multipart for anything over 8 MiB, so the 20 MiB payload goes up and down in 3 parts.
TRANSFER = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB, max_concurrency=4)
RETRYING = Config(retries={"max_attempts": 8, "mode": "adaptive"})
ONE_TRY = Config(retries={"total_max_attempts": 1})
# Reads what the server sends without checking it against the object's checksum: how a client
# sees corrupted bytes, and the only way to read a range from rclone (see CAPABILITIES).
UNCHECKED = Config(retries={"total_max_attempts": 1}, response_checksum_validation="when_required")


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    """A small file and one big enough for a 3-part upload, random so no two are alike."""
    root = tmp_path_factory.mktemp("payloads")
    small, big = root / "small.bin", root / "big.bin"
    small.write_bytes(os.urandom(300 * 1024))
    big.write_bytes(os.urandom(20 * MiB + 1234))
    return {"small": small, "big": big}


def env_client(config: Config | None = None):
    """A client from os.environ alone, as trainyard's own code builds one."""
    return boto3.session.Session().client("s3", config=config)


def put_small(endpoint: S3Endpoint, data: bytes = b"") -> tuple[str, str, bytes]:
    """Put an object directly on the endpoint (not through any proxy): ``(bucket, key, body)``."""
    body = data or os.urandom(64 * 1024)
    bucket, key = endpoint.new_bucket(), f"data/{uuid.uuid4().hex}.bin"
    endpoint.client().put_object(Bucket=bucket, Key=key, Body=body)
    return bucket, key, body


def test_capabilities_table_matches_endpoint(s3_endpoint):
    """CAPABILITIES is what skip_unless decides by; it must describe the endpoint as it behaves now."""
    assert probe_capabilities(s3_endpoint.env) == CAPABILITIES[s3_endpoint.name]
    assert s3_endpoint.capabilities == CAPABILITIES[s3_endpoint.name]


def test_transfer_manager_round_trip(s3_endpoint, payloads, tmp_path):
    """upload_file / download_file, single-part and multipart, with the client from os.environ."""
    client = env_client()
    assert client.meta.endpoint_url == s3_endpoint.endpoint_url
    bucket = s3_endpoint.new_bucket()
    for name, path in payloads.items():
        client.upload_file(str(path), bucket, f"objects/{name}.bin", Config=TRANSFER)
        out = tmp_path / f"{name}.out"
        client.download_file(bucket, f"objects/{name}.bin", str(out), Config=TRANSFER)
        assert out.read_bytes() == path.read_bytes()

    md5 = {name: hashlib.md5(path.read_bytes()).hexdigest() for name, path in payloads.items()}
    small = client.head_object(Bucket=bucket, Key="objects/small.bin")
    assert small["ContentLength"] == payloads["small"].stat().st_size
    assert small["ETag"].strip('"') == md5["small"]
    big_etag = client.head_object(Bucket=bucket, Key="objects/big.bin")["ETag"].strip('"')
    if s3_endpoint.capabilities["multipart_etag_dash"]:
        assert big_etag.endswith("-3")
    else:
        assert big_etag == md5["big"]  # rclone: the whole body's MD5


def test_listing_pages_head_and_range(s3_endpoint):
    """list_objects_v2 pages with continuation tokens, HeadObject sizes, and a ranged GET."""
    client = env_client()
    bucket = s3_endpoint.new_bucket()
    keys = [f"part/{i:02d}.bin" for i in range(7)] + ["part/nested/deep.bin", "other/x.bin"]
    for i, key in enumerate(keys):
        client.put_object(Bucket=bucket, Key=key, Body=bytes(range(i + 1)))

    pages = list(
        client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix="part/", PaginationConfig={"PageSize": 3}
        )
    )
    assert [len(page["Contents"]) for page in pages] == [3, 3, 2]
    assert [obj["Key"] for page in pages for obj in page["Contents"]] == keys[:8]
    delimited = client.list_objects_v2(Bucket=bucket, Prefix="part/", Delimiter="/")
    assert [p["Prefix"] for p in delimited["CommonPrefixes"]] == ["part/nested/"]
    assert client.head_object(Bucket=bucket, Key="part/06.bin")["ContentLength"] == 7

    body = os.urandom(4096)
    client.put_object(Bucket=bucket, Key="ranged.bin", Body=body)
    ranged = s3_client(s3_endpoint.env, UNCHECKED).get_object(Bucket=bucket, Key="ranged.bin", Range="bytes=100-199")
    assert ranged["Body"].read() == body[100:200]
    assert ranged["ContentRange"] == "bytes 100-199/4096"


def test_wrong_credentials_are_rejected(s3_endpoint):
    """Where the endpoint checks SigV4, a wrong secret or an unknown key gets 403, not data."""
    s3_endpoint.skip_unless("sigv4_enforced")
    bucket = s3_endpoint.new_bucket()
    env = s3_endpoint.env
    for wrong, code in (
        ({"AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"] + "x"}, "SignatureDoesNotMatch"),
        ({"AWS_ACCESS_KEY_ID": "nobody"}, "InvalidAccessKeyId"),
    ):
        with pytest.raises(ClientError) as caught:
            s3_client({**env, **wrong}, ONE_TRY).list_objects_v2(Bucket=bucket)
        assert caught.value.response["Error"]["Code"] == code
        assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_proxy_throttle_is_retried(s3_endpoint, fault_proxy):
    """Two 503 SlowDowns on GET: a client without retries sees SlowDown, the adaptive one gets the bytes."""
    bucket, key, body = put_small(s3_endpoint)
    fault_proxy.throttle(1, method="GET", key=key)
    with pytest.raises(ClientError) as caught:
        s3_client(fault_proxy.env, ONE_TRY).get_object(Bucket=bucket, Key=key)
    assert caught.value.response["Error"]["Code"] == "SlowDown"
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503

    fault_proxy.throttle(2, method="GET", key=key)
    seen = fault_proxy.requests_seen
    assert env_client(RETRYING).get_object(Bucket=bucket, Key=key)["Body"].read() == body
    assert fault_proxy.applied["throttle"] == 3
    assert fault_proxy.requests_seen - seen == 3
    assert [outcome for _, _, outcome in fault_proxy.log[-3:]] == ["throttle", "throttle", "200"]


def test_proxy_drop_is_retried(s3_endpoint, fault_proxy):
    """A connection closed with no response is a transient error the retrying client gets past."""
    bucket, key, body = put_small(s3_endpoint)
    fault_proxy.drop(1, method="GET")
    assert env_client(RETRYING).get_object(Bucket=bucket, Key=key)["Body"].read() == body
    assert fault_proxy.applied["drop"] == 1
    assert [outcome for _, _, outcome in fault_proxy.log] == ["drop", "200"]


def test_proxy_drop_mid_body(s3_endpoint, fault_proxy, payloads, tmp_path):
    """Half a body then a closed connection: a plain read fails; the transfer manager re-fetches."""
    bucket, key, body = put_small(s3_endpoint)
    fault_proxy.drop_mid_body(1, method="GET")
    response = env_client(RETRYING).get_object(Bucket=bucket, Key=key)
    with pytest.raises(BotoCoreError):  # IncompleteReadError / ResponseStreamingError
        response["Body"].read()
    assert fault_proxy.applied["drop_mid_body"] == 1

    fault_proxy.drop_mid_body(1, method="GET")
    out = tmp_path / "out.bin"
    env_client(RETRYING).download_file(bucket, key, str(out), Config=TRANSFER)
    assert out.read_bytes() == body
    assert fault_proxy.applied["drop_mid_body"] == 2


def test_proxy_corrupt_changes_one_byte(s3_endpoint, fault_proxy):
    """Corrupted bytes reach a client that does not check them; the object itself is unharmed."""
    bucket, key, body = put_small(s3_endpoint)
    fault_proxy.corrupt(1, method="GET")
    served = s3_client(fault_proxy.env, UNCHECKED).get_object(Bucket=bucket, Key=key)["Body"].read()
    assert len(served) == len(body)
    assert sum(a != b for a, b in zip(served, body, strict=True)) == 1
    assert fault_proxy.applied["corrupt"] == 1
    assert s3_client(fault_proxy.env, UNCHECKED).get_object(Bucket=bucket, Key=key)["Body"].read() == body


def test_proxy_corrupt_caught_by_checksum(s3_endpoint, fault_proxy):
    """Where the endpoint keeps boto3's default CRC32, botocore's own validation spots the flipped byte."""
    s3_endpoint.skip_unless("checksum_crc32")
    bucket, key, _ = put_small(s3_endpoint)
    fault_proxy.corrupt(1, method="GET")
    response = env_client(RETRYING).get_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    with pytest.raises(FlexibleChecksumError):
        response["Body"].read()
    assert fault_proxy.applied["corrupt"] == 1


def test_proxy_forwards_multipart_upload_past_a_dropped_part(s3_endpoint, fault_proxy, payloads, tmp_path):
    """Chunked, checksum-trailed, 100-continue part uploads go through the proxy intact; a dropped
    part is re-sent by botocore and the object is whole."""
    bucket = s3_endpoint.new_bucket()
    fault_proxy.drop(1, method="PUT", key="partNumber=2")
    client = env_client(RETRYING)
    client.upload_file(str(payloads["big"]), bucket, "big.bin", Config=TRANSFER)
    assert fault_proxy.applied["drop"] == 1
    out = tmp_path / "big.out"
    client.download_file(bucket, "big.bin", str(out), Config=TRANSFER)
    assert out.read_bytes() == payloads["big"].read_bytes()


def test_skip_unless_names_endpoint_and_feature(s3_endpoint):
    """The skip message says which endpoint lacks what; an unknown capability is an error, not a skip."""
    missing = [name for name, ok in s3_endpoint.capabilities.items() if not ok]
    if missing:
        with pytest.raises(pytest.skip.Exception, match=f"{s3_endpoint.name}.*{missing[0]}"):
            s3_endpoint.skip_unless(missing[0])
    s3_endpoint.skip_unless("md5_etag")  # present on both: returns
    with pytest.raises(KeyError):
        s3_endpoint.skip_unless("no_such_feature")


def test_fault_proxy_standalone_context_manager(s3_endpoint):
    """Usable on its own as a context manager, leaving os.environ alone; counts what it saw."""
    bucket, key, body = put_small(s3_endpoint)
    with FaultProxy(s3_endpoint.endpoint_url, s3_endpoint.env) as proxy:
        assert proxy.env["AWS_ACCESS_KEY_ID"] == s3_endpoint.env["AWS_ACCESS_KEY_ID"]
        head = s3_client(proxy.env).head_object(Bucket=bucket, Key=key)
        assert head["ContentLength"] == len(body)
        assert proxy.requests_seen == 1 and proxy.applied == dict.fromkeys(proxy.applied, 0)
    assert os.environ["AWS_ENDPOINT_URL_S3"] == s3_endpoint.endpoint_url


def test_environment_restores_what_was_there(monkeypatch):
    """The fixtures' os.environ switch puts back changed values and removes added ones, so an endpoint
    fixture ending does not leave later tests pointed at a stopped server."""
    monkeypatch.setenv("TRAINYARD_TEST_CHANGED", "before")
    monkeypatch.delenv("TRAINYARD_TEST_ADDED", raising=False)
    with environment({"TRAINYARD_TEST_CHANGED": "during", "TRAINYARD_TEST_ADDED": "during"}):
        assert os.environ["TRAINYARD_TEST_CHANGED"] == os.environ["TRAINYARD_TEST_ADDED"] == "during"
    assert os.environ["TRAINYARD_TEST_CHANGED"] == "before"
    assert "TRAINYARD_TEST_ADDED" not in os.environ
