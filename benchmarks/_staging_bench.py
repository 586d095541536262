"""What the sections of ``benchmarks/staging.py`` share: its constants, the result records, and the measured
child processes (one Trainyard staging, run as ``staging.py --child-stage``; one ``aws s3 sync``) with the CPU
that other processes used meanwhile."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "staging.py"  # children run it again, with --child-stage or --child-stream
AWSCLI_VENV = REPO / "benchmarks" / ".venv-awscli"
BUCKET = "bench"
MiB = 2**20
# A cold run is flagged when other processes (not the tool, not the endpoint) used more than this many
# CPU seconds per second of it: a quarter of a core.
BUSY_SHARE = 0.25
TARGET_CHANNELS = ("small", "large")  # the issue's; the others are printed for reference


@dataclass
class Row:
    """One channel's measurements (seconds are medians over the repeats)."""

    channel: str
    objects: int
    bytes: int
    trainyard_s: float  # cold, whole process
    trainyard_stage_s: float  # cold, inside stage_channels only
    aws_s: float  # aws s3 sync, whole process
    warm_s: float  # warm re-stage, inside stage_channels only
    warm_process_s: float  # warm re-stage, whole process
    warm_bytes: int
    trainyard_rss_mib: float  # peak over the cold runs
    aws_rss_mib: float
    runs: dict[str, list[float]] = field(default_factory=dict)  # every timing, for the detail lines
    busy_runs: int = 0  # cold runs during which other processes kept a good part of a core busy

    @property
    def ratio(self) -> float:
        return self.trainyard_s / self.aws_s


@dataclass
class Bench:
    """What the measurement functions share: options, the endpoint's variables, where to write."""

    args: argparse.Namespace
    env: dict[str, str]  # environment for child processes: AWS variables pointing at the endpoint
    endpoint_url: str
    endpoint_pid: int | None
    workdir: Path
    aws: Path
    channels: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # name -> (uri, objects, bytes)
    aws_env: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> what the CLI needs for it


def child_stage(name: str, uri: str) -> None:
    """Stage one channel into ``$TRAINYARD_HOME`` and print what happened as JSON (run in a child)."""
    from trainyard.spec import Channel
    from trainyard.staging import stage_channels

    manifest_dir = Path(os.environ["TRAINYARD_HOME"]) / "manifests"
    start = time.perf_counter()
    manifest = stage_channels({name: Channel(s3_uri=uri, format="raw")}, manifest_dir)[name]
    seconds = time.perf_counter() - start
    result = {
        "seconds": seconds,
        "objects": len(manifest.objects),
        "bytes": manifest.bytes,
        "bytes_downloaded": manifest.bytes_downloaded,
        "objects_downloaded": manifest.objects_downloaded,
    }
    print(json.dumps(result))


@dataclass
class Proc:
    wall_s: float
    rss_mib: float
    cpu_s: float
    stdout: str
    other_cpu_s: float  # CPU used meanwhile by processes other than this one and the endpoint


def _machine_busy_cpu_s() -> float:
    """CPU seconds used by everything on this machine since boot (Linux ``/proc/stat``; 0 elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int | None) -> float:
    """CPU seconds used so far by process ``pid`` (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_measured(cmd: list[str], env: dict[str, str], endpoint_pid: int | None = None) -> Proc:
    """Run ``cmd``; its wall time, peak RSS and CPU time from its own rusage (``wait4``), and how much
    CPU other processes (not it, not the endpoint) took meanwhile: other work on a shared machine."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        busy, endpoint_cpu = _machine_busy_cpu_s(), _process_cpu_s(endpoint_pid)
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        busy, endpoint_cpu = _machine_busy_cpu_s() - busy, _process_cpu_s(endpoint_pid) - endpoint_cpu
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    return Proc(wall, usage.ru_maxrss / 1024, cpu, stdout, max(0.0, busy - cpu - endpoint_cpu))


def trainyard_stage(bench: Bench, name: str, home: Path) -> tuple[Proc, dict]:
    env = {**bench.env, "TRAINYARD_HOME": str(home), "TRAINYARD_PROGRESS": "0"}
    uri = bench.channels[name][0]
    cmd = [sys.executable, str(SCRIPT), "--child-stage", name, uri]
    proc = run_measured(cmd, env, bench.endpoint_pid)
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def aws_sync(bench: Bench, name: str, target: Path) -> Proc:
    uri = bench.channels[name][0]
    cmd = [str(bench.aws), "s3", "sync", uri, str(target), "--endpoint-url", bench.endpoint_url]
    env = {**bench.env, **bench.aws_env.get(name, {})}
    return run_measured([*cmd, "--no-progress", "--only-show-errors"], env, bench.endpoint_pid)


def tree_size(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def s3_client(env: dict[str, str]):
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    return session.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], config=Config(max_pool_connections=32))
