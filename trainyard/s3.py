"""The seam to S3: URI parsing and a boto3 client built from the standard AWS configuration.

Everything that talks to S3 goes through here, so AWS, MinIO, R2 and the embedded local endpoint
all work the same: the endpoint comes from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` or the
profile, credentials from the usual chain. ``s3://`` URIs stay strings; they never go through ``Path``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import botocore.session
import urllib3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
    ProfileNotFound,
)

from trainyard import botocore_loader, collector
from trainyard.errors import StorageError
from trainyard.redaction import redact_text, redact_url

# Throttling (503 SlowDown) and 5xx are retried with backoff by botocore's adaptive mode, 9 attempts in
# all. Response checksums are verified by staging itself, over the whole file: botocore's own check
# misfires on ranged GETs from endpoints that send the whole object's checksum with each range.
DEFAULT_ATTEMPTS, DEFAULT_RETRY_MODE = 9, "adaptive"


def _client_config(core: botocore.session.Session) -> Config:
    """The client's settings. The standard retry settings, AWS_MAX_ATTEMPTS and AWS_RETRY_MODE or the
    profile's max_attempts and retry_mode, replace the defaults above, counted as boto3 counts them
    (attempts in all, the first included)."""
    try:
        profile = core.get_scoped_config()
    except ProfileNotFound:
        profile = {}  # the client's own creation says so
    attempts = os.environ.get("AWS_MAX_ATTEMPTS") or profile.get("max_attempts")
    if attempts is not None and not str(attempts).strip().isdigit():
        raise StorageError(f"AWS_MAX_ATTEMPTS (or the profile's max_attempts) {attempts!r} is not a whole number")
    return Config(
        retries={
            "total_max_attempts": int(attempts) if attempts is not None else DEFAULT_ATTEMPTS,
            "mode": os.environ.get("AWS_RETRY_MODE") or profile.get("retry_mode") or DEFAULT_RETRY_MODE,
        },
        max_pool_connections=32,
        response_checksum_validation="when_required",
    )


# io_chunksize: s3transfer reads each part's body in 256 KiB pieces by default, each a Python-level
# queue hop and write; 1 MiB pieces took a 512 MiB download from 0.83 s to 0.55 s on 2 cores (less CPU
# left to the digest that runs alongside). 4 MiB was slower again. max_io_queue: pieces waiting for the
# writer; the default 100 would hold up to 100 MiB of them. preferred_transfer_client: with awscrt
# installed, boto3's "auto" swaps in the CRT transfer manager on the instance types it is tuned for (the
# GPU families among them), which ignores these settings and botocore's retry modes.
TRANSFER_CONFIG = TransferConfig(
    multipart_threshold=16 * 2**20,
    multipart_chunksize=16 * 2**20,
    max_concurrency=8,
    io_chunksize=2**20,
    max_io_queue=32,
    preferred_transfer_client="classic",
)


@dataclass(frozen=True, slots=True)
class S3Uri:
    """A parsed ``s3://bucket/key`` URI."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> S3Uri:
        if not uri.startswith("s3://"):
            raise StorageError(f"{uri!r} is not an s3:// URI")
        bucket, _, key = uri[5:].partition("/")
        if not bucket:
            raise StorageError(f"{uri!r} names no bucket")
        return cls(bucket, key)

    def join(self, *parts: str) -> S3Uri:
        """A URI below this one (``/`` inserted as needed)."""
        key = self.key
        for part in parts:
            key = f"{key.rstrip('/')}/{part.lstrip('/')}" if key else part.lstrip("/")
        return S3Uri(self.bucket, key)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


_clients: dict[tuple, tuple[boto3.session.Session, object]] = {}
# Set explicitly in _client_config, so its variable cannot change a client; streaming sets it for
# pyarrow's AWS SDK, and keying on it cost a second client (~0.1 s) in every streaming process.
_SET_IN_CONFIG = frozenset({"AWS_RESPONSE_CHECKSUM_VALIDATION"})
_clients_lock = threading.Lock()
# Hosts that have answered a request (any status) in this process. A configured endpoint (not AWS's) when
# none has yet is a wrong endpoint or one that is down: botocore's own retries (9 attempts, about 4 s) have
# already waited for it, and the task's retries would only triple the wait for the same message. After any
# answer, a refused connection is a blip, worth trying again (the retry resumes from the cache); on AWS
# (a host per bucket) so is the first, a network not up yet.
_answered_hosts: set[str] = set()


def _host(url: str) -> str:
    """The host and port of ``url``, never its user or password."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname or ""


def on_aws(hostname: str | None) -> bool:
    """Whether an S3 host is AWS's own (a bucket's virtual host, or a regional endpoint), not a configured one."""
    return hostname is not None and hostname.endswith(("amazonaws.com", "amazonaws.com.cn"))


def _note_answer(http_response=None, **_kwargs) -> None:
    if http_response is not None:
        _answered_hosts.add(_host(http_response.url))


def client():
    """A boto3 S3 client from the standard AWS configuration (env, profile, endpoint variables).

    One client per process and configuration: building one loads botocore's service model (~50 ms)
    and a client is safe to share between threads. The AWS variables are the key, so a change of
    endpoint, profile or credentials in the environment gets a new client.
    """
    return _session_and_client()[1]


def credentials():
    """The credentials ``client()`` signs with (frozen), or None where the chain finds none: for
    pyarrow's S3 file system, which resolves them differently."""
    found = _session_and_client()[0].get_credentials()
    return found.get_frozen_credentials() if found else None


