"""``trainyard jobs`` without a Prefect API: every command says so at once, and nothing is queued.

The commands themselves, against a real ``prefect server`` and workers, are in
``tests/integration/test_deployment.py``."""

from __future__ import annotations

import os
import signal
import time

import pytest
import yaml
from prefect.client.schemas.objects import State, StateType
from prefect.settings import PREFECT_API_URL, temporary_settings
from typer.testing import CliRunner

from tests.unit.specs import minimal
from trainyard.cli import app


@pytest.mark.parametrize(
    "command",
    [["list"], ["describe", "0" * 8 + "-0000-4000-8000-" + "0" * 12], ["logs", "x"], ["stop", "x"], ["submit", "JOB"]],
)
def test_without_an_api_url_the_jobs_commands_say_so(command, tmp_path, monkeypatch):
    # Without one, Prefect's client would start a temporary server of its own and answer from it: an empty
    # job list after seconds, "no deployment" for a submit, as if the user's server had none.
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(minimal()))
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        result = CliRunner().invoke(app, ["jobs", *[str(spec) if part == "JOB" else part for part in command]])
    assert result.exit_code == 2, result.output
    assert "PREFECT_API_URL is not set" in result.stderr and not result.stdout, result.output


def test_an_api_that_does_not_answer_exits_1_a_service_problem_not_2_the_commands():
    # scripts tell "fix the command" (2) from "try again" (1), as the models commands do
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing listens there
        result = CliRunner().invoke(app, ["jobs", "list"])
    assert result.exit_code == 1, result.output
    assert "did not answer" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("deployment", ["nope", "training-pipeline/", "/on-demand", "a/b/c"])
def test_a_deployment_name_not_flow_slash_deployment_is_a_mistake_named_before_the_api_is_asked(deployment, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(minimal()))
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:1/api"}):  # nothing listens: never asked
        result = CliRunner().invoke(app, ["jobs", "submit", str(spec), "--deployment", deployment])
    assert result.exit_code == 2, result.output
    assert f"deployment {deployment!r} is not FLOW/DEPLOYMENT" in result.stderr and not result.stdout, result.output


def test_interrupting_submit_wait_says_the_job_goes_on_and_how_to_stop_it(tmp_path, monkeypatch):
    from flows import client

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # as a supervisor ends it; --wait takes it as Ctrl-C
        time.sleep(5)  # (the signal's handler raises here)

    monkeypatch.setattr(client, "submit", lambda *args: "run-1")
    monkeypatch.setattr(client, "wait", interrupted)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(minimal()))
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(app, ["jobs", "submit", str(spec), "--wait"])
    assert signal.getsignal(signal.SIGTERM) is before  # put back
    assert result.exit_code == 130 and result.stdout.strip() == "run-1", result.output
    flat = " ".join(result.stderr.split())
    assert "stopped waiting; the job goes on" in flat and "trainyard jobs stop run-1" in flat, flat


def test_submit_wait_with_a_timeout_stops_waiting_and_says_the_job_goes_on(tmp_path, monkeypatch):
    from flows import client

    scheduled = {"status": "Scheduled", "secondary_status": "Starting", "secondary_status_transitions": []}
    monkeypatch.setattr(client, "submit", lambda *args: "run-1")
    monkeypatch.setattr(client, "status", lambda run_id: scheduled)  # no worker ever picks it up
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(minimal()))
    result = CliRunner().invoke(app, ["jobs", "submit", str(spec), "--wait", "--timeout", "1"])
    assert result.exit_code == 124, result.output
    flat = " ".join(result.stderr.split())
    assert (
        "still Scheduled: no worker has picked it up" in flat
        and "after 1 s" in flat
        and "the job goes on: `trainyard jobs describe run-1`" in flat
    ), flat


