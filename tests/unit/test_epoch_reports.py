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
    assert [done for done, _ in seen] == [1, 2, 3, 4, 5, 6], seen  # each once, in order, however often looked at
    assert [h["epoch"] for h in outcome.history] == [1, 2, 3, 4, 5, 6]
    for done, loss in seen:  # what was reported is what the epoch recorded
        assert loss == outcome.history[done - 1]["train_loss"]


def test_a_restarted_groups_epoch_times_read_on_the_jobs_clock_and_the_result_is_a_first_attempts(
    trainyard_home, tmp_path
):
    import json

    from tests.conftest import rejoined, slow_until

    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 40, "batch_size": 64, "learning_rate": 0.01, "slow_while": str(tmp_path / "slow")}
        | {"step_sleep": 0.05},  # held steps: 385 left give the restart about 29 s
        elastic={"fault_injection": [{"replica": 0, "at_step": 15, "kind": "kill"}]},
    )
    with slow_until(tmp_path / "slow", lambda: rejoined(folder / "replicas/0/attempt-1")):
        outcome, _ = supervisor.launch_and_train(job, plan, folder)
    assert outcome.stop_reason == "Completed" and outcome.replicas_finished == [0, 1]
    restart = json.loads((folder / "replicas/0/attempt-1/result.json").read_text())
    survivor = json.loads((folder / "replicas/1/attempt-0/result.json").read_text())
    # the restart's early epochs were healed from its peer, its later ones its own: one clock for both
    times = [e["elapsed_seconds"] for e in restart["epochs"]]
    assert times == sorted(times)  # on its own clock, its first epoch after the heal read less than the last
    # group 0's restart first saw a batch seconds into the job; the job's first batch is group 1's
    assert outcome.first_batch_seconds == survivor["first_batch_seconds"]
