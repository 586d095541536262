"""The job's data: its input channels and where its outputs go."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainyard.spec.base import S3_URI_PATTERN, _Model, check_s3_uri, constrained, titled

CHANNEL_NAME_PATTERN = "^[a-z][a-z0-9_]{0,31}$"


class Channel(_Model):
    """One input channel: where its objects are and how to read them."""

    s3_uri: str = Field(
        description='"s3://bucket/prefix/" (every object under it), "s3://bucket/key", '
        "or a manifest (see s3_data_type).",
        json_schema_extra=constrained("string", pattern=S3_URI_PATTERN),
    )
    s3_data_type: Literal["prefix", "manifest"] = Field(
        default="prefix",
        description="prefix: s3_uri names the objects; manifest: s3_uri is a JSON or JSONL list of s3:// URIs "
        '(or SageMaker\'s [{"prefix": "s3://b/p/"}, "key", ...]).',
    )
    format: Literal["parquet", "csv", "jsonl", "raw"] = Field(
        default="parquet", description="parquet, csv or jsonl; raw: files handed to an entrypoint unread."
    )
    label: str | None = Field(default=None, description="The label column (required for built-in algorithms).")
    features: list[str] | None = Field(
        default=None,
        description="Feature columns; default: every numeric column but the label.",
        json_schema_extra=constrained("array", minItems=1, uniqueItems=True),
    )
    classes: list[int | str | bool] | None = Field(
        default=None,
        description="A classifier's label values, in output order (default: every value the label takes in the "
        "train channel; in stream mode, giving them saves reading the label column before training).",
        json_schema_extra=constrained("array", minItems=2, uniqueItems=True),
    )
    mode: Literal["file", "stream"] = Field(
        default="file",
        description="file: download and verify before training; stream (train, parquet): replica groups read "
        "row groups straight from S3 as they train.",
    )
    distribution: Literal["replicated", "sharded"] = Field(
        default="replicated",
        description="replicated: every group draws from the whole channel; sharded: each group trains on a "
        "disjoint share of its objects (or parquet row groups), reassigned when the number of groups changes.",
    )

    @field_validator("s3_uri")
    @classmethod
    def _s3_uri(cls, v: str) -> str:
        return check_s3_uri(v)

    @field_validator("features")
    @classmethod
    def _some_features(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError(
                "an empty list names no feature; list the feature columns, or leave it out for every numeric one"
            )
        if v is not None and len(set(v)) < len(v):
            raise ValueError(f"{sorted({c for c in v if v.count(c) > 1})} listed more than once; list each column once")
        return v

    @field_validator("classes")
    @classmethod
    def _distinct_classes(cls, v: list | None) -> list | None:
        if v is not None and len(v) < 2:
            raise ValueError(
                "a classifier needs two or more classes; list them all, or leave it out to take the train channel's"
            )
        if v is not None and len({(type(c), c) for c in v}) < len(v):
            raise ValueError("a class is listed more than once; list each label value once, in output order")
        return v

    @model_validator(mode="after")
    def _manifest_is_an_object(self) -> Channel:
        if self.s3_data_type == "manifest" and (self.s3_uri.endswith("/") or "/" not in self.s3_uri[5:]):
            raise ValueError(
                "s3_data_type manifest reads one object, and s3_uri names a bucket or prefix; set s3_uri to the "
                f"manifest's key, e.g. {self.s3_uri.rstrip('/')}/manifest.json"
            )
        return self


def _channel_names_schema(schema: dict[str, Any], _model: Any = None) -> None:
    titled(schema)
    schema["propertyNames"] = {"pattern": CHANNEL_NAME_PATTERN}


class Inputs(BaseModel):
    """The input channels: ``train``, optional ``validation``, and any others an entrypoint reads.

    A channel other than these two is staged and handed to the replica groups as a local folder named
    by ``TRAINYARD_CHANNEL_<NAME>`` (SageMaker's ``SM_CHANNEL_<NAME>``).
    """

    # _Model's settings, but for the extra channels (a plain model: _Model's validators are for its fields)
    model_config = ConfigDict(**{**_Model.model_config, "extra": "allow", "json_schema_extra": _channel_names_schema})
    __pydantic_extra__: dict[str, Channel]

    train: Channel = Field(description="The training channel.")
    validation: Channel | None = Field(default=None, description="Scored after every epoch; needed for val_* metrics.")

    @model_validator(mode="after")
    def _channel_names(self) -> Inputs:
        for name in self.__pydantic_extra__ or {}:
            if not re.fullmatch(CHANNEL_NAME_PATTERN, name):
                raise ValueError(f"channel name {name!r}: use lowercase letters, digits and underscores (up to 32)")
        return self


class Output(_Model):
    """Where the model and the job summary are written."""

    s3_uri: str = Field(
        description='"s3://bucket/prefix/"; the job writes under <prefix>/<job id>/.',
        json_schema_extra=constrained("string", pattern=S3_URI_PATTERN),
    )

    @field_validator("s3_uri")
    @classmethod
    def _s3_uri(cls, v: str) -> str:
        v = check_s3_uri(v)
        # S3 keeps "a/../b" as a key of its own, some endpoints refuse it (rclone), and a user reading the
        # outputs would look under b/: refused here, before the job trains, not at the upload after it.
        segments = v[len("s3://") :].rstrip("/").split("/")[1:]
        if any(part in ("", ".", "..") for part in segments):
            raise ValueError(f"{v!r} has an empty, '.' or '..' segment; write the prefix as the outputs should lie")
        return v
