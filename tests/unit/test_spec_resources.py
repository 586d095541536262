"""``resources.job_variables`` against the rest of ``resources``: GPUs reserved that a group would not see, or that
``gpus_per_replica`` overrides, are refused; pool variables on a local job are warned of."""

from __future__ import annotations

from tests.unit.specs import minimal, problems
from trainyard.spec import ignored_settings, parse_job


def test_gpus_in_job_variables_that_gpus_per_replica_would_hide_or_override_are_refused_naming_both():
    pool = {"work_pool": "trainyard-gpu"}
    hidden = problems(minimal(resources=pool | {"job_variables": {"gpus": 2}}))
    assert hidden == [
        "resources.job_variables.gpus: 2 GPUs reserved for each group, which sees none with gpus_per_replica 0 "
        "(a CPU job); set resources.gpus_per_replica: 2 instead"
    ]
    overridden = problems(minimal(resources=pool | {"gpus_per_replica": 1, "job_variables": {"gpus": 4}}))
    assert overridden == [
        "resources.job_variables.gpus: 4 disagrees with resources.gpus_per_replica 1, which sets each group's gpus; "
        "leave gpus out of job_variables"
    ]
    parse_job(minimal(resources=pool | {"gpus_per_replica": 2, "job_variables": {"gpus": 2}}))  # saying it twice


def test_pool_variables_on_a_local_job_are_warned_of():
    local = parse_job(minimal(resources={"job_variables": {"image": "x", "env": {"A": "1"}}}))
    assert [w for w in ignored_settings(local) if w.startswith("resources.job_variables")] == [
        "resources.job_variables (env, image): a work pool's, for the groups' flow runs; a local job's groups run "
        "beside the pipeline, in its environment"
    ]
    pooled = parse_job(minimal(resources={"work_pool": "p", "job_variables": {"image": "x"}}))
    assert not [w for w in ignored_settings(pooled) if w.startswith("resources.job_variables")]