def test_a_jobs_status_is_its_last_tries_with_each_status_ended_by_the_next():
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from flows import job_events

    t0 = datetime(2026, 12, 5, tzinfo=UTC)

    def event(seconds: int, payload: dict):
        return SimpleNamespace(occurred=t0 + timedelta(seconds=seconds), payload=payload)

    def status(seconds: int, name: str) -> dict:
        return {"status": name, "start_time": f"t{seconds}", "end_time": None, "message": name}

    first_try = [status(0, "Starting"), status(1, "Downloading"), status(2, "Failed")]
    events = [event(i, p) for i, p in enumerate(first_try)] + [event(3, {"ended": {"failure_reason": "boom"}})]
    api = SimpleNamespace(read_events=lambda *a, **k: SimpleNamespace(events=events))
    transitions, ended = job_events.read(api, "j", "run-1", t0)
    assert [(t["status"], t["end_time"]) for t in transitions] == [
        ("Starting", "t1"),
        ("Downloading", "t2"),
        ("Failed", "t2"),  # a final status ends as it begins, as the summary has it
    ]
    assert ended == {"failure_reason": "boom"}
    # the run retried (the same run id): the first try's outcome is not the job's now
    events += [event(10, status(10, "Starting")), event(11, status(11, "Downloading"))]
    transitions, ended = job_events.read(api, "j", "run-1", t0)
    assert [(t["status"], t["end_time"]) for t in transitions] == [("Starting", "t11"), ("Downloading", None)]
    assert ended is None
    # a status told again further on (Training: launching, then training) is one transition, with the later word
    events += [event(12, status(12, "Training") | {"message": "Launching replica groups"})]
    events += [event(13, status(12, "Training") | {"message": "Training in progress"})]
    transitions, _ = job_events.read(api, "j", "run-1", t0)
    assert [(t["status"], t["message"]) for t in transitions][-1] == ("Training", "Training in progress")
    assert [t["status"] for t in transitions] == ["Starting", "Downloading", "Training"]


def test_a_job_that_scaled_often_keeps_its_first_transitions():
    # a trainyard.job.scaled event each change of size, on the job's resource: read by the prefix, the newest
    # page of 50 held only those, and the job's Starting and Training were gone
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from flows import job_events

    t0 = datetime(2026, 12, 5, tzinfo=UTC)
    sent = [("trainyard.job.starting", {"status": "Starting", "start_time": "t0", "end_time": None, "message": ""})]
    sent += [("trainyard.job.training", {"status": "Training", "start_time": "t1", "end_time": None, "message": ""})]
    sent += [("trainyard.job.scaled", {"replicas": 2 + i % 2}) for i in range(60)]
    events = [SimpleNamespace(event=n, occurred=t0 + timedelta(seconds=i), payload=p) for i, (n, p) in enumerate(sent)]

    def read_events(filter, limit):  # as the API answers: matching names, the newest page
        names = filter.event
        matching = [
            e
            for e in events
            if (names.name and e.event in names.name) or any(e.event.startswith(p) for p in names.prefix or [])
        ]
        return SimpleNamespace(events=sorted(matching, key=lambda e: e.occurred, reverse=True)[:limit])

    transitions, _ = job_events.read(SimpleNamespace(read_events=read_events), "j", "run-1", t0)
    assert [t["status"] for t in transitions] == ["Starting", "Training"]


def test_a_job_on_a_worker_whose_clock_is_ahead_or_behind_is_read_whole():
    # an event's time is its sender's clock: Prefect's filter ended at the caller's now, so a worker 20 s ahead had
    # its job's end unseen (wait read a job over without it); one 20 s behind, its start before the run was made
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from flows import job_events

    now = datetime.now(UTC)
    for skew in (timedelta(seconds=20), timedelta(seconds=-20)):
        sent = [
            {"status": "Starting", "start_time": "t0", "end_time": None, "message": ""},
            {"status": "Completed", "start_time": "t1", "end_time": None, "message": ""},
            {"ended": {"status": "Completed", "metrics": {"val_accuracy": 0.9}}},
        ]
        events = [SimpleNamespace(occurred=now + skew + timedelta(seconds=i), payload=p) for i, p in enumerate(sent)]

        def read_events(filter, limit, events=events):  # as the API answers: within the filter's times, oldest first
            return SimpleNamespace(events=[e for e in events if filter.occurred.includes(e)][:limit])

        created = now - timedelta(seconds=5)  # the run, by the API's clock
        transitions, ended = job_events.read(SimpleNamespace(read_events=read_events), "j", "run-1", created)
        assert [t["status"] for t in transitions] == ["Starting", "Completed"]
        assert ended == {"status": "Completed", "metrics": {"val_accuracy": 0.9}}


def test_wait_tells_a_retried_runs_transitions_once_each_the_new_try_included(monkeypatch):
    from flows import client

    def state(*statuses: tuple[str, str], status: str = "InProgress") -> dict:
        transitions = [{"status": s, "start_time": t, "end_time": None, "message": ""} for s, t in statuses]
        final = status != "InProgress"
        said = {"status": status, "secondary_status": statuses[-1][0], "secondary_status_transitions": transitions}
        return said | {"started": True, "metrics": {"val_accuracy": 0.9} if final else None}

    answers = [
        state(("Starting", "t0"), ("Downloading", "t1"), ("Training", "t2")),
        state(("Starting", "t10")),  # the run again (rescheduled): its new try's transitions alone
        state(("Starting", "t10"), ("Downloading", "t11")),
        state(("Starting", "t10"), ("Downloading", "t11"), ("Completed", "t12"), status="Completed"),
    ]
    monkeypatch.setattr(client, "status", lambda run_id: answers.pop(0) if len(answers) > 1 else answers[0])
    told = []
    client.wait("r", poll_seconds=0.01, on_transition=lambda t: told.append((t["status"], t["start_time"])))
    assert told == [("Starting", "t0"), ("Downloading", "t1"), ("Training", "t2")] + [
        ("Starting", "t10"),
        ("Downloading", "t11"),
        ("Completed", "t12"),
    ]