def _session_and_client() -> tuple[boto3.session.Session, object]:
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_") and k not in _SET_IN_CONFIG))
    with _clients_lock:
        if key not in _clients:
            # botocore's models and endpoint rules: long-lived objects, which the collector would walk
            # the whole heap for (collector.py); the process's first client is frozen with the imports
            # before it, out of every later collection's walk.
            with collector.paused():
                refused = None
                try:
                    core = botocore_loader.session()
                    session = boto3.session.Session(botocore_session=core)
                    made = session.client("s3", config=_client_config(core))
                    made.meta.events.register("after-call.s3", _note_answer)
                    _clients[key] = (session, made)
                except ValueError as exc:
                    if not str(exc).startswith("Invalid endpoint: "):  # another setting's (a region's): its own
                        raise
                    refused = _endpoint_error(exc)  # botocore's message quotes the URL, password and all
                except ProfileNotFound as exc:  # a mistyped AWS_PROFILE: every command said it with a traceback
                    refused = StorageError(
                        f"{exc}: set AWS_PROFILE to a profile of your AWS config file (AWS_CONFIG_FILE, "
                        "~/.aws/config), or unset it"
                    )
                if refused:  # raised here, so that no chained exception keeps the password
                    raise refused
                collector.freeze_once()
        return _clients[key]


def _endpoint_error(exc: ValueError) -> StorageError:
    """botocore's refusal of the endpoint URL, with the URL's password masked."""
    endpoint = str(exc).removeprefix("Invalid endpoint: ")
    return StorageError(
        f"the S3 endpoint {redact_url(endpoint)!r} is not a URL botocore can use (a host name with '_', no "
        "scheme?); fix AWS_ENDPOINT_URL_S3 (or AWS_ENDPOINT_URL, or the profile's endpoint_url), for example "
        "http://minio:9000"
    )


def describe_error(exc: BaseException, uri: str) -> StorageError:
    """Turn a boto3 error into a ``StorageError`` that names the URI and says what to check.

    botocore quotes the endpoint URL in its errors; a password in it is masked (redaction.py).
    """
    error = _describe(exc, uri)
    return StorageError(redact_text(str(error)), transient=error.transient)


def _describe(exc: BaseException, uri: str) -> StorageError:
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        answered = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("content-type", "")
        # S3 answers errors in XML, which names the error: a body in JSON or HTML botocore could take no code from is
        # no S3 (a proxy's 5xx page in front of one is an outage, retried below; a HEAD's answer has no body at all)
        unnamed = (not code or code.isdigit()) and not exc.operation_name.startswith("Head")
        if unnamed and answered.startswith(("application/json", "text/html")) and (status or 0) < 500:
            return StorageError(
                f"{uri}: the S3 endpoint answered {status} in {answered.split(';')[0]}, not as S3 does; is "
                "AWS_ENDPOINT_URL_S3 (or AWS_ENDPOINT_URL, or the profile's endpoint_url) an S3 API? (MinIO's is "
                "its API port, not its console's)"
            )
        if code in ("NoSuchBucket",):
            return StorageError(f"{uri}: bucket does not exist; create it or fix the bucket name")
        if code in ("NoSuchKey", "404", "NotFound"):
            return StorageError(f"{uri}: no such object")
        if code == "NoSuchVersion":
            return StorageError(f"{uri}: no such version of the object; check the version id")
        if code in ("ExpiredToken", "InvalidToken", "TokenRefreshRequired", "ExpiredTokenException"):
            return StorageError(
                f"{uri}: the AWS session credentials have expired ({code}); refresh them (aws sso login, or a new "
                "role session) and run the job again"
            )
        message = exc.response.get("Error", {}).get("Message", "")
        if code == "InvalidObjectState":  # a 403 too, but no credential will read it
            return StorageError(
                f"{uri}: the object is archived (Glacier or Deep Archive: {message or code}); restore it "
                "(aws s3api restore-object) or copy it to a readable storage class, then run the job again"
            )
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
            # S3's own words where it gives them: a KMS key the role may not use says so there
            said = f": {message}" if message and message != "Forbidden" else ""
            return StorageError(
                f"{uri}: access denied ({code}{said}); check the AWS credentials, the bucket policy and, for an "
                "SSE-KMS object, the KMS key's policy"
            )
        if code == "400" and exc.operation_name == "HeadObject":  # a HEAD's answer has no body to say why
            message += (
                "; S3 says no more to a HEAD: an expired session token is the usual cause, so refresh the credentials"
            )
        # 501 NotImplemented: the endpoint lacks the feature; asking again will not add it
        transient = (status or 0) >= 500 and status != 501 and code != "NotImplemented"
        return StorageError(f"{uri}: S3 error {code or status}: {message}", transient=transient)
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return StorageError(
            f"{uri}: no AWS credentials ({exc}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
            "or run where a role provides them"
        )
    if isinstance(exc, ParamValidationError):  # refused before sending: the URI, not the network
        return StorageError(f"{uri}: not a request S3 can take ({exc}); check the URI")
    if isinstance(exc, EndpointConnectionError):
        host = _host(exc.kwargs.get("endpoint_url", ""))
        if not _answered_hosts and not on_aws(host.split(":")[0]):
            return StorageError(
                f"{uri}: could not connect to S3 at {host or 'its endpoint'}, which has not answered once; check "
                "AWS_ENDPOINT_URL_S3 (or AWS_ENDPOINT_URL, or the profile's endpoint_url) and that the endpoint "
                "is up"
            )
    if isinstance(exc, BotoCoreError | ConnectionError | TimeoutError | urllib3.exceptions.HTTPError):
        # (the raw socket errors are what s3transfer's retries end on, as their last error)
        return StorageError(
            f"{uri}: could not reach S3 ({exc}); check AWS_ENDPOINT_URL_S3 and the network", transient=True
        )
    if disk_full(exc):
        return StorageError(
            f"{uri}: the disk is full ({exc}); free space under TRAINYARD_HOME, or set TRAINYARD_CACHE_MAX_BYTES "
            "below what it can hold"
        )
    return StorageError(f"{uri}: {exc}")


