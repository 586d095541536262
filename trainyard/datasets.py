"""Reading staged channels with pyarrow and turning them into tensors a model can train on.

Every problem names the object or column at fault: an unreadable file, a missing label column,
missing (NaN / null) labels, non-numeric features, a validation class never seen in training.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from trainyard import cache, raw_layout, table_checks
from trainyard.errors import DataError
from trainyard.listing import ChannelManifest
from trainyard.spec import Channel
from trainyard.table_checks import first_in

BLOCK_ROWS = 1 << 16  # rows of features converted at a time (to_arrays): 64Ki x 16 float32 columns is 4 MiB
# "", "NA", "NaN", "null"... are missing in a string column too (by default only in numeric ones): a label
# written so is refused as missing rather than becoming a class
_CSV_OPTIONS = {"convert_options": pa_csv.ConvertOptions(strings_can_be_null=True)}
# A compressed text object (.csv.gz, .jsonl.zst) by its first bytes: its cached copy has no extension to say so.
# bzip2's "BZh" is followed by its block size, a digit 1-9: without it, a CSV whose first column is "BZhx" read as one.
_COMPRESSIONS = {
    re.compile(rb"\x1f\x8b"): "gzip",
    re.compile(rb"BZh[1-9]"): "bz2",
    re.compile(rb"\x28\xb5\x2f\xfd"): "zstd",
}


def read_object(fmt: str, path: str) -> pa.Table:
    """One staged object (its cached file) as a table: parquet, or CSV or JSON lines, compressed or not."""
    if fmt == "parquet":
        return pq.read_table(path)
    with open(path, "rb") as f:
        head = f.read(4)
    compression = next((name for magic, name in _COMPRESSIONS.items() if magic.match(head)), None)

    def read(**options) -> pa.Table:
        with pa.input_stream(path, compression=compression) as source:
            return pa_csv.read_csv(source, **options) if fmt == "csv" else pa_json.read_json(source)

    if fmt != "csv":
        return read()
    try:
        return read(**_CSV_OPTIONS)
    except pa.ArrowInvalid:
        # A quoted value with a line break in it (pandas writes them) splits a row where the parallel reader cuts
        # the file into blocks, past its first MiB; allowed, the read is slower, so only when it is needed.
        return read(parse_options=pa_csv.ParseOptions(newlines_in_values=True), **_CSV_OPTIONS)


@dataclass(slots=True)
class Schema:
    """How a table becomes arrays: feature columns, the label, and class names for classifiers."""

    features: list[str]
    label: str
    task: str
    classes: list = field(default_factory=list)

    @property
    def num_outputs(self) -> int:
        return len(self.classes) if self.task == "classification" else 1


def read_channel(
    manifest: ChannelManifest,
    layout: list[dict] | None = None,
    required: Sequence[str] = (),
    columns: dict[str, list[str]] | None = None,
) -> pa.Table:
    """Read every staged object of a channel into one table; an object without one of the ``required``
    columns is named (concatenated, its rows would only show as missing values), as is one whose header
    names a column twice or, in CSV, appears again among its rows.

    When ``layout`` is given, one ``{"id", "start", "end", "row_groups"}`` entry per object is
    appended to it: where each object's rows lie in the table (what sharding divides, and what names
    the object holding a bad row). ``columns``, when given, is filled with each object's column names
    by URI, for checks that need the schema first (the features inferred from the table).
    """
    tables = []
    start = 0
    read = []  # the objects read, for the column check: an empty one has no columns to check
    for obj in manifest.objects:
        table = None
        # Spark writes an empty part file for each empty partition, pandas an empty frame's JSON lines as
        # one newline: no rows, not a broken object
        if manifest.format == "parquet" or Path(obj.path).stat().st_size > 0:
            try:
                table = read_object(manifest.format, obj.path)
                table.column_names  # noqa: B018 -- decoded from the header here: a name not in UTF-8 fails below
                row_groups = None
                if manifest.format == "parquet" and layout is not None:
                    meta = pq.ParquetFile(obj.path).metadata
                    row_groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
                raise DataError(
                    f"{obj.uri}: cannot be read as {manifest.format} ({str(exc).splitlines()[0]}); "
                    "fix or remove the object, or set the channel's format"
                ) from exc
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{obj.uri}: a column name in its header is not UTF-8 text ({exc.reason}: "
                    f"{exc.object[max(exc.start - 10, 0) : exc.end + 10]!r}); save the file as UTF-8"
                ) from exc
        if table is None or (table.num_columns == 0 and table.num_rows == 0):
            if layout is not None:
                layout.append({"id": obj.uri, "start": start, "end": start, "row_groups": None, "etag": obj.etag})
            continue
        table_checks.check_header(obj.uri, table, manifest.format)
        read.append(obj)
        tables.append(table_checks.decoded(table))
        if layout is not None:
            end = start + table.num_rows
            # the ETag: which bytes of the object these rows are (the id carries a pinned version)
            layout.append({"id": obj.uri, "start": start, "end": end, "row_groups": row_groups, "etag": obj.etag})
            start = end
    names = {obj.uri: t.column_names for obj, t in zip(read, tables, strict=True)}
    if columns is not None:
        columns.update(names)
    table_checks.check_objects_have(required, names)
    if not tables:
        raise DataError(f"channel {manifest.name!r} ({manifest.uri}): every object is empty (0 bytes, or blank lines)")
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        where = f"channel {manifest.name!r} ({manifest.uri})"
        raise table_checks.disagreement(where, [o.uri for o in read], [t.schema for t in tables], exc) from exc
    if table.num_rows == 0:
        raise DataError(f"channel {manifest.name!r} ({manifest.uri}): the objects hold no rows")
    return table


def infer_schema(
    table: pa.Table, channel: Channel, task: str, channel_name: str = "train", layout: list[dict] | None = None
) -> Schema:
    """Choose feature columns and class names from the training table (``layout``: as for ``to_arrays``)."""
    label = channel.label
    where = f"channel {channel_name!r} ({channel.s3_uri})"
    if label is None or label not in table.column_names:
        raise DataError(
            f"{where}: label column {label!r} not found; columns are {table.column_names}; "
            f"set inputs.{channel_name}.label"
        )
    if channel.features is not None:
        missing = [c for c in channel.features if c not in table.column_names]
        if missing:
            raise DataError(f"{where}: feature columns {missing} not found; columns are {table.column_names}")
        features = list(channel.features)
    else:
        features = [c for c in table.column_names if c != label and table_checks.is_numeric(table.schema.field(c).type)]
    if not features:
        raise DataError(f"{where}: no numeric feature columns besides {label!r}; set inputs.{channel_name}.features")
    classes: list = []
    if task == "classification":
        check_labels(table, label, where, layout)
        classes = channel.classes or found_classes(table[label], f"{where}: label {label!r}")
        if len(classes) < 2:
            raise DataError(f"{where}: label {label!r} has a single class {classes}; a classifier needs two or more")
    return Schema(features=features, label=label, task=task, classes=classes)


def found_classes(col: pa.ChunkedArray, where: str) -> list:
    """A label column's distinct values, sorted: its classes, as the training plan's JSON keeps them. A DECIMAL
    label's are numbers (ints where every one is whole): as Python's ``Decimal`` they were written as text, and
    a replica group streaming the channel found none of its labels among them. ``where``: the label, for errors."""
    unique = pc.unique(col)
    classes = unique.to_pylist()
    if pa.types.is_decimal(col.type):
        whole = all(c == c.to_integral_value() for c in classes)
        # (as floats by Arrow's cast: the one that reads the labels back, _numeric_numpy)
        numbers = [int(c) for c in classes] if whole else pc.cast(unique, pa.float64()).to_pylist()
        if len(set(numbers)) < len(classes) or (whole and any(abs(n) > 2**53 for n in numbers)):
            raise DataError(  # two labels one class (a float64 holds 15-17 significant digits)
                f"{where}: DECIMAL classes past float64's precision ({[str(c) for c in classes[:3]]} ...); round "
                "the label, or cast it to text"
            )
        classes = numbers
    return sorted(classes, key=lambda v: (str(type(v)), v))


def to_arrays(
    table: pa.Table, schema: Schema, where: str, layout: list[dict] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Features as float32 ``[n, d]`` and labels (class indices int64, or float32 values). With the
    channel's ``layout`` (``read_channel``), a bad value's message names the object that holds it."""
    missing = [c for c in [*schema.features, schema.label] if c not in table.column_names]
    if missing:
        raise DataError(f"{where}: columns {missing} not found; columns are {table.column_names}")
    for name in schema.features:
        if not table_checks.is_numeric(table[name].type):
            raise DataError(
                f"{where}: feature {name!r} is {table[name].type}, not numeric; encode it or drop it from features"
            )
    x = np.empty((table.num_rows, len(schema.features)), dtype=np.float32)
    bad = np.zeros(len(schema.features), dtype=np.int64)
    start = 0
    # Block by block of rows, every feature at once: a block of x is filled while it is in cache, and no
    # column is first combined into one array. A 7.5M-row, 16-column table: 0.36 s -> 0.21 s (plus the
    # kernel's first touch of x's pages, which after a large parquet read took about 1 s here).
    # An overflow becomes inf, which the check below names (one errstate: entering one costs ~40 us)
    with np.errstate(over="ignore"):
        for batch in table.select(schema.features).to_batches(max_chunksize=BLOCK_ROWS):
            block = x[start : start + batch.num_rows]
            for i, column in enumerate(batch.columns):
                values = _numeric_numpy(column)
                block[:, i] = values  # converted to float32 as it is copied in
                # Checked on the contiguous source, except for float64, where a value past float32's range
                # becomes inf only in the copy.
                bad[i] += np.count_nonzero(~np.isfinite(block[:, i] if values.dtype == np.float64 else values))
            start += batch.num_rows
    for i, (name, count) in enumerate(zip(schema.features, bad.tolist(), strict=True)):
        if count:
            first = int(np.flatnonzero(~np.isfinite(x[:, i]))[0])
            raise DataError(
                f"{where}: feature {name!r} has {count} missing or infinite values{first_in(layout, first)}; "
                "fill or drop those rows"
            )
    check_labels(table, schema.label, where, layout)
    if schema.task == "classification":
        y, known = _class_indices(table[schema.label], schema.classes)
        if not known.all():
            label = table[schema.label]
            unknown = pc.unique(label.filter(pa.array(~known))).to_pylist()
            unknown.sort(key=lambda v: (str(type(v)), v))
            text_labels = pa.types.is_string(label.type) or pa.types.is_large_string(label.type)
            text_classes = all(isinstance(c, str) for c in schema.classes)
            hint = ""
            if text_labels != text_classes:  # '0' and 0 print alike in a list: say which is which
                kinds = "text" if text_classes else "numbers"
                hint = f"; the label column is {label.type} and the classes are {kinds}: give them in the labels' type"
            raise DataError(
                f"{where}: label values {unknown[:5]} are not among the classes {schema.classes[:10]} "
                f"(those of the train channel, or inputs.train.classes){first_in(layout, int(np.argmin(known)))}"
                f"{hint}"
            )
    else:
        if not table_checks.is_numeric(table[schema.label].type):
            raise DataError(f"{where}: label {schema.label!r} is {table[schema.label].type}; regression needs numbers")
        with np.errstate(over="ignore"):
            y = _numeric_numpy(table[schema.label]).astype(np.float32)
        beyond = ~np.isfinite(y)  # finite in the table (checked above), past float32's range once cast
        if beyond.any():
            first = int(np.flatnonzero(beyond)[0])
            raise DataError(
                f"{where}: label {schema.label!r} has {int(beyond.sum())} values beyond float32's range (about "
                f"±3.4e38){first_in(layout, first)}; rescale the label or fix those rows"
            )
    return x, y


