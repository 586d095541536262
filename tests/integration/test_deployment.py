"""The deployed path, as a platform team runs it: a real ``prefect server`` on 127.0.0.1, the pools from
``trainyard infra apply``, the deployments from ``prefect.yaml``, one process worker for the pipeline and
two for the replica groups. Jobs come in as another service would send them: ``run_deployment``,
``flows.client.submit`` and Prefect's REST API; replica groups run as ``train-replica`` flow runs."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import mlflow
import psutil
import pytest
import yaml
from typer.testing import CliRunner

from flows import client
from tests.conftest import job_dict, rejoined, slow_until, upload_dataset, wait_for_step
from tests.integration import deployed_path
from tests.integration.deployed_path import (
    GPU_POOL,
    attempt_folder,
    pool_room,
    replica_runs,
    rest,
    summary_of,
    worker_logs,
)
from trainyard.cli import app

# Above the longest test's own waits (a lost worker's: 240 s, then 500 s), so that those fail first, with the
# workers' logs, not the suite's 300 s with nothing; the first test's also covers the module's fixture.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(800)]
deployed = deployed_path.deployed  # the module's server, pools, deployments and workers


def test_run_deployment_runs_the_pipeline(deployed, bucket):
    from prefect.deployments import run_deployment

    url, mlflow_uri, home, _ = deployed
    spec = job_dict(upload_dataset(bucket, rows=400))
    spec["name"] = "deployed-job"
    run = run_deployment("training-pipeline/on-demand", parameters={"job": spec}, timeout=300)
    assert run.state.is_completed(), (run.state, worker_logs(home))
    summary = summary_of(run.name)  # a run started without a job id is named after the one it made
    assert summary["status"] == "Completed"
    assert summary["prefect_flow_run_id"] == str(run.id)
    assert mlflow.MlflowClient(mlflow_uri).get_registered_model("deployed-job").name == "deployed-job"
    # a data mistake fails the run with its message, and its logs (what a service reads) hold no traceback
    spec["inputs"]["train"]["s3_uri"] = "s3://no-such-bucket-here/train/"
    failed = client.wait(client.submit(spec), timeout_seconds=180)
    assert failed["status"] == "Failed" and "no-such-bucket-here" in failed["failure_reason"], failed
    lines = [entry["message"] for entry in client.logs(failed["flow_run_id"])]
    assert lines and not [line for line in lines if "Traceback" in line], "\n".join(lines)


def test_trainyard_jobs_submit_validates_queues_and_follows_a_job(deployed, bucket, tmp_path):
    _, _, home, _ = deployed
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_dict(upload_dataset(bucket, rows=400))))
    submit = ["jobs", "submit", str(path)]
    bad = CliRunner().invoke(app, [*submit, "--set", "hyperparameters.epochs=0"])
    assert bad.exit_code == 2 and "hyperparameters.epochs" in bad.stderr and not bad.stdout, bad.output
    nowhere = CliRunner().invoke(app, [*submit, "--deployment", "training-pipeline/nope"])
    assert nowhere.exit_code == 2 and "no deployment 'training-pipeline/nope'" in nowhere.stderr, nowhere.output
    result = CliRunner().invoke(app, [*submit, "--set", "name=cli-job", "--idempotency-key", "k1", "--wait"])
    assert result.exit_code == 0, (result.output, worker_logs(home))
    run_id = result.stdout.strip()  # the run id alone on stdout, for scripts
    assert "cli-job-" in result.stderr and ": Completed (Completed)" in result.stderr, result.stderr
    # each secondary status printed once, in order, as the job entered it
    statuses = ["Starting", "Downloading", "Training", "Uploading", "Completed"]
    printed = [line.split()[1] for line in result.stderr.splitlines() if line[:2].isdigit() and line[2] == ":"]
    assert printed == statuses, result.stderr
    described = client.status(run_id)
    assert described["status"] == "Completed" and described["failure_reason"] is None
    assert summary_of(described["job_id"])["status"] == "Completed"
    # every status with its end, and the outcome without reading S3: metrics, the version, the summary's place
    assert all(t["end_time"] for t in described["secondary_status_transitions"]), described
    assert described["model"]["name"] == "cli-job" and described["model"]["version"] == 1, described
    assert 0 <= described["metrics"]["val_accuracy"] <= 1, described
    assert described["summary_uri"].endswith(f"/{described['job_id']}/summary.json"), described
    again = CliRunner().invoke(app, [*submit, "--set", "name=cli-job", "--idempotency-key", "k1"])
    assert again.exit_code == 0 and again.stdout.strip() == run_id  # the same key: the same job, not a second
    other = CliRunner().invoke(app, [*submit, "--set", "name=other-job", "--idempotency-key", "k1"])
    assert other.exit_code == 2 and "already started run" in other.stderr and not other.stdout, other.output
    logs = CliRunner().invoke(app, ["jobs", "logs", run_id])
    assert logs.exit_code == 0 and "registered cli-job version 1" in logs.stdout, logs.output
    # each stage's lines say which stage (its task run) logged them
    assert re.search(r"/registry-\w+: registered cli-job version 1", logs.stdout), logs.stdout


def test_groups_run_as_flow_runs_and_a_killed_one_is_resubmitted_and_heals(deployed, bucket, tmp_path):
    url, _, home, _ = deployed
    spec = job_dict(upload_dataset(bucket, rows=800), resources={"replicas": 2, "work_pool": GPU_POOL})
    # 40 ms steps, 1,200 of them: the survivor is still training when the resubmitted run is back (~15 s);
    # the steps left after that run at full speed.
    spec["algorithm"] = {"entrypoint": "tests.unit.jobs:slow_build"}
    spec["hyperparameters"] |= {"epochs": 120, "step_sleep": 0.04}
    spec["elastic"] = {"fault_injection": [{"replica": 1, "at_step": 30, "kind": "kill"}]}
    submitted = time.time()
    with slow_until(tmp_path / "slow", lambda: rejoined(attempt_folder(run_id, 1, 1))) as hold:
        spec["hyperparameters"]["slow_while"] = hold
        run_id = client.submit(spec)
        final = client.wait(run_id, timeout_seconds=400)
    assert final["status"] == "Completed", (final, worker_logs(home))
    assert [t["status"] for t in final["secondary_status_transitions"]][-1] == "Completed"
    summary = summary_of(final["job_id"])
    runs = replica_runs(final["job_id"])
    # groups 0 and 1, then group 1's resubmission after its process was killed (Crashed)
    assert sorted((r.parameters["replica"], r.parameters["attempt"]) for r in runs) == [(0, 0), (1, 0), (1, 1)]
    states = {(r.parameters["replica"], r.parameters["attempt"]): r.state.type.value for r in runs}
    assert states[(1, 0)] == "CRASHED" and states[(1, 1)] == "COMPLETED" and states[(0, 0)] == "COMPLETED"
    # a CPU job (gpus_per_replica 0): each run is told to hide the GPU worker's GPUs (test_train_replica.py)
    assert {r.parameters["gpus_per_replica"] for r in runs} == {0}
    (recovery,) = summary["elastic"]["recoveries"]
    assert recovery["source"] == "peer" and recovery["failed_at_step"] == 30
    assert summary["training"]["replicas_finished"] == [0, 1]
    # the job's logs: the pipeline's and each group run's, by run name (trainyard jobs logs)
    lines = client.logs(run_id)
    by_run = {line["run"] for line in lines if line["message"].startswith("replica group ")}
    assert by_run == {r.name for r in runs}, lines[-20:]
    assert any(line["message"].startswith("launched 2 replica group(s)") for line in lines)
    assert not any(line["message"].startswith("replica group ") for line in client.logs(run_id, groups=False))
    # The launch overhead, for the record (not a test target): submit to the first step of a group.
    beats = Path(os.environ["TRAINYARD_HOME"]).glob(f"jobs/{final['job_id']}/replicas/*/attempt-0/steps.jsonl")
    first_step = min(json.loads(p.read_text().splitlines()[0])["unix"] for p in beats)
    print(f"launch overhead: {first_step - submitted:.1f} s from submit to the first committed step")


def test_a_job_submitted_through_the_rest_api_completes(deployed, bucket):
    url, _, home, _ = deployed
    spec = job_dict(upload_dataset(bucket, rows=400), resources={"replicas": 2, "work_pool": GPU_POOL})
    spec["name"] = "rest-job"
    deployment = rest(urllib.request.Request(f"{url}/deployments/name/training-pipeline/on-demand"))
    request = urllib.request.Request(
        f"{url}/deployments/{deployment['id']}/create_flow_run",
        data=json.dumps({"parameters": {"job": spec}}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    run_id = rest(request)["id"]
    final = client.wait(run_id, timeout_seconds=300)
    assert final["status"] == "Completed", (final, worker_logs(home))
    assert summary_of(final["job_id"])["status"] == "Completed"
    groups = sorted((r.parameters["replica"], r.state.type.value) for r in replica_runs(final["job_id"]))
    assert groups == [(0, "COMPLETED"), (1, "COMPLETED")]  # two groups, each a flow run on the GPU pool
    # a spec the form or another service sent wrong fails before any compute, and describe says why
    del spec["inputs"]["train"]["label"]
    request.data = json.dumps({"parameters": {"job": spec}}).encode()
    failed = client.wait(rest(request)["id"], timeout_seconds=120)
    assert failed["status"] == "Failed" and "inputs.train" in (failed["failure_reason"] or ""), failed
    (row,) = [r for r in client.jobs(limit=50) if r["flow_run_id"] == failed["flow_run_id"]]
    assert row["status"] == "Failed" and "inputs.train" in row["reason"], row  # jobs list's reason column


def test_stop_cancels_the_pipeline_and_every_group(deployed, bucket):
    url, _, home, _ = deployed
    spec = job_dict(upload_dataset(bucket, rows=400), resources={"replicas": 2, "work_pool": GPU_POOL})
    spec["hyperparameters"]["epochs"] = 100_000
    run_id = client.submit(spec)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        job_id = client.status(run_id)["job_id"]
        if len([r for r in replica_runs(job_id) if r.state and r.state.is_running()]) == 2:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the groups never ran: {worker_logs(home)}")
    for replica in (0, 1):  # both training, their SIGTERM handlers (leave at a step boundary) in place
        wait_for_step(attempt_folder(run_id, replica, 0) / "heartbeat.json", 20)
    # a service following the job sees how far it is (epochs of 5 steps: at least 2 ended) and what it says
    deadline = time.monotonic() + 30
    while (now := client.status(run_id))["progress"] is None and time.monotonic() < deadline:
        time.sleep(1)
    assert now["progress"] is not None, f"no progress 30 s into training: {now}"
    assert now["progress"]["epochs_done"] >= 1 and now["progress"]["epochs"] == 100_000, now
    assert "val_accuracy" in now["progress"]["metrics"], now
    assert now["secondary_status_transitions"][-1]["message"] == "Training in progress", now
    result = CliRunner().invoke(app, ["jobs", "stop", run_id])
    assert result.exit_code == 0 and "cancelled 3 run(s)" in result.output, result.output
    final = client.wait(run_id, timeout_seconds=120)
    assert final["status"] == "Stopped" and final["failure_reason"] == "Cancelled", final  # not a worker's SIGTERM
    deadline = time.monotonic() + 60
    while any(not r.state.is_final() for r in replica_runs(job_id)) and time.monotonic() < deadline:
        time.sleep(1)
    assert all(r.state.type.value == "CANCELLED" for r in replica_runs(job_id))
    assert sorted(r.name for r in replica_runs(job_id)) == [f"{job_id}-g0-a0", f"{job_id}-g1-a0"]
    # each group left at a step boundary (its result written), not killed in a quorum whose lighthouse was gone
    for replica in (0, 1):
        result = json.loads((attempt_folder(run_id, replica, 0) / "result.json").read_text())
        assert result["stop_reason"] == "Left", result
    # torchft's INFO (several lines a step) stays out of the workers' logs, as it does for local groups, and
    # so does its warning at every quorum that a CPU build of torch has no NCCL flight recorder to reset
    for log in home.glob(f"worker-{GPU_POOL}-*.log"):
        text = log.read_text(errors="replace")
        assert "[INFO] [torchft" not in text and "NCCL flight recorder" not in text, log
    # a run id the API does not know, or that is not one, is named as such (exit 2, no traceback)
    for wrong, says in (("0" * 8 + "-0000-4000-8000-" + "0" * 12, "no flow run"), ("nope", "is not a flow run id")):
        for command in ("stop", "describe"):
            result = CliRunner().invoke(app, ["jobs", command, wrong])
            assert result.exit_code == 2 and says in result.output, result.output


def test_a_lost_worker_has_its_group_resubmitted_and_healed(deployed, bucket, tmp_path):
    """A GPU node dies: its worker and the group it runs are killed at once, so nobody reports the run.
    The supervisor finds the group silent and cancels its run; no worker confirms, so the run is marked
    Crashed and the group resubmitted. The spare worker runs it, and it heals from the live group."""
    url, _, home, gpu_workers = deployed
    spec = job_dict(upload_dataset(bucket, rows=800), resources={"replicas": 2, "work_pool": GPU_POOL})
    spec["algorithm"] = {"entrypoint": "tests.unit.jobs:slow_build"}
    # 50 ms steps, 1,700 of them: the survivor is still training when the lost group is found silent
    # (12 s), given up on (15 s more) and back from the spare worker (~15 s); the rest at full speed.
    spec["hyperparameters"] |= {"epochs": 170, "step_sleep": 0.05}
    with slow_until(tmp_path / "slow", lambda: rejoined(attempt_folder(run_id, 1, 1))) as hold:
        spec["hyperparameters"]["slow_while"] = hold
        run_id = client.submit(spec)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            group = attempt_folder(run_id, 1, 0)
            if (group / "heartbeat.json").exists() and json.loads((group / "heartbeat.json").read_text())["step"] >= 20:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"group 1 never trained: {worker_logs(home)}")
        group_pid = int((group / "pid").read_text())
        ancestors = {p.pid for p in psutil.Process(group_pid).parents()}
        (node,) = [w for w in gpu_workers if w.pid in ancestors]
        os.kill(node.pid, signal.SIGKILL)  # the worker first, so it cannot report its run Crashed
        os.kill(group_pid, signal.SIGKILL)
        final = client.wait(run_id, timeout_seconds=500)
    assert final["status"] == "Completed", (final, worker_logs(home))
    job_id = final["job_id"]
    runs = {(r.parameters["replica"], r.parameters["attempt"]): r for r in replica_runs(job_id)}
    assert sorted(runs) == [(0, 0), (1, 0), (1, 1)]
    lost = runs[1, 0].state
    assert lost.type.value == "CRASHED" and "presumed lost with its worker" in lost.message
    assert runs[1, 1].state.type.value == "COMPLETED" and runs[0, 0].state.type.value == "COMPLETED"
    summary = summary_of(job_id)
    (recovery,) = summary["elastic"]["recoveries"]
    assert recovery["source"] == "peer"
    assert "silent" in summary["elastic"]["failure_details"][0]["message"]
    assert summary["training"]["replicas_finished"] == [0, 1]


def test_a_scheduled_run_fires(deployed, bucket):
    """The nightly deployment from prefect.yaml comes with its cron schedule (inactive as shipped).
    A schedule of the kind a team adds, carrying its own job, fires through the server's scheduler
    and a worker, and the job completes."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.schedules import IntervalSchedule

    url, _, home, _ = deployed
    spec = job_dict(upload_dataset(bucket, rows=400))
    spec["name"] = "scheduled-job"
    with get_client(sync_client=True) as api:
        deployment = api.read_deployment_by_name("training-pipeline/nightly-churn")
        (shipped,) = api.read_deployment_schedules(deployment.id)
        assert shipped.schedule.cron == "0 2 * * *" and shipped.active is False
        # The server's scheduler looks every 5 s here (60 s by default): it must see this schedule
        # before its first time passes, or the first run would be tomorrow's.
        first = datetime.now(UTC) + timedelta(seconds=20)
        daily = IntervalSchedule(interval=timedelta(days=1), anchor_date=first)
        api.create_deployment_schedules(
            deployment.id, [DeploymentScheduleCreate(schedule=daily, active=True, parameters={"job": spec})]
        )
        only_this = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done = [r for r in api.read_flow_runs(deployment_filter=only_this) if r.state and r.state.is_final()]
            if done:
                break
            time.sleep(2)
        else:
            pytest.fail(f"no scheduled run finished: {worker_logs(home)}")
    (run,) = done
    assert "auto-scheduled" in run.tags
    assert run.state.is_completed(), (run.state, worker_logs(home))
    assert summary_of(run.name)["status"] == "Completed" and summary_of(run.name)["job_name"] == "scheduled-job"
    # the schedule's next runs, not started: listed by their spec's name and when they are due
    listed = CliRunner().invoke(app, ["jobs", "list", "--limit", "200"])
    assert listed.exit_code == 0, listed.output
    assert "scheduled-job (not started)" in listed.stdout and "due " in listed.stdout, listed.stdout


