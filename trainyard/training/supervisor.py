"""Stage 4, training (the orchestrating side): release the replica groups, watch them, retry a crashed
group (it heals from a live peer, no checkpoint read), enforce the runtime limit, collect the result.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainyard import algorithms, launch
from trainyard.errors import TrainingError
from trainyard.home import write_json_atomic
from trainyard.launch import LaunchHandle, ReplicaProcess
from trainyard.spec import TrainingJob
from trainyard.training.accounting import energy_by_replica, sifting_totals, work_done
from trainyard.training.attempt_files import (
    best_epoch_file,
    finished_the_job,
    last_step,
    moving,
    report_progress,
    silent_seconds,
)
from trainyard.training.failures import failure_record, recoveries, too_few_left, training_failed
from trainyard.training.plan import SUPERVISOR_FILE, TrainingPlan, attempt_dir, request_stop, stop_requested
from trainyard.training.preflight import preflight
from trainyard.training.restarts import (
    RETRY_BACKOFF_SECONDS,
    backoff_seconds,
    quorum_timeout_seconds,
    silent_seconds_limit,
)
from trainyard.training.scaling import Scaler
from trainyard.training.start_barrier import QueuedGroups, mark_ready
from trainyard.training.trainer import load_arrays

POLL_SECONDS = 0.1
# After a stop request, groups get this long to reach a step boundary and write their result (from the request, or
# from their last sign of moving towards it: attempt_files.moving).
STOP_GRACE_SECONDS = 30.0
RESTART_DEFERRED_SECONDS = 10.0  # a restart whose GPUs another job holds is tried again this often


@dataclass(slots=True)
class TrainingOutcome:
    """The result of the training stage, small and serialisable."""

    model_path: str
    stop_reason: str
    history: list[dict]
    steps: int
    samples_trained: int
    flops: dict[str, int]
    failures: list[dict] = field(default_factory=list)
    recoveries: list[dict] = field(default_factory=list)
    departures: list[dict] = field(default_factory=list)
    joins: list[dict] = field(default_factory=list)
    scaling: list[dict] = field(default_factory=list)
    withdrawn: list[int] = field(default_factory=list)  # added groups still queued when the job ended
    replicas_finished: list[int] = field(default_factory=list)
    first_batch_seconds: float | None = None
    steps_per_epoch: int = 0
    sifting: dict | None = None
    energy_by_replica: dict[str, float] = field(default_factory=dict)
    """kWh each group's processes drew (codecarbon process mode), all its attempts together."""
    best_epoch: int | None = None
    """The epoch whose watched metric was best (tracked with patience or ``stopping.restore_best``)."""
    restored_epoch: int | None = None
    """The epoch whose parameters ``model_path`` holds, where not the last (``stopping.restore_best``)."""


def train(
    handle: LaunchHandle,
    plan: TrainingPlan,
    job: TrainingJob,
    on_progress: Callable[[int, dict | None], None] | None = None,
    on_event: Callable[[str, dict], None] | None = None,
) -> TrainingOutcome:
    """Release the launched groups and supervise them until they finish; raise ``TrainingError`` if none does.

    ``on_progress(epochs_done, that_epochs_metrics)`` is called once per epoch, in order; ``on_event(kind,
    payload)`` for each ``replica.failed``, ``replica.restarted``, ``replica.recovered``, ``replica.left``,
    ``replica.queued`` (the job starts without it), ``job.scaled``, ``job.scale_refused`` (a group that
    could not be started), ``replica.added`` and ``replica.removed``."""
    emit = on_event or (lambda kind, payload: None)
    job_dir = Path(handle.job_dir)
    silent_limit = silent_seconds_limit()  # before the plan the groups wait for: a bad value trains nothing
    plan.quorum_timeout_seconds = quorum_timeout_seconds(silent_limit, handle.work_pool)
    preflight(job, plan)
    plan.released_unix = time.time()
    plan.write(job_dir)
    write_json_atomic(job_dir / SUPERVISOR_FILE, {"pid": os.getpid()})
    try:
        return _supervise(handle, plan, job, job_dir, on_progress, emit, silent_limit)
    finally:
        (job_dir / SUPERVISOR_FILE).unlink(missing_ok=True)


