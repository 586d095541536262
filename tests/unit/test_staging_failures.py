"""What staging refuses, and the failures it names: keys that would escape the staging folder or cannot be
laid out as files, a missing bucket, prefix or object, denied requests, missing or expired credentials, a full
disk, requests that time out, and objects deleted or replaced while they download (transient, so retried by the
task)."""

from __future__ import annotations

import errno
import http.server
import threading

import pytest
from botocore.exceptions import ClientError, ReadTimeoutError
from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceeded

from tests import s3_endpoints
from tests.unit.objects import put_big, stage
from trainyard import cache, integrity, listing, raw_layout, s3, staging
from trainyard.errors import DataError, StorageError
from trainyard.spec import Channel

s3_endpoint = s3_endpoints.s3_endpoint
fault_proxy = s3_endpoints.fault_proxy


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
        raw_layout.mirror(manifest, tmp_path / "mirror")
    assert not (tmp_path / "mirror").exists()


def test_a_channel_laid_out_again_holds_only_what_its_manifest_lists(tmp_path):
    # a retried staging task or a rerun of the job id, after an object was deleted in S3: the entrypoint saw it still
    source = tmp_path / "object"
    source.write_bytes(b"x")

    def manifest(*rels):
        objects = [listing.StagedObject("b", f"ch/{rel}", 1, "etag", rel, path=str(source)) for rel in rels]
        return listing.ChannelManifest("extra", "s3://b/ch/", "raw", objects)

    folder = raw_layout.mirror(manifest("vocab.txt", "old/config.json", "old/notes.txt"), tmp_path / "mirror")
    raw_layout.mirror(manifest("vocab.txt", "old/notes.txt"), folder)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == ["old", "old/notes.txt", "vocab.txt"]
    raw_layout.mirror(manifest("vocab.txt"), folder)
    assert [p.name for p in folder.iterdir()] == ["vocab.txt"]  # the emptied folder too
    # a file where a folder was, and a folder where a file was (S3 keys "old/notes.txt" and "vocab.txt" gone)
    raw_layout.mirror(manifest("vocab.txt", "old/notes.txt"), folder)
    raw_layout.mirror(manifest("old", "vocab.txt/part-0"), folder)
    laid_out = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
    assert laid_out == ["old", "vocab.txt", "vocab.txt/part-0"] and (folder / "old").is_file()


def test_a_key_too_long_for_a_file_name_is_named_not_a_traceback(tmp_path):
    source = tmp_path / "object"
    source.write_bytes(b"x")
    rel = "L" * 300 + ".bin"  # S3 keys may be 1,024 bytes; a file name here 255
    objects = [listing.StagedObject("b", f"ch/{rel}", 1, "etag", rel, path=str(source))]
    manifest = listing.ChannelManifest("extra", "s3://b/ch/", "raw", objects)
    with pytest.raises(DataError, match=f"s3://b/ch/{rel}: cannot be laid out as a file.*rename it in S3"):
        raw_layout.mirror(manifest, tmp_path / "mirror")
    # a local failure (here the cached file is gone) is not the key's: no advice to rename it
    gone = [listing.StagedObject("b", "ch/a.bin", 1, "etag", "a.bin", path=str(tmp_path / "evicted"))]
    with pytest.raises(StorageError, match="s3://b/ch/a.bin: laying it out under .* failed"):
        raw_layout.mirror(listing.ChannelManifest("extra", "s3://b/ch/", "raw", gone), tmp_path / "mirror2")


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
    # a table's channel: a Spark folder's side files sort first (".part-N.crc"), more than a page of them (one
    # page of 100 keys was read, all side files: the object alone was staged and the folder lost)
    for i in range(105):
        client.put_object(Bucket=bucket, Key=f"big/train/.part-{i:05}.crc", Body=b"")
    client.put_object(Bucket=bucket, Key="big/train", Body=b"an object")
    client.put_object(Bucket=bucket, Key="big/train/part-00000.parquet", Body=b"data")
    with pytest.raises(DataError, match=r"(?s)big/train is an object and also a prefix.*big/train/part-00000.parquet"):
        stage(f"s3://{bucket}/big/train", tmp_path)


def test_a_single_object_stages_for_a_role_that_may_not_list_its_bucket(s3_endpoint, tmp_path, monkeypatch):
    from botocore.exceptions import ClientError

    client, bucket = s3_endpoint.client(), s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="d/only.bin", Body=b"readable, not listable")

    def denied(**kwargs):  # s3:GetObject on the key, no s3:ListBucket
        raise ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "List")

    monkeypatch.setattr(s3.client(), "list_objects_v2", denied)
    assert [o.key for o in stage(f"s3://{bucket}/d/only.bin", tmp_path, format="raw").objects] == ["d/only.bin"]


def test_a_prefix_without_its_slash_stages_for_a_role_that_may_read_only_under_it(s3_endpoint, fault_proxy, tmp_path):
    # s3:GetObject and s3:ListBucket on "d/*" only: S3 refuses the HEAD of the bare key "d" with 403, not 404
    client, bucket = s3_endpoint.client(), s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="d/a.bin", Body=b"under the prefix")
    fault_proxy.deny(100, lambda method, target: method == "HEAD" and target.split("?")[0] == f"/{bucket}/d")
    assert [o.key for o in stage(f"s3://{bucket}/d", tmp_path, format="raw").objects] == ["d/a.bin"]
    assert fault_proxy.applied["deny"] == 1
    # nothing under it: the URI named an object the role may not read, and the refusal is what is said
    fault_proxy.deny(100, lambda method, target: method == "HEAD" and target.split("?")[0] == f"/{bucket}/e")
    with pytest.raises(StorageError, match=rf"s3://{bucket}/e: access denied"):
        stage(f"s3://{bucket}/e", tmp_path, format="raw")


