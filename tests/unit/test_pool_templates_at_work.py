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
