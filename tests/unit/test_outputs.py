"""The job's outputs in output.s3_uri: uploaded with checksums, an interrupted upload aborted (no partial
object), upload errors described, and a missing output bucket found before any compute (both endpoints)."""

from __future__ import annotations

import pytest

from tests import s3_endpoints
from tests.unit.objects import BIG
from trainyard import outputs, s3
from trainyard.errors import StorageError
from trainyard.spec import parse_job

s3_endpoint = s3_endpoints.s3_endpoint
fault_proxy = s3_endpoints.fault_proxy


def output_job(bucket: str):
    """A job whose outputs go to ``s3://<bucket>/output/``."""
    return parse_job(
        {
            "name": "out",
            "algorithm": {"builtin": "mlp-classifier"},
            "inputs": {"train": {"s3_uri": f"s3://{bucket}/t/", "label": "y"}},
            "output": {"s3_uri": f"s3://{bucket}/output/"},
        }
    )


def test_outputs_are_uploaded_with_checksums_and_an_interrupted_upload_leaves_nothing(
    s3_endpoint, fault_proxy, tmp_path, monkeypatch
):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # fail fast: the part below never goes through
    bucket = s3_endpoint.new_bucket()
    job = output_job(bucket)
    uri = outputs.upload_summary(job, "job-1", {"status": "Completed"})
    head = s3_endpoint.client().head_object(Bucket=bucket, Key="output/job-1/summary.json", ChecksumMode="ENABLED")
    assert uri == f"s3://{bucket}/output/job-1/summary.json" and head.get("ChecksumSHA256")
    model = tmp_path / "model.pt"
    model.write_bytes(bytes(BIG))
    fault_proxy.drop(1000, method="PUT", key="partNumber=2")  # every try of the second part fails
    with pytest.raises(StorageError, match=f"s3://{bucket}/output/job-2/model/model.pt"):
        s3.upload_file(model, f"s3://{bucket}/output/job-2/model/model.pt")
    client = s3_endpoint.client()
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="output/job-2/")
    # The multipart upload was aborted (S3 would otherwise keep, and bill, its parts): the proxy saw
    # the abort answered. rclone serve s3 does not list multipart uploads; moto can say none is left.
    aborts = [outcome for method, target, outcome in fault_proxy.log if method == "DELETE" and "uploadId=" in target]
    assert aborts and all(outcome.startswith("2") for outcome in aborts), fault_proxy.log
    if s3_endpoint.name == "moto":
        assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    fault_proxy.clear_faults()
    s3.upload_file(model, f"s3://{bucket}/output/job-2/model/model.pt")
    head = client.head_object(Bucket=bucket, Key="output/job-2/model/model.pt", ChecksumMode="ENABLED")
    assert head["ContentLength"] == BIG
    if s3_endpoint.capabilities["multipart_checksum"]:  # rclone keeps none for a multipart upload
        assert head.get("ChecksumSHA256")


def test_a_missing_output_bucket_is_found_before_any_compute_and_upload_errors_are_named(s3_endpoint, tmp_path):
    bucket = s3_endpoint.new_bucket()

    def job(output: str):
        train = {"s3_uri": f"s3://{bucket}/t/", "label": "y"}
        return parse_job(
            {
                "name": "o",
                "algorithm": {"builtin": "mlp-classifier"},
                "inputs": {"train": train},
                "output": {"s3_uri": output},
            }
        )

    outputs.check_destination(job(f"s3://{bucket}/output/"))  # there: no error
    with pytest.raises(
        StorageError, match="output.s3_uri s3://no-such-out-bucket/o/: bucket 'no-such-out-bucket' does not exist"
    ) as found:
        outputs.check_destination(job("s3://no-such-out-bucket/o/"))
    assert not found.value.transient
    # boto3's upload error does not chain the request's: described from its context, not as raw text
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(StorageError, match="s3://no-such-out-bucket/k: bucket does not exist; create it"):
        s3.upload_file(tmp_path / "f", "s3://no-such-out-bucket/k")


