"""The job spec: what it accepts, and how it names every problem with the field and the fix. The ``sifting``
section's own checks and defaults are ``test_spec_sifting.py``."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from tests.unit.specs import DESIGN_EXAMPLE, minimal, problems
from trainyard.cli import app
from trainyard.spec import TrainingJob, ignored_settings, load_job, parse_job


def test_design_example_parses(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(DESIGN_EXAMPLE)
    job = load_job(path)
    assert job.name == "churn-mlp"
    assert job.resources.max_replicas == 4
    assert job.elastic.fault_injection[0].kind == "kill"
    assert job.stopping.target_metric.value == 0.95
    assert job.carbon.country_iso_code == "IRL"
    assert job.model_name == "churn-mlp"


def test_defaults_fill_a_minimal_spec():
    job = parse_job(minimal())
    assert job.hyperparameters.epochs == 10 and job.hyperparameters.batch_size == 256
    assert job.resources.replicas == 1 and job.resources.max_replicas == 1
    assert job.algorithm.task == "classification"
    assert job.model_name == "j"


def test_every_problem_is_reported_with_its_field():
    found = problems(
        minimal(
            name="-bad_name",
            inputs={"train": {"s3_uri": "http://bkt/train/", "format": "xlsx", "label": "y"}},
            hyperparameters={"epochs": 0, "learning_rate": -1},
            colour="red",
        )
    )
    fields = [p.split(":")[0] for p in found]
    assert fields == sorted(fields, key=fields.index)  # stable order
    for field in (
        "name",
        "inputs.train.s3_uri",
        "inputs.train.format",
        "hyperparameters.epochs",
        "hyperparameters.learning_rate",
        "colour",
    ):
        assert field in fields, found
    assert any("s3://bucket/prefix/" in p for p in found)  # the fix is named
    assert any("remove it" in p for p in found if p.startswith("colour"))


def test_a_failing_field_a_whole_job_check_reads_is_not_judged_at_its_default():
    # batch_size 1024.5 dropped for its default 256 made sifting's draw check judge a batch the user never wrote
    found = problems(minimal(hyperparameters={"batch_size": 1024.5}, sifting={"enabled": True, "beta": 0.0015}))
    assert [p.split(":")[0] for p in found] == ["hyperparameters.batch_size"], found
    # nor when the failing place is the whole section holding it (an entrypoint's key MLflow would refuse)
    hp = {"batch_size": 1000, "dropout(p)": 0.1}
    found = problems(
        minimal(algorithm={"entrypoint": "m:build"}, hyperparameters=hp, sifting={"enabled": True, "beta": 0.001})
    )
    assert [p.split(":")[0] for p in found] == ["hyperparameters"], found


def test_missing_required_fields():
    found = problems({"name": "j"})
    assert "algorithm: required; add it" in found
    assert "inputs: required; add it" in found
    assert "output: required; add it" in found


def test_a_name_or_entrypoint_ending_in_a_newline_is_refused():
    # a pattern's `$` matches before a last newline too: a YAML `name: |` block passed, and the job id made of it
    # failed later with Prefect's traceback
    assert [p.split(":")[0] for p in problems(minimal(name="churn\n"))] == ["name"]
    assert any("package.module:function" in p for p in problems(minimal(algorithm={"entrypoint": "m:build\n"})))


def test_cross_field_checks_name_fields():
    found = problems(
        minimal(
            stopping={"target_metric": {"name": "val_accuracy", "value": 0.9}, "patience_epochs": 2},
            inputs={"train": {"s3_uri": "s3://bkt/train/"}},
        )
    )
    assert any(p.startswith("inputs.train.label:") for p in found)
    assert any(p.startswith("stopping.target_metric.name:") and "validation" in p for p in found)
    assert any(p.startswith("stopping.patience_epochs:") for p in found)


def test_a_whole_job_problem_is_one_line_with_its_fix():
    # the messages put "; " between the problem and the fix: that must not split one problem in two
    train = {"s3_uri": "s3://bkt/train/", "label": "y", "format": "csv", "mode": "stream"}
    found = problems(minimal(inputs={"train": train}, elastic={"fault_injection": [{"replica": 3, "at_step": 1}]}))
    assert len(found) == 2, found
    assert found[0].startswith("inputs.train.mode:") and found[0].endswith("use file"), found
    assert found[1].startswith("elastic.fault_injection.0.replica:"), found


def test_two_drills_on_one_group_at_one_step_are_refused():
    drills = [{"replica": 1, "at_step": 9}, {"replica": 0, "at_step": 9}, {"replica": 1, "at_step": 9, "kind": "term"}]
    found = problems(minimal(resources={"replicas": 2}, elastic={"fault_injection": drills}))
    assert found == [
        "elastic.fault_injection.2.at_step: group 1 already has a drill at step 9; give each of its drills its own step"
    ], found


def test_replica_bounds_and_algorithm_choice():
    assert any(
        "min_replicas <= replicas <= max_replicas" in p
        for p in problems(minimal(resources={"replicas": 3, "max_replicas": 2}))
    )
    assert any("exactly one" in p for p in problems(minimal(algorithm={})))
    assert any("package.module:function" in p for p in problems(minimal(algorithm={"entrypoint": "not an entry"})))
    assert any(
        "val_rmse is for regression" in p
        for p in problems(
            minimal(
                algorithm={"builtin": "mlp-classifier"},
                inputs={
                    "train": {"s3_uri": "s3://bkt/t/", "label": "y"},
                    "validation": {"s3_uri": "s3://bkt/v/", "label": "y"},
                },
                stopping={"target_metric": {"name": "val_rmse", "value": 1.0}},
            )
        )
    )


def test_regression_builtin_sets_task():
    assert parse_job(minimal(algorithm={"builtin": "linear-regression"})).algorithm.task == "regression"
    # a built-in's task is its own: a classifier asked for a regression is a contradiction, named
    assert problems(minimal(algorithm={"builtin": "mlp-classifier", "task": "regression"})) == [
        "algorithm: task: regression, but the built-in mlp-classifier is a classifier; use builtin linear-regression, "
        "or leave task out (a built-in implies it)"
    ]
    # classes on a regression's channel: read by no one, warned of
    channels = {"train": {"s3_uri": "s3://bkt/train/", "label": "y", "classes": [0, 1]}}
    job = parse_job(minimal(algorithm={"builtin": "linear-regression"}, inputs=channels))
    assert "inputs.train.classes: a classifier's; a regression's labels are numbers, read as they are" in (
        ignored_settings(job)
    )


def test_job_schema_has_descriptions_for_the_ui_form():
    schema = TrainingJob.model_json_schema()
    assert schema["properties"]["name"]["description"]
    channel = schema["$defs"]["Channel"]["properties"]
    assert all(prop.get("description") for prop in channel.values())


def test_an_extra_channel_cannot_be_sharded():
    extra = {"vocab": {"s3_uri": "s3://bkt/vocab/", "format": "raw", "distribution": "sharded"}}
    inputs = {"train": {"s3_uri": "s3://bkt/train/", "label": "y"}} | extra
    entrypoint = {"entrypoint": "pkg.models:build"}  # extra channels are for an entrypoint
    assert any(
        p.startswith("inputs.vocab.distribution:") for p in problems(minimal(inputs=inputs, algorithm=entrypoint))
    )
    inputs["vocab"]["distribution"] = "replicated"
    assert parse_job(minimal(inputs=inputs, algorithm=entrypoint)).channels()["vocab"].distribution == "replicated"


def test_an_extra_channel_with_a_built_in_algorithm_is_refused_and_a_near_miss_named():
    inputs = {
        "train": {"s3_uri": "s3://bkt/train/", "label": "y"},
        "validaton": {"s3_uri": "s3://bkt/v/", "label": "y"},
    }
    assert problems(minimal(inputs=inputs)) == [
        "inputs.validaton: built-in algorithms read only inputs.train and inputs.validation; did you mean "
        "inputs.validation? remove it, or rename it"
    ]
    job = parse_job(minimal(inputs=inputs, algorithm={"entrypoint": "pkg.models:build"}))
    assert ignored_settings(job) == [
        "inputs.validaton: as spelt, an extra channel for the entrypoint, not the validation set; rename it "
        "inputs.validation if that is what it is"
    ]


def test_problems_across_sections_are_named_with_a_failing_field_not_after_it_is_fixed():
    # pydantic skips the whole-job checks once a field fails; they run again without the failing fields
    no_label = {"train": {"s3_uri": "s3://bkt/train/"}}
    found = problems(minimal(name="Bad_Name", inputs=no_label, hyperparameters={"epochs": 0}))
    assert [p.split(":")[0] for p in found] == ["name", "hyperparameters.epochs", "inputs.train.label"], found
    # not when a failing field is one they read: its default would be judged (group 1 of "1 replica group")
    drill = {"fault_injection": [{"replica": 1, "at_step": 5}]}
    found = problems(minimal(resources={"replicas": 0}, elastic=drill, inputs=no_label))
    assert [p.split(":")[0] for p in found] == ["resources.replicas"], found
    # a whole-job problem alone is named once
    assert problems(minimal(stopping={"patience_epochs": 3})) == [
        "stopping.patience_epochs: needs a validation channel; add inputs.validation"
    ]
    # a required section missing: no default stands in for it, so nothing more is said
    assert problems({k: v for k, v in minimal(inputs=no_label).items() if k != "output"}) == [
        "output: required; add it"
    ]


def test_an_unknown_hyperparameter_of_a_built_in_is_refused_and_of_an_entrypoint_warned_of():
    typo = {"epochs": 2, "learnin_rate": 0.1, "dropout": 0.2}
    assert problems(minimal(hyperparameters=typo)) == [
        "hyperparameters.dropout: not a setting of the built-in mlp-classifier (other keys are passed to an "
        "entrypoint); remove it, or rename it",
        "hyperparameters.learnin_rate: not a setting of the built-in mlp-classifier (other keys are passed to an "
        "entrypoint); did you mean hyperparameters.learning_rate? remove it, or rename it",
    ]
    job = parse_job(minimal(hyperparameters=typo, algorithm={"entrypoint": "pkg.models:build"}))
    assert job.hyperparameters.model_extra == {"learnin_rate": 0.1, "dropout": 0.2}  # the entrypoint gets both
    assert ignored_settings(job) == [
        "hyperparameters.learnin_rate: passed to the entrypoint as spelt, while Trainyard reads "
        "hyperparameters.learning_rate (now 0.001); rename it if that is what it is"
    ]


def test_hyperparameters_nothing_reads_as_set_are_named_as_ignored():
    hp = {"momentum": 0.8, "min_lr_fraction": 0.1, "hidden_sizes": [8]}
    assert ignored_settings(parse_job(minimal(hyperparameters=hp, algorithm={"builtin": "linear-regression"}))) == [
        "hyperparameters.momentum: read by sgd only, not adam; set optimizer: sgd to use it",
        "hyperparameters.min_lr_fraction: the learning rate is constant; set lr_schedule: cosine or linear to "
        "decay to it",
        "hyperparameters.hidden_sizes: linear-regression has no hidden layers; remove it",
    ]
    read = hp | {"optimizer": "sgd", "lr_schedule": "cosine"}
    assert ignored_settings(parse_job(minimal(hyperparameters=read))) == []  # the MLP has hidden layers
    assert ignored_settings(parse_job(parse_job(minimal()).model_dump(mode="json"))) == []  # a full dump
    entrypoint = {"entrypoint": "pkg.models:build"}  # it gets every hyperparameter: momentum may be its own
    assert ignored_settings(parse_job(minimal(hyperparameters={"momentum": 0.8}, algorithm=entrypoint))) == []


def test_a_manifest_channel_must_name_the_manifest_object():
    for uri in ("s3://bkt", "s3://bkt/lists/"):
        train = {"s3_uri": uri, "label": "y", "s3_data_type": "manifest"}
        found = problems(minimal(inputs={"train": train}))
        assert any(p.startswith("inputs.train: s3_data_type manifest reads one object") for p in found), found
    assert parse_job(minimal(inputs={"train": {"s3_uri": "s3://bkt/m.json", "label": "y", "s3_data_type": "manifest"}}))


def test_infinite_or_nan_numbers_are_refused_by_field():
    for value in (float("inf"), float("nan")):
        found = problems(minimal(sifting={"enabled": True, "beta": value}, hyperparameters={"learning_rate": value}))
        assert any(p.startswith("sifting.beta:") for p in found), found
        assert any(p.startswith("hyperparameters.learning_rate:") for p in found), found


def test_empty_or_repeated_features_and_classes_are_refused():
    def train(**fields):
        return minimal(inputs={"train": {"s3_uri": "s3://bkt/t/", "label": "y", **fields}})

    assert any(p.startswith("inputs.train.features: an empty list") for p in problems(train(features=[])))
    assert any("['a'] listed more than once" in p for p in problems(train(features=["a", "b", "a"])))
    assert any(
        p.startswith("inputs.train.classes: a class is listed more than once")
        for p in problems(train(classes=[0, 1, 0]))
    )
    assert any("two or more classes" in p for p in problems(train(classes=["only"])))
    assert parse_job(train(classes=[0, 1], features=["a", "b"]))


def test_settings_of_a_stage_that_is_off_are_named_as_ignored(tmp_path):
    assert ignored_settings(parse_job(minimal(sifting={"enabled": True, "beta": 2}))) == []
    ignored = ignored_settings(parse_job(minimal(sifting={"beta": 0.5, "delay_steps": 3})))
    assert ignored == [
        "sifting.beta, sifting.delay_steps: online sifting is off; set sifting.enabled: true to use them"
    ]
    # a job submitted to a deployment arrives as a full dump: every field set, none tuned
    assert ignored_settings(parse_job(parse_job(minimal()).model_dump(mode="json"))) == []
    off = minimal(sifting={"enabled": True, "prefilter": {"enabled": False, "drop_learnt_fraction": 0.2}})
    assert ignored_settings(parse_job(off)) == [
        "sifting.prefilter.drop_learnt_fraction: the prefilter is off; set sifting.prefilter.enabled: true to use them"
    ]
    # sifting on by default (pruning alone) leaves the prefilter unset and off: its switch is named, not sifting's
    champion = minimal(sifting={"enabled": True, "prefilter": {"reference": "champion"}})
    assert ignored_settings(parse_job(champion)) == [
        "sifting.prefilter.reference: the prefilter is off; set sifting.prefilter.enabled: true to use them"
    ]
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(minimal(sifting={"beta": 0.5})))
    result = CliRunner().invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0 and "warning: sifting.beta" in result.output


def test_a_train_loss_target_needs_a_single_replica_group():
    target = {"target_metric": {"name": "train_loss", "value": 0.3}}
    found = problems(minimal(stopping=target, resources={"replicas": 2}))
    assert found == [
        "stopping.target_metric.name: train_loss is each replica group's own, so groups would stop at different "
        "epochs; use val_loss (with inputs.validation), or one replica group (max_replicas: 1)"
    ]
    assert parse_job(minimal(stopping=target, resources={"replicas": 1})).stopping.target_metric.name == "train_loss"


@pytest.mark.parametrize("uri", ["s3://bkt/team-a/../team-b/", "s3://bkt/a//b/", "s3://bkt/./out"])
def test_an_output_prefix_with_dot_or_empty_segments_is_refused(uri):
    assert problems(minimal(output={"s3_uri": uri})) == [
        f"output.s3_uri: {uri!r} has an empty, '.' or '..' segment; write the prefix as the outputs should lie"
    ]
    parse_job(minimal(output={"s3_uri": "s3://bkt/team-a/out"}))  # one without is taken


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"hyperparameters": {"epochs": True}}, "hyperparameters.epochs: true is not a number; give a number"),
        ({"resources": {"replicas": True}}, "resources.replicas: true is not a number"),
        ({"hyperparameters": {"hidden_sizes": [64, True]}}, "hyperparameters.hidden_sizes: item 1 (true) is not a"),
        ({"sifting": {"prefilter": {"reference_hidden_sizes": [False]}}}, "reference_hidden_sizes: item 0 (false)"),
        ({"resources": {"max_replicas": 100}}, "resources.max_replicas: Input should be less than or equal to 64"),
        ({"resources": {"replicas": 2, "min_replicas": 3}}, "got 3 <= 2 <= 2; lower min_replicas or raise replicas"),
        (
            {"resources": {"job_variables": {"imagee": "x"}}},
            "imagee: not a variable of Trainyard's pool templates; did you",
        ),
        (
            {"resources": {"job_variables": {"env": {"TRAINYARD_TORCH_THREADS": "zero"}}}},
            "resources.job_variables: env: TRAINYARD_TORCH_THREADS='zero' is not a whole number of at least 1",
        ),
        (
            {"resources": {"job_variables": {"env": ["A=1"]}}},
            "resources.job_variables: env: ['A=1'] is a list, not a mapping",
        ),
        ({"hyperparameters": {"seed": 1_700_000_000_000_000}}, "hyperparameters.seed: Input should be less than or"),
        (
            {"sifting": {"prefilter": {"seed": -3}}},
            "sifting.prefilter.seed: Input should be greater than or equal to 0",
        ),
        ({"registry": {"model_name": "team/churn"}}, "registry.model_name: 'team/churn': use letters, digits"),
        ({"registry": {"model_name": "churn's"}}, 'registry.model_name: "churn\'s": use letters'),
        (
            {"stopping": {"target_metric": {"name": "val_accuracy", "value": 95}}},
            "stopping.target_metric: value 95: val_accuracy is a fraction of the validation rows; write 0.95 for 95%",
        ),
        ({"stopping": {"target_metric": {"name": "val_loss", "value": -1}}}, "val_loss is never below 0"),
    ],
)
def test_values_that_would_fail_after_compute_or_never_be_met_are_refused_by_field(changes, says):
    assert any(says in p for p in problems(minimal(**changes))), problems(minimal(**changes))


def test_channels_whose_settings_would_be_ignored_or_read_wrongly_are_refused():
    train = {"s3_uri": "s3://bkt/train/", "label": "y", "features": ["a", "y"]}
    assert "inputs.train.features: lists the label 'y', which the model would then be given as an input" in " ".join(
        problems(minimal(inputs={"train": train}))
    )
    train = {"s3_uri": "s3://bkt/train/", "label": "y", "features": ["a"], "classes": [0, 1]}
    validation = {"s3_uri": "s3://bkt/val/", "label": "z", "classes": [0, 1], "features": ["b"]}
    found = problems(minimal(inputs={"train": train, "validation": validation}))
    assert any(p.startswith("inputs.validation.label: 'z', but the train channel's is 'y'") for p in found)
    assert any(p.startswith("inputs.validation.features: the validation channel is read with the train") for p in found)
    assert not any(p.startswith("inputs.validation.classes") for p in found)  # the same as train's
    same = {"s3_uri": "s3://bkt/val/", "label": "y", "features": ["a"]}
    assert parse_job(minimal(inputs={"train": train, "validation": same})).inputs.validation.label == "y"
    # outputs under an input prefix: the next job would read model.pt and summary.json as training data
    found = problems(minimal(output={"s3_uri": "s3://bkt/train/runs/"}))
    assert found == [
        "output.s3_uri: s3://bkt/train/runs/ is inside inputs.train.s3_uri (s3://bkt/train/), so later jobs would read "
        "this job's outputs as that channel's data; write the outputs under another prefix"
    ]
    assert parse_job(minimal(output={"s3_uri": "s3://bkt/train-out/"})).output.s3_uri == "s3://bkt/train-out/"
    # an input written without its slash lists the prefix of that name (or the whole bucket): outputs under it too
    for uri in ("s3://bkt/train", "s3://bkt"):
        channels = {"train": {"s3_uri": uri, "label": "y"}}
        found = problems(minimal(inputs=channels, output={"s3_uri": "s3://bkt/train/runs/"}))
        assert found == [
            f"output.s3_uri: s3://bkt/train/runs/ is inside inputs.train.s3_uri ({uri}), so later jobs would read "
            "this job's outputs as that channel's data; write the outputs under another prefix"
        ]
    channels = {"train": {"s3_uri": "s3://bkt/train", "label": "y"}}
    parse_job(minimal(inputs=channels, output={"s3_uri": "s3://bkt/train-out/"}))


def test_a_value_of_none_of_a_fields_types_is_one_problem_naming_them():
    found = problems(
        minimal(
            inputs={"train": {"s3_uri": "s3://bkt/train/", "label": "y", "classes": [1.5, 2]}},
            stopping={"target_metric": 0.95},
            sifting={"prune": {"hardest_min_loss": "foo"}},
        )
    )
    assert found == [
        "inputs.train.classes.0: give a whole number, text or true or false (got 1.5)",
        "sifting.prune.hardest_min_loss: give a number or 'chance' (got 'foo')",
        "stopping.target_metric: a section: give its fields as a mapping, e.g. {field: value} (got 0.95)",
    ]
