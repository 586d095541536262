"""``trainyard infra apply``: make a Prefect server ready for Trainyard, idempotently.

It creates or updates the work pools (the pipeline's ``trainyard-process`` and the GPU pool, whose base
job templates are the JSON files beside this module), the GPU pool's concurrency limit, the block types
the templates refer to, and the automation that marks a zombie flow run Crashed. Each object is read,
compared with what ``infra/`` describes and written only when it differs, so a second apply changes
nothing.

The module-level parts (the templates, their checks, ``LAUNCHER_JOB_VARIABLES``) import nothing of
Prefect: the engine's launcher and the contract tests use them. The parts that talk to an API import
Prefect inside.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from infra import pool_defaults
from trainyard.errors import TrainyardError
from trainyard.spec.sections import LAUNCHER_JOB_VARIABLES  # the job spec checks a job's against it

INFRA_DIR = Path(__file__).resolve().parent
PIPELINE_POOL = "trainyard-process"
GPU_POOL = "trainyard-gpu"
PIPELINE_TEMPLATE = "process-pool.json"
GPU_TEMPLATES = {
    "process": "process-gpu-pool.json",
    "kubernetes": "kubernetes-gpu-pool.json",
    "ecs": "ecs-gpu-pool.json",
}

# The job variables the launch stage may set on a replica group's flow run (run_deployment(job_variables=...)).
# Every GPU pool template declares all of them, so one set of values is valid on every pool.
# Where a template references the launcher variables its kind of worker cannot apply (a process has no
# image). Workers ignore keys they do not know; the contract tests allow only launcher variables here, so
# a variable a template forgot to use is still caught.
NOT_APPLIED_KEY = "accepted_not_applied"

HEARTBEAT_ENV = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"  # from Prefect 3.5 (pyproject requires it); RUNNER_ before
DEFAULT_HEARTBEAT_SECONDS = 30
MIN_HEARTBEAT_SECONDS = 30  # Prefect's floor for flow run heartbeats
MISSED_HEARTBEATS = 3  # a run silent for this many heartbeats is a zombie
ZOMBIE_AUTOMATION = "trainyard-crash-zombie-flow-runs"
# The state message of a run the automation crashed: its process may live on, cut off from the API
# (tasks/pool_launcher.py tells such a run apart by it).
ZOMBIE_MESSAGE = "Marked Crashed: the flow run's heartbeats stopped"
WATCHED_FLOWS = ("training-pipeline", "train-replica")
# Block types the templates and flows refer to (the ECS template's aws_credentials, the S3 blocks);
# a self-hosted server knows only Prefect's own until they are registered.
BLOCK_TYPES = (("prefect_aws.credentials", "AwsCredentials"), ("prefect_aws.s3", "S3Bucket"))

_PLACEHOLDER = re.compile(r"{{\s*([\w\.\-\[\]$]+)\s*}}")  # the pattern of prefect.utilities.templating
_NON_VARIABLE_PREFIXES = ("prefect.", "$")  # block documents, Prefect variables, environment variables


class InfraError(TrainyardError, ValueError):
    """What was asked cannot be applied as it stands; the message names the object and the fix."""


class ApiUnreachable(TrainyardError, ConnectionError):
    """No Prefect API answered at the URL given."""


@dataclass(frozen=True)
class Change:
    """What apply did (or, on a dry run, would do) to one object."""

    kind: str  # work pool, concurrency limit, block type, automation
    name: str
    action: Literal["created", "updated", "unchanged"]
    detail: str = ""


@dataclass(frozen=True)
class PoolSpec:
    """A work pool as ``infra/`` describes it."""

    name: str
    type: str
    base_job_template: dict[str, Any]
    description: str
    concurrency_limit: int | None  # None: leave the pool's limit as it is
    managed: frozenset[str] = frozenset()  # variables whose defaults apply sets this time (others: the pool's stand)


# ---- templates (no Prefect)


def load_template(file_name: str) -> dict[str, Any]:
    """A base job template from ``infra/``."""
    return json.loads((INFRA_DIR / file_name).read_text())


def referenced_variables(job_configuration: Any) -> set[str]:
    """The template variables a job configuration (or part of one) references as ``{{ name }}``."""
    names = (m.group(1) for m in _PLACEHOLDER.finditer(json.dumps(job_configuration)))
    return {n.split(".")[0] for n in names if not n.startswith(_NON_VARIABLE_PREFIXES)}


def template_problems(template: dict[str, Any], launcher: bool = True) -> list[str]:
    """Why a base job template would misbehave; empty when it is sound.

    Prefect refuses a reference to an undeclared variable, but silently drops a declared variable that
    ``job_configuration`` never references: a job variable set on it would do nothing.
    """
    job_configuration = template.get("job_configuration")
    declared = set(template.get("variables", {}).get("properties", {}))
    if not isinstance(job_configuration, dict) or not declared:
        return ["needs a 'job_configuration' object and 'variables.properties'"]
    used = referenced_variables(job_configuration)
    problems = [f"job_configuration references undeclared variable {n!r}" for n in sorted(used - declared)]
    problems += [f"variable {n!r} is never referenced in job_configuration (dropped)" for n in sorted(declared - used)]
    parked = referenced_variables(job_configuration.get(NOT_APPLIED_KEY, {}))
    stray = sorted(parked - set(LAUNCHER_JOB_VARIABLES))
    problems += [f"{NOT_APPLIED_KEY} may hold launcher variables only, not {n!r}" for n in stray]
    if launcher:
        missing = sorted(set(LAUNCHER_JOB_VARIABLES) - declared)
        problems += [f"launcher variable {n!r} is not declared" for n in missing]
    return problems


def pool_template(file_name: str, heartbeat_seconds: int = DEFAULT_HEARTBEAT_SECONDS, image: str | None = None) -> dict:
    """A template with apply's settings: the heartbeat in ``env``'s defaults, the image's default."""
    template = load_template(file_name)
    props = template["variables"]["properties"]
    props["env"]["default"] = {**props["env"].get("default", {}), HEARTBEAT_ENV: str(heartbeat_seconds)}
    if image:
        props["image"]["default"] = image
    return template