def _numeric_numpy(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A numeric column as a numpy array; nulls become NaN.

    Null-free integer and float columns go through DLPack: pyarrow's ``to_numpy`` imports pandas on
    its first call (~0.3 s of CPU), which a replica group's first streamed batch would wait on.
    """
    array = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if array.null_count == 0 and (pa.types.is_integer(array.type) or pa.types.is_floating(array.type)):
        return np.from_dlpack(array)
    if pa.types.is_decimal(array.type):  # a DECIMAL(10,2) price, say: as the float it is to the model
        return pc.cast(array, pa.float64()).to_numpy(zero_copy_only=False)
    if pa.types.is_boolean(array.type) and array.null_count:
        # as floats: pyarrow gives a boolean column with nulls as Python objects, which no finiteness check takes
        array = pc.cast(array, pa.float64())
    return array.to_numpy(zero_copy_only=False)


def _class_indices(col: pa.ChunkedArray, classes: list) -> tuple[np.ndarray, np.ndarray]:
    """Each label's index in ``classes`` (int64; 0 where it is none), and whether it is one (bool)."""
    numeric = table_checks.is_numeric(col.type) and not pa.types.is_boolean(col.type)
    if numeric and col.null_count == 0 and all(isinstance(c, int | float) and not isinstance(c, bool) for c in classes):
        raw = _numeric_numpy(col)  # vectorised: a Python loop over millions of labels takes seconds
        if raw.dtype.kind in "iu" and classes == list(range(len(classes))):  # labels 0..K-1: their own index
            known = (raw >= 0) & (raw < len(classes))
            return np.where(known, raw, 0).astype(np.int64), known
        values = np.asarray(classes, dtype=np.result_type(raw.dtype, *(type(c) for c in classes)))
        order = np.argsort(values, kind="stable")
        slot = np.clip(np.searchsorted(values[order], raw), 0, len(values) - 1)
        known = values[order][slot] == raw
        return np.where(known, order[slot], 0).astype(np.int64), known
    found = _indices_in(col, classes)
    if found is not None:
        return found.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64), found.is_valid().to_numpy()
    index = {c: i for i, c in enumerate(classes)}  # classes of mixed types: a Python look-up, row by row
    raw = col.to_pylist()
    known = np.fromiter((v in index for v in raw), dtype=bool, count=len(raw))
    return np.fromiter((index.get(v, 0) for v in raw), dtype=np.int64, count=len(raw)), known


