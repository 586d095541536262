"""Stream mode's reading side against both S3 endpoints: footers, classes, row groups on demand."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests import s3_endpoints
from tests.conftest import blobs_table
from trainyard import staging, streaming
from trainyard.errors import DataError
from trainyard.spec import Channel, parse_job
from trainyard.training.plan import TrainingPlan
from trainyard.training.sampling import StreamSampler

s3_endpoint = s3_endpoints.s3_endpoint


def put_parquet(endpoint, bucket: str, key: str, table, row_group_size: int) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size)
    endpoint.client().put_object(Bucket=bucket, Key=key, Body=buf.getvalue())


def test_describe_reads_footers_and_classes_without_downloading(s3_endpoint, tmp_path):
    bucket = s3_endpoint.new_bucket()
    table = blobs_table(500, seed=2)
    put_parquet(s3_endpoint, bucket, "t/a.parquet", table.slice(0, 300), 100)
    put_parquet(s3_endpoint, bucket, "t/b.parquet", table.slice(300), 50)
    channel = Channel(s3_uri=f"s3://{bucket}/t/", label="label", mode="stream")
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    assert manifest.bytes_downloaded == 0 and all(o.path == "" for o in manifest.objects)
    staged = streaming.describe(manifest, channel, "classification", tmp_path / "data")
    assert [o["row_groups"] for o in staged.train_layout] == [[100, 100, 100], [50, 50, 50, 50]]
    assert staged.rows["train"] == 500 and staged.schema["classes"] == [0, 1] and staged.streamed
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, tmp_path / "cache")
    x, y = source.load(f"s3://{bucket}/t/b.parquet#rg2")
    want = table.slice(400, 50).to_pandas()
    np.testing.assert_allclose(x[:, 0], want["f0"].to_numpy(np.float32))
    np.testing.assert_array_equal(y, want["label"].to_numpy())
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1  # kept for the next epoch


def test_stream_sampler_covers_each_share_once_per_epoch(s3_endpoint, tmp_path):
    bucket = s3_endpoint.new_bucket()
    table = blobs_table(400, seed=3)
    table = table.append_column("row", pa.array(np.arange(400, dtype=np.float64)))
    put_parquet(s3_endpoint, bucket, "t/a.parquet", table, 50)
    job = parse_job(
        {
            "name": "s",
            "algorithm": {"builtin": "mlp-classifier"},
            "hyperparameters": {"batch_size": 40},
            "inputs": {
                "train": {"s3_uri": f"s3://{bucket}/t/", "label": "label", "mode": "stream", "features": ["row"]}
            },
            "output": {"s3_uri": f"s3://{bucket}/o/"},
        }
    )
    manifest = staging.stage_channels(job.channels(), tmp_path)["train"]
    staged = streaming.describe(manifest, job.inputs.train, "classification", tmp_path / "data")
    plan = TrainingPlan(
        "j",
        job.model_dump(mode="json"),
        staged.train_data,
        None,
        staged.schema,
        2,
        "",
        staged.train_layout,
        streamed=True,
    )
    seen = {0: [], 1: []}
    samplers = {g: StreamSampler(job, plan, g, 2, tmp_path / "cache") for g in (0, 1)}
    assert samplers[0].steps_per_epoch == samplers[1].steps_per_epoch == 10  # 200 rows a group, 20 a step
    for group, sampler in samplers.items():
        for index in range(sampler.steps_per_epoch):
            x, _ = sampler.batch(0, index)
            seen[group] += x[:, 0].int().tolist()
    assert sorted(seen[0] + seen[1]) == list(range(400))  # disjoint, and together everything
    assert samplers[0].batch(0, 3)[0].tolist() == samplers[0].batch(0, 3)[0].tolist()  # a function of the step


def test_stream_needs_parquet(s3_endpoint, tmp_path):
    bucket = s3_endpoint.new_bucket()
    s3_endpoint.client().put_object(Bucket=bucket, Key="t/a.csv", Body=b"f0,label\n1,0\n")
    manifest = staging.list_channel("train", Channel(s3_uri=f"s3://{bucket}/t/", format="csv", label="label"))
    with pytest.raises(DataError, match="mode stream reads parquet"):
        streaming.describe(manifest, Channel(s3_uri=f"s3://{bucket}/t/", label="label"), "classification", tmp_path)