def desired_pools(
    kind: str = "process",
    gpu_pool: str = GPU_POOL,
    gpus_per_pool: int | None = None,
    gpus_per_group: int = 1,
    heartbeat_seconds: int = DEFAULT_HEARTBEAT_SECONDS,
    image: str | None = None,
) -> list[PoolSpec]:
    """The pipeline's pool and the GPU pool, as apply will make them."""
    if kind not in GPU_TEMPLATES:
        raise InfraError(f"--kind must be one of {', '.join(GPU_TEMPLATES)}, not {kind!r}")
    if heartbeat_seconds < MIN_HEARTBEAT_SECONDS:
        raise InfraError(f"--heartbeat-seconds must be at least {MIN_HEARTBEAT_SECONDS} (Prefect's minimum)")
    if image and kind == "process":
        raise InfraError("--image applies to kubernetes and ecs pools; a process pool runs on the worker's machine")
    if gpus_per_group < 1:
        raise InfraError("--gpus-per-group must be at least 1")
    limit = None
    if gpus_per_pool is not None:
        if gpus_per_pool < gpus_per_group:
            raise InfraError(
                f"--gpus-per-pool {gpus_per_pool} cannot hold one group of {gpus_per_group} GPU(s); "
                "raise --gpus-per-pool or lower --gpus-per-group"
            )
        limit = gpus_per_pool // gpus_per_group
    pipeline = PoolSpec(
        PIPELINE_POOL,
        "process",
        pool_template(PIPELINE_TEMPLATE, heartbeat_seconds),
        "Trainyard: the training-pipeline flow runs (staging, launch, filtering, training, carbon, registry).",
        None,
    )
    gpu = PoolSpec(
        gpu_pool,
        kind,
        pool_template(GPU_TEMPLATES[kind], heartbeat_seconds, image),
        f"Trainyard: replica groups (train-replica flow runs) on {kind} GPU workers. Its concurrency limit counts "
        "groups: runs beyond it wait in Scheduled (shown Late) until a group finishes; none fails for it.",
        limit,
        frozenset({"image"}) if image else frozenset(),
    )
    return [pipeline, gpu]


