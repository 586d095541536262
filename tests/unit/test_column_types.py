"""Column types across a channel's objects. Stream mode checks at staging what the groups would trip over
mid-training: a label that is a number in some objects and text in others, and column types the first objects
disagree on, named by object. A category (dictionary-encoded) column reads as its values, in both modes."""

from __future__ import annotations

import pyarrow as pa
import pytest

from tests import s3_endpoints
from tests.conftest import blobs_table
from tests.unit.streams import put_parquet
from trainyard import datasets, staging, streaming
from trainyard.errors import DataError
from trainyard.spec import Channel

s3_endpoint = s3_endpoints.s3_endpoint


def _stage(endpoint, tmp_path, tables: dict[str, pa.Table], **channel):
    bucket = endpoint.new_bucket()
    for key, table in tables.items():
        put_parquet(endpoint, bucket, f"t/{key}", table, 10_000)
    spec = Channel(s3_uri=f"s3://{bucket}/t/", label="label", mode="stream", **channel)
    manifest = staging.stage_channels({"train": spec}, tmp_path)["train"]
    return bucket, lambda: streaming.describe(manifest, spec, "classification", tmp_path / "data")


def _as_text(table: pa.Table) -> pa.Table:
    return table.set_column(4, "label", table["label"].cast(pa.string()))


@pytest.mark.parametrize("classes", [None, [0, 1]])
def test_a_label_that_is_text_in_one_object_and_a_number_in_another_is_named_at_staging(s3_endpoint, tmp_path, classes):
    # past the scaling sample (the first 20,000 rows): only the footers show b's labels are text
    numbers, text = blobs_table(25_000, seed=1), _as_text(blobs_table(100, seed=2))
    bucket, describe = _stage(s3_endpoint, tmp_path, {"a.parquet": numbers, "b.parquet": text}, classes=classes)
    with pytest.raises(
        DataError, match=rf"^s3://{bucket}/t/b.parquet: label 'label' is string, but int64 in .*a.parquet"
    ):
        describe()


def test_a_category_label_beside_a_text_one_is_one_kind_and_stages(s3_endpoint, tmp_path):
    text = _as_text(blobs_table(25_000, seed=1))
    category = text.set_column(4, "label", text["label"].dictionary_encode()).slice(0, 100)
    _, describe = _stage(s3_endpoint, tmp_path, {"a.parquet": text, "b.parquet": category})
    assert describe().schema["classes"] == ["0", "1"]


def test_a_category_column_and_a_text_one_both_in_the_sample_are_one_column_in_stream_mode(s3_endpoint, tmp_path):
    # both objects in the scaling sample: its row groups are concatenated (a column no feature uses counts too)
    text = _as_text(blobs_table(100, seed=1)).append_column("note", pa.array(["x", "y"] * 50))
    category = text.set_column(4, "label", text["label"].dictionary_encode())
    category = category.set_column(5, "note", category["note"].dictionary_encode())
    _, describe = _stage(s3_endpoint, tmp_path, {"a.parquet": text, "b.parquet": category}, features=["f0", "f1"])
    assert describe().schema["classes"] == ["0", "1"]


def test_first_objects_that_disagree_on_a_columns_type_are_named(s3_endpoint, tmp_path):
    first = blobs_table(100, seed=1)
    second = blobs_table(100, seed=2)
    second = second.set_column(0, "f0", second["f0"].cast(pa.string()))
    bucket, describe = _stage(s3_endpoint, tmp_path, {"a.parquet": first, "b.parquet": second})
    with pytest.raises(
        DataError, match=rf"^s3://{bucket}/t/b.parquet: column 'f0' is string, but double in .*a.parquet"
    ):
        describe()


def test_in_file_mode_a_category_label_and_a_text_one_read_as_one_column(s3_endpoint, tmp_path):
    text = _as_text(blobs_table(100, seed=1))
    category = text.set_column(4, "label", text["label"].dictionary_encode())
    bucket = s3_endpoint.new_bucket()
    for key, table in {"a.parquet": text, "b.parquet": category}.items():
        put_parquet(s3_endpoint, bucket, f"t/{key}", table, 10_000)
    manifest = staging.stage_channels({"train": Channel(s3_uri=f"s3://{bucket}/t/", label="label")}, tmp_path)["train"]
    table = datasets.read_channel(manifest)
    assert table.num_rows == 200 and table.schema.field("label").type == pa.string()
