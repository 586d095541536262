"""The job's outputs in ``output.s3_uri``: ``<prefix>/<job id>/model/``, ``summary.json`` and, when the
prefilter ran, ``filtering/train.filtered.manifest.json``.

Uploads go through boto3's transfer manager, which aborts a failed multipart upload, so an
interrupted upload never leaves a partial object under the final key.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from trainyard import s3
from trainyard.errors import StorageError
from trainyard.spec import TrainingJob


def job_prefix(job: TrainingJob, job_id: str) -> s3.S3Uri:
    """Where this job's outputs go."""
    return s3.S3Uri.parse(job.output.s3_uri).join(job_id)


def check_destination(job: TrainingJob) -> None:
    """Fail before any compute when S3 says ``output.s3_uri``'s bucket does not exist (found out after
    training, the job's model would be lost with it). Anything less certain lets the job go on: a role
    may write to a prefix without the right to HEAD the bucket, and a passing error is staging's to retry."""
    target = s3.S3Uri.parse(job.output.s3_uri)
    if s3.bucket_missing(s3.client(), target.bucket):
        raise StorageError(
            f"output.s3_uri {job.output.s3_uri}: bucket {target.bucket!r} does not exist; create it or fix the "
            "bucket name"
        )


def upload_model(job: TrainingJob, job_id: str, model_path: Path, schema: dict) -> str:
    """Upload the trained parameters and what is needed to rebuild the model; return the model folder URI.

    ``model.json`` goes first and ``model.pt`` last, so a ``model.pt`` in S3 always has its ``model.json``;
    when ``model.pt`` fails, or a signal interrupts either upload, both are deleted (best effort), leaving
    no half model: not even an earlier run's ``model.pt`` under this job id without its ``model.json``.
    """
    target = job_prefix(job, job_id).join("model")
    meta = {
        "job_id": job_id,
        "algorithm": job.algorithm.model_dump(),
        "hyperparameters": job.hyperparameters.model_dump(),
        "schema": schema,
    }
    try:
        _upload_json(meta, str(target.join("model.json")))
        s3.upload_file(model_path, str(target.join("model.pt")))
    except BaseException:  # a failed upload, or a signal (SIGTERM's TerminationSignal, Ctrl-C)
        # model.pt too: an earlier run's (a rerun of the job id), or a single PUT still landing as the
        # transfer manager winds down after a signal
        s3.delete_quietly(str(target.join("model.pt")))
        s3.delete_quietly(str(target.join("model.json")))
        raise
    return str(target) + "/"


def remove_model(job: TrainingJob, job_id: str) -> None:
    """Delete the job id's model from its outputs (best effort): a run that trained nothing must not leave an
    earlier run's model there as if it were its own."""
    target = job_prefix(job, job_id).join("model")
    s3.delete_quietly(str(target.join("model.pt")))  # first: a model.pt is never left without its model.json
    s3.delete_quietly(str(target.join("model.json")))


def upload_file(job: TrainingJob, job_id: str, path: Path, name: str) -> str:
    """Upload one of the job's files (the filtered manifest) as ``<job prefix>/<name>``; return its URI."""
    return s3.upload_file(path, str(job_prefix(job, job_id).join(name)))


def summary_uri(job: TrainingJob, job_id: str) -> str:
    """Where the job summary is uploaded."""
    return str(job_prefix(job, job_id).join("summary.json"))


def upload_summary(job: TrainingJob, job_id: str, summary: dict) -> str:
    """Upload the job summary; return its URI."""
    uri = summary_uri(job, job_id)
    _upload_json(summary, uri)
    return uri


def published_summary(job: TrainingJob, job_id: str) -> dict | None:
    """The job summary an earlier run uploaded, or None where there is none (or it is not JSON). A refusal is
    raised: a role that may not list the bucket is answered 403 for a missing key, as for a denied one."""
    from botocore.exceptions import BotoCoreError, ClientError

    uri = summary_uri(job, job_id)
    where = s3.S3Uri.parse(uri)
    try:
        body = s3.client().get_object(Bucket=where.bucket, Key=where.key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise s3.describe_error(exc, uri) from exc
    except BotoCoreError as exc:
        raise s3.describe_error(exc, uri) from exc
    try:
        found = json.loads(body)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _upload_json(data: dict, uri: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.json"
        path.write_text(json.dumps(data, indent=2, default=str))
        s3.upload_file(path, uri)
