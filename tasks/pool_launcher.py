"""Replica groups as flow runs on a Prefect work pool: the launcher the engine's supervisor drives
when ``resources.work_pool`` is not ``local``.

Each group attempt is a run of the ``train-replica`` deployment on the pool, submitted with an
idempotency key (job, launch, group, attempt), so a request sent again never doubles a group, while a
rerun of the job id starts groups of its own (the last run's, ended, would come back in their place). The run's state
stands in for a process's exit code; the group's heartbeat, progress and result still come through
the job's folder. Killing a group cancels its run (the worker stops its process). A worker that died
with its node never confirms a cancellation: such a run is marked Crashed after
``CANCEL_CONFIRM_SECONDS`` (``TRAINYARD_CANCEL_CONFIRM_SECONDS``: longer where a worker takes longer to
stop a run, as a pod's grace period), so the supervisor resubmits the group instead of waiting on it forever.
"""

from __future__ import annotations

import logging
import time
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State, StateType
from prefect.deployments import run_deployment
from prefect.states import Cancelled, Cancelling, Crashed

from infra.apply import ZOMBIE_MESSAGE
from trainyard import env_settings
from trainyard.errors import SpecError, TrainingError
from trainyard.launch import LaunchHandle, ReplicaProcess
from trainyard.servers import HOST_ENV, advertised_host
from trainyard.spec import Resources
from trainyard.status import JOB_TAG, REPLICA_TAG

log = logging.getLogger(__name__)
REPLICA_FLOW = "train-replica"
# States are read at most this often per group: the supervisor polls ten times a second.
STATE_CACHE_SECONDS = 1.0
# A live process worker stops a cancelled run's process in about a second; a silent group's run still
# Cancelling after this long has lost its worker.
CANCEL_CONFIRM_SECONDS = 15.0
CANCEL_CONFIRM_SECONDS_ENV = "TRAINYARD_CANCEL_CONFIRM_SECONDS"
# How long the supervisor rides out an API that does not answer about a group's run (its client's own retries
# spent), on the last state it read: as long as flows.client.wait's outage (API_OUTAGE_SECONDS there).
API_OUTAGE_SECONDS = 300.0
_EXIT_CODES = {StateType.COMPLETED: 0, StateType.FAILED: 1, StateType.CRASHED: 2, StateType.CANCELLED: -15}


def check_deployment(pool: str, gpus_per_replica: int = 0, pipeline_here: bool = False) -> None:
    """Refuse, before any compute, a work pool whose ``train-replica`` deployment the API does not have: a
    group's first run would fail after staging, as an internal error (Prefect's ObjectNotFound). Where the
    pipeline runs here (``pipeline_here``; not where a job is submitted from), a pool whose groups run in
    containers (Kubernetes, ECS, Docker) while ``TRAINYARD_HOST`` is unset: the lighthouse would be on this
    machine's loopback, which no group there reaches. A CPU job (``gpus_per_replica`` 0) on a pool whose groups
    each reserve a GPU whatever they are given (its template's ``gpus`` minimum: ECS has no GPU-less requirement),
    which would hold GPUs its groups never see. And an ECS pool with no subnets for its groups' tasks."""
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(f"{REPLICA_FLOW}/{pool}")
        except ObjectNotFound:
            raise SpecError(
                [
                    f"resources.work_pool: {pool!r} has no {REPLICA_FLOW}/{pool} deployment on this Prefect API; "
                    "fix the pool's name, or deploy it (prefect deploy --all, after trainyard infra apply)"
                ]
            ) from None
        if not deployment.work_pool_name:
            return
        work_pool = client.read_work_pool(deployment.work_pool_name)
    if pipeline_here and work_pool.type != "process" and advertised_host() == "127.0.0.1":
        # (its groups failed one by one after staging, each after a minute's wait for "the lighthouse")
        raise TrainingError(
            f"resources.work_pool: {pool!r} runs its groups in {work_pool.type} containers, and {HOST_ENV} is unset "
            f"where this pipeline runs: its lighthouse would listen on 127.0.0.1, which no group there reaches; set "
            f"{HOST_ENV} on the pipeline's worker to an address the groups can reach (infra/README.md)"
        )
    template = work_pool.base_job_template or {}
    variables = (template.get("variables") or {}).get("properties") or {}
    least = variables.get("gpus", {}).get("minimum", 0)
    if least and not gpus_per_replica:
        raise SpecError(
            [
                f"resources.gpus_per_replica: 0 (a CPU job), and {deployment.work_pool_name!r}'s groups each reserve "
                f"at least {least} GPU (its template's gpus minimum); set resources.gpus_per_replica, or run the job "
                "on a pool without GPUs"
            ]
        )
    network = (deployment.job_variables or {}).get("network_configuration") or variables.get(
        "network_configuration", {}
    ).get("default")
    # (an operator's own template may name its subnets in the run request itself)
    request = (template.get("job_configuration") or {}).get("task_run_request") or {}
    written = ((request.get("networkConfiguration") or {}).get("awsvpcConfiguration") or {}).get("subnets")
    named = [found for found in ((network or {}).get("subnets"), written) if isinstance(found, list) and found]
    if work_pool.type == "ecs" and not named:  # (a template's "{{ subnets }}" with no value is no list)
        # awsvpc tasks (the groups reach each other at their own addresses) need subnets, which prefect-aws picks
        # with a public IP ECS refuses for EC2 tasks: each group's run was refused, after staging
        raise TrainingError(
            f"resources.work_pool: {pool!r} is an ECS pool whose tasks have no subnets (network_configuration); set "
            "network_configuration {subnets, securityGroups} and vpc_id in the pool's defaults (infra/README.md, "
            "ECS networking)"
        )


