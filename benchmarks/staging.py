"""Staging benchmark: Trainyard's staging against ``aws s3 sync`` on a local S3 endpoint.

Run from the repository root::

    .venv/bin/python benchmarks/staging.py            # full size: 2,000 small objects, one 512 MiB object
    .venv/bin/python benchmarks/staging.py --quick    # a small smoke run
    .venv/bin/python benchmarks/staging.py --section stream   # only stream mode's first batch (~2 min)

It starts an S3 endpoint on 127.0.0.1 (``rclone serve s3`` by default: objects on local disk, like a
real store; ``--endpoint moto`` for moto's in-memory server), uploads the channels (untimed), then
measures for each channel, in the same run:

- Trainyard cold staging: ``stage_channels`` in a child process with a fresh ``TRAINYARD_HOME``;
  wall time of the process (interpreter start and imports included, as for the AWS CLI), the time
  inside ``stage_channels`` alone, and the child's peak RSS (``wait4`` rusage);
- ``aws s3 sync s3://bucket/prefix/ <empty dir>`` with the AWS CLI (v1, installed into
  ``benchmarks/.venv-awscli`` on first run) against the same endpoint: the baseline;
- a warm re-stage: the same channel staged again into the last cold run's ``TRAINYARD_HOME``
  (nothing changed in S3): time and bytes downloaded.

The channels: ``small`` (2,000 objects, one PUT each) and ``large`` (one 512 MiB object in 8 MiB
parts, as ``aws s3 cp`` uploads it) carry the issue's targets. ``large-crc32``, for reference only, is
the same size in one PUT with a CRC32: rclone keeps no checksum of a multipart upload, so ``large``
is checked by its MD5 ETag (about 0.8 GB/s on one core), while S3 keeps a checksum of every object,
and staging checks that instead of the MD5.

Cold measurements are repeated (``--repeats``, default 5) alternating which tool goes first; medians
are reported. The OS page cache cannot be dropped without root, so the endpoint reads its objects
from a warm page cache in every run (for both tools alike); the timings are for the network and
client side, not for cold disks.

Results are rows (``Row``) gathered by the ``measure_*`` functions in ``SECTIONS``; a new
measurement is a new function that returns rows and targets, added to ``SECTIONS``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script: make ``trainyard`` and ``tests`` importable

AWSCLI_VENV = REPO / "benchmarks" / ".venv-awscli"
BUCKET = "bench"
MiB = 2**20
# A cold run is flagged when other processes (not the tool, not the endpoint) used more than this many
# CPU seconds per second of it: a quarter of a core.
BUSY_SHARE = 0.25
TARGET_CHANNELS = ("small", "large")  # the issue's; the others are printed for reference


# --- results -------------------------------------------------------------------------------------


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
class Target:
    name: str
    met: bool
    detail: str


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


# --- child process: one Trainyard staging --------------------------------------------------------


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
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-stage", name, uri]
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


# --- measurements ---------------------------------------------------------------------------------


def _cold_trainyard(bench: Bench, name: str, home: Path, samples: dict[str, list[float]]) -> None:
    uri, n_objects, n_bytes = bench.channels[name]
    proc, result = trainyard_stage(bench, name, home)
    if result["objects"] != n_objects or result["bytes_downloaded"] < n_bytes:
        raise RuntimeError(f"trainyard staged {result} of {uri}; expected {n_objects} objects, {n_bytes} bytes")
    samples["trainyard"].append(proc.wall_s)
    samples["trainyard stage"].append(result["seconds"])
    samples["trainyard cpu"].append(proc.cpu_s)
    samples["trainyard rss"].append(proc.rss_mib)
    samples["trainyard: other procs cpu"].append(proc.other_cpu_s)
    samples["other share"].append(proc.other_cpu_s / proc.wall_s)


def _cold_aws(bench: Bench, name: str, target: Path, samples: dict[str, list[float]]) -> None:
    uri, n_objects, n_bytes = bench.channels[name]
    target.mkdir()
    proc = aws_sync(bench, name, target)
    got = tree_size(target)
    if got != (n_objects, n_bytes):
        raise RuntimeError(f"aws s3 sync gave {got} (files, bytes) for {uri}; expected {(n_objects, n_bytes)}")
    samples["aws"].append(proc.wall_s)
    samples["aws cpu"].append(proc.cpu_s)
    samples["aws rss"].append(proc.rss_mib)
    samples["aws: other procs cpu"].append(proc.other_cpu_s)
    samples["other share"].append(proc.other_cpu_s / proc.wall_s)
    shutil.rmtree(target)


def measure_cold_and_warm(bench: Bench) -> tuple[list[Row], list[Target]]:
    """Per channel: Trainyard cold vs aws s3 sync (alternating), then a warm re-stage."""
    rows, targets = [], []
    repeats = bench.args.repeats
    for name, (_, n_objects, n_bytes) in bench.channels.items():
        keys = ("trainyard", "trainyard stage", "trainyard cpu", "trainyard rss", "aws", "aws cpu", "aws rss")
        keys += ("trainyard: other procs cpu", "aws: other procs cpu", "other share")
        samples: dict[str, list[float]] = {k: [] for k in keys}
        for i in range(repeats):
            home = bench.workdir / f"home-{name}-{i}"
            for step in ("trainyard", "aws") if i % 2 == 0 else ("aws", "trainyard"):
                # Every step starts with nothing left to write back: the previous step's files would
                # otherwise be flushed to disk while this one runs, slowing whichever tool goes second.
                os.sync()
                if step == "trainyard":
                    _cold_trainyard(bench, name, home, samples)
                    if i < repeats - 1:  # the last run's cache stays, for the warm re-stage
                        shutil.rmtree(home)
                else:
                    _cold_aws(bench, name, bench.workdir / f"aws-{name}-{i}", samples)
            print(
                f"  {name} run {i + 1}/{repeats} ({'trainyard first' if i % 2 == 0 else 'aws first'}): "
                f"trainyard {samples['trainyard'][-1]:.2f} s (stage {samples['trainyard stage'][-1]:.2f} s, "
                f"cpu {samples['trainyard cpu'][-1]:.2f} s), "
                f"aws {samples['aws'][-1]:.2f} s (cpu {samples['aws cpu'][-1]:.2f} s); other processes' cpu "
                f"meanwhile {samples['trainyard: other procs cpu'][-1]:.2f} s, "
                f"{samples['aws: other procs cpu'][-1]:.2f} s",
                flush=True,
            )

        warm_stage, warm_wall, warm_bytes = [], [], []
        for _ in range(repeats):
            os.sync()
            proc, result = trainyard_stage(bench, name, home)
            warm_stage.append(result["seconds"])
            warm_wall.append(proc.wall_s)
            warm_bytes.append(result["bytes_downloaded"])
        print(
            f"  {name} warm re-stage: {', '.join(f'{s:.3f} s' for s in warm_stage)} "
            f"(process {', '.join(f'{s:.2f} s' for s in warm_wall)}), bytes {warm_bytes}",
            flush=True,
        )
        shutil.rmtree(home, ignore_errors=True)

        row = Row(
            channel=name,
            objects=n_objects,
            bytes=n_bytes,
            trainyard_s=statistics.median(samples["trainyard"]),
            trainyard_stage_s=statistics.median(samples["trainyard stage"]),
            aws_s=statistics.median(samples["aws"]),
            warm_s=statistics.median(warm_stage),
            warm_process_s=statistics.median(warm_wall),
            warm_bytes=max(warm_bytes),
            trainyard_rss_mib=max(samples["trainyard rss"]),
            aws_rss_mib=max(samples["aws rss"]),
            runs={k: v for k, v in samples.items() if not k.endswith(("rss", "share"))},
            busy_runs=sum(share > BUSY_SHARE for share in samples["other share"]),
        )
        rows.append(row)
        if name not in TARGET_CHANNELS:
            continue
        targets.append(
            Target(
                f"{name}: Trainyard cold no slower than aws s3 sync",
                row.ratio <= 1.0,
                f"{row.trainyard_s:.2f} s vs {row.aws_s:.2f} s, ratio {row.ratio:.2f} (target <= 1.00)",
            )
        )
        if name == "small":
            targets.append(
                Target(
                    f"{name}: unchanged re-stage of {n_objects:,} objects moves 0 bytes in under 1 s",
                    row.warm_bytes == 0 and row.warm_s < 1.0,
                    f"{row.warm_bytes} bytes, {row.warm_s:.3f} s in stage_channels "
                    f"({row.warm_process_s:.2f} s with interpreter start and imports)",
                )
            )
    return rows, targets


# Each section measures something and returns result rows and targets; add new ones here.
def child_stream(mode: str, uri: str) -> None:
    """Time one way to the first training batch of a parquet channel (run in a child, fresh cache).

    ``file``: stage the whole channel (download and verify), then read it into arrays: only then can
    training start. ``stream``: list it, read the footers, the label column and a scaling sample,
    then the first batch's row group from S3, as a replica group in stream mode does.
    """
    from trainyard import cache, datasets, staging, streaming
    from trainyard.spec import parse_job
    from trainyard.training.plan import TrainingPlan
    from trainyard.training.sampling import StreamSampler

    home = Path(os.environ["TRAINYARD_HOME"])
    job = parse_job(
        {
            "name": "bench",
            "algorithm": {"builtin": "mlp-classifier"},
            "inputs": {"train": {"s3_uri": uri, "label": "label", "mode": mode, "classes": [0, 1]}},
            "output": {"s3_uri": f"s3://{BUCKET}/out/"},
        }
    )
    start = time.perf_counter()
    manifests = staging.stage_channels(job.channels(), home / "manifests")
    staged_s = time.perf_counter() - start
    if mode == "file":
        datasets.prepare(manifests, job.channels(), "classification", home / "data")
        result = {"staged_s": staged_s, "ready_s": time.perf_counter() - start}
    else:
        staged = streaming.describe(
            manifests["train"], job.inputs.train, "classification", home / "data", cache.rowgroups_dir()
        )
        described_s = time.perf_counter() - start
        plan = TrainingPlan(
            "bench",
            job.model_dump(mode="json"),
            staged.train_data,
            None,
            staged.schema,
            1,
            "",
            staged.train_layout,
            streamed=True,
        )
        x, _ = StreamSampler(job, plan, cache.rowgroups_dir()).slot_batch(0, 0, 1, 0)
        result = {
            "listed_s": staged_s,
            "described_s": described_s,
            "first_batch_s": time.perf_counter() - start,
            "batch_rows": len(x),
        }
    print(json.dumps(result))


def upload_parquet(bench: Bench) -> tuple[str, int]:
    """A parquet channel of about ``--large-mib`` MiB (16 float32 features, an int64 label) in row groups
    of 256 Ki rows, as a large training table would be written; not timed."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = bench.args.large_mib * MiB // (16 * 4 + 8)
    rng = np.random.default_rng(7)
    features = {f"f{i}": rng.standard_normal(rows, dtype=np.float32) for i in range(16)}
    table = pa.table({**features, "label": (features["f0"] > 0).astype(np.int64)})
    path = bench.workdir / "table.parquet"
    pq.write_table(table, path, row_group_size=256 * 1024, compression="snappy")
    size = path.stat().st_size
    s3_client(bench.env).upload_file(str(path), BUCKET, "table/part-000.parquet")
    path.unlink()
    return f"s3://{BUCKET}/table/", size