def test_a_job_fills_up_to_max_replicas_as_the_pool_has_room(deployed, bucket, tmp_path):
    """replicas 1, max_replicas 2 on the GPU pool while it has room for one group: the second group's
    run waits queued (not failed) while the first trains. When the pool grows (the limit raised, as
    when a node joins), it starts, heals from the first group and trains with it to the end."""
    url, _, home, _ = deployed
    resources = {"replicas": 1, "max_replicas": 2, "work_pool": GPU_POOL}
    spec = job_dict(upload_dataset(bucket, rows=800), resources=resources)
    spec["algorithm"] = {"entrypoint": "tests.unit.jobs:slow_build"}
    # 40 ms steps while the second group is away, up to 3,000 of them (~120 s): the first group is still
    # training when the second joins, however long its flow run takes to start on a busy machine (with
    # 1,300, CI once saw the first group finish before the second had committed a step: no join); the
    # steps left after the join run at full speed, shared by the two groups.
    spec["hyperparameters"] |= {"epochs": 300, "step_sleep": 0.04}
    pool_room(url, 1)
    with slow_until(tmp_path / "slow", lambda: rejoined(attempt_folder(run_id, 1, 0))) as hold:
        spec["hyperparameters"]["slow_while"] = hold
        try:
            run_id = client.submit(spec)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                job_id = client.status(run_id).get("job_id")
                beat = attempt_folder(run_id, 0, 0) / "heartbeat.json"
                queued = [r for r in replica_runs(job_id) if r.parameters["replica"] == 1] if job_id else []
                if queued and beat.exists() and json.loads(beat.read_text())["step"] >= 200:
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"the first group never trained: {worker_logs(home)}")
            (waiting,) = [r for r in replica_runs(job_id) if r.parameters["replica"] == 1]
            assert waiting.state.type.value == "SCHEDULED", waiting.state  # queued for room, not failed
        finally:
            pool_room(url, 4)
        final = client.wait(run_id, timeout_seconds=400)
    assert final["status"] == "Completed", (final, worker_logs(home))
    elastic = summary_of(job_id)["elastic"]
    assert [(c["from"], c["to"]) for c in elastic["scaling"]] == [(1, 2)]
    assert len(elastic["joins"]) == 1, (elastic, summary_of(job_id)["training"], worker_logs(home))
    (join,) = elastic["joins"]
    assert join["replica"] == 1 and join["source"] == "peer" and join["joined_at_step"] > 200
    assert summary_of(job_id)["training"]["replicas_finished"] == [0, 1]
    assert elastic["withdrawn"] == []


