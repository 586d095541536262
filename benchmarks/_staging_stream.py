"""The stream section of ``benchmarks/staging.py``: the time to a stream-mode job's first batch against staging
the whole parquet channel first (file mode), each in a child process with a fresh cache."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from _staging_bench import BUCKET, SCRIPT, Bench, MiB, Row, run_measured, s3_client
from _targets import Target


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
            cmd = [sys.executable, str(SCRIPT), "--child-stream", mode, uri]
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
