"""The job's torchft lighthouse: the process that forms each step's quorum of replica groups.

Started by the launch stage (``launch.launch``) beside the train stage, and stopped with the job
(``launch.shutdown``, after the groups: a group told to leave finishes its step, whose quorum needs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from trainyard.errors import TrainingError
from trainyard.servers import advertised_host, bind_host, die_with_parent, free_port, stop_process, wait_until_answering

# Failure detection. A group's Manager heartbeats every 100 ms; a group silent for HEARTBEAT_TIMEOUT_MS is
# dropped from the next quorum. Until then the survivors' quorum waits for it, so this is their stall when
# a group dies (3 s measured with 3000). 500 ms is five missed beats: short enough that a survivor stalls
# about half a second, long enough that a busy but live group is not dropped (if one were, it would rejoin
# at the next step and heal: slower, never wrong).
HEARTBEAT_TIMEOUT_MS = 500
# How long a quorum waits for a heartbeating group that has not asked to join.
JOIN_TIMEOUT_MS = 3000
LIGHTHOUSE_TRIES = 3  # ports tried: a free port can be taken by another process before the lighthouse binds it


def start_lighthouse(job_dir: Path, min_replicas: int) -> tuple[subprocess.Popen, str]:
    """The job's torchft lighthouse, started and answering, and the address groups dial. One that exits at start
    (its port taken meanwhile) is tried again on another port; the last failure names its log's last line
    (``job_dir/lighthouse.log``)."""
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    log_path = job_dir / "lighthouse.log"
    problem = ""
    for _ in range(LIGHTHOUSE_TRIES):
        port = free_port()
        with log_path.open("ab") as log:  # the child keeps its own descriptor
            lighthouse = subprocess.Popen(
                [
                    binary,
                    "--min_replicas",
                    str(min_replicas),
                    "--bind",
                    f"{bind_host()}:{port}",
                    "--heartbeat_timeout_ms",
                    str(HEARTBEAT_TIMEOUT_MS),
                    "--join_timeout_ms",
                    str(JOIN_TIMEOUT_MS),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={"RUST_LOG": "warn", **os.environ},  # its INFO is a few lines per step
                preexec_fn=die_with_parent(),  # not orphaned by a pipeline process killed outright (SIGKILL, OOM)
                # A process group of its own: a worker cancelling the pipeline run SIGTERMs its whole group, and
                # the lighthouse must outlive that until the job's groups have left (shutdown); they hung in their
                # quorum without it until their workers killed them.
                start_new_session=True,
            )
        addr = f"http://{advertised_host()}:{port}"  # what the groups dial, wherever they run
        try:
            problem = wait_until_answering(addr, lighthouse, timeout_seconds=15.0) or ""
        except BaseException:  # (interrupted while waiting: no one else holds it to stop)
            stop_process(lighthouse)
            raise
        if not problem and lighthouse.poll() is None:
            return lighthouse, addr
        # (answered, but by whatever holds the port: ours exited, its bind refused)
        problem = problem or f"exited at start (code {lighthouse.returncode})"
        stop_process(lighthouse)
        if "exited" not in problem:
            break  # it did not answer in time: another port would not help
    said = _last_line(log_path)
    raise TrainingError(f"the torchft lighthouse {problem}{f': {said}' if said else ''} (its log: {log_path})")


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""
