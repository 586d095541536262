"""The disaster fallback: the job's training state in S3 every N committed steps.

While any replica group is alive, a restarted group heals from it and no checkpoint is read. Only
when every group is lost (or a restarted group finds no peer ahead of it) does a group start from
the latest checkpoint here. Off by default (``elastic.checkpoint_every_steps``): it costs a
serialisation per checkpoint on the group that writes it (the upload runs in the background).

Checkpoints are ``<output prefix>/<job id>/checkpoints/<launch id>/step-<step>.pt``, the launch the train
stage's own (``TrainingPlan.launch_id``): a rerun of the job id never resumes from an earlier run's state,
which may be of other data or another spec. An upload that fails or is
interrupted leaves no object (the transfer manager aborts it), so every listed one is whole; it is
checked against the checksum its upload stored when it is read back.
"""

from __future__ import annotations

import io
import logging
import re
import tempfile
import threading
from pathlib import Path

import torch
from botocore.exceptions import BotoCoreError, ClientError

from trainyard import outputs, s3, staging
from trainyard.errors import StorageError
from trainyard.spec import TrainingJob

log = logging.getLogger(__name__)
_NAME = re.compile(r"step-(\d+)\.pt$")


def prefix(job: TrainingJob, job_id: str, launch_id: str) -> s3.S3Uri:
    """Where the checkpoints of the job's launch ``launch_id`` go."""
    return outputs.job_prefix(job, job_id).join(f"checkpoints/{launch_id or 'unlaunched'}/")


class Checkpointer:
    """Writes a checkpoint every ``every`` committed steps, uploading it in a background thread."""

    def __init__(self, job: TrainingJob, job_id: str, launch_id: str, every: int, scratch: Path):
        self.every, self.scratch = every, scratch
        self.prefix = prefix(job, job_id, launch_id)
        self._upload: threading.Thread | None = None
        self.written: list[int] = []

    def due(self, step: int) -> bool:
        """Whether ``step`` is one to save at: every ``every``-th, unless the previous upload is still running
        (asked before the state is built: building it copies the model, the optimizer and the sifter's memory)."""
        return bool(self.every) and not step % self.every and not (self._upload and self._upload.is_alive())

    def save(self, step: int, state: dict, manager_state: dict) -> None:
        """Snapshot the state now and upload it in the background (at a step ``due`` said yes to)."""
        buffer = io.BytesIO()
        torch.save({"step": step, "manager": manager_state, "state": state}, buffer)  # a snapshot, now
        # The buffer itself goes to the upload thread: getvalue() would hold a second copy of the state
        self._upload = threading.Thread(target=self._put, args=(step, buffer), daemon=True)
        self._upload.start()

    def _put(self, step: int, buffer: io.BytesIO) -> None:
        with tempfile.NamedTemporaryFile(dir=self.scratch, suffix=".pt") as tmp:
            tmp.write(buffer.getbuffer())
            tmp.flush()
            buffer.close()  # on disk now: its memory is freed before the upload, not after
            try:
                s3.upload_file(Path(tmp.name), str(self.prefix.join(f"step-{step:09d}.pt")))
                self.written.append(step)
            except StorageError as exc:  # the fallback is best effort: training goes on without it
                log.warning("checkpoint at step %d not written: %s", step, exc)

    def close(self) -> None:
        """Wait for the upload in flight."""
        if self._upload is not None:
            self._upload.join()


def latest(job: TrainingJob, job_id: str, launch_id: str) -> tuple[str, int] | None:
    """The newest checkpoint of the job's launch ``launch_id``: its URI and step, or None."""
    where = prefix(job, job_id, launch_id)
    best: tuple[str, int] | None = None
    try:
        for page in s3.client().get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=where.key):
            for obj in page.get("Contents", []):
                match = _NAME.search(obj["Key"])
                if match and (best is None or int(match.group(1)) > best[1]):
                    best = (f"s3://{where.bucket}/{obj['Key']}", int(match.group(1)))
    except (ClientError, BotoCoreError) as exc:
        raise s3.describe_error(exc, str(where)) from exc
    return best


def load(uri: str, scratch: Path) -> tuple[dict, int]:
    """A checkpoint's contents and its size in bytes.

    It is fetched into ``scratch`` as staging fetches a channel's objects (concurrent ranged parts
    when large, checked against the checksum its upload stored, so corrupt bytes are fetched again or
    named), then loaded memory-mapped: the group's memory holds it once, in its model and optimizer.
    """
    path = scratch / ".checkpoint.pt"
    try:
        size = staging.fetch_object(uri, path).size
        # On the CPU: loading copies it into the group's model and optimizer, wherever they are.
        return torch.load(path, weights_only=True, map_location="cpu", mmap=True), size
    finally:
        path.unlink(missing_ok=True)  # the mapped pages stay readable until the state is copied out
