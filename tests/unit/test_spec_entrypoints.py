"""An entrypoint job's spec: an entrypoint that does not import is named before a run starts (``run`` refuses,
``validate`` warns), and hyperparameters MLflow cannot record are refused before training."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from tests.unit.specs import DESIGN_EXAMPLE, minimal, problems  # noqa: F401 - DESIGN_EXAMPLE: an entrypoint the test names
from trainyard.cli import app
from trainyard.spec import parse_job


def per_row_build(num_features, num_outputs, hyperparameters):
    """An importable entrypoint for the checks below."""


@pytest.mark.parametrize(
    ("entrypoint", "says"),
    [
        ("no_such_pkg.models:build", "install the package that provides it, or add its folder to PYTHONPATH"),
        (
            "tests.unit.test_spec_entrypoints:no_such_build",
            "tests.unit.test_spec_entrypoints.no_such_build does not exist",
        ),
        (
            "tests.unit.test_spec_entrypoints:DESIGN_EXAMPLE",
            "tests.unit.test_spec_entrypoints.DESIGN_EXAMPLE is not callable",
        ),
    ],
)
def test_an_entrypoint_that_does_not_import_is_named_before_run_starts(tmp_path, monkeypatch, entrypoint, says):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(minimal(algorithm={"entrypoint": entrypoint})))
    result = CliRunner().invoke(app, ["run", str(spec)])
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output
    assert not (tmp_path / "home").exists()  # no job was made
    validated = CliRunner().invoke(app, ["validate", str(spec)])  # validate warns: it may import where it runs
    assert validated.exit_code == 0 and says in " ".join(validated.output.split())


def test_an_importable_entrypoint_gets_no_warning(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(minimal(algorithm={"entrypoint": "tests.unit.test_spec_entrypoints:per_row_build"})))
    result = CliRunner().invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0 and "where the job runs" not in " ".join(result.output.split())


def test_an_entrypoint_hyperparameter_mlflow_cannot_record_is_refused_before_training():
    """``dropout(p)`` trained a whole job, which then failed at registration (MLflow refused ``hp.dropout(p)``)."""
    entrypoint = {"entrypoint": "pkg.models:build"}
    (problem,) = problems(minimal(algorithm=entrypoint, hyperparameters={"dropout(p)": 0.1, "lr/decay": 0.5}))
    assert problem.startswith("hyperparameters: 'dropout(p)': MLflow records hyperparameters as params")
    assert problem.endswith("rename it (e.g. 'dropout_p_')")
    for bad in ("a/../b", "x" * 248, "a//b", "a/"):
        assert problems(minimal(algorithm=entrypoint, hyperparameters={bad: 1})), bad
    job = parse_job(minimal(algorithm=entrypoint, hyperparameters={"layer.0/width": 8, "warm up: steps": 2}))
    assert job.hyperparameters.model_extra == {"layer.0/width": 8, "warm up: steps": 2}