def test_a_group_still_queued_when_the_job_ends_is_withdrawn(deployed, bucket):
    """The pool never has room for the job's second group: its run is cancelled when the job ends."""
    url, _, home, _ = deployed
    resources = {"replicas": 1, "max_replicas": 2, "work_pool": GPU_POOL}
    spec = job_dict(upload_dataset(bucket, rows=400), resources=resources)
    spec["algorithm"] = {"entrypoint": "tests.unit.jobs:slow_build"}
    spec["hyperparameters"]["epochs"] = 50  # ~5 s of training: group 1 is asked for while it runs
    pool_room(url, 1)
    try:
        final = client.wait(client.submit(spec), timeout_seconds=300)
    finally:
        pool_room(url, 4)
    assert final["status"] == "Completed", (final, worker_logs(home))
    elastic = summary_of(final["job_id"])["elastic"]
    assert elastic["withdrawn"] == [1] and all(j["replica"] != 1 for j in elastic["joins"])  # it never trained
    # Withdrawn while group 0 was still exiting. A run still queued is cancelled at once ("withdrawn before it
    # started"); one a worker had just claimed as group 0's room came free is cancelled by that worker moments
    # later, after the job has ended.
    deadline = time.monotonic() + 60
    while True:
        runs = {r.parameters["replica"]: r.state for r in replica_runs(final["job_id"])}
        if runs[1].type.value != "CANCELLING" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert runs[0].type.value == "COMPLETED"
    assert runs[1].type.value == "CANCELLED", runs[1]


