"""Replica group failures and recoveries as the job records them: a failed attempt, read from its folder (its
last step, and the error it wrote, if any); a restart's recovery, from the failure to the first step it committed;
and the training stage's error, which carries them into the job summary."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from trainyard.errors import TrainingError


def recoveries(job_dir: Path, failures: list[dict]) -> list[dict]:
    """One record per restarted attempt (``attempt``: the restart's): from the failure to the first step
    it committed."""
    records = []
    for failure in failures:
        # (not attempt_dir: that would create the folder of a restart that never happened)
        progress_path = job_dir / "replicas" / str(failure["replica"]) / f"attempt-{failure['attempt'] + 1}"
        progress_path /= "progress.json"
        recovery = json.loads(progress_path.read_text()).get("recovery") if progress_path.exists() else None
        if not recovery or "rejoined_at_step" not in recovery:
            continue  # the restart never committed a step (it failed again, or the job ended first)
        records.append(
            {
                "replica": failure["replica"],
                "attempt": failure["attempt"] + 1,
                "failed_at_step": failure["step"],
                "rejoined_at_step": recovery["rejoined_at_step"],
                "recovery_seconds": round(recovery["first_commit_unix"] - failure["detected_unix"], 3),
                "source": recovery["source"],
                "bytes_moved": recovery.get("bytes_moved", 0),
            }
            | ({"sifter_history": recovery["sifter_history"]} if recovery.get("sifter_history") is not None else {})
        )
    return records


def training_failed(message: str, failures: list[dict]) -> TrainingError:
    """The training stage's error, carrying each group failure for the job summary."""
    error = TrainingError(message)
    error.failures = list(failures)  # a copy per error: the class default is shared
    return error


def too_few_left(
    min_replicas: int, max_attempts: int, failures: list[dict], left: list[int], live: int
) -> TrainingError:
    """The training stage's error when groups gone for good (failed past their attempts, or ``left``: asked to
    go by SIGTERM, never restarted) leave ``live`` groups, fewer than a step needs."""
    if left:  # (a spot interruption notice, a pod evicted: it is not restarted)
        gone, fix = f"replica group(s) {', '.join(map(str, left))} left the job (SIGTERM)", "lower min_replicas"
    else:
        last = failures[-1]
        gone = (
            f"replica group {last['replica']} failed for good ({last['message']}; retries.max_attempts {max_attempts})"
        )
        fix = "lower min_replicas, or raise retries.max_attempts"
    return training_failed(
        f"{gone}, leaving {live} group(s), fewer than resources.min_replicas {min_replicas} a step needs: {fix}",
        failures,
    )


def failure_record(out: Path, replica: int, attempt: int, code: int, ended_how: str | None = None) -> dict:
    """A failed attempt of group ``replica``, from its folder ``out``: the last step it reached, and the error
    it wrote (``error.json``: its message, whether it is the user's to fix, its kind), else how its run ended
    (``ended_how``, a pool's words for it), else its exit code."""
    step = 0
    # counts.json is rewritten at every committed step; the heartbeat (every 0.2 s) can be steps behind it
    for name in ("heartbeat.json", "progress.json", "counts.json"):
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            step = max(step, json.loads((out / name).read_bytes())["step"])
    message, user_error, kind = ended_how or f"exited with code {code}", False, None
    if (out / "error.json").exists():
        error = json.loads((out / "error.json").read_text())
        message, user_error, kind = error["message"], error["user_error"], error.get("kind")
    return {
        "kind": kind,
        "replica": replica,
        "attempt": attempt,
        "exit_code": code,
        "step": step,
        "message": message,
        "user_error": user_error,
        "detected_unix": time.time(),
    }