def test_jobs_lists_a_crashed_runs_job_as_it_ended_as_status_does(monkeypatch):
    # SIGTERM from a worker shut down: the job wrote its summary as Stopped, Prefect marked its run Crashed
    import contextlib
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from flows import client, job_events

    def run(name: str, kind: str, message: str) -> SimpleNamespace:
        state = State(type=StateType(kind), name=kind.title(), message=message)
        return SimpleNamespace(
            id=name,
            name=name,
            state=state,
            parameters={"job_id": name, "job": {"name": "churn"}},
            tags=[],
            created=datetime(2026, 12, 7, tzinfo=UTC),
            end_time=datetime(2026, 12, 7, 1, tzinfo=UTC),  # (its events long in: its summary artifact read too)
            start_time=None,
            expected_start_time=None,
            run_count=1,
        )

    runs = [run("reclaimed", "CRASHED", "Flow run infrastructure exited"), run("broke", "CRASHED", "exit 137")]
    runs.append(run("last-week", "CRASHED", "Flow run infrastructure exited"))  # its events since let go
    api = SimpleNamespace(read_flow_runs=lambda **_: runs)
    kept = {"last-week": ([{"status": "Stopped"}], {"failure_reason": "Terminated"})}  # its summary artifact
    monkeypatch.setattr(job_events, "from_summary_artifact", lambda api, run_id: kept.get(run_id, ([], None)))
    monkeypatch.setattr(client, "_api", lambda: contextlib.nullcontext(api))
    said = {"reclaimed": ([{"status": "Stopped"}], {"failure_reason": "Terminated"})}
    monkeypatch.setattr(job_events, "read", lambda api, job_id, run_id, since: said.get(job_id, ([], None)))
    rows = {r["job_id"]: (r["status"], r["reason"]) for r in client.jobs()}
    assert rows == {
        "reclaimed": ("Stopped", "Terminated"),
        "broke": ("Failed", "exit 137"),
        "last-week": ("Stopped", "Terminated"),
    }


def test_a_run_past_its_events_reads_its_summary_artifact_but_not_an_earlier_trys(monkeypatch):
    # Prefect keeps events 7 days: a job finished before read without metrics or model. Its summary artifact says
    # them; but a retried run's last artifact may be an earlier try's (the last try killed before publishing)
    import contextlib
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from flows import client, job_events

    state = State(type=StateType.CRASHED, name="Crashed", message="exit 137")
    ended_at = datetime.now(UTC) - timedelta(days=8)
    run = SimpleNamespace(id="r", name="j", parameters={"job_id": "j"}, state=state)
    run.created = run.end_time = ended_at
    first_try = [{"status": "Starting", "start_time": "t0"}, {"status": "Failed", "start_time": "t1"}]
    monkeypatch.setattr(client, "_api", lambda: contextlib.nullcontext(None))
    monkeypatch.setattr(client, "_read_run", lambda api, run_id: run)
    monkeypatch.setattr(job_events, "progress", lambda *_: None)
    monkeypatch.setattr(job_events, "from_summary_artifact", lambda api, run_id: (first_try, {"failure_reason": "x"}))
    for events, reason in (
        (([], None), "x"),  # let go: the artifact's
        ((first_try[:1], None), "x"),  # the same try's start
        (([{"status": "Starting", "start_time": "t5"}], None), "exit 137"),  # a later try's: not the first's end
    ):
        monkeypatch.setattr(job_events, "read", lambda *_, events=events: events)
        said = client.status("r")
        assert said["failure_reason"] == reason
        assert said["secondary_status"] == ("Failed" if reason == "x" else "Starting")


def test_a_status_entered_again_with_a_new_message_is_told_again_and_stays_one_transition():
    from trainyard.status import StatusLog

    told: list[dict] = []
    log = StatusLog(on_transition=lambda t: told.append(dict(t)))
    log.enter("Training", "Launching replica groups")
    log.enter("Training", "Training in progress")  # what a service following the job's events must see too
    assert [t["message"] for t in told] == ["Launching replica groups", "Training in progress"]
    assert [(t["status"], t["message"]) for t in log.transitions] == [("Training", "Training in progress")]


