"""Helpers for the staging tests: objects put on an S3 endpoint (a parquet table, a multipart object), and a
channel staged from them."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from boto3.s3.transfer import TransferConfig

from tests.conftest import blobs_table
from trainyard import listing, staging
from trainyard.spec import Channel

MULTIPART = TransferConfig(multipart_threshold=8 * 2**20, multipart_chunksize=8 * 2**20)
BIG = 20 * 2**20  # over staging's 16 MiB threshold: fetched by the transfer manager in ranged parts


def put_parquet(client, bucket: str, key: str, rows: int = 20, seed: int = 0) -> None:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(blobs_table(rows, seed), buf)
    client.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())


def put_big(client, bucket: str, key: str, tmp_path: Path, seed: int = 0) -> bytes:
    data = hashlib.sha256(str(seed).encode()).digest() * (BIG // 32)
    path = tmp_path / f"big-{seed}"
    path.write_bytes(data)
    client.upload_file(str(path), bucket, key, Config=MULTIPART)  # a multipart upload
    return data


def stage(uri: str, tmp_path: Path, **channel) -> listing.ChannelManifest:
    return staging.stage_channels({"train": Channel(s3_uri=uri, **channel)}, tmp_path)["train"]
