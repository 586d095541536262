"""``resources.job_variables`` against the rest of ``resources``: GPUs reserved that a group would not see, or that
``gpus_per_replica`` overrides, are refused; pool variables on a local job and GPUs a group would leave idle are
warned of."""

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


def test_job_variables_of_a_type_the_pools_refuse_fail_at_parse_naming_the_fix():
    # Prefect's API refused them only when the launch stage asked for the first group, after staging
    pool = {"work_pool": "trainyard-gpu"}
    assert problems(minimal(resources=pool | {"job_variables": {"env": {"OMP_NUM_THREADS": 4}}})) == [
        "resources.job_variables: env.OMP_NUM_THREADS: 4 is a number; its values are text: quote it ('4')"
    ]
    assert problems(minimal(resources=pool | {"job_variables": {"image": 123}})) == [
        "resources.job_variables: image: 123 is a number; give the image's name, as text"
    ]
    assert problems(minimal(resources=pool | {"job_variables": {"tolerations": "gpu"}})) == [
        "resources.job_variables: tolerations: 'gpu' is text; give a list of mappings (key, operator, value, effect)"
    ]
    parse_job(minimal(resources=pool | {"job_variables": {"env": {"A": "1", "B": None}, "memory": 16, "cpu": "2"}}))


def test_the_job_variables_check_agrees_with_the_pool_templates():
    import json
    from pathlib import Path

    import jsonschema

    from trainyard.spec import job_variables
    from trainyard.spec.sections import LAUNCHER_JOB_VARIABLES

    samples = ["x", "", 2, 1.5, -1, True, None, [], [{"key": "a"}], ["a"], {}, {"A": "1"}, {"A": 1}, {"A": None}]
    infra = Path(__file__).parents[2] / "infra"
    for template in ("process-gpu-pool.json", "kubernetes-gpu-pool.json"):  # (ECS: whole cpu and memory only)
        declared = json.loads((infra / template).read_text())["variables"]["properties"]
        for name in LAUNCHER_JOB_VARIABLES:
            if name not in declared:
                continue
            schema = {k: v for k, v in declared[name].items() if k not in ("default", "title", "description")}
            for value in samples:  # what a pool's API would refuse is refused at parse (it may refuse more: -1 MiB)
                if not jsonschema.Draft202012Validator(schema).is_valid(value):
                    assert job_variables.problem(name, value) is not None, (template, name, value)


def test_more_than_one_gpu_a_group_is_warned_of_as_idle():
    # a group is one process on cuda:0 (training/device.py): the GPUs past the first are reserved and never used
    two = parse_job(minimal(resources={"work_pool": "trainyard-gpu", "gpus_per_replica": 2}))
    assert [w for w in ignored_settings(two) if w.startswith("resources.gpus_per_replica")] == [
        "resources.gpus_per_replica: 2: a group trains on one GPU (more a group is not built yet), so the others "
        "it reserves stay idle; give 1 and raise resources.replicas instead"
    ]
    one = parse_job(minimal(resources={"work_pool": "trainyard-gpu", "gpus_per_replica": 1}))
    assert not [w for w in ignored_settings(one) if w.startswith("resources.gpus_per_replica")]
