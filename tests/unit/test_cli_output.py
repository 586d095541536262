"""What the command line prints, and checks before a job runs: problems one a line and literally, whatever
a value holds or the terminal's width; a --summary-out that cannot be written; demo's option bounds."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from tests.unit.specs import minimal
from trainyard.cli import app


def test_problems_print_literally_and_one_a_line_whatever_the_terminal(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(minimal()))
    name = "a[/b]-" + "x" * 100  # rich read [/b] as a closing tag (MarkupError) and wrapped at 80 columns
    result = CliRunner().invoke(app, ["validate", str(spec), "--set", f"name='{name}'"], env={"COLUMNS": "80"})
    assert result.exit_code == 2
    lines = result.output.splitlines()
    assert f"  - name: {name!r}: use 1-63 letters, digits or hyphens, not starting or ending with a hyphen" in lines


def test_a_summary_out_path_that_cannot_be_written_is_refused_before_the_job_runs(tmp_path, monkeypatch):
    from trainyard import cli

    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(minimal()))
    ran = []
    monkeypatch.setattr(cli, "_run_job", lambda job, out: ran.append(out) or 0)
    (tmp_path / "a-file").write_text("")
    for bad, says in ((tmp_path, "is a folder; give the file to write"), (tmp_path / "a-file/s.json", "a file is in")):
        result = CliRunner().invoke(app, ["run", str(spec), "--summary-out", str(bad)])
        assert result.exit_code == 2 and says in result.output, result.output
    assert ran == []  # nothing ran: the path was found wrong first, not after the job (a traceback, exit 1)
    missing = tmp_path / "new" / "folder" / "summary.json"
    assert CliRunner().invoke(app, ["run", str(spec), "--summary-out", str(missing)]).exit_code == 0
    assert ran == [missing] and missing.parent.is_dir()  # its folder made for it
    result = CliRunner().invoke(app, ["demo", "--replicas", "0"])
    assert result.exit_code == 2 and "--replicas" in result.output


def test_a_key_given_twice_is_refused_naming_both_lines_and_a_failing_entrypoint_is_a_warning(tmp_path):
    spec = tmp_path / "job.yaml"
    text = yaml.safe_dump(minimal(), sort_keys=False)
    spec.write_text(text + "resources: {replicas: 2}\nresources: {replicas: 3}\n")  # the first was dropped unsaid
    result = CliRunner().invoke(app, ["validate", str(spec)])
    lines = text.count("\n")
    assert result.exit_code == 2, result.output
    assert f"'resources' is given twice, at lines {lines + 1} and {lines + 2}; keep one" in result.output
    # a merge key's keys may be overridden: that is what `<<` is for
    spec.write_text(
        "name: j\nalgorithm: {builtin: mlp-classifier}\noutput: {s3_uri: 's3://bkt/out/'}\ninputs:\n"
        "  train: &channel {s3_uri: 's3://bkt/train/', label: y}\n"
        "  validation:\n    <<: *channel\n    s3_uri: 's3://bkt/validation/'\n"
    )
    result = CliRunner().invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0, result.output
    spec.write_text(yaml.safe_dump(minimal() | {"algorithm": {"entrypoint": "nosuch.mod:build"}}))
    result = CliRunner().invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0 and "warning: algorithm.entrypoint: cannot import" in " ".join(result.output.split())


def test_the_example_specs_are_valid(tmp_path):
    from pathlib import Path

    examples = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
    assert examples  # the README points new users at them
    for spec in examples:
        result = CliRunner().invoke(app, ["validate", str(spec)])
        assert result.exit_code == 0 and "warning" not in result.output, (spec, result.output)