def measure_stream_first_batch(bench: Bench) -> tuple[list[Row], list[Target]]:
    """Stream mode: time to the first batch vs staging the whole parquet channel first (medians)."""
    uri, size = upload_parquet(bench)
    samples: dict[str, list[float]] = {"file staged": [], "file ready": [], "stream first batch": []}
    for run in range(bench.args.repeats):
        for mode in ("file", "stream") if run % 2 == 0 else ("stream", "file"):
            os.sync()
            home = bench.workdir / f"stream-home-{run}-{mode}"
            env = {**bench.env, "TRAINYARD_HOME": str(home), "TRAINYARD_PROGRESS": "0"}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child-stream", mode, uri]
            result = json.loads(run_measured(cmd, env, bench.endpoint_pid).stdout.strip().splitlines()[-1])
            if mode == "file":
                samples["file staged"].append(result["staged_s"])
                samples["file ready"].append(result["ready_s"])
                print(f"  file run {run + 1}: staged {result['staged_s']:.2f} s, ready {result['ready_s']:.2f} s")
            else:
                samples["stream first batch"].append(result["first_batch_s"])
                print(
                    f"  stream run {run + 1}: listed {result['listed_s']:.2f} s, described (footers, label "
                    f"column, sample) {result['described_s']:.2f} s, first batch {result['first_batch_s']:.2f} s"
                )
            shutil.rmtree(home, ignore_errors=True)
    staged, ready = statistics.median(samples["file staged"]), statistics.median(samples["file ready"])
    first = statistics.median(samples["stream first batch"])
    print(
        f"  parquet channel {size / MiB:.0f} MiB: file mode staged in {staged:.2f} s, arrays ready in {ready:.2f} s; "
        f"stream mode first batch in {first:.2f} s"
    )
    target = Target(
        "stream: time to first batch under a tenth of staging the whole channel",
        first < staged / 10,
        f"{first:.2f} s vs {staged:.2f} s to stage {size / MiB:.0f} MiB (ratio {first / staged:.3f}, target < 0.1); "
        f"{ready:.2f} s until file mode's arrays are ready",
    )
    return [], [target]


