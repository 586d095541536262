"""Contracts between prefect.yaml, the work-pool templates in infra/, the launcher and the TrainingJob form.

No server: templates are checked as data and rendered through the workers' own configuration classes;
deployments are read from prefect.yaml and their entrypoints loaded.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import yaml

from infra import apply as infra
from trainyard.spec import TrainingJob

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
ALL_TEMPLATES = [infra.PIPELINE_TEMPLATE, *infra.GPU_TEMPLATES.values()]
# What apply creates, so what a deployment in prefect.yaml may name as its pool.
POOL_TEMPLATES = {infra.PIPELINE_POOL: infra.PIPELINE_TEMPLATE, infra.GPU_POOL: infra.GPU_TEMPLATES["process"]}
# One value for every launcher variable, as the launch stage would send them, per kind of pool.
LAUNCHER_VALUES = {
    "env": {"CUDA_VISIBLE_DEVICES": "0,1"},
    "gpus": 2,
    "image": "registry.example/trainyard-worker:1",
    "cpu": "8",
    "memory": "32Gi",
    "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "shm_size": "16Gi",
    "shared_memory_mib": 16384,
}
KIND_VALUES = {"process": {}, "kubernetes": {}, "ecs": {"cpu": 4096, "memory": "32768"}}


class _NoClient:
    """Stands in for the API client while rendering: the templates hold no block or variable references."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None


def _render(config_class, template: dict, values: dict):
    return asyncio.run(config_class.from_template_and_values(template, values, client=_NoClient()))


# ---- templates


@pytest.mark.parametrize("file_name", ALL_TEMPLATES)
def test_template_declares_what_it_references_and_references_what_it_declares(file_name):
    template = infra.load_template(file_name)
    assert infra.template_problems(template, launcher=file_name != infra.PIPELINE_TEMPLATE) == []
    assert template["variables"]["properties"]["env"]["default"][infra.HEARTBEAT_ENV] == "30"


def test_template_check_catches_dropped_undeclared_and_stray_variables():
    template = copy.deepcopy(infra.load_template(infra.GPU_TEMPLATES["process"]))
    props, job = template["variables"]["properties"], template["job_configuration"]
    props["unused"] = {"type": "string"}
    job["typo"] = "{{ gpu }}"
    job[infra.NOT_APPLIED_KEY]["working_dir"] = "{{ working_dir }}"
    del props["shm_size"], job[infra.NOT_APPLIED_KEY]["shm_size"]
    problems = infra.template_problems(template)
    assert "variable 'unused' is never referenced in job_configuration (dropped)" in problems
    assert "job_configuration references undeclared variable 'gpu'" in problems
    assert f"{infra.NOT_APPLIED_KEY} may hold launcher variables only, not 'working_dir'" in problems
    assert "launcher variable 'shm_size' is not declared" in problems


@pytest.mark.parametrize("kind", infra.GPU_TEMPLATES)
def test_every_launcher_variable_is_declared_and_its_values_are_valid(kind):
    from prefect.utilities.schema_tools import validate

    variables = infra.load_template(infra.GPU_TEMPLATES[kind])["variables"]
    assert set(infra.LAUNCHER_JOB_VARIABLES) <= set(variables["properties"])
    assert set(LAUNCHER_VALUES) == set(infra.LAUNCHER_JOB_VARIABLES)
    validate({**LAUNCHER_VALUES, **KIND_VALUES[kind]}, variables, raise_on_error=True, ignore_required=True)


def test_the_launcher_sets_only_launcher_variables():
    from tasks import pool_launcher
    from trainyard.spec import Resources

    resources = Resources(gpus_per_replica=2, work_pool=infra.GPU_POOL)
    assert set(pool_launcher.job_variables(resources, replica=0)) <= set(infra.LAUNCHER_JOB_VARIABLES)


def test_a_group_attempts_run_is_keyed_by_its_launch_so_a_rerun_of_the_job_id_starts_new_groups(monkeypatch):
    from types import SimpleNamespace

    from tasks import pool_launcher
    from trainyard.launch import LaunchHandle
    from trainyard.spec import Resources

    keys = []
    monkeypatch.setattr(
        pool_launcher, "run_deployment", lambda *a, **kw: keys.append(kw["idempotency_key"]) or SimpleNamespace(id=1)
    )
    launcher = pool_launcher.WorkPoolLauncher("gpu", Resources(work_pool=infra.GPU_POOL))
    first, rerun = (LaunchHandle("job-1", "/j", infra.GPU_POOL, "http://h:1", 0, 1) for _ in range(2))
    for handle in (first, first, rerun):
        launcher.start(handle, replica=0, attempt=0, resume=False)
    # the same request sent again is one run; a rerun's (same job id, a new launch) got the old, ended one back
    assert keys[0] == keys[1] != keys[2] and all(k.startswith("job-1-") and k.endswith("-g0-a0") for k in keys)