@pytest.mark.parametrize("failing", ["model.pt", "model.json"])
def test_a_model_that_fails_to_upload_leaves_no_half_model(s3_endpoint, fault_proxy, tmp_path, monkeypatch, failing):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    bucket = s3_endpoint.new_bucket()
    job = output_job(bucket)
    model = tmp_path / "model.pt"
    model.write_bytes(b"parameters")
    fault_proxy.drop(1000, method="PUT", key=failing)
    with pytest.raises(StorageError, match=f"s3://{bucket}/output/job-3/model/{failing}"):
        outputs.upload_model(job, "job-3", model, {"num_outputs": 2})
    assert "Contents" not in s3_endpoint.client().list_objects_v2(Bucket=bucket, Prefix="output/job-3/")
    fault_proxy.clear_faults()
    uri = outputs.upload_model(job, "job-3", model, {"num_outputs": 2})
    listed = s3_endpoint.client().list_objects_v2(Bucket=bucket, Prefix="output/job-3/")["Contents"]
    assert uri == f"s3://{bucket}/output/job-3/model/"
    assert sorted(o["Key"] for o in listed) == ["output/job-3/model/model.json", "output/job-3/model/model.pt"]
    fault_proxy.drop(1000, method="PUT", key=failing)  # a rerun of the job id whose upload fails
    with pytest.raises(StorageError):
        outputs.upload_model(job, "job-3", model, {"num_outputs": 2})
    # not the earlier run's model.pt left without its model.json
    assert "Contents" not in s3_endpoint.client().list_objects_v2(Bucket=bucket, Prefix="output/job-3/")


@pytest.mark.parametrize("interrupt", ["model.json", "model.pt"])
def test_a_signal_during_the_model_upload_leaves_no_half_model(s3_endpoint, tmp_path, monkeypatch, interrupt):
    bucket = s3_endpoint.new_bucket()
    model = tmp_path / "model.pt"
    model.write_bytes(b"parameters")

    def interrupted(path, uri):
        real(path, uri)  # a single PUT already sent lands as the transfer manager winds down
        if uri.endswith(interrupt):
            raise KeyboardInterrupt  # as Prefect's TerminationSignal for SIGTERM: not an Exception

    real = s3.upload_file

    monkeypatch.setattr(s3, "upload_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        outputs.upload_model(output_job(bucket), "job-3", model, {"num_outputs": 2})
    assert "Contents" not in s3_endpoint.client().list_objects_v2(Bucket=bucket, Prefix="output/job-3/")


def test_a_multipart_upload_a_killed_run_left_open_is_aborted_by_the_next_upload_of_its_key(s3_server, tmp_path):
    # moto's server (rclone's lists no multipart uploads): the parts of an upload nobody aborts are kept
    # (and billed) for good
    client = s3.client()
    bucket = f"left-open-{tmp_path.name[-8:].lower().replace('_', '-')}"
    client.create_bucket(Bucket=bucket)
    key = "output/job-9/model/model.pt"
    started = client.create_multipart_upload(Bucket=bucket, Key=key)  # the killed run's, one part up
    client.upload_part(Bucket=bucket, Key=key, UploadId=started["UploadId"], PartNumber=1, Body=b"p" * 5 * 2**20)
    other = client.create_multipart_upload(Bucket=bucket, Key=key + ".other")  # another key's: left alone
    big = tmp_path / "model.pt"
    big.write_bytes(b"m" * (s3.TRANSFER_CONFIG.multipart_threshold + 1))
    s3.upload_file(big, f"s3://{bucket}/{key}")
    open_uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["UploadId"] for u in open_uploads] == [other["UploadId"]]
    assert client.head_object(Bucket=bucket, Key=key)["ContentLength"] == big.stat().st_size