def _indices_in(col: pa.ChunkedArray, classes: list) -> pa.ChunkedArray | None:
    """Each label's index in ``classes`` (null where it is none), computed by Arrow: text and boolean labels, and
    numbers with nulls; None where the classes cannot be given the column's type. A Python look-up took 0.3 s
    and 115 MB for 2M text labels, Arrow 0.015 s."""
    values = col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col
    try:
        return pc.index_in(values, value_set=pa.array(classes, type=values.type))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, OverflowError):
        return None


def check_labels(table: pa.Table, label: str, where: str, layout: list[dict] | None = None) -> None:
    """Refuse missing (null or NaN) and infinite labels, naming the channel, the count and (given the
    channel's ``layout``) the object holding the first. An infinite label is no class, and no target a
    regression can be trained towards (its loss is infinite)."""
    col = table[label]
    if pa.types.is_nested(col.type):
        raise DataError(
            f"{where}: label {label!r} is {col.type}, not one value per row; "
            "make it a number or a string column, or set the channel's label to another column"
        )
    missing = pc.is_null(col, nan_is_null=True) if pa.types.is_floating(col.type) else pc.is_null(col)
    if pa.types.is_floating(col.type):
        missing = pc.or_(missing, pc.fill_null(pc.is_inf(col), False))
    nulls = int(pc.sum(missing).as_py() or 0)
    if nulls:
        first = pc.index(missing, True).as_py()
        raise DataError(
            f"{where}: label {label!r} has {nulls} missing (null or NaN) or infinite values"
            f"{first_in(layout, first)}; drop or fix those rows"
        )


