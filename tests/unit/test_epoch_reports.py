"""Each epoch reaches the train stage as it ends: the progress bar, the live metrics and the carbon
budget follow it. (A misplaced block once reported epochs only at the end of the job, and with them
the reset of the epoch's loss sum, so train_loss became a running mean of the job.)"""

from __future__ import annotations

from tests.unit.jobs import make_job
from trainyard import launch
from trainyard.training import supervisor


def test_every_epoch_is_reported_as_it_ends(trainyard_home):
    # 10 ms steps, 10 steps an epoch: epochs end ~0.1 s apart, as often as the train stage looks
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        resources={"replicas": 1},
        hyperparameters={"epochs": 6, "batch_size": 64, "learning_rate": 0.01},
    )
    seen: list[tuple[int, float]] = []
    handle = launch.launch(job_id, folder, job.resources)
    plan.lighthouse_addr = handle.lighthouse_addr
    try:
        outcome = supervisor.train(
            handle, plan, job, on_progress=lambda done, last: seen.append((done, last["train_loss"]))
        )
    finally:
        launch.shutdown(handle)
    assert len(seen) >= 3 and seen[0][0] < 6, seen  # not one report at the end
    assert [h["epoch"] for h in outcome.history] == [1, 2, 3, 4, 5, 6]
    for done, loss in seen:  # what was reported is what the epoch recorded
        assert loss == outcome.history[done - 1]["train_loss"]
