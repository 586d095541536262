"""The report of ``benchmarks/staging.py``: the machine and tools measured, a table of the channels'
timings, and whether each target was met."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from _staging_bench import AWSCLI_VENV, BUSY_SHARE, REPO, Bench, MiB, Row
from _targets import Target


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
        console.print(target.line())
    console.print(f"whole benchmark run: {wall:.0f} s")
