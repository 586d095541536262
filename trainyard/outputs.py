"""The job's outputs in ``output.s3_uri``: ``<prefix>/<job id>/model/`` and ``summary.json``.

Uploads go through boto3's transfer manager, which aborts a failed multipart upload, so an
interrupted upload never leaves a partial object under the final key.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from trainyard import s3
from trainyard.errors import StorageError
from trainyard.spec import TrainingJob


def job_prefix(job: TrainingJob, job_id: str) -> s3.S3Uri:
    """Where this job's outputs go."""
    return s3.S3Uri.parse(job.output.s3_uri).join(job_id)


def check_destination(job: TrainingJob) -> None:
    """Fail before any compute when ``output.s3_uri``'s bucket does not exist (found out after training,
    the job's model would be lost with it). A bucket this role may not HEAD passes: writing to a prefix
    needs no right to list the bucket, so a denied HEAD says nothing about the upload."""
    target = s3.S3Uri.parse(job.output.s3_uri)
    try:
        s3.client().head_bucket(Bucket=target.bucket)
    except ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status == 404 or exc.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket", "NotFound"):
            raise StorageError(
                f"output.s3_uri {job.output.s3_uri}: bucket {target.bucket!r} does not exist; create it or fix "
                "the bucket name"
            ) from exc
        if status != 403:
            raise s3.describe_error(exc, job.output.s3_uri) from exc
    except BotoCoreError as exc:
        raise s3.describe_error(exc, job.output.s3_uri) from exc


def upload_model(job: TrainingJob, job_id: str, model_path: Path, schema: dict) -> str:
    """Upload the trained parameters and what is needed to rebuild the model; return the model folder URI."""
    target = job_prefix(job, job_id).join("model")
    s3.upload_file(model_path, str(target.join("model.pt")))
    meta = {
        "job_id": job_id,
        "algorithm": job.algorithm.model_dump(),
        "hyperparameters": job.hyperparameters.model_dump(),
        "schema": schema,
    }
    _upload_json(meta, str(target.join("model.json")))
    return str(target) + "/"


def upload_summary(job: TrainingJob, job_id: str, summary: dict) -> str:
    """Upload the job summary; return its URI."""
    uri = str(job_prefix(job, job_id).join("summary.json"))
    _upload_json(summary, uri)
    return uri


def _upload_json(data: dict, uri: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.json"
        path.write_text(json.dumps(data, indent=2, default=str))
        s3.upload_file(path, uri)
