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
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script: make ``trainyard`` and ``tests`` importable

from _staging_bench import (  # noqa: E402
    AWSCLI_VENV,
    BUCKET,
    BUSY_SHARE,
    TARGET_CHANNELS,
    Bench,
    MiB,
    Row,
    aws_sync,
    child_stage,
    s3_client,
    trainyard_stage,
    tree_size,
)
from _staging_report import machine_facts, print_report  # noqa: E402
from _staging_stream import child_stream, measure_stream_first_batch  # noqa: E402
from _targets import Target  # noqa: E402

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
