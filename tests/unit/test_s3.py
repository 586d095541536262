"""The S3 client seam (``trainyard.s3``): one client per configuration, built without the collector,
and the credentials it signs with handed to pyarrow's file system."""

from __future__ import annotations

import gc
import http.server
import os
import socket
import threading
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from trainyard import s3


@pytest.fixture
def fresh_clients(monkeypatch):
    """An empty client cache and only the test's AWS variables."""
    monkeypatch.setattr(s3, "_clients", {})
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")


@pytest.mark.parametrize("enabled_before", [True, False])
def test_a_client_is_built_with_the_collector_paused_and_it_is_left_as_it_was(
    fresh_clients, monkeypatch, enabled_before
):
    seen = []
    build = boto3.session.Session.client

    def recording(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return build(self, *args, **kwargs)

    monkeypatch.setattr(boto3.session.Session, "client", recording)
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        first = s3.client()
        after = gc.isenabled()
        again = s3.client()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False]  # built once, with the collector off
    assert after is enabled_before
    assert again is first


def test_a_change_of_aws_variables_gets_a_new_client_and_its_credentials(fresh_clients, monkeypatch):
    first = s3.client()
    assert s3.credentials().access_key == "test-key-id"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "other-key-id")
    assert s3.client() is not first
    assert s3.credentials().access_key == "other-key-id"
    # streaming's own variable, set in the client's config anyway, does not cost a new client
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    assert s3.client() is s3.client()
    assert len(s3._clients) == 2


def test_no_credentials_anywhere_gives_none(fresh_clients, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert s3.credentials() is None


def test_a_client_is_built_without_listing_every_aws_service(fresh_clients, monkeypatch):
    from botocore.loaders import Loader

    from trainyard import botocore_loader

    def full_scan(self, type_name):
        raise AssertionError(f"listed every service for {type_name}")

    monkeypatch.setattr(Loader, "list_available_services", full_scan)
    assert s3.client().meta.service_model.service_name == "s3"
    session = s3._session_and_client()[0]
    assert isinstance(session._session.get_component("data_loader"), botocore_loader.QuickLoader)


def test_the_quick_loader_knows_the_same_services_as_botocore(tmp_path, monkeypatch):
    import botocore.exceptions
    from botocore.loaders import Loader

    from trainyard import botocore_loader

    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path))
    core = botocore_loader.session()
    loader = core.get_component("data_loader")
    assert str(tmp_path) in loader.search_paths  # AWS_DATA_PATH, as botocore's own loader reads it
    known = loader.list_available_services("service-2")
    assert "s3" in known and "sts" in known and "no-such-service" not in known and 3 not in known
    assert list(known) == Loader().list_available_services("service-2")  # the full list, for whoever reads it
    with pytest.raises(botocore.exceptions.UnknownServiceError, match="no-such-service"):
        boto3.session.Session(botocore_session=core).client("no-such-service", region_name="us-east-1")


def test_the_quick_loader_reads_botocores_files_as_botocore_does(tmp_path):
    import botocore
    from botocore.loaders import JSONFileLoader

    from trainyard import botocore_loader

    data = Path(botocore.__file__).parent / "data"
    ours, theirs = botocore_loader.JSONFiles(), JSONFileLoader()
    for name in ("endpoints", "partitions", "s3/2006-03-01/service-2", "s3/2006-03-01/endpoint-rule-set-1"):
        assert ours.load_file(str(data / name)) == theirs.load_file(str(data / name)), name
    assert ours.load_file(str(data / "no-such-file")) is None
    # A model of the user's own (AWS_DATA_PATH) is read by json: orjson would make this integer a float
    (tmp_path / "big.json").write_text('{"max": 123456789012345678901234567890}')
    assert ours.load_file(str(tmp_path / "big")) == {"max": 123456789012345678901234567890}
    assert type(botocore_loader.QuickLoader().file_loader) is botocore_loader.JSONFiles


def test_transfers_keep_the_classic_transfer_manager_on_instances_the_crt_is_tuned_for(monkeypatch):
    # On the GPU instance types awscrt is optimised for, boto3's "auto" picks the CRT transfer manager,
    # which ignores TRANSFER_CONFIG's concurrency and part sizes and botocore's retry modes.
    import awscrt.s3 as awscrt_s3  # a dependency (its xxhash)
    from boto3.s3.transfer import TransferConfig, _should_use_crt

    monkeypatch.setattr(awscrt_s3, "is_optimized_for_system", lambda: True)
    assert _should_use_crt(TransferConfig())  # the default would switch on such a machine
    assert not _should_use_crt(s3.TRANSFER_CONFIG)


