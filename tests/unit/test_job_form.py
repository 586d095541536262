"""The job spec as the Prefect UI's form and the API's check see it: the deployment's parameter schema. Every field
is labelled; what the spec refuses by a pattern, a choice or a length, the schema refuses too (a form checks it
before a run is made, the API before it queues one); defaults are the ones that apply."""

from __future__ import annotations

import pytest

from tests.unit.specs import minimal
from trainyard.errors import SpecError
from trainyard.spec import DEFAULT_PRUNING, parse_job


@pytest.fixture(scope="module")
def schema() -> dict:
    from prefect.utilities.callables import parameter_schema

    from flows.training_pipeline import training_pipeline

    return parameter_schema(training_pipeline.fn).model_dump_for_openapi()


def _accepted(schema: dict, job: dict) -> bool:
    """Whether the API takes ``job`` as a deployment run's parameter (Prefect's own check, preprocessing and all)."""
    from prefect.utilities.schema_tools.validation import validate

    return not validate({"job": job}, schema, raise_on_error=False)


def _fields(schema: dict):
    """(where, name, field schema) of every property of every section."""
    for section, definition in schema["definitions"].items():
        for name, field in definition.get("properties", {}).items():
            yield section, name, field


def test_every_field_of_the_form_has_a_title_and_a_description(schema):
    untitled = [f"{section}.{name}" for section, name, field in _fields(schema) if "title" not in field]
    assert untitled == []  # a section's field was labelled by its type ("Channel", "Field (Optional)")
    undescribed = [f"{section}.{name}" for section, name, field in _fields(schema) if not field.get("description")]
    assert undescribed == []
    titles = {name: field["title"] for _, name, field in _fields(schema)}
    assert (titles["s3_uri"], titles["country_iso_code"], titles["pue"]) == ("S3 URI", "Country ISO code", "PUE")
    assert (titles["lr_schedule"], titles["supplier_g_per_kwh"]) == ("Learning-rate schedule", "Supplier g per kWh")


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"name": "churn mlp"}, "name"),
        ({"name": "a" * 64}, "name"),
        ({"inputs": {"train": {"s3_uri": "https://x/y", "label": "y"}}}, "s3_uri"),
        ({"output": {"s3_uri": "s3://Bucket/out/"}}, "s3_uri"),
        ({"algorithm": {"entrypoint": "not an entrypoint"}}, "entrypoint"),
        ({"carbon": {"country_iso_code": "XX"}}, "country_iso_code"),
        ({"registry": {"model_name": "a/b"}}, "model_name"),
        ({"hyperparameters": {"hidden_sizes": [0]}}, "hidden_sizes"),
        ({"inputs": {"train": {"s3_uri": "s3://bkt/t/", "label": "y", "features": []}}}, "features"),
        ({"inputs": {"train": {"s3_uri": "s3://bkt/t/", "label": "y", "classes": [1]}}}, "classes"),
        ({"resources": {"job_variables": {"gpu": 1}}}, "job_variables"),
        ({"resources": {"job_variables": None}}, "job_variables"),  # a form's empty field
        ({"elastic": {"fault_injection": None}}, "fault_injection"),
        ({"stopping": {"target_metric": {"name": "accuracy", "value": 0.9}}}, "target_metric"),
        ({"registry": {"promote_if": {"metric": "acc"}}}, "promote_if"),
    ],
)
def test_what_the_spec_refuses_by_its_form_the_form_refuses_too(schema, change, where):
    job = minimal(**change)
    with pytest.raises(SpecError, match=where):
        parse_job(job)
    assert not _accepted(schema, job)  # the schema took each, and the run failed as a worker started it


def test_an_extra_channels_name_is_checked_by_the_form_and_a_good_spec_passes_both(schema):
    job = minimal()
    job["inputs"]["Bad-Name"] = {"s3_uri": "s3://bkt/x/"}
    with pytest.raises(SpecError, match="channel name"):
        parse_job(job)
    assert not _accepted(schema, job)
    target = {"target_metric": {"name": "train_loss", "value": 0.1}}
    good = minimal(algorithm={"entrypoint": "pkg.models:build"}, carbon={"country_iso_code": "irl"}, stopping=target)
    good["inputs"]["extra_1"] = {"s3_uri": "s3://bkt/x/"}
    assert _accepted(schema, good) and parse_job(good)


def test_smart_siftings_names_are_taken_but_not_drawn_and_prunings_defaults_are_the_defaults(schema):
    sifting = schema["definitions"]["Sifting"]
    assert {"beta_value", "sift_delay"}.isdisjoint(sifting["properties"])  # the form drew each setting twice
    assert _accepted(schema, minimal(sifting={"enabled": True, "beta_value": 0.5, "sift_delay": 20}))
    assert not _accepted(schema, minimal(sifting={"beta_valu": 0.5}))
    pruning = schema["definitions"]["Pruning"]["properties"]
    assert {name: pruning[name]["default"] for name in DEFAULT_PRUNING} == DEFAULT_PRUNING  # the form's start