def test_a_services_mistakes_are_told_apart_by_type_not_by_their_words(monkeypatch):
    from flows import client

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}), pytest.raises(client.ApiNotSet):
        client.status("0" * 8 + "-0000-4000-8000-" + "0" * 12)
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing is asked of it below
        with pytest.raises(client.DeploymentNotFound):
            client.submit(minimal(), deployment="nope")
        with pytest.raises(client.RunNotFound):
            client.status("nope")
        # each is a TrainyardError too (the CLI's exit 2), and a LookupError where that is what it is
        assert issubclass(client.RunNotFound, LookupError) and issubclass(client.WaitTimeout, TimeoutError)
        training = {"status": "InProgress", "secondary_status": "Training", "secondary_status_transitions": []}
        monkeypatch.setattr(client, "status", lambda run_id: training)
        with pytest.raises(client.WaitTimeout, match="still Training after 0.1 s"):
            client.wait("any", timeout_seconds=0.1, poll_seconds=0.05)


def test_a_crashed_run_whose_job_wrote_its_end_has_the_jobs_status(monkeypatch):
    # a worker shut down (SIGTERM, not a cancel): Prefect marks the run Crashed, the job ended Stopped first
    import contextlib
    from types import SimpleNamespace

    from flows import client, job_events

    def run(state: str):
        return SimpleNamespace(
            id="r",
            name="j",
            parameters={"job_id": "j"},
            created=None,
            end_time=None,
            state=SimpleNamespace(type=SimpleNamespace(value=state), name=state.title(), message="crashed"),
        )

    ended = [
        {"status": "Training", "start_time": "2026-12-05T10:00:00+00:00"},
        {"status": "Stopped", "start_time": "t1"},
    ]
    monkeypatch.setattr(client, "_api", lambda: contextlib.nullcontext(None))
    monkeypatch.setattr(job_events, "read", lambda api, job_id, run_id, since: (ended, None))
    monkeypatch.setattr(client, "_read_run", lambda api, run_id: run("CRASHED"))
    monkeypatch.setattr(job_events, "from_summary_artifact", lambda api, run_id: ([], None))  # none made
    monkeypatch.setattr(job_events, "progress", lambda api, job_id, run_id, since: None)
    assert client.status("r")["status"] == "Stopped"
    # one that crashed before the job could say how it ended (killed outright) stays Failed
    monkeypatch.setattr(job_events, "read", lambda api, job_id, run_id, since: (ended[:1], None))
    assert client.status("r")["status"] == "Failed"


def test_wait_rides_out_an_api_that_does_not_answer_and_says_the_job_goes_on_when_it_gives_up(monkeypatch):
    from types import SimpleNamespace

    from flows import client

    closed = {PREFECT_API_URL: "http://127.0.0.1:9/api"}  # nothing listens there
    with temporary_settings(closed), pytest.raises(client.ApiUnreachable, match="did not answer"):  # not httpx's
        client.jobs()
    answers = [client.ApiUnreachable("down"), client.ApiUnreachable("down")]
    stopping = {"status": "Stopping", "secondary_status": "Training", "secondary_status_transitions": []}
    stopped = {"status": "Stopped", "secondary_status": "Stopped", "secondary_status_transitions": []}
    stopped |= {"metrics": None, "started": False}
    answers += [stopping, stopped]

    def status(run_id):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(client, "status", status)
    assert client.wait("r", poll_seconds=0.01)["status"] == "Stopped"  # Stopping (cancelling) is not an end
    cancelling = SimpleNamespace(type=SimpleNamespace(value="CANCELLING"), name="Cancelling")
    assert client._run_status(cancelling) == "Stopping"  # was InProgress, beside a secondary status Stopped
    monkeypatch.setattr(client, "API_OUTAGE_SECONDS", 0.05)
    monkeypatch.setattr(client, "status", lambda run_id: _raise())
    with pytest.raises(client.ApiUnreachable, match="stopped waiting for job run r, which goes on"):
        client.wait("r", poll_seconds=0.01)
    # the wait's own timeout passing in an outage is its timeout (exit 124), not the API's (it was exit 1)
    monkeypatch.setattr(client, "API_OUTAGE_SECONDS", 60.0)
    with pytest.raises(client.WaitTimeout, match="the wait for job run r timed out meanwhile"):
        client.wait("r", poll_seconds=0.01, timeout_seconds=0.05)


def _raise():
    from flows import client

    raise client.ApiUnreachable("the Prefect API did not answer")
