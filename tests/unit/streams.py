"""Helpers for the stream-mode tests: parquet objects put on an S3 endpoint, staged in stream mode."""

from __future__ import annotations

import io

import pyarrow.parquet as pq

from trainyard import datasets, staging, streaming
from trainyard.spec import Channel


def put_parquet(endpoint, bucket: str, key: str, table, row_group_size: int, **options) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size, **options)
    endpoint.client().put_object(Bucket=bucket, Key=key, Body=buf.getvalue())


def schema_of(staged) -> datasets.Schema:
    return datasets.Schema(**{k: v for k, v in staged.schema.items() if k != "num_outputs"})


def stream_one_object(endpoint, tmp_path, table, row_group_size: int):
    """``table`` as ``t/a.parquet`` in a new bucket, staged in stream mode: ``(bucket, channel, staged)``."""
    bucket = endpoint.new_bucket()
    put_parquet(endpoint, bucket, "t/a.parquet", table, row_group_size)
    channel = Channel(s3_uri=f"s3://{bucket}/t/", label="label", mode="stream")
    manifest = staging.stage_channels({"train": channel}, tmp_path)["train"]
    return bucket, channel, streaming.describe(manifest, channel, "classification", tmp_path / "data")