# ---- objects on the server


def zombie_automation(within_seconds: float, name: str = ZOMBIE_AUTOMATION, flows: tuple[str, ...] = WATCHED_FLOWS):
    """Prefect's "detect zombie flows" automation, scoped to Trainyard's deployed flow runs.

    After a heartbeat, a run that sends neither another heartbeat nor a final (or paused) state within
    ``within_seconds`` is marked Crashed. The scope matters: flows elsewhere on the server may send
    heartbeats less often (Prefect's default is 180 s) and must not be crashed by this window.
    """
    from datetime import timedelta

    from prefect.automations import AutomationCore, ChangeFlowRunState, EventTrigger, Posture, ResourceSpecification
    from prefect.client.schemas.objects import StateType

    ends = ("Completed", "Failed", "Cancelled", "Crashed", "Paused", "Suspended")
    return AutomationCore(
        name=name,
        description=f"Trainyard: a Running flow run of {', '.join(flows)} (from a deployment) that stops sending "
        f"heartbeats for {within_seconds:g} s is marked Crashed: its worker died. Installed by trainyard infra apply.",
        enabled=True,
        tags=[],
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{e}" for e in ends)},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=[
                ResourceSpecification({"prefect.resource.role": "flow", "prefect.resource.name": list(flows)}),
                ResourceSpecification({"prefect.resource.role": "deployment"}),
            ],
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_seconds),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=ZOMBIE_MESSAGE)],
        actions_on_trigger=[],
        actions_on_resolve=[],
    )


def apply(
    *,
    api_url: str | None = None,
    kind: str = "process",
    gpu_pool: str = GPU_POOL,
    gpus_per_pool: int | None = None,
    gpus_per_group: int = 1,
    heartbeat_seconds: int = DEFAULT_HEARTBEAT_SECONDS,
    image: str | None = None,
    dry_run: bool = False,
    reset_defaults: bool = False,
) -> list[Change]:
    """Create or update everything ``infra/`` describes on the Prefect API; return what changed. The defaults an
    operator set on an existing pool's variables stand unless ``reset_defaults`` (``pool_defaults``)."""
    pools = desired_pools(kind, gpu_pool, gpus_per_pool, gpus_per_group, heartbeat_seconds, image)
    for pool in pools:
        if problems := template_problems(pool.base_job_template, launcher=pool.name == gpu_pool):
            raise InfraError(f"template of {pool.name}: " + "; ".join(problems))
    automation = zombie_automation(MISSED_HEARTBEATS * heartbeat_seconds)

    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url} if api_url else {}):
        url = PREFECT_API_URL.value()
        if not url:
            raise InfraError("no Prefect API to apply to: pass --api-url or set PREFECT_API_URL")
        try:
            with get_client(sync_client=True) as client:
                current = {pool.name: _read_pool(client, pool) for pool in pools}  # refuse before writing anything
                changes = [
                    change
                    for pool in pools
                    for change in _apply_pool(client, pool, current[pool.name], dry_run, reset_defaults)
                ]
                changes += [_apply_block_type(client, module, name, dry_run) for module, name in BLOCK_TYPES]
                changes.append(_apply_automation(client, automation, dry_run))
        except httpx.TransportError as exc:
            raise ApiUnreachable(f"cannot reach the Prefect API at {url}: {exc}") from exc
        except PrefectHTTPStatusError as exc:  # it answered, and refused or failed: said, not a traceback
            status = exc.response.status_code
            check = {
                401: "check PREFECT_API_KEY (or the server's auth string)",
                403: "check PREFECT_API_KEY's permissions on the workspace",
                404: "check the URL: a Prefect API's ends in /api (Prefect Cloud's in /workspaces/<id>)",
            }.get(status, "try again, or look at the server's log")
            raise ApiUnreachable(
                f"the Prefect API at {url} answered {status} to {exc.request.url.path}; {check}"
            ) from None
    return changes


