"""What a channel's objects are checked for before their rows are used: headers whose columns cannot be
told apart, objects that lack a column the others have or disagree on a column's type, and text columns
that inferred features would leave out though they hold numbers. Each problem names the object (and row)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainyard.errors import DataError
from trainyard.spec import Channel


def decoded(table: pa.Table) -> pa.Table:
    """``table`` with its dictionary-encoded columns (pandas' categories) as their values' type: one object's
    category label and another's plain text one are then one column (concatenated as they are, they were refused)."""
    for i, column in enumerate(table.schema):
        if pa.types.is_dictionary(column.type):
            table = table.set_column(i, column.name, table.column(i).cast(column.type.value_type))
    return table


def check_header(uri: str, table: pa.Table, fmt: str) -> None:
    """Refuse an object whose columns cannot be told apart (a name twice in its header), or a CSV object
    whose header line appears again among its rows (files joined with their headers): every column with
    that line in it reads as text, which would fail later as "no numeric feature columns", or as objects
    that disagree, naming neither the object nor the line."""
    names = table.column_names
    check_unique_columns(uri, names)
    if fmt == "csv" and (row := _header_row(table)) is not None:
        raise DataError(
            f"{uri}: its data row {row + 1} (counting from 1, after the header) repeats the header "
            f"({','.join(names)}), so its columns read as text; "
            "remove that line (were files with headers joined into one?)"
        )


def check_unique_columns(uri: str, names: list[str]) -> None:
    """Refuse an object that names a column twice: which of the two is the feature or the label would be
    a guess (pyarrow's, by position), so the object is named instead."""
    repeated = [name for name in dict.fromkeys(names) if names.count(name) > 1]
    if repeated:
        raise DataError(
            f"{uri}: column {repeated[0]!r} appears {names.count(repeated[0])} times in its header (its columns are "
            f"{names}); rename or drop the repeats"
        )


def _header_row(table: pa.Table) -> int | None:
    """The first row that repeats the table's column names, or None. Only a table with a text column can
    have one, and only rows where that column holds its own name are compared in full."""
    text = [i for i, f in enumerate(table.schema) if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    if not text:
        return None
    named = pc.fill_null(pc.equal(table.column(text[0]), table.column_names[text[0]]), False)
    rows = pc.indices_nonzero(named)
    if len(rows) == 0:
        return None
    candidates = table.take(rows)
    repeats = pa.array(np.ones(len(rows), dtype=bool))
    for i, name in enumerate(table.column_names):
        same = pc.equal(pc.cast(candidates.column(i), pa.string()), name)
        repeats = pc.and_(repeats, pc.fill_null(same, False))
    hits = pc.indices_nonzero(repeats)
    return rows[hits[0].as_py()].as_py() if len(hits) else None


def disagreement(where: str, uris: list[str], schemas: list[pa.Schema], exc: Exception) -> DataError:
    """pyarrow's refusal to concatenate the objects' tables (``schemas``, of the objects at ``uris``), as the first
    object whose column cannot take the type the objects before it gave that column (a text value in a numeric
    column, say), named."""
    seen: dict[str, tuple[pa.DataType, str]] = {}  # column -> its type so far, and the first object with it
    for uri, schema in zip(uris, schemas, strict=True):
        for column in schema:
            if column.name not in seen:
                seen[column.name] = (column.type, uri)
                continue
            kept, first = seen[column.name]
            try:
                merged = pa.unify_schemas(
                    [pa.schema([pa.field(column.name, kept)]), pa.schema([column])], promote_options="permissive"
                )
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                return DataError(
                    f"{uri}: column {column.name!r} is {column.type}, but {kept} in {first}; make it one type in "
                    "every object (a value that is not a number in a numeric column?)"
                )
            seen[column.name] = (merged.field(column.name).type, first)
    return DataError(f"{where}: objects disagree on columns ({str(exc).splitlines()[0]})")


def first_in(layout: list[dict] | None, row: int) -> str:
    """``", the first in <object> (its data row N)"`` for a row of a channel's table, given its layout; N
    counts from 1, as a person reading the file counts (a CSV's header line not among them)."""
    for entry in layout or ():
        if entry["start"] <= row < entry["end"]:
            return f", the first in {entry['id']} (its data row {row - entry['start'] + 1}, counting from 1)"
    return ""


def check_objects_have(required: Sequence[str], columns: dict[str, list[str]]) -> None:
    """Name the first object (``columns``: each object's column names) without one of the ``required``
    columns that the channel's other objects have. A column no object has is the spec's to fix, and
    ``infer_schema`` says so (naming the field)."""
    for column in required:
        lacking = [uri for uri, names in columns.items() if column not in names]
        if lacking and len(lacking) < len(columns):
            raise DataError(
                f"{lacking[0]}: no column {column!r} (its columns are {columns[lacking[0]]}), which the channel's "
                "other objects have; every object needs the label and feature columns (add it, or list the features "
                "to train on in the channel's features)"
            )


def check_objects_share_numeric(schemas: dict[str, pa.Schema], label: str | None) -> None:
    """Where the features are inferred from a sample of a channel's row groups (stream mode): every number column
    (but the label) one object has, each of the others has too (``schemas``: the objects with rows), else the first
    without one is named. The sample's objects decide the features: a column that they lacked and others had was
    left out of training without a word (the file mode's whole table shows it as missing values, refused)."""
    numeric = {n for s in schemas.values() for n in s.names if n != label and is_numeric(s.field(n).type)}
    check_objects_have(sorted(numeric), {uri: schema.names for uri, schema in schemas.items()})


def required_columns(channel: Channel) -> list[str]:
    """The columns every object of a channel must have, as far as the spec names them."""
    return [c for c in (channel.label, *(channel.features or ())) if c]


_NUMBER = r"^\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$"


def is_numeric(dtype: pa.DataType) -> bool:
    """Whether a column of this type can be a feature (integers, floats, decimals, booleans)."""
    return (
        pa.types.is_integer(dtype)
        or pa.types.is_floating(dtype)
        or pa.types.is_decimal(dtype)
        or (pa.types.is_boolean(dtype))
    )


def left_out_columns(
    table: pa.Table, channel: Channel, channel_name: str = "train", layout: list[dict] | None = None
) -> list[str]:
    """Warnings of the columns that inferred features leave out: each text column most of whose values are
    numbers (one stray value, ``n/a `` or ``1,5``, makes CSV's reader type a numeric column as text, and the
    model would silently train without it), then one naming the other columns that are not numbers (text,
    dates: the model takes numbers only). Nothing when the channel lists its features."""
    if channel.features is not None:
        return []
    where = f"channel {channel_name!r} ({channel.s3_uri})"
    found, other = [], []
    for name in table.column_names:
        column = table[name]
        if name == channel.label or is_numeric(column.type):
            continue
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            other.append(name)
            continue
        numeric = pc.match_substring_regex(column, _NUMBER)
        values, numbers = len(column) - column.null_count, int(pc.sum(numeric).as_py() or 0)
        if numbers * 2 < values or not values:  # mostly text (an id, a name, a category), or nothing in it
            other.append(name)
            continue
        first = pc.index(pc.invert(numeric), True).as_py()
        if first < 0:  # every value a number, written as text (a JSON writer's "1.5"): no stray value to quote
            found.append(
                f"{where}: column {name!r} is left out of the features: it is text, though all {values} of its "
                f"values are numbers written as text; write it as a number column to train on it, or list the "
                f"features in inputs.{channel_name}.features to leave it out knowingly"
            )
            continue
        found.append(
            f"{where}: column {name!r} is left out of the features: it is text, though {numbers} of its {values} "
            f"values are numbers ({column[first].as_py()!r} is not{first_in(layout, first)}); fix those values to "
            f"train on it, or list the features in inputs.{channel_name}.features to leave it out knowingly"
        )
    if other:
        found.append(
            f"{where}: columns {other} are left out of the features: they are not numbers (the model takes "
            f"numbers only); encode them as numbers (one column per category, say) to train on them, or list the "
            f"features in inputs.{channel_name}.features to leave them out knowingly"
        )
    return found
