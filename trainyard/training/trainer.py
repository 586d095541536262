"""The training loop one replica group runs, under torchft.

Every group holds the whole model; torchft's ``Manager`` forms a quorum of live groups each step,
averages gradients across them (fault-tolerant DDP) and commits the step only when every
participant succeeded. A group that joins late or restarts after a crash heals from a live peer:
torchft sends it the ``state_dict`` below, so its data position (derived from the committed step)
and history continue where the others are. Stopping decisions use only values every group shares
(the committed step, validation metrics of identical parameters), so the groups agree on them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from trainyard import algorithms, cache
from trainyard.home import write_json_atomic
from trainyard.servers import advertised_host
from trainyard.spec import TrainingJob
from trainyard.training import checkpoint
from trainyard.training.attempt_files import (
    COUNTS_FILE,
    STEP_LOG_ENV,
    Heartbeat,
    StepCounts,
    StepLog,
    job_step,
    last_step,
    save_best_epoch,
    write_progress,
)
from trainyard.training.batches import StepData
from trainyard.training.drills import DRILL_FILE, drills, due_drill, inject_fault, played_drills
from trainyard.training.epochs import History, end_epoch, evaluate, history_state, step_rate, validates
from trainyard.training.flops import FlopMeter
from trainyard.training.heal_transport import HealTransport, confine_manager_server, group_store
from trainyard.training.plan import LIGHTHOUSE_ENV, TrainingPlan, attempt_dir, stop_requested
from trainyard.training.start_barrier import start_barrier

LEAVE = threading.Event()
"""Set on SIGTERM: the group leaves at its next step boundary, and the others go on."""


def _leave_or_die(parent: int):
    """The SIGTERM handler once training has begun: a graceful leave at the next step boundary, unless the
    process that started this group is gone (a pipeline killed outright: its death sends this SIGTERM,
    ``servers.die_with_parent``). Then no one is left to leave to, and the lighthouse went with it: the
    next quorum would wait minutes, the group outliving its job. It ends at once instead."""

    def handler(*_) -> None:
        if os.getppid() != parent:
            os._exit(128 + signal.SIGTERM)
        LEAVE.set()

    return handler


# Failure detection: short enough that survivors stall briefly when a peer dies.
PG_TIMEOUT = timedelta(seconds=10)
MANAGER_TIMEOUT = timedelta(seconds=30)
HEAL_TRIES = 3  # fetches of a peer's state a group tries before it fails (and is restarted, as any failure)
STOP_CHECK_STEPS = 4  # how often the groups agree on whether the job's stop was asked for (a tiny allreduce)
FUSED_DEVICES = ("cpu", "cuda")  # where the optimizer takes torch's fused kernel (_optimizer)


def load_arrays(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.load(path)
    return torch.from_numpy(data["x"]), torch.from_numpy(data["y"])


def train_replica(job_dir: Path, replica: int, attempt: int, resume: bool = False) -> dict:
    """Train as replica group ``replica`` until the job's stopping conditions hold; return the result.

    ``resume``: start from the job's latest S3 checkpoint (every group was lost), not from step 0.
    """
    from torchft import Manager

    from trainyard.training import device as devices
    from trainyard.training.ddp import BufferSync, StepForward, any_group

    started, started_unix = time.monotonic(), time.time()
    plan = TrainingPlan.read(job_dir)
    plan.export_channels()
    job = TrainingJob.model_validate(plan.job)
    hp = job.hyperparameters
    out = attempt_dir(job_dir, replica, attempt)
    x_train, y_train = load_arrays(plan.train_data)
    val = load_arrays(plan.validation_data) if plan.validation_data else None
    num_outputs = plan.schema["num_outputs"]
    device = devices.select(job.resources.gpus_per_replica, replica)
    model, loss_fn = algorithms.build(job.algorithm, hp, x_train.numpy(), y_train.numpy(), num_outputs)
    model.to(device)  # before the optimizer is built over its parameters
    probe, _ = algorithms.build(job.algorithm, hp, x_train.numpy(), y_train.numpy(), num_outputs)  # stays on CPU
    optimizer = _optimizer(model, hp)
    history = History()
    meter = FlopMeter(probe, loss_fn)
    # The epoch in progress: its number, its first step, and how many groups it was dealt to (first_slots: the
    # first epoch's).
    cursor = {"epoch": 0, "start_step": 0, "slots": 0}

    data = StepData(job, plan, x_train, y_train, cache.rowgroups_dir(), loss_fn, meter, device)

    def state_dict() -> dict:
        return {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "history": history_state(history),
            "cursor": dict(cursor),
            # the current step: a try of it that did not commit is not part of the state (torchft redoes it)
            "sifter": data.state_dict(manager.current_step()),
        }

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        for key, value in state["history"].items():
            setattr(history, key, value)
        cursor.update(state["cursor"])
        data.load_state_dict(state.get("sifter", {}))

    store = group_store()
    pg = devices.process_group(device, PG_TIMEOUT)
    confine_manager_server()  # torchft's manager server on 127.0.0.1 too, unless TRAINYARD_HOST is set
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=job.resources.min_replicas,
        use_async_quorum=False,  # heal before the batch is chosen, so the data position is current
        timeout=MANAGER_TIMEOUT,
        quorum_timeout=timedelta(seconds=plan.quorum_timeout_seconds),  # outlasts a peer's restart
        rank=0,
        world_size=1,
        store_addr=advertised_host(),  # the quorum's primary's store is where every group sets up the process group
        store_port=store.port,
        lighthouse_addr=os.environ.get(LIGHTHOUSE_ENV) or plan.lighthouse_addr,
        replica_id=f"{plan.job_id}-g{replica}",
        hostname=advertised_host(),  # where a healing peer fetches this group's state (TRAINYARD_HOST)
        checkpoint_transport=HealTransport(timeout=MANAGER_TIMEOUT),
    )
    # Added while the job runs (trainyard scale), or a first group that starts after the job has (one its pool
    # had no room for, start_barrier.QueuedGroups): it heals from the others and joins, never starts at step 0.
    joining = replica >= plan.num_replicas or (attempt == 0 and job_step(job_dir) > 0)
    if attempt == 0 and not joining:
        start_barrier(job_dir, replica, plan.num_replicas)
    forward = StepForward(manager, model)  # DDP, or the model itself while this group is alone in the quorum
    buffers = BufferSync(manager, model)

    previous = last_step(attempt_dir(job_dir, replica, attempt - 1)) if attempt > 0 else 0
    faults = drills(job, replica, played_drills(job_dir, replica, attempt))
    samples_trained, epoch_loss_sum, epoch_loss_count = 0, 0.0, 0
    first_batch_seconds = None
    heartbeat = Heartbeat(out / "heartbeat.json")
    step_log = StepLog(out / "steps.jsonl") if os.environ.get(STEP_LOG_ENV) == "1" else None
    recovery: dict | None = {"attempt": attempt, "joined": joining} if attempt > 0 or joining else None
    # Where this group must not start below: the job's furthest step for a restart or a group added
    # mid-job (one with nobody left to heal from would otherwise train the job alone from step 0).
    resume_floor = max(previous, job_step(job_dir)) if attempt > 0 or joining else 0
    every = job.elastic.checkpoint_every_steps
    checkpointer = checkpoint.Checkpointer(job, plan.job_id, plan.launch_id, every, out) if every else None
    if resume:
        found = checkpoint.latest(job, plan.job_id, plan.launch_id)
        if found is None:
            raise NoPeerToHeal(f"replica group {replica}: every group was lost before the first checkpoint")
        saved, size = checkpoint.load(found[0], out)
        load_state_dict(saved["state"])
        manager.load_state_dict(saved["manager"])
        recovery = (recovery or {}) | {
            "source": "checkpoint",
            "checkpoint": found[0],
            "healed_to_step": saved["step"],
            "bytes_moved": size,
        }
    stop = None

    def report() -> dict:  # progress.json, read by the train stage
        step = manager.current_step()
        return write_progress(out, replica, attempt, step, history, meter, samples_trained, recovery, data)

    counts = StepCounts(out / COUNTS_FILE)
    leave_on_sigterm = False
    # A stop request (the job's stop.json) is acted on at a step every group agrees on. Each reading it at the top
    # of a step, one that read it just before it was written joined the step's quorum while a peer that saw it
    # left: the first waited for the peer until it was killed. So, once in a quorum, the groups read it every
    # STOP_CHECK_STEPS committed steps and sum what they saw over the quorum (ddp.any_group): all stop there.
    in_quorum, stop_agreed, heal_failures = False, False, 0

    try:
        while True:
            if history.stop_reason or len(history.epochs) >= hp.epochs:
                break  # the job is done: a stop or a SIGTERM arriving now does not make it Stopped
            stop = (stop_requested(job_dir) or {"reason": "Stopped"}) if stop_agreed else None
            if not in_quorum:  # still on its own: a stop asked before the job's first step ends it here
                stop = stop_requested(job_dir)
            if LEAVE.is_set():
                stop = {"reason": "Left"}
            if stop:
                break
            due = due_drill(faults, manager.current_step())
            heartbeat.beat(manager.current_step(), force=due is not None)
            if due is not None:
                # recorded first: the restart plays the drills left, whatever step this one ends at
                write_json_atomic(out / DRILL_FILE, {"at_step": due, "step": manager.current_step()})
                inject_fault(faults.pop(due))
            before = manager.current_step()
            # it may wait on a peer's restart, or heal
            with heartbeat.while_busy(before, closing_beat=False, own_work=False):
                manager.start_quorum()  # joins the step's quorum; heals from a peer if behind
            in_quorum = True
            if not leave_on_sigterm:
                # From its first quorum on, SIGTERM (a spot interruption notice, a scale-down) is a graceful
                # leave at the next step boundary: the others go on without this group. Until then it ended
                # the process (replica.py): that quorum can wait minutes in torchft, where no handler runs.
                signal.signal(signal.SIGTERM, _leave_or_die(os.getppid()))
                leave_on_sigterm = True
            # the fetch from the peer broke (the step is redone and the heal tried again), a few times at most
            healing_failed = manager.errored() is not None and manager.current_step() <= before
            heal_failures = heal_failures + 1 if healing_failed else 0
            if heal_failures >= HEAL_TRIES:
                raise RuntimeError(
                    f"replica group {replica} could not fetch a live peer's state {HEAL_TRIES} times: "
                    f"{manager.errored()}"
                )
            if (
                recovery is not None
                and "source" not in recovery
                and not healing_failed
                and manager.current_step() <= before < resume_floor
            ):
                how = "added" if joining else "restarted"
                raise NoPeerToHeal(
                    f"replica group {replica} was {how} with the job at step {resume_floor} but no live group "
                    "was ahead of it to heal from; it does not start over alone"
                )
            if recovery is not None and "source" not in recovery and manager.current_step() > before:
                # the step jumped: torchft loaded a live peer's state (no checkpoint was read)
                recovery |= {
                    "source": "peer",
                    "healed_to_step": manager.current_step(),
                    "bytes_moved": _state_bytes(state_dict()),
                    "sifter_history": len(data.sifter.history) if data.sifter else None,
                }
            optimizer.zero_grad()
            step, members, rank = manager.current_step(), manager.num_participants(), manager.participating_rank()
            if step == cursor["start_step"]:
                cursor["slots"] = members  # the epoch is dealt to the groups in its first quorum
                if cursor["epoch"] == 0:
                    cursor["first_slots"] = members  # (the summary's steps_per_epoch)
            participating = rank is not None
            xb, yb, normaliser = data.batch(
                model, cursor["epoch"], step - cursor["start_step"], step, cursor["slots"], rank or 0, members
            )
            if first_batch_seconds is None:
                first_batch_seconds = time.monotonic() - started
            with algorithms.one_row_batch_norm(model, len(xb)):
                losses = loss_fn(forward()(xb), yb)
            losses = algorithms.check_per_sample(losses, len(xb))
            data.trained(losses)  # with sifting.reuse_loss_epochs, these rows need no scoring pass for a while
            # torchft averages gradients over the quorum's groups, whose batches may differ in size:
            # scaled so, the average is the gradient of the mean loss over the whole global batch.
            weighted = losses if data.weights is None else losses * data.weights  # sifting.prune's kept learnt rows
            (weighted.sum() * (members / max(normaliser, 1))).backward()
            if participating:
                meter.add_train_step(xb, yb)
            buffers.reduce()
            stopping = step % STOP_CHECK_STEPS == 0 and any_group(manager, stop_requested(job_dir) is not None, device)
            index, spe = step - cursor["start_step"], data.steps_per_epoch(cursor["slots"], cursor["epoch"])
            data.share_losses(manager, closes_epoch=index + 1 >= spe)  # (this step ends the epoch: see below)
            with heartbeat.while_busy(step, closing_beat=False, own_work=False):  # may wait for a peer that died
                committing = manager.should_commit()
            if not committing:
                continue  # a participant failed: nothing is applied and the step is redone
            data.committed()  # (sifting.score proxy: the proxy learns the step's rows only once it counts)
            stop_agreed = stopping
            buffers.apply()
            rate = step_rate(hp, step, (cursor["epoch"] + index / spe) / hp.epochs, cursor)  # (cursor: the warm-up)
            for param_group in optimizer.param_groups:
                param_group["lr"] = rate
            optimizer.step()
            if step_log is not None:
                step_log.add(manager.current_step())
            if recovery is not None and "rejoined_at_step" not in recovery:
                recovery |= {"rejoined_at_step": manager.current_step(), "first_commit_unix": time.time()}
                recovery.setdefault("source", "none")  # no peer was ahead: nothing to heal from
                report()
            if participating:
                samples_trained += len(xb)
                epoch_loss_sum += float(losses.detach().sum())
                epoch_loss_count += len(xb)
            counts.write(manager.current_step(), samples_trained, meter, data)
            if manager.current_step() - cursor["start_step"] >= spe:
                epoch = cursor["epoch"] + 1
                metrics = {"train_loss": epoch_loss_sum / max(epoch_loss_count, 1), "steps": spe}
                metrics |= data.epoch_metrics()
                # This group's training FLOPs so far (forward, backward, sifting's scoring; counted from
                # its own start: a restarted group's count restarts): compute over time, per epoch.
                metrics["group_train_flops"] = meter.forward + meter.backward + meter.scoring
                validating = val is not None and validates(job, epoch)  # (stopping.validate_every_epochs)
                # every group validates now: none is hung
                with heartbeat.while_busy(manager.current_step()) if validating else contextlib.nullcontext():
                    if val is not None and validating:  # (val named again for the type checker)
                        metrics |= evaluate(model, loss_fn, *val, job.algorithm.task, meter)
                    end_epoch(history, epoch, metrics, job, plan.released_unix or started_unix)
                if val is not None and not validating and (history.stop_reason or history.best_epoch == epoch):
                    # A train_loss target or patience (one group only) ended the job, or kept this epoch as its best,
                    # between validations: the model it keeps is validated all the same (what it is registered by).
                    with heartbeat.while_busy(manager.current_step()):
                        history.epochs[-1] |= evaluate(model, loss_fn, *val, job.algorithm.task, meter)
                if job.stopping.restores_best and history.best_epoch == epoch:
                    with heartbeat.while_busy(manager.current_step()):
                        save_best_epoch(out, history.best_epoch, devices.cpu_state(model))
                cursor.update(epoch=epoch, start_step=manager.current_step(), slots=0)
                epoch_loss_sum, epoch_loss_count = 0.0, 0
                report()
            if checkpointer is not None and rank == 0 and checkpointer.due(manager.current_step()):
                with heartbeat.while_busy(manager.current_step()):
                    checkpointer.save(manager.current_step(), state_dict(), manager.state_dict())
    except BaseException:
        _close(counts, heartbeat, manager, pg, checkpointer)
        raise
    counts.close()
    manager.shutdown(wait=False)
    devices.close_process_group(pg)
    result = report()
    result |= {
        "stop_reason": (stop or {}).get("reason") or history.stop_reason or "Completed",
        "best_epoch": history.best_epoch,
        "epoch_end_step": cursor["start_step"],  # where the last whole epoch ended: a stop may come mid-epoch
        "steps_per_epoch": data.steps_per_epoch(cursor.get("first_slots") or plan.num_replicas, 0),  # the first epoch's
        "first_batch_seconds": first_batch_seconds,
        "wall_seconds": time.monotonic() - started,
        "finished": True,
    }
    # The model and the result first, then the wait for a checkpoint upload still in flight: a stop's grace, or the
    # silence limit, ran out during that wait and the group was killed with its model unsaved (a job stopped to
    # keep its model so far ended failed). The group beats meanwhile: the supervisor knows it is saving.
    with heartbeat.while_busy(manager.current_step()):
        torch.save(devices.cpu_state(model), out / ".model.pt.tmp")
        os.replace(out / ".model.pt.tmp", out / "model.pt")
        write_json_atomic(out / "result.json", result)
        if checkpointer is not None:
            checkpointer.close()  # (a later checkpoint's object only: none is needed once the result is written)
    heartbeat.close()
    return result


def _close(counts, heartbeat, manager, pg, checkpointer) -> None:
    """What a group that fails lets go of: its files, torchft's manager, its process group, and the upload of a
    checkpoint in flight (waited for: a later restart may resume from it)."""
    from trainyard.training import device as devices

    counts.close()
    heartbeat.close()
    manager.shutdown(wait=False)
    devices.close_process_group(pg)
    if checkpointer is not None:
        checkpointer.close()


def _optimizer(model: torch.nn.Module, hp) -> torch.optim.Optimizer:
    """The job's optimizer over ``model``'s parameters, with torch's fused kernel where it has one.

    Fused, one kernel updates every parameter; torch's default on CPU is a Python loop over them. A
    digits job's step (the built-in MLP, 256 x 256) took 3.7 ms fused against 4.5 ms on 2 cores
    (medians of 10 runs each). The update rule is the same; only the rounding differs. Torch's fused
    kernels take floating-point parameters on the CPU and CUDA, the devices a group trains on; any
    other parameter (a user's model may hold a complex one, which fused refuses at its first step) gets
    torch's default for all.
    """
    params = list(model.parameters())
    fused = all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in params)
    options = {"lr": hp.learning_rate, "weight_decay": hp.weight_decay} | ({"fused": True} if fused else {})
    if hp.optimizer == "sgd":
        return torch.optim.SGD(params, momentum=hp.momentum, **options)
    return torch.optim.AdamW(params, **options)


class NoPeerToHeal(RuntimeError):
    """A restarted or added group found nobody to take the job's state from (not the user's fault)."""


def _state_bytes(state: object) -> int:
    """Bytes of the tensors in a (nested) state dict: what a healing group receives from its peer."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_state_bytes(v) for v in state)
    return 0