def _supervise(
    handle: LaunchHandle, plan: TrainingPlan, job: TrainingJob, job_dir: Path, on_progress, emit, silent_limit: float
):
    deadline = time.monotonic() + job.stopping.max_runtime_seconds
    stop_deadline: float | None = None
    stepped: dict[tuple[int, int], int] = {}  # each group's step when last looked at, while a stop is pending
    shut_down = False
    live = {r.replica: r for r in handle.replicas}
    failures: list[dict] = []
    finished: dict[int, dict] = {}
    silenced: dict[tuple[int, int], tuple[float, float]] = {}  # (replica, attempt) -> (seconds silent, last beat)
    epochs_seen = 0
    scaler = Scaler(handle, job, emit)
    queued = QueuedGroups(handle, plan.num_replicas, job.resources.min_replicas, emit)
    # A failed group's restart waits out its backoff here, while the loop goes on watching the others
    # (a second failure, a hang, a stop request): replica -> (when, the failed attempt, from a checkpoint).
    waiting: dict[int, tuple[float, ReplicaProcess, bool]] = {}
    announced: set[tuple[int, int]] = set()  # (replica, attempt) of restarts whose recovery was emitted
    # A group still running STOP_GRACE_SECONDS after another finished the job (wedged before its first
    # heartbeat, so never found silent) is ended, not waited on until max_runtime, and is no failure.
    done_deadline: float | None = None
    reaped: set[tuple[int, int]] = set()
    while live or waiting:
        # Every group that ended since the last look leaves `live` before any is judged: groups lost
        # together (one node, one power cut) are all lost, and the first judged must not count the
        # others as live peers to heal from.
        # Those that finished are counted first, so a failure judged beside them sees the job done.
        ended = {
            r: (p, code)
            for r, p in live.items()
            if (code := launch.exit_code(handle, p)) is not None and not _ended_alive(handle, job_dir, p, silent_limit)
        }
        for replica, (proc, _code) in list(ended.items()):
            del live[replica]
            out = attempt_dir(job_dir, replica, proc.attempt)
            # Its result written, it finished, however its process ended: a pool reports a run cancelled to make
            # its group leave (a scale-down, a stop) as exit code -15, after the group left at a step boundary.
            if (out / "result.json").exists():
                del ended[replica]
                finished[replica] = json.loads((out / "result.json").read_text())
                if finished[replica]["stop_reason"] == "Left":
                    emit("replica.left", {"replica": replica, "left_at_step": finished[replica]["step"]})
        for replica, (proc, code) in ended.items():
            out = attempt_dir(job_dir, replica, proc.attempt)
            if replica in scaler.leaving or (replica, proc.attempt) in reaped:
                # asked to leave (scaled down), or ended once the job was done: however it ended, even
                # before its SIGTERM handler was up, it is not a failure and is not restarted
                continue
            # where it wrote no error of its own, its pool's words for how its run ended (one API read a failure)
            how = None if (out / "error.json").exists() else launch.ended_how(handle, proc)
            failure = failure_record(out, replica, proc.attempt, code, how)
            job_done = finished_the_job(
                job_dir, finished, live
            )  # a group finished the job, its process maybe still exiting
            if job_done and failure["kind"] == "NoPeerToHeal":
                continue  # a restart that came back after the others finished the job: nothing failed
            if (replica, proc.attempt) in silenced:
                silent, last_beat = silenced[replica, proc.attempt]
                failure["message"] = f"silent for {silent:.1f} s (hung, or lost with its node): killed and restarted"
                # it stopped training at its last heartbeat, not when the silence was noticed: recovery
                # time (to the restart's first committed step) counts from there
                failure["detected_unix"] = last_beat
            failures.append(failure)
            emit("replica.failed", failure)
            mark_ready(job_dir, replica)  # the others at the start barrier go on without it
            if failure["user_error"]:
                launch.shutdown(handle)
                raise training_failed(f"replica group {replica}: {failure['message']}", failures)
            # A restart heals from a live group. With none left (or none ahead of a restarted group)
            # it would start over from step 0 alone; the S3 checkpoint, if the job writes them, is
            # the fallback for that.
            started = [p for p in live.values() if not launch.queued(handle, p)]  # a queued group has no state
            lost = (not started and failure["step"] > 0) or failure.get("kind") == "NoPeerToHeal"
            resume = lost and job.elastic.checkpoint_every_steps is not None
            if resume:  # the restarts still waiting out their backoff have no live group either
                waiting = {r: (when, failed, True) for r, (when, failed, _) in waiting.items()}
            if lost and not resume and not job_done:
                failure["message"] += (
                    "; no live replica group is left to heal from (elastic.checkpoint_every_steps is off)"
                )
            if (
                proc.attempt + 1 < job.retries.max_attempts
                and not stop_requested(job_dir)
                and not job_done
                and (resume or not lost)
            ):
                restart_at = time.monotonic() + backoff_seconds(proc.attempt, RETRY_BACKOFF_SECONDS)
                waiting[replica] = (restart_at, proc, resume)
        job_finished = finished_the_job(job_dir, finished, live)
        ending = stop_requested(job_dir) or job_finished
        short = job.resources.min_replicas - len(live) - len(waiting)
        leaving = scaler.leaving & live.keys()  # (a group asked to leave that has gone no longer counts)
        left = sorted(r for r, res in finished.items() if res["stop_reason"] == "Left")  # (SIGTERM: never restarted)
        if (failures or left) and live and short > 0 and not ending and not leaving:  # (none live: said below)
            # Groups lost for good left fewer than a step needs: the others would wait out the quorum's
            # timeout and fail with torchft's words. Said at once, with the settings that decide it.
            launch.shutdown(handle)
            raise too_few_left(job.resources.min_replicas, job.retries.max_attempts, failures, left, len(live))
        for replica, (when, failed, resume) in list(waiting.items()):
            if ending:  # finished or stopped while it waited: nothing to come back to
                del waiting[replica]
            elif time.monotonic() >= when:
                try:
                    restarted = launch.start_replica(handle, replica, failed.attempt + 1, resume=resume)
                except TrainingError as exc:  # its GPUs taken by another job's group, its pool's API down: tried later
                    waiting[replica] = (time.monotonic() + RESTART_DEFERRED_SECONDS, failed, resume)
                    emit("replica.restart_deferred", {"replica": replica, "reason": str(exc)})
                    continue
                del waiting[replica]
                handle.replicas.append(restarted)
                emit(
                    "replica.restarted",
                    {"replica": replica, "attempt": restarted.attempt, "pid": restarted.pid, "from_checkpoint": resume},
                )
                live[replica] = restarted
        if ending:
            # Withdrawn at once: a queued group must not take the room a finishing group frees.
            scaler.withdraw_unstarted(live, queued.released)
        elif not waiting:  # a request is acted on once no restart is pending, so that it counts every group
            scaler.tick(live, max((last_step(attempt_dir(job_dir, r, p.attempt)) for r, p in live.items()), default=0))
        if not ending:
            queued.tick(live)
        for replica, proc in live.items():
            silent = silent_seconds(attempt_dir(job_dir, replica, proc.attempt))
            if silent > silent_limit and (replica, proc.attempt) not in silenced:
                # hung (SIGSTOP, a wedged collective): its peers went on
                silenced[replica, proc.attempt] = (silent, time.time() - silent)
                launch.kill(handle, proc)
        # a restart's first committed step with the others, told as it happens
        unannounced = [f for f in failures if (f["replica"], f["attempt"] + 1) not in announced]
        for recovery in recoveries(job_dir, unannounced):
            announced.add((recovery["replica"], recovery["attempt"]))
            emit("replica.recovered", recovery)
        epochs_seen = report_progress(job_dir, handle, epochs_seen, on_progress)
        now = time.monotonic()
        if now > deadline and not stop_requested(job_dir):
            request_stop(job_dir, "MaxRuntimeExceeded", f"max_runtime_seconds={job.stopping.max_runtime_seconds}")
        if stop_requested(job_dir) and not shut_down:
            # The grace runs from the request, and again from each sign that a group is on its way to the step all
            # stop at (a step committed, or a fresh beat of its own slow work: a validation, its model's save): a
            # fixed 30 s killed groups validating or saving for longer, and the job lost the model it was stopped
            # to keep. Groups waiting on peers that have left show neither, and are shut down when it runs out.
            yet = {r: p for r, p in live.items() if r not in finished}  # (a finished group's beats: its model's save)
            moved = any(moving(attempt_dir(job_dir, r, p.attempt), (r, p.attempt), stepped) for r, p in yet.items())
            if stop_deadline is None or moved:
                stop_deadline = max(stop_deadline or now, now + STOP_GRACE_SECONDS)
        if done_deadline is None and job_finished:
            done_deadline = now + STOP_GRACE_SECONDS
        # a stop's stragglers first: shut down, each counts as failed (a hung one) at the next look; reaped, not
        if stop_deadline is not None and now > stop_deadline and not shut_down:
            launch.shutdown(handle)  # stragglers stuck waiting for departed peers
            shut_down = True
        elif done_deadline is not None and now > done_deadline:
            for replica, proc in live.items():
                if (replica, proc.attempt) not in reaped:
                    reaped.add((replica, proc.attempt))
                    launch.kill(handle, proc)
        due = min((when for when, _, _ in waiting.values()), default=now + POLL_SECONDS)
        time.sleep(min(POLL_SECONDS, max(0.0, due - now)))
    report_progress(job_dir, handle, epochs_seen, on_progress)
    if not finished:
        last = failures[-1]["message"] if failures else "no group reported a result"
        # the attempts that ran: a failure no retry can mend (no live peer to heal from) is not retried
        attempts = 1 + max((f["attempt"] for f in failures), default=0)
        raise training_failed(
            f"every replica group failed after {attempts} attempt(s) (retries.max_attempts "
            f"{job.retries.max_attempts}): {last}",
            failures,
        )
    lost = sorted({f["replica"] for f in failures} - set(finished))
    if lost and all(res["stop_reason"] == "Left" for res in finished.values()) and not stop_requested(job_dir):
        # the groups that went on after the others left failed for good: the job ended in failure, not in
        # a stop, and the model of a group that left early is not its result
        raise training_failed(
            f"replica group(s) {', '.join(map(str, lost))} failed for good after the others had left the job: "
            f"{failures[-1]['message']}",
            failures,
        )
    outcome = _collect(job_dir, handle, finished, failures, job.stopping.restores_best)
    outcome.joins, outcome.scaling, outcome.withdrawn = scaler.joins(queued.released), scaler.changes, scaler.withdrawn
    for recovery in outcome.recoveries:  # any the loop had not seen yet
        if (recovery["replica"], recovery["attempt"]) not in announced:
            emit("replica.recovered", recovery)
    return outcome