def test_the_first_client_is_frozen_out_of_later_collections_and_a_later_one_is_not(fresh_clients, monkeypatch):
    from trainyard import collector

    monkeypatch.setattr(collector, "_frozen", False)
    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(len(s3._clients)))
    s3.client()
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    s3.client()
    assert frozen == [1]  # once, with the first client built


def test_the_standard_retry_settings_are_honoured_as_boto3_counts_them(fresh_clients, monkeypatch, tmp_path):
    retries = lambda: s3.client().meta.config.retries  # noqa: E731
    assert retries() == {"total_max_attempts": 9, "mode": "adaptive"}  # Trainyard's defaults
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # one attempt in all, as plain boto3 reads it
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    assert retries() == {"total_max_attempts": 1, "mode": "standard"}
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    monkeypatch.delenv("AWS_RETRY_MODE")
    config = tmp_path / "config"
    config.write_text("[profile team]\nmax_attempts = 2\nretry_mode = standard\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "team")
    assert retries() == {"total_max_attempts": 2, "mode": "standard"}  # the profile's
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "three")
    with pytest.raises(s3.StorageError, match="AWS_MAX_ATTEMPTS .* 'three' is not a whole number"):
        s3.client()
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    monkeypatch.setenv("AWS_PROFILE", "tem")  # a mistyped profile: botocore's traceback, where every command said it
    with pytest.raises(s3.StorageError, match="The config profile \\(tem\\) could not be found: set AWS_PROFILE"):
        s3.client()


def test_an_endpoint_that_never_answered_is_not_retried_and_one_that_answered_before_is(fresh_clients, monkeypatch):
    """A refused connection to an endpoint that has not answered once is a wrong or stopped endpoint: the
    task's retries would only repeat botocore's wait. After one answer, a refused connection is a blip."""
    monkeypatch.setattr(s3, "_answered_hosts", set())
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")

    class Forbidden(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # any answer at all counts: here S3's "access denied"
            self.send_response(403)
            self.end_headers()

        def log_message(self, *args):
            pass

    with socket.socket() as probe:  # a port nothing listens on, until the server below takes it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://user:secret@127.0.0.1:{port}")
    with pytest.raises(EndpointConnectionError) as refused:  # nothing listens yet
        s3.client().list_objects_v2(Bucket="b")
    never = s3.describe_error(refused.value, "s3://b/ch/")
    assert not never.transient
    assert f"s3://b/ch/: could not connect to S3 at 127.0.0.1:{port}, which has not answered once" in str(never)
    assert "AWS_ENDPOINT_URL_S3" in str(never) and "secret" not in str(never)
    # on AWS (a host per bucket, no endpoint configured) a first refusal is a network not up yet: retried
    aws = EndpointConnectionError(endpoint_url="https://bkt.s3.us-east-1.amazonaws.com/ch/a.bin", error=OSError())
    assert s3.describe_error(aws, "s3://bkt/ch/a.bin").transient

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Forbidden)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with pytest.raises(ClientError):
        s3.client().list_objects_v2(Bucket="b")
    server.shutdown()
    server.server_close()
    with pytest.raises(EndpointConnectionError) as refused:
        s3.client().list_objects_v2(Bucket="b")
    blip = s3.describe_error(refused.value, "s3://b/ch/")
    assert blip.transient
    assert "could not reach S3" in str(blip)


@pytest.mark.parametrize("kind", ["application/json", "text/html; charset=utf-8"])
def test_an_endpoint_that_is_no_s3_is_named_as_such_not_as_a_missing_bucket(fresh_clients, monkeypatch, kind):
    # AWS_ENDPOINT_URL_S3 at the Prefect API's port, or at MinIO's console: it answers, but not as S3 does
    class NotS3(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"detail": "Not Found"}' if kind.startswith("application/json") else b"<html>console</html>"
            self.send_response(404)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        with pytest.raises(ClientError) as answered:
            s3.client().list_objects_v2(Bucket="trainyard-demo")
    finally:
        server.shutdown()
        server.server_close()
    error = str(s3.describe_error(answered.value, "s3://trainyard-demo/data/"))
    assert "answered 404 in " + kind.split(";")[0] + ", not as S3 does; is AWS_ENDPOINT_URL_S3" in error, error
    # a proxy's 503 page in front of S3 is an outage, retried, not a wrong endpoint
    answered.value.response["ResponseMetadata"]["HTTPStatusCode"] = 503
    answered.value.response["Error"] = {"Code": "503", "Message": "Service Unavailable"}
    assert s3.describe_error(answered.value, "s3://trainyard-demo/data/").transient
