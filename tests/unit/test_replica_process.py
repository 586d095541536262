"""A replica group process's start-up (``python -m trainyard.training.replica``), in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import gc, json, sys
import trainyard.training.replica as replica
replica.wait_for_plan = lambda *_: "the plan never came (in this test)"  # main returns once start-up is done
code = replica.main(["--job-dir", sys.argv[1], "--replica", "0"])
print(json.dumps({"code": code, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}))
"""


def test_start_up_imports_without_collections_and_leaves_the_collector_on(tmp_path):
    env = {**os.environ, "TRAINYARD_CARBON_METER": "off"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 3  # no plan: the group says so and exits
    assert "the plan never came" in json.loads((tmp_path / "replicas/0/attempt-0/error.json").read_text())["message"]
    # What the imports made (torch, torchft, the engine) is out of every later collection's walk, and
    # the collector runs again for what training allocates.
    assert result["enabled"] is True
    assert result["frozen"] > 100_000


def test_sigterm_before_training_starts_ends_the_group_at_once(trainyard_home):
    # The job was stopped while this group started: its lighthouse is gone, and torchft would wait a
    # minute to reach it. Nothing is trained yet, so SIGTERM ends the group where it is, without waiting
    # for a step boundary that would come only after that minute (its worker kills it after 30 s).
    import signal
    import time

    from tests.unit.jobs import make_job
    from trainyard.servers import free_port

    job, job_id, folder, plan = make_job(trainyard_home)
    plan.lighthouse_addr = f"http://127.0.0.1:{free_port()}"  # nobody answers there
    plan.write(folder)
    group = subprocess.Popen(
        [sys.executable, "-m", "trainyard.training.replica", "--job-dir", str(folder), "--replica", "0"],
        env={**os.environ, "TRAINYARD_CARBON_METER": "off"},
    )
    try:
        pid_file = folder / "replicas/0/attempt-0/pid"
        deadline = time.monotonic() + 120
        while not pid_file.exists() and group.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)  # past the plan, into the lighthouse's connect
        assert group.poll() is None
        group.send_signal(signal.SIGTERM)
        assert group.wait(timeout=20) == -signal.SIGTERM
    finally:
        group.kill()


