"""Reading staged channels: formats, and a clear error naming the object or column for bad data."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests import s3_endpoints
from tests.conftest import blobs_table, put_table
from trainyard import datasets, listing, s3, staging, table_checks
from trainyard.errors import DataError
from trainyard.spec import Channel

s3_endpoint = s3_endpoints.s3_endpoint


@pytest.fixture
def bucket(s3_endpoint):
    """A fresh bucket on each S3 endpoint in turn (moto, then rclone): channels read alike from both."""
    return s3_endpoint.new_bucket()


def stage(bucket, tmp_path, fmt="parquet", label="label", prefix="ch/"):
    channel = Channel(s3_uri=f"s3://{bucket}/{prefix}", format=fmt, label=label)
    return staging.stage_channels({"train": channel}, tmp_path)["train"], channel


def test_parquet_csv_and_jsonl_read_alike(bucket, tmp_path):
    table = blobs_table(30)
    put_table(bucket, "pq/a.parquet", table)
    df = table.to_pandas()
    s3.client().put_object(Bucket=bucket, Key="csv/a.csv", Body=df.to_csv(index=False).encode())
    lines = "\n".join(json.dumps(r) for r in df.to_dict(orient="records"))
    s3.client().put_object(Bucket=bucket, Key="jsonl/a.jsonl", Body=lines.encode())
    arrays = []
    for fmt, prefix in (("parquet", "pq/"), ("csv", "csv/"), ("jsonl", "jsonl/")):
        manifest, channel = stage(bucket, tmp_path, fmt, prefix=prefix)
        t = datasets.read_channel(manifest)
        schema = datasets.infer_schema(t, channel, "classification")
        arrays.append(datasets.to_arrays(t, schema, "train"))
        assert schema.features == ["f0", "f1", "f2", "f3"] and schema.classes == [0, 1]
    for x, y in arrays[1:]:
        np.testing.assert_allclose(x, arrays[0][0], rtol=1e-6)
        np.testing.assert_array_equal(y, arrays[0][1])


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_empty_part_files_add_no_rows_and_an_all_empty_channel_is_named(bucket, tmp_path, fmt):
    # Spark writes a zero-byte part file for each empty partition
    df = blobs_table(12).to_pandas()
    body = df.to_csv(index=False) if fmt == "csv" else "\n".join(json.dumps(r) for r in df.to_dict(orient="records"))
    s3.client().put_object(Bucket=bucket, Key=f"{fmt}/part-0.{fmt}", Body=b"")
    s3.client().put_object(Bucket=bucket, Key=f"{fmt}/part-1.{fmt}", Body=body.encode())
    if fmt == "jsonl":  # pandas writes an empty frame's JSON lines as one newline
        s3.client().put_object(Bucket=bucket, Key=f"{fmt}/part-2.{fmt}", Body=b"\n")
    manifest, channel = stage(bucket, tmp_path, fmt, prefix=f"{fmt}/")
    layout = []
    table = datasets.read_channel(manifest, layout, required=["label"])
    assert table.num_rows == 12
    assert [(e["start"], e["end"]) for e in layout] == [(0, 0), (0, 12)] + ([(12, 12)] if fmt == "jsonl" else [])
    s3.client().put_object(Bucket=bucket, Key=f"none/part-0.{fmt}", Body=b"")
    manifest, _ = stage(bucket, tmp_path / "none", fmt, prefix="none/")
    with pytest.raises(DataError, match=r"every object is empty \(0 bytes, or blank lines\)"):
        datasets.read_channel(manifest)


def test_wrong_label_column_names_the_columns(bucket, tmp_path):
    put_table(bucket, "ch/a.parquet", blobs_table(10))
    manifest, channel = stage(bucket, tmp_path, label="churned")
    with pytest.raises(DataError, match=r"label column 'churned' not found; columns are \['f0'"):
        datasets.infer_schema(datasets.read_channel(manifest), channel, "classification")


def test_nan_labels_are_refused(bucket, tmp_path):
    put_table(bucket, "ch/a.parquet", pa.table({"f0": [1.0, 2.0, 3.0], "label": [1.0, float("nan"), None]}))
    manifest, channel = stage(bucket, tmp_path)
    table = datasets.read_channel(manifest)
    with pytest.raises(DataError, match="label 'label' has 2 missing"):
        datasets.infer_schema(table, channel, "classification")
    with pytest.raises(DataError, match="label 'label' has 2 missing"):
        datasets.to_arrays(table, datasets.infer_schema(table, channel, "regression"), "train")


def test_nan_labels_in_validation_are_refused():
    table = pa.table({"f0": [1.0, 2.0], "label": [1.0, float("nan")]})
    with pytest.raises(DataError, match="channel 'validation'.*label 'label' has 1 missing"):
        datasets.to_arrays(table, datasets.Schema(["f0"], "label", "regression"), "channel 'validation' (s3://b/v/)")


@pytest.mark.parametrize(
    "bad",
    [
        pa.array([1.0, float("nan"), 3.0], pa.float32()),
        pa.array([1.0, float("inf"), 3.0], pa.float32()),
        pa.array([1.0, None, 3.0], pa.float32()),
        pa.array([1, None, 3], pa.int64()),
        pa.array([1.0, 1e39, 3.0], pa.float64()),  # finite in float64, inf once float32
    ],
    ids=["nan", "inf", "null-float", "null-int", "float64-overflow"],
)
def test_a_feature_with_missing_or_infinite_values_is_named(bad):
    table = pa.table({"f0": pa.array([0.5, 1.5, 2.5], pa.float64()), "f1": bad, "label": [0, 1, 0]})
    with pytest.raises(DataError, match="train: feature 'f1' has 1 missing or infinite"):
        datasets.to_arrays(table, datasets.Schema(["f0", "f1"], "label", "classification", [0, 1]), "train")


def test_a_boolean_feature_with_missing_values_is_named_not_a_traceback():
    # pyarrow gives a boolean column with nulls as Python objects: the finiteness check raised a TypeError
    table = pa.table({"flag": pa.array([True, None, False]), "label": [0, 1, 0]})
    layout = [{"id": "s3://b/t/a.parquet", "start": 0, "end": 3}]
    with pytest.raises(DataError, match=r"feature 'flag' has 1 missing.*s3://b/t/a.parquet \(its data row 2"):
        datasets.to_arrays(table, datasets.Schema(["flag"], "label", "classification", [0, 1]), "t", layout)
    x, _ = datasets.to_arrays(table.slice(2), datasets.Schema(["flag"], "label", "classification", [0, 1]), "t")
    assert x.tolist() == [[0.0]]


@pytest.mark.parametrize(
    "labels, task, message",
    [
        (pa.array([0.0, float("inf"), 1.0]), "classification", "label 'label' has 1 missing .* or infinite"),
        (pa.array([0.5, -float("inf"), 1.0]), "regression", "label 'label' has 1 missing .* or infinite"),
        (pa.array([0.5, 1e39, 1.0]), "regression", r"label 'label' has 1 values beyond float32's range"),
        (pa.array([[0], [1], [0]]), "classification", r"label 'label' is list<item: int64>, not one value per row"),
        (pa.array([{"a": 1}] * 3), "regression", r"label 'label' is struct<a: int64>, not one value per row"),
    ],
    ids=["inf-class", "inf-target", "past-float32", "list", "struct"],
)
def test_infinite_and_nested_labels_are_refused_naming_the_object(labels, task, message):
    table = pa.table({"x": pa.array(np.zeros(3, np.float32)), "label": labels})
    layout = [{"id": "s3://b/t/a.parquet", "start": 0, "end": 3}]
    classes = [0.0, 1.0] if task == "classification" else []
    with pytest.raises(DataError, match=f"^t: {message}"):
        datasets.to_arrays(table, datasets.Schema(["x"], "label", task, classes), "t", layout)
    if task == "classification":  # found at schema inference too, before pyarrow's unique() could fail on a list
        channel = Channel(s3_uri="s3://bkt/t/", label="label")
        with pytest.raises(DataError, match=message):
            datasets.infer_schema(table, channel, task, layout=layout)


def test_columns_left_out_of_inferred_features_are_warned_of_text_of_mostly_numbers_on_its_own():
    table = pa.table(
        {
            "x": [1.0, 2.0, 3.0, 4.0],
            "y": ["1", "2", "n/a ", "4"],  # one stray value: CSV's reader typed the whole column as text
            "name": ["ann", "bob", "7", "dee"],  # text: an id or a name, rightly left out
            "label": [0, 1, 0, 1],
        }
    )
    channel = Channel(s3_uri="s3://bkt/t/", label="label")
    layout = [{"id": "s3://b/t/a.csv", "start": 0, "end": 4}]
    assert datasets.infer_schema(table, channel, "classification").features == ["x"]
    warning, other = table_checks.left_out_columns(table, channel, "train", layout)
    assert warning.startswith("channel 'train' (s3://bkt/t/): column 'y' is left out of the features")
    assert "3 of its 4 values are numbers ('n/a ' is not, the first in s3://b/t/a.csv (its data row 3" in warning
    # the other columns left out (text, dates) are named too: a category the model never sees, say
    assert other.startswith("channel 'train' (s3://bkt/t/): columns ['name'] are left out of the features")
    assert table_checks.left_out_columns(table, channel.model_copy(update={"features": ["x"]})) == []
    # every value a number written as text (a JSON writer's): none to quote (it quoted the last, a number)
    quoted = pa.table({"x": [1.0, 2.0], "y": ["1.5", None], "label": [0, 1]})
    (all_numbers,) = table_checks.left_out_columns(quoted, channel)
    assert "all 1 of its values are numbers written as text; write it as a number column" in all_numbers
    empty = pa.table({"x": [1.0, 2.0], "notes": pa.array([None, None], pa.string()), "label": [0, 1]})
    (unread,) = table_checks.left_out_columns(empty, channel)  # no values: not "all 0 numbers written as text"
    assert "columns ['notes'] are left out of the features: they are not numbers" in unread


def test_a_header_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "a.csv"
    path.write_bytes("label,x,n\u00e9\n0,1,2\n1,2,3\n".encode("latin-1"))
    obj = listing.StagedObject("b", "t/a.csv", path.stat().st_size, "etag", "a.csv", path=str(path))
    manifest = listing.ChannelManifest("train", "s3://b/t/", "csv", [obj])
    with pytest.raises(DataError, match=r"^s3://b/t/a.csv: a column name in its header is not UTF-8 text .*save"):
        datasets.read_channel(manifest)


def test_features_of_mixed_numeric_types_become_one_float32_matrix():
    table = pa.table(
        {
            "i": pa.array([1, -2, 3], pa.int64()),
            "d": pa.array([0.25, 1e30, -3.5], pa.float64()),
            "s": pa.array([7.0, 8.0, 9.0], pa.float32()),
            "u": pa.array([0, 255, 9], pa.uint8()),
            "label": [0, 1, 0],
        }
    )
    x, y = datasets.to_arrays(table, datasets.Schema(["s", "i", "d", "u"], "label", "classification", [0, 1]), "t")
    assert x.dtype == np.float32 and x.flags.c_contiguous
    expected = np.array([[7, 1, 0.25, 0], [8, -2, 1e30, 255], [9, 3, -3.5, 9]], dtype=np.float32)
    np.testing.assert_array_equal(x, expected)
    assert y.tolist() == [0, 1, 0]


def test_features_are_converted_block_by_block_across_chunks(monkeypatch):
    monkeypatch.setattr(datasets, "BLOCK_ROWS", 3)  # blocks that cut across the columns' chunks
    a = pa.chunked_array([pa.array([0.0, 1.0], pa.float64()), pa.array([2.0, 3.0, 4.0, 5.0, 6.0], pa.float64())])
    b = pa.chunked_array([pa.array([10, 11, 12, 13], pa.int32()), pa.array([14, 15, 16], pa.int32())])
    table = pa.table({"a": a, "b": b, "label": [0, 1, 0, 1, 0, 1, 0]})
    schema = datasets.Schema(["b", "a"], "label", "classification", [0, 1])
    x, y = datasets.to_arrays(table, schema, "t")
    np.testing.assert_array_equal(x, np.array([[10 + i, i] for i in range(7)], dtype=np.float32))
    assert y.tolist() == [0, 1, 0, 1, 0, 1, 0]
    # missing values in different blocks and chunks are counted together
    holes = pa.chunked_array([pa.array([0.0, None], pa.float64()), pa.array([2.0, 3.0, 4.0, float("nan"), 6.0])])
    with pytest.raises(DataError, match="t: feature 'a' has 2 missing or infinite"):
        datasets.to_arrays(table.set_column(0, "a", holes), schema, "t")


def test_unreadable_file_is_named(bucket, tmp_path):
    put_table(bucket, "ch/a.parquet", blobs_table(10))
    s3.client().put_object(Bucket=bucket, Key="ch/b.parquet", Body=b"this is not parquet at all")
    manifest, _ = stage(bucket, tmp_path)
    with pytest.raises(DataError, match=f"s3://{bucket}/ch/b.parquet: cannot be read as parquet"):
        datasets.read_channel(manifest)


def test_non_numeric_feature_and_unknown_class():
    table = pa.table({"f0": ["a", "b"], "label": [0, 1]})
    with pytest.raises(DataError, match="feature 'f0' is string, not numeric"):
        datasets.to_arrays(table, datasets.Schema(["f0"], "label", "classification", [0, 1]), "train")
    val = pa.table({"f0": [1.0, 2.0], "label": [0, 7]})
    with pytest.raises(DataError, match=r"label values \[7\] are not among the classes \[0, 1\]"):
        datasets.to_arrays(val, datasets.Schema(["f0"], "label", "classification", [0, 1]), "validation")


def test_prepare_writes_arrays(bucket, tmp_path):
    put_table(bucket, "ch/a.parquet", blobs_table(40))
    manifest, channel = stage(bucket, tmp_path)
    staged = datasets.prepare({"train": manifest}, {"train": channel}, "classification", tmp_path / "data")
    data = np.load(staged.train_data)
    assert data["x"].shape == (40, 4) and data["x"].dtype == np.float32
    assert staged.schema["num_outputs"] == 2 and staged.validation_data is None


@pytest.mark.parametrize(
    "labels, classes",
    [
        (pa.array([3, 1, 2, 1, 3], pa.int64()), [1, 2, 3]),
        (pa.array([3, 1, 2, 1, 3], pa.int32()), [3, 2, 1]),  # declared in another order
        (pa.array([2, 0, 1, 0], pa.uint8()), [0, 1, 2]),  # labels 0..K-1, each its own index
        (pa.array([1.0, 0.0, 1.0], pa.float32()), [0, 1]),  # float labels, integer classes
        (pa.array(["b", "a", "b"]), ["a", "b"]),
        (pa.array([True, False, True]), [False, True]),
    ],
)
def test_class_indices_follow_the_class_list(labels, classes):
    table = pa.table({"x": pa.array(np.zeros(len(labels), np.float32)), "label": labels})
    schema = datasets.Schema(["x"], "label", "classification", classes)
    _, y = datasets.to_arrays(table, schema, "channel 'train'")
    assert y.dtype == np.int64
    assert y.tolist() == [classes.index(v) for v in labels.to_pylist()]


def test_labels_outside_the_classes_are_named_whatever_their_type():
    for labels in (pa.array([0, 5, 1, 7, 5]), pa.array([0.0, 5.0, 1.0])):
        table = pa.table({"x": pa.array(np.zeros(len(labels), np.float32)), "label": labels})
        with pytest.raises(DataError, match=r"label values \[5(\.0)?(, 7)?\] are not among the classes"):
            datasets.to_arrays(table, datasets.Schema(["x"], "label", "classification", [0, 1]), "channel 'train'")
    table = pa.table({"x": pa.array(np.zeros(4, np.float32)), "label": pa.array([0, -1, 1, 2])})
    with pytest.raises(DataError, match=r"label values \[-1, 2\] are not among the classes \[0, 1\]"):
        datasets.to_arrays(table, datasets.Schema(["x"], "label", "classification", [0, 1]), "channel 'train'")


def test_classes_of_another_type_than_the_labels_are_said_to_be_so():
    # '0' and 0 print alike in a message written with str(): "[0, 1] are not among the classes [0, 1]"
    table = pa.table({"x": pa.array(np.zeros(3, np.float32)), "label": pa.array([0, 1, 0])})
    layout = [{"id": "s3://b/t/a.csv", "start": 0, "end": 3}]
    with pytest.raises(
        DataError,
        match=r"label values \[0, 1\] are not among the classes \['0', '1'\] .*the first in s3://b/t/a.csv "
        r"\(its data row 1.*the label column is int64 and the classes are text",
    ):
        datasets.to_arrays(table, datasets.Schema(["x"], "label", "classification", ["0", "1"]), "t", layout)
    text = table.set_column(1, "label", pa.array(["0", "1", "2"]))
    with pytest.raises(DataError, match=r"label values \['0', '1', '2'\].*the label column is string and the classes"):
        datasets.to_arrays(text, datasets.Schema(["x"], "label", "classification", [0, 1, 2]), "t")


def test_numeric_columns_do_not_wait_on_pandas(tmp_path):
    # pyarrow's to_numpy imports pandas on first use (~0.3 s of CPU): a streamed group's first batch
    # would wait on it. Run in a fresh interpreter: this one has pandas loaded already.
    path = tmp_path / "t.parquet"
    table = pa.table({"f": pa.array(np.arange(8, dtype=np.float32)), "label": pa.array(np.arange(8) % 2)})
    pq.write_table(table, path)
    script = f"""