SECTIONS: dict[str, Callable[[Bench], tuple[list[Row], list[Target]]]] = {
    "channels": measure_cold_and_warm,  # needs upload()'s channels
    "stream": measure_stream_first_batch,  # uploads its own parquet channel
}


# --- set-up: the AWS CLI, the endpoint, the data ---------------------------------------------------


def ensure_awscli() -> Path:
    """The AWS CLI (v1, from PyPI) in its own virtual environment: its botocore pin differs from ours."""
    aws = AWSCLI_VENV / "bin" / "aws"
    if aws.exists():
        return aws
    print(f"installing the AWS CLI into {AWSCLI_VENV.relative_to(REPO)} (first run only) ...", flush=True)
    python = shutil.which("python3") or sys.executable
    subprocess.run([python, "-m", "venv", str(AWSCLI_VENV)], check=True)
    pip = [str(AWSCLI_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "awscli"], check=True)
    return aws


def start_endpoint(kind: str):
    if kind == "rclone":
        from tests.s3_endpoints import RcloneS3

        server = RcloneS3().start()
        return server, f"rclone serve s3 at {server.endpoint_url} (objects as files under {server.root})"
    from trainyard.local_s3 import LocalS3

    server = LocalS3().start()
    return server, f"moto server at {server.endpoint_url} (objects in memory)"


