"""A misspelt field is named with the field it most likely meant, in every section, the section's own
names and smart sifting's aliases among them."""

from __future__ import annotations

from tests.unit.specs import minimal, problems


def test_an_unknown_field_in_any_section_names_the_closest_known_one():
    spec = minimal(
        inputs={"train": {"s3_uri": "s3://bkt/train/", "label": "y", "lable": "z"}},
        output={"s3_uri": "s3://bkt/out/", "s3uri": "s3://bkt/o/"},
        hyperparamters={"epochs": 3},
        sifting={"enabled": True, "beta_valeu": 1.0, "prefilter": {"enabeld": True}},
        carbon={"country_iso": "IRL"},
    )
    found = problems(spec)
    for line in (
        "inputs.train.lable: unknown field; did you mean label? remove it or fix its spelling",
        "output.s3uri: unknown field; did you mean s3_uri? remove it or fix its spelling",
        "hyperparamters: unknown field; did you mean hyperparameters? remove it or fix its spelling",
        "sifting.beta_valeu: unknown field; did you mean beta_value? remove it or fix its spelling",
        "sifting.prefilter.enabeld: unknown field; did you mean enabled? remove it or fix its spelling",
        "carbon.country_iso: unknown field; did you mean country_iso_code? remove it or fix its spelling",
    ):
        assert line in found, found
    # in a list's item, and in a channel beside train and validation
    drill = minimal(elastic={"fault_injection": [{"replica": 0, "at_stpe": 3, "kind": "kill"}]})
    assert "elastic.fault_injection.0.at_stpe: unknown field; did you mean at_step? remove it or fix its spelling" in (
        problems(drill)
    )
    side = {"train": {"s3_uri": "s3://bkt/train/", "label": "y"}, "extra": {"s3_uri": "s3://bkt/x/", "lable": "z"}}
    assert "inputs.extra.lable: unknown field; did you mean label? remove it or fix its spelling" in problems(
        minimal(algorithm={"entrypoint": "a.b:c"}, inputs=side)
    )
    # nothing close: no guess
    assert "output.colour: unknown field; remove it or fix its spelling" in problems(
        minimal(output={"s3_uri": "s3://bkt/out/", "colour": "red"})
    )


def test_a_capitalised_unknown_field_or_a_key_that_is_no_name_is_named_as_such():
    # "Label" and "S3_URI" look like the names pydantic gives the types it tried: they were taken for them
    found = problems(minimal(inputs={"train": {"s3_uri": "s3://bkt/train/", "label": "y", "Label": "z"}}))
    assert found == ["inputs.train.Label: unknown field; did you mean label? remove it or fix its spelling"]
    found = problems(minimal(output={"S3_URI": "s3://bkt/out/"}))
    assert "output.S3_URI: unknown field; did you mean s3_uri? remove it or fix its spelling" in found
    found = problems(minimal(algorithm={"entrypoint": "a.b:c"}, hyperparameters={None: 1}))
    assert found == [
        "hyperparameters: the key None is not a name (YAML reads null, true and numbers as values); quote it"
    ]
