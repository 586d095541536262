"""CSV and JSON-lines objects as exporters write them: values with line breaks in them, and compressed files."""

from __future__ import annotations

import bz2
import gzip
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from trainyard import datasets, listing


def _read(tmp_path, fmt: str, name: str, body: bytes):
    path = tmp_path / name
    path.write_bytes(body)
    obj = listing.StagedObject("b", f"t/{name}", len(body), "etag", name, path=str(path))
    return datasets.read_channel(listing.ChannelManifest("train", "s3://b/t/", fmt, [obj]))


def test_a_csv_past_one_block_with_line_breaks_in_quoted_values_reads_whole(tmp_path):
    # about 3.5 MB: several of the reader's 1 MiB blocks, which its fast path cuts at the last line break in each
    rows = 100_000
    frame = pd.DataFrame({"f0": np.arange(rows, dtype=np.float64), "note": "two\nlines", "label": np.arange(rows) % 2})
    table = _read(tmp_path, "csv", "a.csv", frame.to_csv(index=False).encode())
    assert table.num_rows == rows and set(table["note"].to_pylist()) == {"two\nlines"}
    assert table["f0"].to_pylist() == frame["f0"].tolist()


ROWS = [{"f0": 0.5, "f1": 1.0, "label": "cat"}, {"f0": 1.5, "f1": -1.0, "label": "dog"}]
CSV = pd.DataFrame(ROWS).to_csv(index=False).encode()
JSONL = "\n".join(json.dumps(r) for r in ROWS).encode()


@pytest.mark.parametrize(
    ("fmt", "body"),
    [
        # (mtime 0: gzip's header holds the time, and the bytes named the test: two pytest-xdist workers that
        # collected a second apart saw different tests, and the run stopped before any test ran)
        ("csv", gzip.compress(CSV, mtime=0)),
        ("csv", bz2.compress(CSV)),
        ("jsonl", gzip.compress(JSONL, mtime=0)),
        ("jsonl", pa.compress(JSONL, "zstd", asbytes=True)),
    ],
    ids=["csv-gzip", "csv-bzip2", "jsonl-gzip", "jsonl-zstd"],
)
def test_compressed_csv_and_json_lines_read_as_their_text(tmp_path, fmt, body):
    # a cached copy has no .gz or .zst to say so: its first bytes do
    table = _read(tmp_path, fmt, "part-0", body)
    assert table.to_pylist() == ROWS


def test_a_csv_whose_header_begins_as_bzip2_does_is_read_as_text(tmp_path):
    # bzip2's magic is "BZh" and a block-size digit: a first column named BZhx is plain text
    table = _read(tmp_path, "csv", "part-0", b"BZhx,label\n1.5,cat\n2.5,dog\n")
    assert table.to_pylist() == [{"BZhx": 1.5, "label": "cat"}, {"BZhx": 2.5, "label": "dog"}]
