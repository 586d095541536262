"""What the spec's sections share: the strict base model, the metric table and the field checks."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic.config import JsonDict

BUILTIN_ALGORITHMS = ("mlp-classifier", "linear-regression")
# Metric name -> whether bigger is better. Stopping and promotion use this table.
METRICS: dict[str, bool] = {"val_accuracy": True, "val_loss": False, "val_rmse": False, "train_loss": False}
_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
POSITIVE_WIDTHS: JsonDict = {"items": {"type": "integer", "minimum": 1}}  # hidden sizes' JSON schema (_check_widths)
SEED_MAX = 2**32 - 1  # numpy's and most tools' range; torch's generators overflowed on larger seeds


# Words of field names written as a reader writes them, in the titles the Prefect UI's form shows ("S3 URI").
_TITLE_WORDS = {
    "s3": "S3",
    "uri": "URI",
    "iso": "ISO",
    "pue": "PUE",
    "lr": "learning-rate",
    "gpus": "GPUs",
    "kwh": "kWh",
}


def field_title(name: str) -> str:
    """A field's title in the job's JSON schema (the Prefect UI's form labels): ``country_iso_code`` is
    "Country ISO code"."""
    title = " ".join(_TITLE_WORDS.get(word, word) for word in name.split("_"))
    return title[:1].upper() + title[1:]


def titled(schema: dict[str, Any], _model: Any = None) -> None:
    """A section's ``json_schema_extra``: each of its fields titled by ``field_title``. Pydantic's own titles
    read "Country Iso Code", and a field holding a section had none: the form labelled it by its type."""
    for name, field in schema.get("properties", {}).items():
        field["title"] = field_title(name)


def constrained(json_type: str, **constraints: Any) -> Callable[[dict[str, Any]], None]:
    """A field's ``json_schema_extra`` that adds ``constraints`` (``pattern``, ``enum``, ``minItems``...) to its
    schema of ``json_type``, a nullable one's too: the form checks them before a run is made, and the API before
    it queues one (the field's validator, which says the fix in words, stays the check every spec goes through)."""

    def extra(schema: dict[str, Any]) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") == json_type:
                branch.update(constraints)

    return extra


class _Model(BaseModel):
    # allow_inf_nan: a beta or learning rate of .inf or .nan passes gt=0 checks, and fails only in training
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, json_schema_extra=titled)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_bools(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse true / false for a number: pydantic reads them as 1 and 0 (``epochs: true`` trained one epoch)."""
        field = cls.model_fields.get(info.field_name or "")
        kinds = str(field.annotation) if field is not None else ""
        if ("int" in kinds or "float" in kinds) and "bool" not in kinds:
            if isinstance(value, bool):
                raise ValueError(f"{str(value).lower()} is not a number; give a number")
            if isinstance(value, list | tuple):  # a list of numbers (hidden_sizes: [true] was read as [1])
                for index, item in enumerate(value):
                    if isinstance(item, bool):
                        raise ValueError(f"item {index} ({str(item).lower()}) is not a number; give numbers")
        return value


def _known_metric(v: str) -> str:
    if v not in METRICS:
        raise ValueError(f"unknown metric {v!r}; use one of {', '.join(METRICS)}")
    return v


def _check_widths(v: list[int]) -> list[int]:
    if any(w < 1 for w in v):
        raise ValueError("every hidden size must be a positive integer, e.g. [128, 128]")
    return v


S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$"  # check_s3_uri's, for the JSON schema


def check_s3_uri(v: str) -> str:
    """``v`` if it is an ``s3://bucket/...`` URI with a valid bucket name; else a ValueError saying how to write it."""
    if not v.startswith("s3://"):
        raise ValueError(f"{v!r} is not an S3 URI; write it as s3://bucket/prefix/")
    bucket = v[5:].split("/", 1)[0]
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
        raise ValueError(f"{bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, dots, hyphens)")
    return v