def _read_pool(client, spec: PoolSpec):
    """The pool as the server has it (None when absent); refuses a pool of another type."""
    from prefect.exceptions import ObjectNotFound

    try:
        current = client.read_work_pool(spec.name)
    except ObjectNotFound:
        return None
    if current.type != spec.type:
        raise InfraError(
            f"work pool {spec.name!r} is a {current.type} pool and a pool's type cannot change: delete it "
            f"(prefect work-pool delete {spec.name}) or apply to another name (--gpu-pool)"
        )
    return current


def _apply_pool(client, spec: PoolSpec, current, dry_run: bool, reset_defaults: bool = False) -> list[Change]:
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate

    limit_name = f"{spec.name} (groups)"
    if current is None:
        if not dry_run:
            client.create_work_pool(
                WorkPoolCreate(
                    name=spec.name,
                    type=spec.type,
                    base_job_template=spec.base_job_template,
                    description=spec.description,
                    concurrency_limit=spec.concurrency_limit,
                )
            )
        changes = [Change("work pool", spec.name, "created", f"{spec.type} pool")]
        if spec.concurrency_limit is not None:
            changes.append(Change("concurrency limit", limit_name, "created", str(spec.concurrency_limit)))
        return changes
    update: dict[str, Any] = {}
    desired, kept = spec.base_job_template, []
    if not reset_defaults:
        desired, kept = pool_defaults.kept(current.base_job_template or {}, desired, spec.managed, HEARTBEAT_ENV)
    if current.base_job_template != desired:
        update["base_job_template"] = desired
    if current.description != spec.description:
        update["description"] = spec.description
    detail = ", ".join(update) + (f" (the pool's own defaults kept: {', '.join(kept)})" if kept else "")
    pool_change = Change("work pool", spec.name, "updated" if update else "unchanged", detail)
    changes = [pool_change]
    if spec.concurrency_limit is not None:
        same = current.concurrency_limit == spec.concurrency_limit
        if not same:
            update["concurrency_limit"] = spec.concurrency_limit
        detail = str(spec.concurrency_limit) if same else f"{current.concurrency_limit} -> {spec.concurrency_limit}"
        changes.append(Change("concurrency limit", limit_name, "unchanged" if same else "updated", detail))
    if update and not dry_run:
        client.update_work_pool(spec.name, WorkPoolUpdate(**update))
    return changes


def _apply_block_type(client, module: str, class_name: str, dry_run: bool) -> Change:
    import importlib

    from prefect.exceptions import ObjectNotFound

    block = getattr(importlib.import_module(module), class_name)
    slug = block.get_block_type_slug()
    action: Literal["created", "updated"]
    try:
        client.read_block_type_by_slug(slug)
    except ObjectNotFound:
        action = "created"
    else:
        try:
            client.read_block_schema_by_checksum(block._calculate_schema_checksum(), block.get_block_schema_version())
            return Change("block type", slug, "unchanged")
        except ObjectNotFound:
            action = "updated"
    if not dry_run:
        block.register_type_and_schema()  # registers nested block types too; idempotent
    return Change("block type", slug, action, "schema of this prefect-aws version")


def _apply_automation(client, desired, dry_run: bool) -> Change:
    found = client.read_automations_by_name(desired.name)
    if not found:
        if not dry_run:
            client.create_automation(desired)
        return Change("automation", desired.name, "created", "zombie flow runs -> Crashed")
    current, duplicates = found[0], found[1:]
    if _comparable(current) == _comparable(desired) and not duplicates:
        return Change("automation", desired.name, "unchanged")
    if not dry_run:
        client.update_automation(current.id, desired)
        for extra in duplicates:  # left by two applies racing
            client.delete_automation(extra.id)
    return Change(
        "automation", desired.name, "updated", f"removed {len(duplicates)} duplicate(s)" if duplicates else ""
    )


def _comparable(automation) -> Any:
    """An automation as data, without server-assigned ids and with sets in a stable order."""
    fields = (
        "name",
        "description",
        "enabled",
        "tags",
        "trigger",
        "actions",
        "actions_on_trigger",
        "actions_on_resolve",
    )
    return _normalise(automation.model_dump(mode="json", include=set(fields)))


def _normalise(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items() if k not in ("id", "created", "updated")}
    if isinstance(value, list):
        items = [_normalise(v) for v in value]
        return sorted(items) if all(isinstance(v, str) for v in items) else items
    return value