def s3_client(env: dict[str, str]):
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    return session.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], config=Config(max_pool_connections=32))


def upload(bench: Bench) -> None:
    """Upload the channels (not timed): N small objects of varied sizes, one large multipart object, and
    the same large object in one PUT with a CRC32."""
    from boto3.s3.transfer import TransferConfig

    args = bench.args
    client = s3_client(bench.env)
    rng = random.Random(20240601)
    # Varied sizes around the mean, as parquet shards of one dataset are: 0.5x to 1.5x.
    sizes = [max(1, int(args.small_size * rng.uniform(0.5, 1.5))) for _ in range(args.small_objects)]

    def put(i: int) -> None:
        key = f"small/part-{i:05d}.parquet"
        client.put_object(Bucket=BUCKET, Key=key, Body=os.urandom(sizes[i]))

    start = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(len(sizes))))
    bench.channels["small"] = (f"s3://{BUCKET}/small/", len(sizes), sum(sizes))
    seconds = time.perf_counter() - start
    print(f"  uploaded {len(sizes):,} small objects, {sum(sizes) / MiB:.1f} MiB, in {seconds:.1f} s")

    start = time.perf_counter()
    size = args.large_mib * MiB
    blob = bench.workdir / "large.bin"
    with blob.open("wb") as f:
        for offset in range(0, size, 8 * MiB):
            f.write(os.urandom(min(8 * MiB, size - offset)))
    # The transfer manager's defaults (8 MiB parts), as aws s3 cp / boto3 upload_file would upload it.
    config = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB, max_concurrency=8)
    client.upload_file(str(blob), BUCKET, "large/blob-000.bin", Config=config)
    head = client.head_object(Bucket=BUCKET, Key="large/blob-000.bin")
    bench.channels["large"] = (f"s3://{BUCKET}/large/", 1, size)
    print(
        f"  uploaded 1 large object, {size / MiB:.0f} MiB in {-(-size // (8 * MiB))} parts "
        f"(ETag {head['ETag']}), in {time.perf_counter() - start:.1f} s"
    )
    start = time.perf_counter()
    with blob.open("rb") as f:
        client.put_object(Bucket=BUCKET, Key="large-crc32/blob-000.bin", Body=f, ChecksumAlgorithm="CRC32")
    blob.unlink()
    head = client.head_object(Bucket=BUCKET, Key="large-crc32/blob-000.bin", ChecksumMode="ENABLED")
    if not head.get("ChecksumCRC32"):
        raise RuntimeError("the endpoint kept no CRC32 of large-crc32/blob-000.bin")
    bench.channels["large-crc32"] = (f"s3://{BUCKET}/large-crc32/", 1, size)
    # rclone sends the whole object's CRC with each ranged GET, which the CLI's default response check
    # rejects ("Expected checksum ... did not match"); Trainyard's client sets the same (s3.py)
    bench.aws_env["large-crc32"] = {"AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}
    print(f"  uploaded the same bytes in one PUT with a CRC32, in {time.perf_counter() - start:.1f} s")


# --- report ---------------------------------------------------------------------------------------


def machine_facts(bench: Bench, endpoint: str) -> list[tuple[str, str]]:
    import boto3

    aws_version = subprocess.run([str(bench.aws), "--version"], capture_output=True, text=True, env=bench.env)
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in line), "0")
    rclone = ""
    if bench.args.endpoint == "rclone":
        from tests.s3_endpoints import rclone_binary

        out = subprocess.run([rclone_binary(), "version"], capture_output=True, text=True).stdout
        rclone = out.splitlines()[0] if out else "?"
    facts = [
        ("machine", f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), {int(mem) / 2**20:.1f} GiB RAM"),
        ("system", f"{platform.system()} {platform.release()}, Python {platform.python_version()}"),
        ("endpoint", endpoint + (f", {rclone}" if rclone else "")),
        ("trainyard", f"boto3 {boto3.__version__}, in {sys.prefix}"),
        ("baseline", (aws_version.stdout or aws_version.stderr).strip() + f", in {AWSCLI_VENV.relative_to(REPO)}"),
        ("load", "load average {:.2f} {:.2f} {:.2f} at start".format(*os.getloadavg())),
        ("repeats", f"{bench.args.repeats} cold runs per tool and channel, alternating which goes first; medians"),
        ("page cache", "not dropped (needs root): the endpoint serves from a warm page cache for both tools"),
    ]
    return facts


