"""The GPU pools' templates as their workers run them: a CPU job's groups reserve no GPU on Kubernetes, and ECS' worker
waits for a group's task to start. Rendered through the workers' own configuration classes, no server
(``test_contracts.py``'s)."""

from __future__ import annotations

from infra import apply as infra
from tests.unit.test_contracts import KIND_VALUES, LAUNCHER_VALUES, _render


def test_a_cpu_jobs_groups_reserve_no_gpu_on_the_kubernetes_pool():
    # the template's gpus default is 1: a CPU job's pods each held a GPU they hide (or stayed Pending for one)
    from prefect_kubernetes import worker

    from tasks import pool_launcher
    from trainyard.spec import Resources

    variables = pool_launcher.job_variables(Resources(work_pool=infra.GPU_POOL), replica=0)
    template = infra.load_template(infra.GPU_TEMPLATES["kubernetes"])
    config = _render(worker.KubernetesWorkerJobConfiguration, template, variables)
    limits = config.job_manifest["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert variables["gpus"] == 0 and limits["nvidia.com/gpu"] == 0


def test_the_ecs_worker_waits_for_a_groups_task_to_start(monkeypatch):
    # The template set the watch's timeout and interval to 0: prefect-aws raised "Timed out" after its first
    # DescribeTasks, even a RUNNING one, and every group's run was Crashed while its task went on starting.
    import logging

    from prefect_aws.workers import ecs_worker

    template = infra.load_template(infra.GPU_TEMPLATES["ecs"])
    config = _render(ecs_worker.ECSJobConfiguration, template, {**LAUNCHER_VALUES, **KIND_VALUES["ecs"]})
    assert (config.task_start_timeout_seconds, config.task_watch_poll_interval) == (600, 5.0)
    statuses, slept = iter(["PROVISIONING", "PENDING", "RUNNING"]), []

    class Ecs:
        def describe_tasks(self, tasks, cluster, include):
            return {"tasks": [{"taskArn": tasks[0], "lastStatus": next(statuses)}]}

    monkeypatch.setattr(ecs_worker.time, "sleep", slept.append)
    worker = ecs_worker.ECSWorker(work_pool_name="ecs-gpu")
    task = worker._wait_for_task_start(
        logging.getLogger("test"), config, "task", "cluster", Ecs(), timeout=config.task_start_timeout_seconds
    )
    assert task["lastStatus"] == "RUNNING" and slept == [5.0, 5.0, 5.0]


def test_a_kubernetes_groups_pod_advertises_its_own_ip_to_its_peers():
    # Unset, each group advertised 127.0.0.1: a group on another node dialled its own loopback for its peers'
    # store and checkpoint server. The pod's IP, by the downward API, beside the job's own env (which wins).
    import uuid

    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes import worker

    template = infra.load_template(infra.GPU_TEMPLATES["kubernetes"])
    for env, host in (({"CUDA_VISIBLE_DEVICES": "0"}, None), ({"TRAINYARD_HOST": "node-7.cluster"}, "node-7.cluster")):
        config = _render(worker.KubernetesWorkerJobConfiguration, template, {**LAUNCHER_VALUES, "env": env})
        config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="replica"))
        listed = config.job_manifest["spec"]["template"]["spec"]["containers"][0]["env"]
        named = [e for e in listed if e["name"] == "TRAINYARD_HOST"]
        if host is None:
            assert named == [{"name": "TRAINYARD_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
            assert {"name": "CUDA_VISIBLE_DEVICES", "value": "0"} in listed
        else:
            assert named == [{"name": "TRAINYARD_HOST", "value": host}]


class _Ec2:
    """The worker's EC2 client, for a pool's own network: its VPC and subnets, as prefect-aws checks them."""

    def describe_vpcs(self, **ask):
        return {"Vpcs": [{"VpcId": "vpc-0a1b2c3d"}]}

    def describe_subnets(self, **ask):
        return {"Subnets": [{"SubnetId": "subnet-0aaa"}, {"SubnetId": "subnet-0bbb"}]}


def test_an_ecs_groups_task_has_an_address_of_its_own_and_advertises_it(monkeypatch):
    # EC2 tasks defaulted to bridge networking, whose container addresses no other instance reaches, and no group
    # was told its task's address: each advertised 127.0.0.1. Now awsvpc, and TRAINYARD_HOST=ecs-task beside the
    # job's own env (which wins). Never prefect-aws's default network either: assignPublicIp ENABLED, which ECS
    # refuses for the EC2 launch type; a pool without its own subnets is refused for want of them, before any call.
    import uuid

    import botocore.session
    from botocore.validate import ParamValidator
    from prefect.client.schemas.objects import FlowRun
    from prefect_aws.workers import ecs_worker

    run_task = botocore.session.get_session().get_service_model("ecs").operation_model("RunTask").input_shape
    network = {"subnets": ["subnet-0aaa"], "securityGroups": ["sg-0ccc"]}
    for pool, env, host in (
        ({}, {"CUDA_VISIBLE_DEVICES": "0"}, "ecs-task"),
        ({"vpc_id": "vpc-0a1b2c3d", "network_configuration": network}, {"TRAINYARD_HOST": "10.0.3.7"}, "10.0.3.7"),
    ):
        template = infra.pool_template(infra.GPU_TEMPLATES["ecs"])
        for name, value in {"trainyard_home_efs_id": "fs-0123456789abcdef0", **pool}.items():
            template["variables"]["properties"][name]["default"] = value  # the operator's, in the pool's defaults
        # the job's cpu and memory as numbers, or as numbers written as text, which a job spec may give for any pool
        # (a container override's must be numbers: "32768" there was refused; the task's, which prefect-aws makes
        # text, are the group's)
        values = {**LAUNCHER_VALUES, "cpu": 4096, "memory": "32768" if pool else 32768, "env": env}
        config = _render(ecs_worker.ECSJobConfiguration, template, values)
        flow_run = FlowRun(flow_id=uuid.uuid4(), name="replica")
        config.prepare_for_flow_run(flow_run)
        worker = ecs_worker.ECSWorker(work_pool_name="ecs-gpu")
        monkeypatch.setattr(worker, "_get_client", lambda configuration, kind: {"ec2": _Ec2()}[kind])
        task_definition = worker._prepare_task_definition(config, "us-east-1", flow_run)
        assert task_definition["networkMode"] == "awsvpc"
        request = worker._prepare_task_run_request(config, task_definition, "arn:aws:ecs:us-east-1:1:task-definition/g")
        listed = request["overrides"]["containerOverrides"][0]["environment"]
        assert [e["value"] for e in listed if e["name"] == "TRAINYARD_HOST"] == [host]
        problems = ParamValidator().validate(request, run_task)
        assert (request["overrides"]["cpu"], request["overrides"]["memory"]) == ("4096", "32768")
        if pool:
            assert request["networkConfiguration"] == {"awsvpcConfiguration": network}
            assert not problems.has_errors(), problems.generate_report()
        else:
            assert request["networkConfiguration"] == {"awsvpcConfiguration": {"assignPublicIp": "DISABLED"}}
            assert 'Missing required parameter in networkConfiguration.awsvpcConfiguration: "subnets"' in (
                problems.generate_report()
            )


def test_an_ecs_pool_made_before_gets_the_tasks_address_on_the_next_apply():
    # its stored env default (the heartbeat, the operator's entries) is kept, and apply's new entry joins it
    from infra.pool_defaults import kept

    desired = infra.pool_template(infra.GPU_TEMPLATES["ecs"])
    stored = infra.pool_template(infra.GPU_TEMPLATES["ecs"])
    stored["variables"]["properties"]["env"]["default"] = {infra.HEARTBEAT_ENV: "30", "AWS_REGION": "eu-west-1"}
    merged, _ = kept(stored, desired, frozenset(), infra.HEARTBEAT_ENV)
    env = merged["variables"]["properties"]["env"]["default"]
    assert env == {infra.HEARTBEAT_ENV: "30", "AWS_REGION": "eu-west-1", "TRAINYARD_HOST": "ecs-task"}