def test_denied_request_is_clear(s3_endpoint, tmp_path, monkeypatch):
    s3_endpoint.skip_unless("sigv4_enforced")
    bucket = s3_endpoint.new_bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match=f"s3://{bucket}/x/: access denied"):
        stage(f"s3://{bucket}/x/", tmp_path)


def test_an_archived_object_is_named_as_archived_not_as_a_credentials_problem(s3_endpoint, tmp_path):
    s3_endpoint.skip_unless("archive_refused")
    bucket = s3_endpoint.new_bucket()
    s3_endpoint.client().put_object(Bucket=bucket, Key="x/old.bin", Body=b"cold", StorageClass="DEEP_ARCHIVE")
    with pytest.raises(StorageError, match=rf"s3://{bucket}/x/old.bin: the object is archived .*restore it") as caught:
        stage(f"s3://{bucket}/x/", tmp_path, format="raw")
    assert "credentials" not in str(caught.value) and not caught.value.transient


def test_a_denial_keeps_s3s_own_words_which_name_a_kms_key_the_role_may_not_use():
    said = "User: arn:aws:sts::1:assumed-role/train is not authorized to perform: kms:Decrypt"
    answer = {"Error": {"Code": "AccessDenied", "Message": said}, "ResponseMetadata": {"HTTPStatusCode": 403}}
    error = s3.describe_error(ClientError(answer, "GetObject"), "s3://b/k")
    assert str(error).startswith(f"s3://b/k: access denied (AccessDenied: {said}); check") and "KMS key" in str(error)


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
def test_a_local_disk_error_is_named_for_the_object_not_raised_bare(s3_endpoint, tmp_path, monkeypatch, size):
    client, bucket = s3_endpoint.client(), s3_endpoint.new_bucket()
    if size == "small":
        client.put_object(Bucket=bucket, Key="ch/a.bin", Body=b"x" * 1000)
    else:
        put_big(client, bucket, "ch/a.bin", tmp_path)

    def failing_disk(self, data):
        raise OSError(errno.EIO, "Input/output error")

    writer = (integrity.Digester, "update") if size == "small" else (integrity.FollowingDigest, "write")
    monkeypatch.setattr(*writer, failing_disk)
    with pytest.raises(StorageError, match=rf"^s3://{bucket}/ch/a.bin: .*Input/output error"):
        stage(f"s3://{bucket}/ch/", tmp_path, format="raw")


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


@pytest.mark.parametrize("size", ["small", "large"])
def test_an_object_deleted_after_listing_is_named_as_such_and_transient(s3_endpoint, tmp_path, size):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    if size == "large":
        put_big(client, bucket, "ch/a.bin", tmp_path)
    else:
        client.put_object(Bucket=bucket, Key="ch/a.bin", Body=b"x" * 100)
    manifest = listing.list_channel("train", Channel(s3_uri=f"s3://{bucket}/ch/", format="raw"))
    client.delete_object(Bucket=bucket, Key="ch/a.bin")
    with pytest.raises(StorageError, match=rf"s3://{bucket}/ch/a.bin: deleted from S3 while it was being staged"):
        staging.fetch_channel(manifest)
    # (a retry lists the channel again, without it; "no such object" was not retried)
    assert pytest.raises(StorageError, staging.fetch_channel, manifest).value.transient


def test_a_large_object_replaced_during_its_ranged_download_is_named_and_transient(s3_endpoint, tmp_path):
    s3_endpoint.skip_unless("if_match_honoured")
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    put_big(client, bucket, "ch/big.bin", tmp_path, seed=1)
    manifest = listing.list_channel("train", Channel(s3_uri=f"s3://{bucket}/ch/", format="raw"))
    arrived = []

    def replace_part_way(n: int) -> None:  # the transfer manager's callback, as its parts land
        arrived.append(n)
        if sum(arrived) >= 4 << 20 and not hasattr(replace_part_way, "done"):
            replace_part_way.done = True  # type: ignore[attr-defined]
            put_big(client, bucket, "ch/big.bin", tmp_path, seed=2)  # same size, other bytes

    with pytest.raises(StorageError, match=rf"s3://{bucket}/ch/big.bin: changed in S3") as failed:
        staging.fetch_channel(manifest, on_bytes=replace_part_way)
    assert failed.value.transient


class _ExpiredTokenS3(http.server.BaseHTTPRequestHandler):
    """What S3 answers a request signed with an expired session token: 400, the code in the body (none for a HEAD)."""

    def _answer(self, body: bool) -> None:
        xml = b"<Error><Code>ExpiredToken</Code><Message>The provided token has expired.</Message></Error>"
        self.send_response(400)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(xml)))
        self.end_headers()
        if body:
            self.wfile.write(xml)

    def do_GET(self):  # noqa: N802 - http.server's name
        self._answer(body=True)

    def do_HEAD(self):  # noqa: N802
        self._answer(body=False)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("uri", ["s3://bkt/ch/", "s3://bkt/ch/a.bin"])
def test_expired_session_credentials_are_named_with_what_to_do(tmp_path, monkeypatch, uri):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ExpiredTokenS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        with pytest.raises(StorageError) as failed:
            stage(uri, tmp_path, format="raw")
    finally:
        server.shutdown()
        server.server_close()
    message = str(failed.value)
    if uri.endswith("/"):  # a listing: S3 names the code
        assert "the AWS session credentials have expired (ExpiredToken); refresh them" in message
    else:  # a one-object URI is asked with a HEAD, whose answer has no body
        assert "an expired session token is the usual cause, so refresh the credentials" in message
    assert not failed.value.transient
