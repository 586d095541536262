"""A spec read from a file (YAML) and changed by ``--set`` overrides, and ``trainyard validate`` on it: what
cannot be read is named with the file and the fix."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tests.unit.specs import DESIGN_EXAMPLE, minimal
from trainyard.cli import app
from trainyard.errors import SpecError
from trainyard.spec import apply_overrides, load_job, parse_job


def test_overrides_apply_yaml_values():
    data = minimal()
    apply_overrides(
        data,
        [
            "hyperparameters.epochs=5",
            "resources.replicas=2",
            "stopping.max_runtime_seconds=600",
            "carbon.pue=1.2",
        ],
    )
    job = parse_job(data)
    assert job.hyperparameters.epochs == 5
    assert job.resources.replicas == 2
    assert job.stopping.max_runtime_seconds == 600 and job.carbon.pue == 1.2
    with pytest.raises(SpecError, match="key.path=value"):
        apply_overrides(minimal(), ["novalue"])


def test_load_job_reports_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_job(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML") as refused:
        load_job(bad)
    assert f'in "{bad}", line 1' in str(refused.value)  # the file named where the error is, not "<unicode string>"


def test_unreadable_job_files_and_bad_override_values_are_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="is a folder"):
        load_job(tmp_path)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(SpecError, match="not UTF-8"):
        load_job(latin1)
    with pytest.raises(SpecError, match=r"--set 'name=\[unclosed': the value is not valid YAML"):
        apply_overrides(minimal(), ["name=[unclosed"])
    result = CliRunner().invoke(app, ["validate", str(tmp_path)])
    # rich wraps at 80 columns, where a longer temporary path (another user's, pytest-xdist's) moves the break
    assert result.exit_code == 2 and "is a folder" in " ".join(result.output.split())


def test_validate_command(tmp_path):
    runner = CliRunner()
    good = tmp_path / "good.yaml"
    good.write_text(DESIGN_EXAMPLE)
    result = runner.invoke(app, ["validate", str(good)])
    assert result.exit_code == 0, result.output
    assert "valid job" in result.stdout  # the result on stdout, warnings on stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(DESIGN_EXAMPLE.replace("replicas: 2,", "replicas: 9,"))
    result = runner.invoke(app, ["validate", str(bad), "--set", "hyperparameters.epochs=0"])
    assert result.exit_code == 2
    assert "hyperparameters.epochs" in result.output
    assert "Traceback" not in result.output