def bucket_missing(client, bucket: str) -> bool:
    """Whether S3 says for certain that ``bucket`` does not exist (HeadBucket's 404). Anything else,
    a role that may not HEAD it, a 5xx, an unreachable endpoint, is not certain: False."""
    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404
    except BotoCoreError:
        return False
    return False


def configured_region() -> str | None:
    """The region the AWS configuration names (``AWS_DEFAULT_REGION``, the profile's), or None where it
    names none: boto3 then signs for us-east-1 and follows S3's redirect to a bucket in another region."""
    return _session_and_client()[0].region_name


def bucket_region(client, bucket: str) -> str | None:
    """The region S3 says ``bucket`` is in (HeadBucket's ``x-amz-bucket-region``, which S3 sends with a 403
    too), or None where it says nothing (no such bucket, an unreachable endpoint)."""
    try:
        response = client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        response = exc.response
    except BotoCoreError:
        return None
    return response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says a write found no space (or no quota) left: trying again will not help."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def upload_file(path: Path, uri: str) -> str:
    """Upload a local file with the transfer manager, with a SHA-256 checksum S3 verifies on receipt
    (per part for multipart uploads). A failed multipart upload is aborted, so no partial object is
    left. Returns the object's URI."""
    target = S3Uri.parse(uri)
    if path.stat().st_size >= TRANSFER_CONFIG.multipart_threshold:
        _abort_abandoned_uploads(target)
    try:
        client().upload_file(
            str(path), target.bucket, target.key, Config=TRANSFER_CONFIG, ExtraArgs={"ChecksumAlgorithm": "SHA256"}
        )
    except S3UploadFailedError as exc:
        # boto3 raises it inside its handler without "from": the failed request is the context
        raise describe_error(exc.__cause__ or exc.__context__ or exc, str(target)) from exc
    except (ClientError, BotoCoreError) as exc:
        raise describe_error(exc, str(target)) from exc
    return str(target)


def _abort_abandoned_uploads(target: S3Uri) -> None:
    """Abort the multipart uploads of ``target``'s key left open: a process killed mid-upload (a job's
    earlier run) cannot abort its own, and S3 keeps (and bills) their parts until someone does. Best
    effort: a role that may not list them leaves them to the bucket's lifecycle rule."""
    with contextlib.suppress(ClientError, BotoCoreError):
        listed = client().list_multipart_uploads(Bucket=target.bucket, Prefix=target.key)
        for upload in listed.get("Uploads", []):
            if upload["Key"] == target.key:
                client().abort_multipart_upload(Bucket=target.bucket, Key=target.key, UploadId=upload["UploadId"])


def put_bytes(uri: str, data: bytes) -> str:
    """Put a small object in one request, with a SHA-256 checksum S3 verifies; returns its URI."""
    target = S3Uri.parse(uri)
    try:
        client().put_object(Bucket=target.bucket, Key=target.key, Body=data, ChecksumAlgorithm="SHA256")
    except (ClientError, BotoCoreError) as exc:
        raise describe_error(exc, uri) from exc
    return uri


def delete_quietly(uri: str) -> bool:
    """Delete one object, as a clean-up after a failure: whether it went; an error is not raised, since
    the failure being cleaned up after is the one to report."""
    target = S3Uri.parse(uri)
    try:
        client().delete_object(Bucket=target.bucket, Key=target.key)
    except (ClientError, BotoCoreError):
        return False
    return True
