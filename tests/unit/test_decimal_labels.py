"""DECIMAL labels: their classes as numbers, which come back from the training plan's JSON as the labels read
(a streaming group's), and refused where float64 cannot tell two of them apart."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from trainyard import datasets
from trainyard.errors import DataError
from trainyard.spec import Channel


@pytest.mark.parametrize(
    ("labels", "classes"), [(["1.00", "2.00", "1.00"], [1, 2]), (["0.50", "1.00", "0.50"], [0.5, 1.0])]
)
def test_a_decimal_labels_classes_come_back_from_the_plan_as_its_labels(tmp_path, labels, classes):
    # written to plan.json as Decimals (as text), a streaming group found none of its labels among them
    import decimal

    from trainyard.home import write_json_atomic

    label = pa.array([decimal.Decimal(v) for v in labels], pa.decimal128(10, 2))
    table = pa.table({"x": [0.1, 0.2, 0.3], "label": label})
    schema = datasets.infer_schema(table, Channel(s3_uri="s3://bkt/t/", label="label"), "classification")
    assert schema.classes == classes and all(type(c) is type(classes[0]) for c in schema.classes)
    write_json_atomic(tmp_path / "plan.json", datasets.schema_dict(schema))
    planned = json.loads((tmp_path / "plan.json").read_text())
    read_back = datasets.Schema(planned["features"], planned["label"], planned["task"], planned["classes"])
    _, y = datasets.to_arrays(table, read_back, "a streamed row group")
    assert y.tolist() == [0, 1, 0]


def test_decimal_labels_past_float64s_precision_are_refused_naming_the_label():
    import decimal

    close = [decimal.Decimal("0.100000000000000001"), decimal.Decimal("0.100000000000000002")]  # one float64
    table = pa.table({"x": [0.1, 0.2], "label": pa.array(close, pa.decimal128(38, 18))})
    with pytest.raises(DataError, match=r"label 'label': DECIMAL classes past float64's precision"):
        datasets.infer_schema(table, Channel(s3_uri="s3://bkt/t/", label="label"), "classification")