def _ended_alive(handle: LaunchHandle, job_dir: Path, proc: ReplicaProcess, silent_limit: float) -> bool:
    """Whether a group whose run ended in its pool's records alone (marked Crashed for missed heartbeats: a worker
    cut off from the API) still trains: it wrote no result or error, and its heartbeat is younger than a hung
    group's limit. A restart beside it would be a second group of one replica; it is judged once silent."""
    out = attempt_dir(job_dir, proc.replica, proc.attempt)
    if (out / "result.json").exists() or (out / "error.json").exists() or not launch.lost_touch(handle, proc):
        return False
    return (out / "heartbeat.json").exists() and silent_seconds(out) < silent_limit


def launch_and_train(
    job: TrainingJob, plan: TrainingPlan, job_dir: Path, on_event: Callable[[str, dict], None] | None = None
) -> tuple[TrainingOutcome, LaunchHandle]:
    """Training without an orchestrator: start the lighthouse and the groups, train, stop them all."""
    handle = launch.launch(plan.job_id, job_dir, job.resources)
    plan.lighthouse_addr, plan.launch_id = handle.lighthouse_addr, handle.launch_id
    try:
        return train(handle, plan, job, on_event=on_event), handle
    finally:
        launch.shutdown(handle)


def _collect(
    job_dir: Path,
    handle: LaunchHandle,
    finished: dict[int, dict],
    failures: list[dict],
    restore_best: bool = False,
) -> TrainingOutcome:
    """Pick the result (the group that got furthest; a group that left early is not it), check the
    groups agree, and add up what every attempt spent. With ``restore_best``, the model is the best
    epoch's parameters that some attempt kept, where the model trained past that epoch."""
    # of those level, one that did not leave (a SIGTERM in the last step: the others completed the job), and a
    # first attempt's: a restart's first_batch_seconds counts from its restart
    first = max(
        finished,
        key=lambda r: (finished[r]["step"], finished[r]["stop_reason"] != "Left", -finished[r]["attempt"], -r),
    )
    result = finished[first]
    model_path = attempt_dir(job_dir, first, result["attempt"]) / "model.pt"
    reference = torch.load(model_path, weights_only=True, map_location="cpu")
    for replica, other in finished.items():
        if replica == first or other["step"] != result["step"]:
            continue
        state = torch.load(
            attempt_dir(job_dir, replica, other["attempt"]) / "model.pt", weights_only=True, map_location="cpu"
        )
        # integer buffers (BatchNorm's num_batches_tracked) count each group's own forward passes, redone steps
        # included; the floating-point ones are averaged every step (ddp.BufferSync)
        worst = max(
            (
                float((state[k].float() - reference[k].float()).abs().max())
                for k in reference
                if reference[k].is_floating_point()
            ),
            default=0.0,
        )
        if worst > 1e-5:
            raise TrainingError(
                f"replica groups {first} and {replica} ended with different parameters "
                f"(max difference {worst:.3g}); the model is not registered"
            )
    best, restored = result.get("best_epoch"), None
    # where the best epoch is the last whole one, a stop mid-epoch (trainyard stop, max runtime, the carbon budget)
    # left steps past it: the model is not that epoch's either
    past_it = result["step"] > result.get("epoch_end_step", result["step"])
    if restore_best and best is not None and (best < result["epochs"][-1]["epoch"] or past_it):
        kept = best_epoch_file(job_dir, best)
        if kept is not None:
            model_path, restored = kept, best
    done = work_done(job_dir)
    flops, samples, sifted = done["flops"], done["samples_trained"], done["sifting"]
    return TrainingOutcome(
        model_path=str(model_path),
        best_epoch=best,
        restored_epoch=restored,
        stop_reason=result["stop_reason"],
        history=result["epochs"],
        steps=result["step"],
        samples_trained=samples,
        flops=flops,
        failures=failures,
        recoveries=recoveries(job_dir, failures),
        departures=[
            {"replica": r, "left_at_step": res["step"]} for r, res in finished.items() if res["stop_reason"] == "Left"
        ],
        replicas_finished=sorted(finished),
        first_batch_seconds=result.get("first_batch_seconds"),
        steps_per_epoch=result.get("steps_per_epoch", 0),
        sifting=sifting_totals(sifted, flops) if sifted else None,
        energy_by_replica=energy_by_replica(job_dir),
    )


def load_model(outcome: TrainingOutcome, job: TrainingJob, plan: TrainingPlan) -> torch.nn.Module:
    """Rebuild the trained model in this process from the chosen group's parameters."""
    plan.export_channels()
    x, y = load_arrays(plan.train_data)
    model, _ = algorithms.build(job.algorithm, job.hyperparameters, x.numpy(), y.numpy(), plan.schema["num_outputs"])
    model.load_state_dict(torch.load(outcome.model_path, weights_only=True, map_location="cpu"))
    return model.eval()