import sys, pyarrow.parquet as pq
from trainyard import datasets
table = pq.ParquetFile({str(path)!r}).read_row_group(0)
x, y = datasets.to_arrays(table, datasets.Schema(["f"], "label", "classification", [0, 1]), "t")
assert x.shape == (8, 1) and y.tolist() == [0, 1] * 4
print("pandas" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_bad_rows_and_missing_columns_name_their_object(bucket, tmp_path):
    good = pa.table({"f0": [1.0, 2.0], "label": ["cat", "dog"]})
    put_table(bucket, "ch/a.parquet", good)
    put_table(bucket, "ch/b.parquet", pa.table({"f0": [1.0, float("nan"), 3.0], "label": ["cat", "dog", "cat"]}))
    manifest, channel = stage(bucket, tmp_path)
    with pytest.raises(
        DataError,
        match=rf"feature 'f0' has 1 missing.*the first in s3://{bucket}/ch/b.parquet \(its data row 2, counting from 1",
    ):
        datasets.prepare({"train": manifest}, {"train": channel}, "classification", tmp_path / "d1")
    # an object without the label column: named as such, not as rows with missing labels
    put_table(bucket, "nolabel/a.parquet", good)
    put_table(bucket, "nolabel/b.parquet", pa.table({"f0": [1.0], "z": [2.0]}))
    manifest, channel = stage(bucket, tmp_path, prefix="nolabel/")
    with pytest.raises(
        DataError, match=rf"s3://{bucket}/nolabel/b.parquet: no column 'label' \(its columns are \['f0', 'z'\]\)"
    ):
        datasets.prepare({"train": manifest}, {"train": channel}, "classification", tmp_path / "d2")


def test_missing_string_labels_in_csv_are_refused_not_made_classes(bucket, tmp_path):
    body = "f0,label\n1,cat\n2,dog\n3,NaN\n4,NA\n5,\n"
    s3.client().put_object(Bucket=bucket, Key="csv/a.csv", Body=b"f0,label\n0,cat\n")
    s3.client().put_object(Bucket=bucket, Key="csv/b.csv", Body=body.encode())
    manifest, channel = stage(bucket, tmp_path, "csv", prefix="csv/")
    with pytest.raises(
        DataError,
        match=rf"label 'label' has 3 missing.*the first in s3://{bucket}/csv/b.csv \(its data row 3, counting from 1\)",
    ):
        datasets.prepare({"train": manifest}, {"train": channel}, "classification", tmp_path / "d")


@pytest.mark.parametrize(
    "objects, message",
    [
        # the same name twice in one header: pyarrow's "Can't unify schema with duplicate field names" named no object
        ({"a.csv": "f0,f0,label\n{rows}"}, r"a.csv: column 'f0' appears 2 times in its header"),
        # a header line again among the rows (files joined with their headers): its columns read as text, which
        # read as "no numeric feature columns" alone, or as "objects disagree on columns" beside a good object
        (
            {"a.csv": "f0,f1,label\n{rows}f0,f1,label\n{rows}"},
            r"a.csv: its data row 13 \(counting from 1, after the header\) repeats the header \(f0,f1,label\)",
        ),
        (
            {"a.csv": "f0,f1,label\n{rows}", "b.csv": "f0,f1,label\nf0,f1,label\n{rows}"},
            r"b.csv: its data row 1 \(counting from 1, after the header\) repeats the header .*remove that line",
        ),
        # an object with a column the others lack: inferred as a feature, it read as the others' missing values
        (
            {"a.csv": "f0,f1,label\n{rows}", "b.csv": "f0,f1,f2,label\n{extra}"},
            r"a.csv: no column 'f2' \(its columns are \['f0', 'f1', 'label'\]\).*list the features",
        ),
        # a value that is not a number in a numeric column: the object and the column, not "objects disagree"
        (
            {"a.csv": "f0,f1,label\n{rows}", "b.csv": "f0,f1,label\noops,1,0\n{rows}"},
            r"b.csv: column 'f0' is string, but double in s3://.*/a.csv; make it one type",
        ),
    ],
    ids=["name-twice", "header-repeated", "header-repeated-in-one-of-two", "extra-column", "text-in-numbers"],
)
def test_csv_header_and_column_problems_name_the_object_and_the_fix(bucket, tmp_path, objects, message):
    rows = "".join(f"{i / 10},{i % 3},{i % 2}\n" for i in range(12))
    extra = "".join(f"{i / 10},{i % 3},{i},{i % 2}\n" for i in range(12))
    for key, body in objects.items():
        s3.client().put_object(Bucket=bucket, Key=f"csv/{key}", Body=body.format(rows=rows, extra=extra).encode())
    manifest, channel = stage(bucket, tmp_path, "csv", prefix="csv/")
    with pytest.raises(DataError, match=rf"^s3://{bucket}/csv/{message}"):
        datasets.prepare({"train": manifest}, {"train": channel}, "classification", tmp_path / "d")


def test_a_decimal_column_is_a_numeric_feature():
    import decimal

    prices = pa.array([decimal.Decimal("1.50"), decimal.Decimal("2.25")], pa.decimal128(10, 2))  # DECIMAL(10,2)
    table = pa.table({"price": prices, "label": [0, 1]})
    channel = Channel(s3_uri="s3://bkt/t/", label="label")
    schema = datasets.infer_schema(table, channel, "classification")
    assert schema.features == ["price"] and table_checks.left_out_columns(table, channel) == []
    x, _ = datasets.to_arrays(table, schema, "here")
    assert x.dtype == np.float32 and x[:, 0].tolist() == [1.5, 2.25]
