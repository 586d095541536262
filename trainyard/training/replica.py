"""Entrypoint of one replica group process: ``python -m trainyard.training.replica``.

The launch stage starts it early, so interpreter and torch start-up overlap the filtering stage;
it then waits for the train stage's plan (the go signal) and trains. It exits 0 when it finished,
non-zero on failure, after writing what went wrong to ``error.json`` in its attempt folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

from trainyard import collector, env_settings
from trainyard.env_settings import THREADS_ENV
from trainyard.errors import TrainyardError
from trainyard.home import write_json_atomic
from trainyard.redaction import redact_exception
from trainyard.training.plan import LAUNCH_ENV, LIGHTHOUSE_ENV, PLAN_FILE, attempt_dir

METER_ENV = "TRAINYARD_CARBON_METER"
PLAN_WAIT_SECONDS = 6 * 3600
LIGHTHOUSE_LOOK_SECONDS = 5.0  # how often a pool group waiting for its plan asks its job's lighthouse
LIGHTHOUSE_GONE_SECONDS = 60.0  # unanswered this long (a restart of it would take seconds), the job is gone
# The pid of the process that started this group (launch sets it): read from the start-up's own
# getppid(), a parent that died while this interpreter started (its imports take seconds on a busy
# machine) was never seen, and the group waited the whole PLAN_WAIT_SECONDS for a plan that could not come.
PARENT_ENV = "TRAINYARD_PARENT_PID"


def wait_for_plan(job_dir: Path, parent_pid: int) -> str | None:
    """Wait for this group's launch's plan: None once it is there, else why it will not come. Given up when the
    process that started the group is gone (a local group's pipeline), when the job's lighthouse has stopped
    answering (a pool group's: its pipeline died, and nothing else cancels its run, which would hold its slot
    for ``PLAN_WAIT_SECONDS``), when the plan is another launch's (the job id run again meanwhile: this
    group's job is over), or when it never comes."""
    deadline = time.monotonic() + PLAN_WAIT_SECONDS
    launch, lighthouse = os.environ.get(LAUNCH_ENV, ""), os.environ.get(LIGHTHOUSE_ENV, "")
    answered, next_look = time.monotonic(), 0.0
    while time.monotonic() < deadline:
        if (job_dir / PLAN_FILE).exists():
            theirs = _plan_launch(job_dir)
            if launch and theirs and theirs != launch:
                return f"the plan is another launch's ({theirs}, this group's {launch}): the job id was run again"
            return None
        if os.getppid() != parent_pid:
            return "the plan never came: the train stage is gone"
        if lighthouse and time.monotonic() >= next_look:
            next_look = time.monotonic() + LIGHTHOUSE_LOOK_SECONDS
            if _answers(lighthouse):
                answered = time.monotonic()
            elif time.monotonic() - answered > LIGHTHOUSE_GONE_SECONDS:
                return (
                    f"the plan never came: the job's lighthouse {lighthouse} has not answered for "
                    f"{LIGHTHOUSE_GONE_SECONDS:g} s"
                )
        time.sleep(0.05)
    return f"the plan never came in {PLAN_WAIT_SECONDS / 3600:g} h"


def _plan_launch(job_dir: Path) -> str:
    try:
        return json.loads((job_dir / PLAN_FILE).read_text()).get("launch_id") or ""
    except (OSError, ValueError):  # (written atomically: unreadable only if removed meanwhile)
        return ""


def _answers(url: str) -> bool:
    """Whether the lighthouse at ``url`` answers HTTP at all (any status counts)."""
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job-dir", type=Path, required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="start from the job's latest S3 checkpoint")
    args = parser.parse_args(argv)
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())
    out = attempt_dir(args.job_dir, args.replica, args.attempt)
    try:  # set by the worker or the job's job_variables.env: its mistake, named, and not retried
        threads = env_settings.count(THREADS_ENV, 1)
    except TrainyardError as exc:
        write_json_atomic(out / "error.json", {"message": str(exc), "kind": "TrainyardError", "user_error": True})
        print(exc, file=sys.stderr, flush=True)
        return 1
    # The imports below (torch, torchft, the engine, codecarbon) make objects that live as long as the
    # process: no collection while they run (collector.py), and what they made is then frozen out of
    # every later collection's walk.
    with collector.paused():
        from trainyard.carbon import BackgroundMeter

        # The group's own share of the machine (carbon.by_replica), started first, in a thread: where this
        # machine has no saved hardware probe yet (carbon_probe), codecarbon's ~1.4 s of CPU for it then
        # overlaps the imports and the wait for the plan. Off only to measure what metering costs.
        energy = BackgroundMeter(f"replica-{args.replica}") if os.environ.get(METER_ENV) != "off" else None
        # torchft's Rust side logs several lines per step at INFO: megabytes a minute, and time per step.
        os.environ.setdefault("RUST_LOG", "warn")
        import torch  # after argument parsing: a bad command line fails fast

        torch.set_num_threads(threads)
        if not hasattr(torch._C._distributed_c10d, "_reset_fr_recording_nccl"):
            # a build without NCCL's flight recorder (CPU): torchft warns at every quorum that it cannot reset it
            logging.getLogger("torchft.manager").addFilter(lambda r: "NCCL flight recorder" not in r.getMessage())
        from trainyard.training.trainer import train_replica

        collector.freeze_once()
    # SIGTERM (a spot interruption notice, a scale-down, a cancelled run) ends the group at once until
    # its first quorum: nothing is trained yet, and where it waits (for the plan, for the other groups, in
    # torchft's minute-long connect to a lighthouse that a stopped job took down) no step boundary comes
    # soon. From then on, the trainer makes it a graceful leave at the next step boundary.
    # (In a train-replica flow run, this replaces Prefect's handler.)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    # whole or absent (a temporary name, then a rename): what signals the group reads it as soon as it exists,
    # and a reader once found it empty (a test's signaller, in a fresh-clone CI run at 52fd651)
    (out / ".pid.tmp").write_text(str(os.getpid()))
    os.replace(out / ".pid.tmp", out / "pid")
    gone = wait_for_plan(args.job_dir, parent)
    if gone is not None:
        write_json_atomic(out / "error.json", {"message": gone, "user_error": False})
        return 3
    if energy is not None:  # its figures so far, every half minute: a group killed outright is counted too
        from trainyard.carbon_probe import machine_id

        # (and which launch: a rerun of a job killed in training counts its groups on other machines by it)
        energy.keep_writing(out / "energy.json", {"machine": machine_id(), "launch": os.environ.get(LAUNCH_ENV)})
    try:
        train_replica(args.job_dir, args.replica, args.attempt, resume=args.resume)
    except Exception as exc:  # noqa: BLE001 - reported to the train stage, which decides
        redact_exception(exc)  # a URL's password a bug's message quotes stays out of the logs and the summary
        # A TrainyardError is the job's fault (data, algorithm) and would fail again: no retry. Not a transient
        # StorageError (a streamed row group S3 failed twice, a checkpoint read the network dropped): the group's
        # restart, healing from a live peer, is what the elastic retries are for.
        user_error = isinstance(exc, TrainyardError) and not getattr(exc, "transient", False)
        write_json_atomic(
            out / "error.json",
            {"message": f"{type(exc).__name__}: {exc}", "kind": type(exc).__name__, "user_error": user_error},
        )
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        return 1
    finally:
        record = energy.stop() if energy else None
        if record is not None:  # this group's share of the machine, for the job's carbon by replica
            # and which machine: a group on another one than the pipeline's is outside its stage meters
            from trainyard.carbon_probe import machine_id

            write_json_atomic(
                out / "energy.json", record | {"machine": machine_id(), "launch": os.environ.get(LAUNCH_ENV)}
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