def test_the_first_groups_start_without_one_the_pool_has_no_room_for(deployed, bucket):
    """replicas 2, min_replicas 1, on a pool with room for one group: the group that started trains once the
    other has sat queued a short while (it waited out the start barrier's two minutes, its GPUs idle), and
    the queued one is withdrawn when the job ends."""
    url, _, home, _ = deployed
    resources = {"replicas": 2, "min_replicas": 1, "work_pool": GPU_POOL}
    spec = job_dict(upload_dataset(bucket, rows=400), resources=resources)
    spec["algorithm"] = {"entrypoint": "tests.unit.jobs:slow_build"}
    spec["hyperparameters"]["epochs"] = 20
    pool_room(url, 1)
    try:
        run_id = client.submit(spec)
        final = client.wait(run_id, timeout_seconds=300)
    finally:
        pool_room(url, 4)
    assert final["status"] == "Completed", (final, worker_logs(home))
    summary = summary_of(final["job_id"])
    assert summary["training"]["first_batch_seconds"] < 60, summary["training"]  # not the barrier's 120 s
    # whichever group a worker took first trained; the other never started, and was withdrawn at the end
    (trained,) = summary["training"]["replicas_finished"]
    assert summary["elastic"]["withdrawn"] == [1 - trained]
    said = [line["message"] for line in client.logs(run_id, groups=False)]
    assert any("no room on work pool 'trainyard-gpu' yet" in message for message in said), said
