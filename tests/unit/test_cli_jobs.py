"""``trainyard jobs`` without a Prefect API: every command says so at once, and nothing is queued.

The commands themselves, against a real ``prefect server`` and workers, are in
``tests/integration/test_deployment.py``."""

from __future__ import annotations

import pytest
import yaml
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
        raise KeyboardInterrupt  # Ctrl-C, or SIGTERM, which --wait takes as one

    monkeypatch.setattr(client, "submit", lambda *args: "run-1")
    monkeypatch.setattr(client, "wait", interrupted)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(minimal()))
    result = CliRunner().invoke(app, ["jobs", "submit", str(spec), "--wait"])
    assert result.exit_code == 130 and result.stdout.strip() == "run-1", result.output
    flat = " ".join(result.stderr.split())
    assert "stopped waiting; the job goes on" in flat and "trainyard jobs stop run-1" in flat, flat
