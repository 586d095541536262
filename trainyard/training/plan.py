"""The files through which the train stage and its replica groups talk, in the job's folder.

``plan.json`` (written by the train stage) is the go signal: replica processes started by the
launch stage wait for it. ``stop.json`` asks every group to stop at its next step; ``scale.json``
asks the train stage for another number of groups, and ``supervisor.json`` says which process runs
the train stage. Each group attempt writes ``replicas/<r>/attempt-<a>/progress.json`` after every
epoch, ``counts.json`` (its running counts, rewritten in place by one write) after every committed step,
and ``result.json`` plus ``model.pt`` when it finishes. Every other write is atomic (temporary name, then
rename).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainyard.home import write_json_atomic
from trainyard.redaction import redact_job_variables

PLAN_FILE = "plan.json"
CHANNEL_ENV_PREFIX = "TRAINYARD_CHANNEL_"
SAGEMAKER_CHANNEL_ENV_PREFIX = "SM_CHANNEL_"
STOP_FILE = "stop.json"
SCALE_FILE = "scale.json"
SUPERVISOR_FILE = "supervisor.json"
LIGHTHOUSE_ENV = "TRAINYARD_LIGHTHOUSE"  # set by the train-replica flow from its parameter
LAUNCH_ENV = "TRAINYARD_LAUNCH_ID"  # the launch a group belongs to: set by the launcher, or the flow's parameter


def export_channels(extra_channels: dict[str, str]) -> None:
    """Name each extra channel's folder in ``TRAINYARD_CHANNEL_<NAME>``, where entrypoints look, and in
    SageMaker's ``SM_CHANNEL_<NAME>``, where a script ported from SageMaker looks."""
    for name, folder in extra_channels.items():
        for prefix in (CHANNEL_ENV_PREFIX, SAGEMAKER_CHANNEL_ENV_PREFIX):
            os.environ[f"{prefix}{name.upper()}"] = folder


@dataclass(slots=True)
class TrainingPlan:
    """Everything a replica group needs to train: the job, its data, and how to find its peers."""

    job_id: str
    job: dict
    train_data: str
    validation_data: str | None
    schema: dict
    num_replicas: int
    lighthouse_addr: str
    train_layout: list[dict] = field(default_factory=list)
    streamed: bool = False
    extra_channels: dict[str, str] = field(default_factory=dict)
    # When the supervisor released the groups (Unix time): every group's epoch times count from it, so a
    # restarted group's history, whose early epochs it healed from a peer, reads as one clock.
    released_unix: float | None = None
    # The launch whose groups this plan releases: a group of another (an earlier run of the job id, whose
    # pipeline died before its plan) must not take it (``replica.wait_for_plan``). Empty: any group.
    launch_id: str = ""
    # How long a group waits in a quorum for the groups its step needs (``restarts.quorum_timeout_seconds``,
    # set by the supervisor; this default is its figure for local groups at the default silence limit).
    quorum_timeout_seconds: float = 240.0

    def export_channels(self) -> None:
        """Name each extra channel's folder where entrypoints look (``export_channels``)."""
        export_channels(self.extra_channels)

    def write(self, job_dir: Path) -> None:
        # The groups read no work-pool job variables (the launcher passes them): secret-named ones (an env's
        # DB_PASSWORD) are masked in the file, which a shared TRAINYARD_HOME volume may show other jobs.
        plan = asdict(self)
        write_json_atomic(job_dir / PLAN_FILE, plan | {"job": redact_job_variables(plan["job"])})

    @classmethod
    def read(cls, job_dir: Path) -> TrainingPlan:
        return cls(**json.loads((job_dir / PLAN_FILE).read_text()))


def attempt_dir(job_dir: Path, replica: int, attempt: int) -> Path:
    """The folder of one attempt of one replica group."""
    path = job_dir / "replicas" / str(replica) / f"attempt-{attempt}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def request_stop(job_dir: Path, reason: str, message: str) -> None:
    """Ask every replica group to stop at its next step boundary."""
    write_json_atomic(job_dir / STOP_FILE, {"reason": reason, "message": message})


def stop_requested(job_dir: Path) -> dict | None:
    """The stop request, if one was made."""
    path = job_dir / STOP_FILE
    return json.loads(path.read_text()) if path.exists() else None


def request_scale(job_dir: Path, replicas: int) -> None:
    """Ask the train stage to run ``replicas`` groups: it starts new ones, or asks some to leave.

    Each request has an id of its own: asking again for the number last asked for (after a group
    was lost to a spot notice, say) is a new request, acted on."""
    write_json_atomic(job_dir / SCALE_FILE, {"replicas": replicas, "id": uuid.uuid4().hex})


def scale_requested(job_dir: Path) -> tuple[int, str] | None:
    """The last request, if any: ``(groups asked for, the request's id)``."""
    path = job_dir / SCALE_FILE
    try:
        found = json.loads(path.read_text())
        return int(found["replicas"]), str(found.get("id", ""))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