def job_variables(resources: Resources, replica: int) -> dict:
    """The pool's job variables for one group, from the job's ``resources`` (whose keys the spec has checked
    against those every Trainyard pool template declares, ``LAUNCHER_JOB_VARIABLES``)."""
    variables = dict(resources.job_variables)
    # 0 too: a pool's template may reserve a GPU by default (the Kubernetes one's 1), which a CPU group never sees
    variables["gpus"] = resources.gpus_per_replica
    return variables


class WorkPoolLauncher:
    """Starts each replica group as a run of ``train-replica/<deployment>`` on a work pool."""

    def __init__(self, deployment: str, resources: Resources):
        self.deployment, self.resources = deployment, resources
        self.cancel_confirm_seconds = env_settings.seconds(CANCEL_CONFIRM_SECONDS_ENV, CANCEL_CONFIRM_SECONDS)
        # run id -> (when read, exit code, state type, the state)
        self._states: dict[UUID, tuple[float, int | None, StateType | None, State | None]] = {}
        self._cancelled: dict[UUID, float] = {}  # run id -> when we asked for the cancellation
        self._unanswered: dict[UUID, float] = {}  # run id -> since when the API has not answered about it
        self._to_kill: dict[UUID, ReplicaProcess] = {}  # runs whose cancellation the API did not take yet

    def start(self, handle: LaunchHandle, replica: int, attempt: int, resume: bool) -> ReplicaProcess:
        """Submit the group attempt's run. An API that does not take it (past its client's retries) is a
        ``TrainingError``: a restart is then tried again later, as one whose GPUs another job holds (the same
        idempotency key: never a second run), where it failed the job as an internal error."""
        import httpx

        try:
            return self._start(handle, replica, attempt, resume)
        except httpx.HTTPError as exc:  # (Prefect's HTTP status errors among them)
            raise TrainingError(
                f"the Prefect API did not take replica group {replica}'s run ({exc}); it is asked again"
            ) from None

    def _start(self, handle: LaunchHandle, replica: int, attempt: int, resume: bool) -> ReplicaProcess:
        run = run_deployment(
            f"{REPLICA_FLOW}/{self.deployment}",
            parameters={
                "job_dir": handle.job_dir,
                "replica": replica,
                "attempt": attempt,
                "resume": resume,
                "lighthouse_addr": handle.lighthouse_addr,
                "launch_id": handle.launch_id,
                "gpus_per_replica": self.resources.gpus_per_replica,
            },
            job_variables=job_variables(self.resources, replica),
            timeout=0,  # submit and return: the supervisor watches
            flow_run_name=f"{handle.job_id}-g{replica}-a{attempt}",  # in the UI and `jobs logs`: whose group it is
            # the same group attempt of the same launch: a create the client sends again is not a second group
            idempotency_key=f"{handle.job_id}-{handle.launch_id}-g{replica}-a{attempt}",
            tags=[f"{JOB_TAG}{handle.job_id}", REPLICA_TAG],
            as_subflow=False,
        )
        run_id = str(run.id)  # type: ignore[union-attr]  # called sync, it returns the run (typed: run or coroutine)
        return ReplicaProcess(replica=replica, attempt=attempt, pid=0, log="", resumed=resume, run_id=run_id)

    def exit_code(self, proc: ReplicaProcess) -> int | None:
        return self._read(proc)[0]

    def ended_how(self, proc: ReplicaProcess) -> str | None:
        """The ended run's state in Prefect's words ("Crashed: ... exit code 137"): what a group that failed
        before writing its own error (an image pull, an OOM kill, the worker's import) tells of its cause."""
        state = self._state(proc)
        if state is None:
            return None
        return f"its run {state.name}" + (f": {state.message}" if state.message else "")

    def lost_touch(self, proc: ReplicaProcess) -> bool:
        """Whether the run was marked Crashed for its heartbeats alone (``infra.apply``'s zombie automation): its
        worker cut off from the API, its group may train on."""
        state = self._state(proc)
        return state is not None and state.type == StateType.CRASHED and state.message == ZOMBIE_MESSAGE

    def _state(self, proc: ReplicaProcess) -> State | None:
        """The run's state as last read (``_read``, at most every STATE_CACHE_SECONDS)."""
        self._read(proc)
        return self._states[_run_id(proc)][3]

    def queued(self, proc: ReplicaProcess) -> bool:
        return self._read(proc)[1] == StateType.SCHEDULED  # no worker with room has taken it yet

    def _read(self, proc: ReplicaProcess) -> tuple[int | None, StateType | None]:
        """The run's exit code (None while it runs) and state type, read at most every STATE_CACHE_SECONDS.
        While the API does not answer (past its client's own retries), the last state read stands, for up to
        ``API_OUTAGE_SECONDS``: one failed read ended the job as an internal error, its groups shut down."""
        import httpx

        run_id = _run_id(proc)
        seen, code, kind, state = self._states.get(run_id, (0.0, None, None, None))
        if time.monotonic() - seen < STATE_CACHE_SECONDS:
            return code, kind
        if run_id in self._to_kill:  # a cancellation the API did not take
            self.kill(self._to_kill[run_id])
        try:
            code, kind = self._read_now(run_id)
        except httpx.HTTPError as exc:  # (Prefect's HTTP status errors among them)
            self._states[run_id] = (time.monotonic(), code, kind, state)  # asked again at the usual pace
            since = self._unanswered.setdefault(run_id, time.monotonic())
            if time.monotonic() - since > API_OUTAGE_SECONDS:
                raise TrainingError(
                    f"the Prefect API has not answered for replica group {proc.replica}'s run {run_id} for "
                    f"{API_OUTAGE_SECONDS:g} s ({exc}); is it up?"
                ) from None
            return code, kind
        self._unanswered.pop(run_id, None)
        return code, kind

    def _read_now(self, run_id: UUID) -> tuple[int | None, StateType | None]:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run_id).state
            kind = state.type if state else None
            code = _EXIT_CODES.get(state.type) if state else None
            asked = self._cancelled.get(run_id)
            if code is None and asked is not None and time.monotonic() - asked > self.cancel_confirm_seconds:
                message = (
                    f"cancelled {time.monotonic() - asked:.0f} s ago and no worker stopped it:"
                    " presumed lost with its worker"
                )
                state = Crashed(message=message)
                client.set_flow_run_state(run_id, state, force=True)
                kind, code = StateType.CRASHED, _EXIT_CODES[StateType.CRASHED]
        self._states[run_id] = (time.monotonic(), code, kind, state)
        return code, kind

    def kill(self, proc: ReplicaProcess) -> None:
        """Cancel the group's run (its worker stops its process). Where the API does not answer, asked again at
        each read of the run's state (``_read``) until it does: a hung group's kill, or a scale-down's, failed the
        job as an internal error."""
        import httpx

        try:
            self._kill(proc)
        except httpx.HTTPError as exc:
            self._to_kill[_run_id(proc)] = proc
            log.warning("could not cancel replica group %d's run (%s); asked again", proc.replica, exc)
        else:
            self._to_kill.pop(_run_id(proc), None)

    def _kill(self, proc: ReplicaProcess) -> None:
        run_id = _run_id(proc)
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run_id).state
            if state is None or state.is_final():
                return
            if state.type == StateType.SCHEDULED:  # still queued: no process to stop, no worker to ask
                client.set_flow_run_state(run_id, Cancelled(message="withdrawn before it started"), force=True)
                return
            client.set_flow_run_state(run_id, Cancelling(), force=True)
        self._cancelled.setdefault(run_id, time.monotonic())

    def terminate(self, proc: ReplicaProcess) -> None:
        self.kill(proc)  # a cancelled run's process gets SIGTERM first: the group leaves at a step boundary


def _run_id(proc: ReplicaProcess) -> UUID:
    """The flow run a pool's group is (``start`` sets it on every group it starts)."""
    assert proc.run_id is not None, f"replica group {proc.replica} was not started on a work pool"
    return UUID(proc.run_id)