def print_report(facts: list[tuple[str, str]], rows: list[Row], targets: list[Target], wall: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    for key, value in facts:
        console.print(f"[bold]{key}:[/] {value}", highlight=False)
    table = Table(title="Staging: Trainyard vs aws s3 sync (cold = fresh cache; seconds are medians)")
    for column in (
        "channel",
        "objects",
        "MiB",
        "Trainyard cold s",
        "(in stage_channels)",
        "aws s3 sync s",
        "ratio Ty/aws",
        "warm re-stage s",
        "warm bytes",
        "Trainyard peak RSS MiB",
        "aws peak RSS MiB",
        "MB/s Ty / aws",
    ):
        table.add_column(column, justify="left" if column == "channel" else "right")
    for row in rows:
        table.add_row(
            row.channel,
            f"{row.objects:,}",
            f"{row.bytes / MiB:,.1f}",
            f"{row.trainyard_s:.2f}",
            f"{row.trainyard_stage_s:.2f}",
            f"{row.aws_s:.2f}",
            f"{row.ratio:.2f}",
            f"{row.warm_s:.3f} ({row.warm_process_s:.2f})",
            f"{row.warm_bytes:,}",
            f"{row.trainyard_rss_mib:.0f}",
            f"{row.aws_rss_mib:.0f}",
            f"{row.bytes / row.trainyard_s / 1e6:.0f} / {row.bytes / row.aws_s / 1e6:.0f}",
        )
    if rows:  # none when only the stream section ran
        console.print(table)
        console.print(
            "Cold times are whole processes (interpreter start and imports included, for both tools); "
            "'in stage_channels' excludes them. Warm re-stage: in stage_channels (whole process)."
        )
    for row in rows:
        runs = "; ".join(f"{k} {', '.join(f'{v:.2f}' for v in vs)}" for k, vs in row.runs.items())
        console.print(f"  {row.channel} runs (s): {runs}", highlight=False)
    busy = sum(row.busy_runs for row in rows)
    if busy:
        console.print(
            f"[yellow]warning:[/] during {busy} cold run(s) other processes on this machine used more than "
            f"{BUSY_SHARE:.2f} CPU s per s ('other procs cpu' above): those timings are inflated and noisy; "
            "rerun on an idle machine before drawing conclusions from small differences."
        )
    for target in targets:
        mark = "[green]met[/]" if target.met else "[red]NOT MET[/]"
        console.print(f"target {mark}: {target.name}: {target.detail}")
    console.print(f"whole benchmark run: {wall:.0f} s")


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", choices=("rclone", "moto"), default="rclone", help="local S3 endpoint")
    parser.add_argument("--small-objects", type=int, default=2000, help="objects in the small channel")
    parser.add_argument("--small-size", type=int, default=64 * 1024, help="mean small object size, bytes (±50%%)")
    parser.add_argument("--large-mib", type=int, default=512, help="size of the large channel's one object, MiB")
    parser.add_argument("--repeats", type=int, default=5, help="cold runs per tool and channel (at least 2)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 200 small objects, 64 MiB, 2 repeats")
    parser.add_argument("--workdir", type=Path, default=None, help="where downloads go (default: a temp dir)")
    parser.add_argument(
        "--section",
        action="append",
        choices=list(SECTIONS),
        help="measure only this section (repeatable; default: all): channels (small, large, vs aws s3 sync), "
        "stream (time to first batch)",
    )
    parser.add_argument("--child-stage", nargs=2, metavar=("NAME", "URI"), help=argparse.SUPPRESS)
    parser.add_argument("--child-stream", nargs=2, metavar=("MODE", "URI"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.small_objects, args.large_mib, args.repeats = 200, 64, 2
    args.repeats = max(2, args.repeats)
    args.section = args.section or list(SECTIONS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_stage:
        child_stage(*args.child_stage)
        return 0
    if args.child_stream:
        child_stream(*args.child_stream)
        return 0
    started = time.perf_counter()
    aws = ensure_awscli()
    workdir = Path(tempfile.mkdtemp(prefix="trainyard-bench-", dir=args.workdir))
    server, endpoint = start_endpoint(args.endpoint)
    try:
        # Only the endpoint's variables, no user AWS config, and no instance-metadata lookups: nothing
        # leaves 127.0.0.1.
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            **server.env,
            "AWS_CONFIG_FILE": str(workdir / "aws-config-none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "aws-credentials-none"),
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        pid = server._proc.pid if server._proc else None
        bench = Bench(args=args, env=env, endpoint_url=server.endpoint_url, endpoint_pid=pid, workdir=workdir, aws=aws)
        facts = machine_facts(bench, endpoint)
        s3_client(env).create_bucket(Bucket=BUCKET)
        if "channels" in args.section:
            print("uploading (not timed) ...", flush=True)
            upload(bench)
        rows, targets = [], []
        for section in (SECTIONS[name] for name in args.section):
            print(f"measuring: {section.__name__} ...", flush=True)
            new_rows, new_targets = section(bench)
            rows += new_rows
            targets += new_targets
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print_report(facts, rows, targets, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