def test_a_group_whose_starter_died_while_it_started_gives_up_waiting_for_its_plan(tmp_path):
    # Its parent gone before its start-up read getppid(), the group took init for its parent and waited
    # six hours for a plan nobody would write.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no live process has (a starter that died)
    env = {**os.environ, "TRAINYARD_CARBON_METER": "off", "TRAINYARD_PARENT_PID": str(gone.pid)}
    command = [sys.executable, "-m", "trainyard.training.replica", "--job-dir", str(tmp_path), "--replica", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "the plan never came" in json.loads((tmp_path / "replicas/0/attempt-0/error.json").read_text())["message"]


def test_a_bad_thread_count_from_the_worker_is_the_jobs_mistake_named_and_not_retried(tmp_path):
    # a pool group's TRAINYARD_TORCH_THREADS comes from its worker's environment (the spec checks its own)
    env = {**os.environ, "TRAINYARD_CARBON_METER": "off", "TRAINYARD_TORCH_THREADS": "zero"}
    done = subprocess.run(
        [sys.executable, "-m", "trainyard.training.replica", "--job-dir", str(tmp_path), "--replica", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    error = json.loads((tmp_path / "replicas/0/attempt-0/error.json").read_text())
    assert error["user_error"] is True  # the supervisor does not restart the group for it
    assert error["message"].startswith("TRAINYARD_TORCH_THREADS='zero' is not a whole number of at least 1")


FAILING = """
import sys
import trainyard.training.replica as replica
import trainyard.training.trainer as trainer
from trainyard.errors import StorageError
replica.wait_for_plan = lambda *_: None
def train_replica(*_, **__):
    raise StorageError(sys.argv[2], transient=sys.argv[3] == "transient")
trainer.train_replica = train_replica
sys.exit(replica.main(["--job-dir", sys.argv[1], "--replica", "0"]))
"""


@pytest.mark.parametrize(("kind", "user_error"), [("transient", False), ("permanent", True)])
def test_a_transient_storage_error_is_the_groups_to_retry_a_permanent_one_the_jobs(tmp_path, kind, user_error):
    # a streamed row group S3 failed twice in a row is no mistake of the job's: the group restarts and heals
    message = "s3://b/train/part-0.parquet: row group 3 cannot be read (connection reset)"
    env = {**os.environ, "TRAINYARD_CARBON_METER": "off"}
    command = [sys.executable, "-c", FAILING, str(tmp_path), message, kind]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    error = json.loads((tmp_path / "replicas/0/attempt-0/error.json").read_text())
    assert error == {"message": f"StorageError: {message}", "kind": "StorageError", "user_error": user_error}


def test_a_pool_api_failing_at_shutdown_still_stops_the_lighthouse(caplog, monkeypatch):
    from trainyard import launch
    from trainyard.launch import LaunchHandle, ReplicaProcess

    class Unreachable:  # a work pool whose Prefect API has gone away
        def kill(self, proc):
            raise ConnectionError("the Prefect API did not answer")

        def exit_code(self, proc):
            raise ConnectionError("the Prefect API did not answer")

    monkeypatch.setitem(launch._LAUNCHERS, "gone", Unreachable())
    lighthouse = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    monkeypatch.setitem(launch._PROCESSES, lighthouse.pid, lighthouse)
    groups = [ReplicaProcess(r, 0, 0, "", run_id="0" * 32) for r in (0, 1)]
    handle = LaunchHandle("j", "/nowhere", "gone", "http://127.0.0.1:1", lighthouse.pid, 1, groups)
    launch.shutdown(handle, grace_seconds=5)
    assert lighthouse.poll() is not None  # stopped, though no group run could be cancelled
    assert caplog.text.count("could not cancel replica group") == 2


def test_a_lighthouse_port_taken_before_it_binds_is_tried_again_on_another(tmp_path, monkeypatch):
    import socket

    from trainyard import lighthouse as lighthouse_module
    from trainyard import servers
    from trainyard.errors import TrainingError
    from trainyard.lighthouse import start_lighthouse

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # another process got the free port first
    busy = taken.getsockname()[1]
    ports = iter([busy, servers.free_port()])
    monkeypatch.setattr(lighthouse_module, "free_port", lambda: next(ports))
    lighthouse, addr = start_lighthouse(tmp_path, 1)
    try:
        assert lighthouse.poll() is None and not addr.endswith(f":{busy}")
    finally:
        servers.stop_process(lighthouse)
    monkeypatch.setattr(lighthouse_module, "free_port", lambda: busy)  # every port tried is taken
    monkeypatch.setattr(lighthouse_module, "LIGHTHOUSE_TRIES", 1)  # (the retry is above: one failure says the rest)
    with pytest.raises(TrainingError, match=r"lighthouse exited at start \(code \d+\): .*(?i:in use).*lighthouse.log"):
        start_lighthouse(tmp_path, 1)
    taken.close()


def test_a_group_waiting_for_its_plan_takes_only_its_launchs_and_gives_up_on_a_lighthouse_gone(tmp_path, monkeypatch):
    from trainyard.training import replica
    from trainyard.training.plan import LAUNCH_ENV, LIGHTHOUSE_ENV, PLAN_FILE

    parent = os.getppid()
    monkeypatch.setenv(LAUNCH_ENV, "launch-b")
    (tmp_path / PLAN_FILE).write_text(json.dumps({"launch_id": "launch-b"}))
    assert replica.wait_for_plan(tmp_path, parent) is None
    # the job id run again while this group (an earlier launch's, its pipeline dead) still waited on its pool
    (tmp_path / PLAN_FILE).write_text(json.dumps({"launch_id": "launch-c"}))
    assert "another launch's (launch-c, this group's launch-b)" in replica.wait_for_plan(tmp_path, parent)
    (tmp_path / PLAN_FILE).write_text(json.dumps({}))  # a plan that names no launch: any group's
    assert replica.wait_for_plan(tmp_path, parent) is None
    # no plan yet, and the job's lighthouse (a pool group's only sign of its pipeline) does not answer
    (tmp_path / PLAN_FILE).unlink()
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://127.0.0.1:9")
    monkeypatch.setattr(replica, "LIGHTHOUSE_LOOK_SECONDS", 0.05)
    monkeypatch.setattr(replica, "LIGHTHOUSE_GONE_SECONDS", 0.3)
    assert "the job's lighthouse http://127.0.0.1:9 has not answered" in replica.wait_for_plan(tmp_path, parent)
