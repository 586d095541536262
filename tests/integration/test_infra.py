"""``trainyard infra apply`` against a real ``prefect server`` on 127.0.0.1: pools, templates, the GPU
concurrency limit and the zombie automation are created once, a second apply changes nothing, the
deployments of prefect.yaml land on the pools, a group beyond the limit waits, and a Running run whose
heartbeats stop is marked Crashed."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from infra import apply as infra
from trainyard.cli_infra import infra_app

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
pytestmark = pytest.mark.integration

cli = typer.Typer()
cli.add_typer(infra_app, name="infra")  # as trainyard/cli.py mounts it


def _apply(url: str, *args: str):
    return CliRunner().invoke(cli, ["infra", "apply", "--api-url", url, *args])


@pytest.fixture(scope="module")
def applied(prefect_server):
    """Two applies of the default set-up: 2 GPUs in the pool, 2 per group (a limit of one group)."""
    url, _, _ = prefect_server
    first, second = (_apply(url, "--gpus-per-pool", "2", "--gpus-per-group", "2") for _ in range(2))
    return first, second


@pytest.fixture
def client(prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server[0]}), get_client(sync_client=True) as client:
        yield client


def test_apply_creates_everything_once_and_the_second_apply_changes_nothing(prefect_server, applied, client):
    first, second = applied
    assert first.exit_code == 0, first.output
    assert "created" in first.output
    assert second.exit_code == 0, second.output
    assert "no changes" in second.output and "created" not in second.output and "updated" not in second.output

    pipeline, gpu = client.read_work_pool(infra.PIPELINE_POOL), client.read_work_pool(infra.GPU_POOL)
    assert (pipeline.type, gpu.type) == ("process", "process")
    assert pipeline.base_job_template == infra.pool_template(infra.PIPELINE_TEMPLATE)
    assert gpu.base_job_template == infra.pool_template(infra.GPU_TEMPLATES["process"])
    assert gpu.concurrency_limit == 1 and pipeline.concurrency_limit is None
    (automation,) = client.read_automations_by_name(infra.ZOMBIE_AUTOMATION)
    assert automation.enabled and automation.trigger.within.total_seconds() == 90
    assert automation.actions[0].state.value == "CRASHED"

    dry = _apply(prefect_server[0], "--heartbeat-seconds", "60", "--dry-run")
    assert dry.exit_code == 0 and "would update" in dry.output and "change(s) to make" in dry.output, dry.output
    assert client.read_work_pool(infra.GPU_POOL).base_job_template == gpu.base_job_template  # dry: nothing written


def test_kubernetes_and_ecs_pools_accept_the_launchers_variables(prefect_server, applied, client, monkeypatch):
    from prefect.exceptions import PrefectHTTPStatusError

    url, _, _ = prefect_server
    values = {
        "env": {"CUDA_VISIBLE_DEVICES": "0"},
        "gpus": 2,
        "image": "registry.example/trainyard-worker:1",
        "node_selector": {"nvidia.com/gpu.product": "A100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "shm_size": "16Gi",
    }
    flow_id = client.create_flow_from_name("train-replica")
    for kind, extra in (("kubernetes", {"cpu": "8", "memory": "32Gi"}), ("ecs", {"cpu": 4096, "memory": 32768})):
        result = _apply(url, "--kind", kind, "--gpu-pool", f"{kind}-gpu", "--image", "registry.example/ty:1")
        assert result.exit_code == 0, result.output
        assert client.read_work_pool(f"{kind}-gpu").type == kind
        deployment = client.create_deployment(
            flow_id=flow_id, name=f"{kind}-gpu", work_pool_name=f"{kind}-gpu", entrypoint="flows/train_replica.py:x"
        )
        run = client.create_flow_run_from_deployment(deployment, job_variables={**values, **extra})
        assert run.job_variables["gpus"] == 2
        with pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_flow_run_from_deployment(deployment, job_variables={"gpus": "two"})
        assert refused.value.response.status_code == 422
    refused = _apply(url, "--kind", "ecs", "--gpu-pool", "kubernetes-gpu")
    assert refused.exit_code == 2 and "cannot change" in refused.output
    # a CPU job: the Kubernetes pool's groups are given gpus 0 (the launcher's); ECS' reserve one whatever they are
    # given, so such a job is refused before any compute
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.pool_launcher import check_deployment
    from trainyard.errors import SpecError, TrainingError

    with temporary_settings({PREFECT_API_URL: url}):
        # groups in containers, and the pipeline's lighthouse on its loopback: each group failed after staging
        monkeypatch.delenv("TRAINYARD_HOST", raising=False)
        for pool in ("ecs-gpu", "kubernetes-gpu"):
            with pytest.raises(TrainingError, match=rf"'{pool}' runs its groups in \w+ containers, and TRAINYARD_HOST"):
                check_deployment(pool, gpus_per_replica=1, pipeline_here=True)
        check_deployment("kubernetes-gpu", gpus_per_replica=1)  # where a job is submitted from: not its worker's
        monkeypatch.setenv("TRAINYARD_HOST", "10.0.0.5")  # the pipeline's node, as the groups reach it
        with pytest.raises(SpecError, match=r"gpus_per_replica: 0 \(a CPU job\), and 'ecs-gpu'.s groups each reserve"):
            check_deployment("ecs-gpu", gpus_per_replica=0)
        # awsvpc tasks with no subnets in the pool's defaults: each group's run was refused, after staging
        with pytest.raises(TrainingError, match=r"'ecs-gpu' is an ECS pool whose tasks have no subnets"):
            check_deployment("ecs-gpu", gpus_per_replica=1)
        from prefect.client.schemas.actions import WorkPoolUpdate

        template = client.read_work_pool("ecs-gpu").base_job_template
        network = {"subnets": ["subnet-0a1b2c3d"], "securityGroups": ["sg-0a1b2c3d"]}
        written = template["job_configuration"]["task_run_request"]["networkConfiguration"]["awsvpcConfiguration"]
        for where in ("the template's run request", "the pool's defaults"):
            if where == "the template's run request":  # an operator's own template, its subnets written in
                written |= network
            else:
                written.pop("subnets")
                written.pop("securityGroups")
                template["variables"]["properties"]["network_configuration"]["default"] = network
            client.update_work_pool("ecs-gpu", WorkPoolUpdate(base_job_template=template))
            check_deployment("ecs-gpu", gpus_per_replica=1)
        check_deployment("kubernetes-gpu", gpus_per_replica=0)


def test_a_later_apply_keeps_the_defaults_an_operator_set_on_the_pool(prefect_server, client):
    # an apply to resize the pool put every default set since (the EFS id, a namespace, env entries, the image)
    # back to the template's: on ECS every group's task definition was then refused
    from prefect.client.schemas.actions import WorkPoolUpdate

    url, _, _ = prefect_server
    first = _apply(url, "--kind", "kubernetes", "--gpu-pool", "k8s-kept", "--image", "registry.example/ty:1")
    assert first.exit_code == 0, first.output
    template = client.read_work_pool("k8s-kept").base_job_template
    props = template["variables"]["properties"]
    props["namespace"]["default"] = "ml"  # the operator's, in the UI
    props["env"]["default"] = props["env"]["default"] | {"AWS_REGION": "eu-west-1"}
    client.update_work_pool("k8s-kept", WorkPoolUpdate(base_job_template=template))

    def defaults() -> dict:
        stored = client.read_work_pool("k8s-kept").base_job_template["variables"]["properties"]
        return {name: stored[name].get("default") for name in ("namespace", "image", "env")}

    resized = _apply(url, "--kind", "kubernetes", "--gpu-pool", "k8s-kept", "--gpus-per-pool", "8")
    assert resized.exit_code == 0 and "no changes" not in resized.output, resized.output
    assert client.read_work_pool("k8s-kept").concurrency_limit == 8
    env = {"AWS_REGION": "eu-west-1", infra.HEARTBEAT_ENV: "30"}
    assert defaults() == {"namespace": "ml", "image": "registry.example/ty:1", "env": env}
    again = _apply(url, "--kind", "kubernetes", "--gpu-pool", "k8s-kept", "--heartbeat-seconds", "60")
    assert "the pool's own defaults kept: " in " ".join(again.output.split()), again.output  # said
    assert defaults() == {"namespace": "ml", "image": "registry.example/ty:1", "env": env | {infra.HEARTBEAT_ENV: "60"}}
    reset = _apply(url, "--kind", "kubernetes", "--gpu-pool", "k8s-kept", "--reset-defaults")
    assert reset.exit_code == 0, reset.output
    shipped = infra.pool_template(infra.GPU_TEMPLATES["kubernetes"])["variables"]["properties"]
    assert defaults() == {name: shipped[name].get("default") for name in ("namespace", "image", "env")}


def test_deployments_land_on_the_pools_a_group_beyond_the_limit_waits_and_a_zombie_is_crashed(
    prefect_server, applied, client
):
    from prefect.client.schemas.objects import StateType
    from prefect.states import Running

    url, env, _ = prefect_server
    deploy = subprocess.run(
        [PREFECT, "--no-prompt", "deploy", "--name", "on-new-data", "--name", "trainyard-gpu"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    assert client.read_deployment_by_name("training-pipeline/on-new-data").work_pool_name == infra.PIPELINE_POOL
    assert any(a.trigger.expect == {"trainyard.data.arrived"} for a in client.read_automations())
    replica = client.read_deployment_by_name("train-replica/trainyard-gpu")
    assert replica.work_pool_name == infra.GPU_POOL

    # The pool holds one group: with one Running, the next is not offered to workers and stays Scheduled.
    params = {"job_dir": "/jobs/x", "replica": 0, "attempt": 0, "lighthouse_addr": ""}
    running, waiting = (client.create_flow_run_from_deployment(replica.id, parameters=params) for _ in range(2))
    client.set_flow_run_state(running.id, Running(), force=True)
    assert client.get_scheduled_flow_runs_for_work_pool(infra.GPU_POOL) == []
    assert client.read_flow_run(waiting.id).state.type == StateType.SCHEDULED

    # The zombie automation's shape with a 10 s window: the replica run's heartbeat stops, it is Crashed;
    # another flow's run, silent as long, is left alone.
    client.create_automation(infra.zombie_automation(10, name="zombie-test"))
    other_flow = client.create_flow_from_name("someone-elses-flow")
    other_deployment = client.create_deployment(
        flow_id=other_flow, name="theirs", work_pool_name=infra.PIPELINE_POOL, entrypoint="x.py:f"
    )
    other = client.create_flow_run_from_deployment(other_deployment)
    client.set_flow_run_state(other.id, Running(), force=True)
    # A heartbeat a second for eight: the triggers service loads a new automation within a few seconds (a
    # heartbeat before it has would start no window; more on a busy machine), and both runs fall silent at the
    # same moment.
    for _ in range(8):
        _heartbeat(client, running, replica.flow_id, "train-replica", replica.id)
        _heartbeat(client, other, other_flow, "someone-elses-flow", other_deployment)
        time.sleep(1)
    deadline = time.monotonic() + 45
    while client.read_flow_run(running.id).state.type == StateType.RUNNING and time.monotonic() < deadline:
        time.sleep(1)
    state = client.read_flow_run(running.id).state
    assert state.type == StateType.CRASHED, state
    assert "heartbeats stopped" in (state.message or "")
    # The other run fell silent at the same moment: had the automation matched it, it would be Crashed by
    # now, or within moments (3 s: a margin for its evaluation after the replica run's).
    time.sleep(3)
    assert client.read_flow_run(other.id).state.type == StateType.RUNNING
    # The crashed group's slot is free again: the waiting one is offered.
    offered = client.get_scheduled_flow_runs_for_work_pool(infra.GPU_POOL)
    assert [r.flow_run.id for r in offered] == [waiting.id]


def _heartbeat(client, run, flow_id, flow_name: str, deployment_id) -> None:
    """The event a flow run's engine sends every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds."""
    event = {
        "id": str(uuid.uuid4()),
        "occurred": datetime.now(UTC).isoformat(),
        "event": "prefect.flow-run.heartbeat",
        "resource": {"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.resource.name": run.name},
        "related": [
            {
                "prefect.resource.id": f"prefect.flow.{flow_id}",
                "prefect.resource.role": "flow",
                "prefect.resource.name": flow_name,
            },
            {"prefect.resource.id": f"prefect.deployment.{deployment_id}", "prefect.resource.role": "deployment"},
        ],
    }
    client.request("POST", "/events", json=[event]).raise_for_status()