def test_process_gpu_pool_pins_gpus_and_keeps_the_heartbeat():
    from prefect.workers.process import ProcessJobConfiguration

    config = _render(ProcessJobConfiguration, infra.load_template(infra.GPU_TEMPLATES["process"]), LAUNCHER_VALUES)
    assert config.env == {infra.HEARTBEAT_ENV: "30", "CUDA_VISIBLE_DEVICES": "0,1"}


def test_kubernetes_pool_renders_gpus_tolerations_node_selector_and_shm():
    from prefect.utilities.templating import apply_values

    template = infra.load_template(infra.GPU_TEMPLATES["kubernetes"])
    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if v.get("default") is not None}
    manifest = apply_values(template["job_configuration"], {**defaults, **LAUNCHER_VALUES})["job_manifest"]
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": 2, "memory": "32Gi"},
        "requests": {"cpu": "8", "memory": "32Gi"},
    }
    assert container["image"] == LAUNCHER_VALUES["image"]
    assert pod["nodeSelector"] == LAUNCHER_VALUES["node_selector"]
    assert pod["tolerations"] == LAUNCHER_VALUES["tolerations"]
    # /dev/shm in memory, and the shared job folder at the pipeline's TRAINYARD_HOME path
    assert container["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "trainyard-home", "mountPath": "/var/lib/trainyard"},
    ]
    assert pod["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
        {"name": "trainyard-home", "persistentVolumeClaim": {"claimName": "trainyard-home"}},
    ]
    tolerated = defaults["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerated


def test_kubernetes_pool_is_valid_for_the_kubernetes_worker():
    from prefect_kubernetes import worker  # a dev dependency: this runs wherever the tests do

    template = infra.load_template(infra.GPU_TEMPLATES["kubernetes"])
    config = _render(worker.KubernetesWorkerJobConfiguration, template, LAUNCHER_VALUES)
    assert (
        config.job_manifest["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    )


def test_ecs_pool_renders_a_task_definition_ecs_accepts():
    import uuid

    import botocore.session
    from botocore.validate import ParamValidator
    from prefect.client.schemas.objects import FlowRun
    from prefect_aws.workers.ecs_worker import ECSJobConfiguration, ECSWorker

    template = infra.load_template(infra.GPU_TEMPLATES["ecs"])
    template["variables"]["properties"]["shared_memory_mib"]["default"] = 8192
    template["variables"]["properties"]["trainyard_home_efs_id"]["default"] = "fs-0123456789abcdef0"  # pool default
    config = _render(ECSJobConfiguration, template, {**LAUNCHER_VALUES, **KIND_VALUES["ecs"]})
    assert config.task_run_request["launchType"] == "EC2"
    task_definition = ECSWorker(work_pool_name="ecs-gpu")._prepare_task_definition(
        config, "us-east-1", FlowRun(flow_id=uuid.uuid4(), name="replica")
    )
    container = task_definition["containerDefinitions"][0]
    assert container["resourceRequirements"] == [{"type": "GPU", "value": "2"}]  # ECS wants text
    assert container["linuxParameters"] == {"sharedMemorySize": 16384}  # the job's, over the pool's default
    assert container["mountPoints"] == [{"sourceVolume": "trainyard-home", "containerPath": "/var/lib/trainyard"}]
    assert task_definition["volumes"][0]["efsVolumeConfiguration"]["fileSystemId"] == "fs-0123456789abcdef0"
    shape = botocore.session.get_session().get_service_model("ecs").operation_model("RegisterTaskDefinition")
    assert not ParamValidator().validate(task_definition, shape.input_shape).has_errors()


def test_options_that_cannot_apply_are_refused():
    with pytest.raises(infra.InfraError, match="--image applies to kubernetes and ecs"):
        infra.desired_pools("process", image="x")
    with pytest.raises(infra.InfraError, match="cannot hold one group"):
        infra.desired_pools("process", gpus_per_pool=1, gpus_per_group=2)
    with pytest.raises(infra.InfraError, match="--kind must be one of"):
        infra.desired_pools("slurm")
    pools = infra.desired_pools("kubernetes", gpus_per_pool=8, gpus_per_group=2, heartbeat_seconds=45, image="img")
    assert [(p.name, p.type, p.concurrency_limit) for p in pools] == [
        (infra.PIPELINE_POOL, "process", None),
        (infra.GPU_POOL, "kubernetes", 4),
    ]
    variables = pools[1].base_job_template["variables"]["properties"]
    assert variables["env"]["default"][infra.HEARTBEAT_ENV] == "45"
    assert variables["image"]["default"] == "img"


def test_zombie_automation_is_prefects_detect_zombies_shape_scoped_to_trainyard():
    from prefect.automations import ChangeFlowRunState, Posture

    automation = infra.zombie_automation(infra.MISSED_HEARTBEATS * infra.DEFAULT_HEARTBEAT_SECONDS)
    trigger = automation.trigger
    assert trigger.posture == Posture.Proactive and trigger.within.total_seconds() == 90
    assert trigger.after == {"prefect.flow-run.heartbeat"}
    assert {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Crashed"} <= trigger.expect
    assert trigger.for_each == {"prefect.resource.id"}
    related = [spec.model_dump() for spec in trigger.match_related]
    assert {"prefect.resource.role": "flow", "prefect.resource.name": list(infra.WATCHED_FLOWS)} in related
    (action,) = automation.actions
    assert isinstance(action, ChangeFlowRunState) and action.state.value == "CRASHED"


# ---- prefect.yaml


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=lambda d: d["name"])
def test_entrypoint_loads(deployment):
    from prefect.flows import load_flow_from_entrypoint

    path = deployment["entrypoint"].split(":")[0]
    assert (REPO / path).exists(), f"{deployment['name']}: its entrypoint {path} does not exist"
    flow = load_flow_from_entrypoint(str(REPO / deployment["entrypoint"]))
    if flow.name == "train-replica":  # the launcher runs train-replica/<pool>
        assert deployment["name"] == deployment["work_pool"]["name"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=lambda d: d["name"])
def test_deployment_names_a_pool_apply_creates_and_only_its_variables(deployment):
    pool = deployment["work_pool"]["name"]
    assert pool in POOL_TEMPLATES, f"{deployment['name']}: pool {pool} is not one trainyard infra apply creates"
    declared = infra.load_template(POOL_TEMPLATES[pool])["variables"]["properties"]
    assert set(deployment["work_pool"].get("job_variables") or {}) <= set(declared)


@pytest.mark.parametrize("deployment", [d for d in DEPLOYMENTS if d.get("parameters")], ids=lambda d: d["name"])
def test_deployment_parameters_fit_the_flow(deployment):
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    from flows.training_pipeline import training_pipeline

    assert deployment["entrypoint"] == "flows/training_pipeline.py:training_pipeline"
    schema = parameter_schema(training_pipeline).model_dump_for_openapi()
    validate(deployment["parameters"], schema, raise_on_error=True)
    TrainingJob.model_validate(deployment["parameters"]["job"])


def test_schedules_and_triggers_are_valid():
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.events import DeploymentTriggerTypes
    from pydantic import TypeAdapter

    schedules = [s for d in DEPLOYMENTS for s in d.get("schedules") or []]
    triggers = [t for d in DEPLOYMENTS for t in d.get("triggers") or []]
    assert schedules and triggers  # the nightly retrain and the new-data examples
    for schedule in schedules:
        CronSchedule(cron=schedule["cron"], timezone=schedule.get("timezone"))
    for trigger in triggers:
        parsed = TypeAdapter(DeploymentTriggerTypes).validate_python(trigger)
        assert parsed.expect == {"trainyard.data.arrived"}


# ---- the TrainingJob form


def test_training_job_parameter_schema_renders_fields_descriptions_and_defaults():
    from prefect.utilities.callables import parameter_schema
    from pydantic_core import PydanticUndefined

    import trainyard.spec as spec
    from flows.training_pipeline import training_pipeline

    schema = parameter_schema(training_pipeline).model_dump_for_openapi()
    assert schema["properties"]["job"]["$ref"] == "#/definitions/TrainingJob"
    assert schema["properties"]["job"]["description"]
    assert schema["required"] == ["job"]
    assert set(schema["definitions"]["TrainingJob"]["properties"]) == set(TrainingJob.model_fields)
    for name, definition in schema["definitions"].items():
        model = getattr(spec, name)
        for field_name, field in model.model_fields.items():
            prop = definition["properties"][field.alias or field_name]
            assert prop.get("description"), f"{name}.{field_name} has no description in the form"
            if field.default is not PydanticUndefined and field.default_factory is None:
                assert "default" in prop, f"{name}.{field_name} has no default in the form"
    hyper = schema["definitions"]["Hyperparameters"]["properties"]
    assert hyper["epochs"]["default"] == 10 and hyper["batch_size"]["default"] == 256


# ---- the flow's job_id


@pytest.mark.parametrize("job_id", ["../../escaped", "a/b", ".", "-x", "x" * 201])
def test_a_job_id_that_is_not_one_folder_name_is_refused_before_anything_runs(trainyard_home, job_id):
    from prefect.exceptions import ParameterTypeError

    from flows.training_pipeline import training_pipeline
    from trainyard.errors import SpecError, TrainingError
    from trainyard.home import job_dir, jobs_dir
    from trainyard.training import scaling

    job = {"name": "j", "algorithm": {"builtin": "mlp-classifier"}, "inputs": {"train": {"s3_uri": "s3://bkt/x/"}}}
    job["output"] = {"s3_uri": "s3://bkt/out/"}
    job["inputs"]["train"]["label"] = "y"
    with pytest.raises(ParameterTypeError, match=r"^[^\n]*\n - job_id: String should match pattern") as caught:
        training_pipeline.validate_parameters({"job": job, "job_id": job_id})
    assert caught.value.args[0].count("\n - ") == 1  # the job itself is valid
    with pytest.raises(SpecError, match="job_id .*letters, digits"):
        job_dir(job_id)
    with pytest.raises(TrainingError, match="is not a job id"):
        scaling.request(job_id, 2)
    assert not (jobs_dir().parent / "escaped").exists()
    assert training_pipeline.validate_parameters({"job": job, "job_id": ""})["job_id"] == ""  # "": make one


def test_trainyards_own_job_ids_are_valid(trainyard_home):
    from flows.training_pipeline import training_pipeline
    from trainyard.home import job_dir, new_job_id

    job_id = new_job_id("churn-model")
    job = {
        "name": "j",
        "algorithm": {"builtin": "mlp-classifier"},
        "inputs": {"train": {"s3_uri": "s3://bkt/x/", "label": "y"}},
    }
    job["output"] = {"s3_uri": "s3://bkt/out/"}
    assert training_pipeline.validate_parameters({"job": job, "job_id": job_id})["job_id"] == job_id
    assert job_dir(job_id).name == job_id


def test_the_launcher_waits_for_a_cancellation_as_long_as_the_platform_says(monkeypatch):
    from tasks import pool_launcher
    from trainyard.errors import TrainyardError
    from trainyard.spec import Resources

    resources = Resources(work_pool=infra.GPU_POOL)
    assert pool_launcher.WorkPoolLauncher("d", resources).cancel_confirm_seconds == 15.0
    monkeypatch.setenv("TRAINYARD_CANCEL_CONFIRM_SECONDS", "45")  # pods with a 30 s grace period
    assert pool_launcher.WorkPoolLauncher("d", resources).cancel_confirm_seconds == 45.0
    for bad in ("soon", "0", "-3", "nan", "inf"):
        monkeypatch.setenv("TRAINYARD_CANCEL_CONFIRM_SECONDS", bad)
        with pytest.raises(TrainyardError, match=f"TRAINYARD_CANCEL_CONFIRM_SECONDS='{bad}' is not a number"):
            pool_launcher.WorkPoolLauncher("d", resources)


def test_a_silent_group_is_never_taken_for_hung_before_the_collectives_time_out(monkeypatch):
    from trainyard.training import restarts

    monkeypatch.setenv(restarts.SILENT_GROUP_SECONDS_ENV, "1")
    assert restarts.silent_seconds_limit() > restarts.PG_TIMEOUT.total_seconds()
    monkeypatch.setenv(restarts.SILENT_GROUP_SECONDS_ENV, "")
    assert restarts.silent_seconds_limit() == 120


def test_groups_on_other_nodes_reach_the_lighthouse_and_their_peers_by_trainyard_host(monkeypatch):
    from trainyard import servers

    monkeypatch.delenv(servers.HOST_ENV, raising=False)
    assert (servers.advertised_host(), servers.bind_host()) == ("127.0.0.1", "127.0.0.1")  # the embedded default
    # a pod's IP (the downward API): the lighthouse listens on every interface, and is dialled at that address
    monkeypatch.setenv(servers.HOST_ENV, "10.1.2.3")
    assert (servers.advertised_host(), servers.bind_host()) == ("10.1.2.3", "0.0.0.0")