@dataclass(slots=True)
class StagedData:
    """The channels as arrays on local disk (``.npz`` with ``x`` and ``y``), ready for training."""

    train_data: str
    validation_data: str | None
    schema: dict
    rows: dict[str, int]
    train_layout: list[dict] = field(default_factory=list)
    extra_channels: dict[str, str] = field(default_factory=dict)
    streamed: bool = False
    """True when ``train_data`` is only a scaling sample and the groups stream the channel from S3."""
    warnings: list[str] = field(default_factory=list)
    """What the staging stage should tell the user but does not fail on (``left_out_columns``)."""


def schema_dict(schema: Schema) -> dict:
    """A ``Schema`` as plain data, for the training plan."""
    return {
        "features": schema.features,
        "label": schema.label,
        "task": schema.task,
        "classes": schema.classes,
        "num_outputs": schema.num_outputs,
    }


def prepare(manifests: dict[str, ChannelManifest], channels: dict[str, Channel], task: str, out_dir) -> StagedData:
    """Read the train and validation channels, check them, and write them as arrays under ``out_dir``;
    lay any other channel out as files under ``out_dir/channels/<name>``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    layout: list[dict] = []
    paths: dict[str, str] = {}
    rows: dict[str, int] = {}
    extra = {}
    if channels["train"].mode == "stream":
        from trainyard import streaming  # streaming builds on this module

        described = streaming.describe(manifests["train"], channels["train"], task, out_dir, cache.rowgroups_dir())
        schema = Schema(**{k: v for k, v in described.schema.items() if k != "num_outputs"})
        paths["train"], rows["train"], layout = described.train_data, described.rows["train"], described.train_layout
        warnings = described.warnings
    else:
        columns: dict[str, list[str]] = {}
        train_table = read_channel(
            manifests["train"], layout, table_checks.required_columns(channels["train"]), columns
        )
        schema = infer_schema(train_table, channels["train"], task, layout=layout)
        warnings = table_checks.left_out_columns(train_table, channels["train"], layout=layout)
        # Features the spec does not list are inferred from all the objects together: a column only some
        # objects have would fail as the others' "missing values", naming an object that never had it.
        table_checks.check_objects_have(schema.features, columns)
    for name, manifest in manifests.items():
        if name not in ("train", "validation"):
            extra[name] = str(raw_layout.mirror(manifest, out_dir / "channels" / name))
            continue
        if name == "train" and channels["train"].mode == "stream":
            continue
        objects = layout if name == "train" else []
        table = train_table if name == "train" else read_channel(manifest, objects, [schema.label, *schema.features])
        x, y = to_arrays(table, schema, f"channel {name!r} ({manifest.uri})", objects)
        path = out_dir / f"{name}.npz"
        np.savez(path, x=x, y=y)
        paths[name], rows[name] = str(path), len(x)
    meta = schema_dict(schema)
    streamed = channels["train"].mode == "stream"
    return StagedData(paths["train"], paths.get("validation"), meta, rows, layout, extra, streamed, warnings)
