"""A stop's grace (``supervisor.STOP_GRACE_SECONDS``) lasts while a group is on its way to the step all stop at, and a
group's model is saved before it waits for a checkpoint upload: either way the job stops with the model it was
stopped to keep. Groups waiting on peers that left are still shut down when it runs out (``test_training.py``)."""

from __future__ import annotations

from tests.unit.jobs import make_job, run
from trainyard.training import supervisor


def test_a_stop_asked_during_a_validation_longer_than_the_grace_keeps_the_model(trainyard_home, monkeypatch):
    # the grace ran out 2 s after the request: SIGTERM, then SIGKILL 5 s later, in the middle of the validation
    monkeypatch.setattr(supervisor, "STOP_GRACE_SECONDS", 2.0)
    job, *rest = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:stop_then_slow_validation_build"},
        hyperparameters={"epochs": 5, "batch_size": 64, "learning_rate": 0.01, "validation_seconds": 10},
        resources={"replicas": 1},
    )
    outcome, _ = run(job, *rest)  # was: every replica group failed (killed), the model lost
    assert outcome.stop_reason == "Stopped" and outcome.model_path and not outcome.failures
    assert outcome.replicas_finished == [0]


def test_a_checkpoint_upload_in_flight_does_not_hold_back_a_stopped_groups_model(trainyard_home, bucket, monkeypatch):
    # each upload takes 30 s, so one is in flight when max_runtime stops the job: the group waited for it before
    # saving its model, and the grace ran out first
    monkeypatch.setattr(supervisor, "STOP_GRACE_SECONDS", 2.0)
    job, *rest = make_job(
        trainyard_home,
        output={"s3_uri": f"s3://{bucket}/out/"},
        algorithm={"entrypoint": "tests.unit.jobs:slow_upload_build"},
        hyperparameters={"epochs": 1000, "batch_size": 64, "learning_rate": 0.01, "upload_seconds": 30},
        resources={"replicas": 1},
        stopping={"max_runtime_seconds": 8},
        elastic={"checkpoint_every_steps": 5},
    )
    outcome, _ = run(job, *rest)
    assert outcome.stop_reason == "MaxRuntimeExceeded" and outcome.model_path and not outcome.failures
