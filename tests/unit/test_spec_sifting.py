"""The job spec's ``sifting`` section: what it refuses (settings that cannot work on the job's channel),
smart sifting's own names, and what ``sifting.enabled: true`` alone turns on."""

from __future__ import annotations

import pytest

from tests.unit.specs import minimal, problems
from trainyard.spec import parse_job


def test_reducible_loss_sifting_needs_the_prefilters_reference_losses():
    streamed = {"train": {"s3_uri": "s3://bkt/train/", "label": "y", "mode": "stream", "format": "parquet"}}
    found = problems(minimal(inputs=streamed, sifting={"enabled": True, "score": "reducible_loss"}))
    assert any(p.startswith("sifting.score:") and "inputs.train.mode: file" in p for p in found)
    off = {"enabled": True, "beta": 1, "score": "reducible_loss", "prefilter": {"enabled": False}}
    assert any(p.startswith("sifting.score:") and "prefilter.enabled" in p for p in problems(minimal(sifting=off)))
    assert parse_job(minimal(sifting={"enabled": True, "score": "reducible_loss"})).sifting.score == "reducible_loss"
    assert any(p.startswith("sifting.score") for p in problems(minimal(sifting={"enabled": True, "score": "rho"})))


def test_reusing_losses_needs_the_rows_in_memory():
    streamed = {"train": {"s3_uri": "s3://bkt/train/", "label": "y", "mode": "stream", "format": "parquet"}}
    found = problems(minimal(inputs=streamed, sifting={"enabled": True, "reuse_loss_epochs": 2}))
    assert any(p.startswith("sifting.reuse_loss_epochs:") and "inputs.train.mode: file" in p for p in found)
    assert parse_job(minimal(inputs=streamed, sifting={"enabled": True, "reuse_loss_epochs": 0})).sifting.enabled
    # Left unset: the benchmark's best (1) where the rows are in memory, 0 for a streamed channel, no error.
    assert parse_job(minimal(sifting={"enabled": True})).sifting.loss_reuse_epochs(streamed=False) == 1
    assert parse_job(minimal(inputs=streamed, sifting={"enabled": True})).sifting.loss_reuse_epochs(streamed=True) == 0
    assert parse_job(minimal(sifting={"enabled": True, "reuse_loss_epochs": 2})).sifting.reuse_loss_epochs == 2
    assert any(p.startswith("sifting.reuse_loss_epochs") for p in problems(minimal(sifting={"reuse_loss_epochs": -1})))


def test_prefilter_settings_that_cannot_work_are_refused():
    both = {"enabled": True, "prefilter": {"drop_learnt_fraction": 0.6, "drop_unlearnable_fraction": 0.4}}
    assert any(p.startswith("sifting.prefilter:") and "every row" in p for p in problems(minimal(sifting=both)))
    streamed = {"train": {"s3_uri": "s3://bkt/train/", "label": "y", "mode": "stream", "format": "parquet"}}
    asked = {"enabled": True, "prefilter": {"drop_unlearnable_fraction": 0.1}}
    found = problems(minimal(inputs=streamed, sifting=asked))
    assert any(p.startswith("sifting.prefilter:") and "inputs.train.mode: file" in p for p in found)
    assert parse_job(minimal(inputs=streamed, sifting={"enabled": True})).sifting.enabled  # unset: not run, no error


@pytest.mark.parametrize("beta, batch_size", [(0.01, 32), (0.2, 2), (0.4, 1)])
def test_a_beta_too_small_to_pass_any_candidate_over_is_refused(beta, batch_size):
    # round(batch_size * (1 + beta)) candidates for batch_size kept: every step scored, nothing passed over
    job = minimal(sifting={"enabled": True, "beta": beta}, hyperparameters={"batch_size": batch_size})
    (problem,) = problems(job)
    assert problem.startswith(f"sifting.beta: {beta:g} draws round(") and "every scoring pass is wasted" in problem
    hint = float(problem.split("raise sifting.beta to at least ")[1].split()[0])
    raised = minimal(sifting={"enabled": True, "beta": hint}, hyperparameters={"batch_size": batch_size})
    assert parse_job(raised).sifting.beta == hint  # the least beta it names passes a candidate over


def test_smart_siftings_own_names_are_accepted_and_named_in_errors():
    sifting = parse_job(minimal(sifting={"enabled": True, "beta_value": 0.5, "sift_delay": 1000})).sifting
    assert (sifting.beta, sifting.delay_steps) == (0.5, 1000)
    assert parse_job(minimal(sifting={"beta": 2})).sifting.beta == 2  # our own names, as before
    assert any(p.startswith("sifting.beta_value:") for p in problems(minimal(sifting={"beta_value": -1})))
    both = problems(minimal(sifting={"beta": 1, "beta_value": 2}))  # one knob, given twice
    assert any(p.startswith("sifting:") and "beta and beta_value are one setting" in p for p in both)


def test_the_proxys_top_selection_starts_at_once_unless_a_delay_is_given():
    # the delay warms the keep rule's history of losses; the proxy's top selection ranks each step's candidates among
    # themselves (stop 51: the delay cost the proxy's top quarter 0.58x -> 0.78x the baseline's FLOPs on digits)
    from trainyard.spec import ignored_settings

    top = {"enabled": True, "beta": 3, "score": "proxy", "selection": "top"}
    job = parse_job(minimal(sifting=top))
    assert job.sifting.delay_steps == 0
    assert parse_job(job.model_dump(mode="json")).sifting.delay_steps == 0  # as a deployment receives it
    assert parse_job(minimal(sifting=top | {"delay_steps": None})).sifting.delay_steps == 0  # a form's empty field
    assert parse_job(minimal(sifting=top | {"delay_steps": 10})).sifting.delay_steps == 10  # given: kept
    assert parse_job(minimal(sifting=top | {"sift_delay": 4})).sifting.delay_steps == 4  # smart sifting's name
    assert parse_job(minimal(sifting=top | {"selection": "keep_rule"})).sifting.delay_steps == 10
    assert parse_job(minimal(sifting=top | {"score": "loss"})).sifting.delay_steps == 10  # (measured for the proxy)
    assert parse_job(minimal(sifting={"enabled": True, "beta": 1})).sifting.delay_steps == 10
    # with the keep rule off (beta 0) the delay is not a setting anyone gave: no warning of it
    for off in ({"enabled": True, "score": "proxy", "selection": "top"}, {"enabled": True}):
        assert not any("delay_steps" in w for w in ignored_settings(parse_job(minimal(sifting=off))))
    given = parse_job(minimal(sifting={"enabled": True, "score": "proxy", "selection": "top", "delay_steps": 10}))
    assert any(w.startswith("sifting.delay_steps, sifting.score") for w in ignored_settings(given))


def test_sifting_enabled_alone_turns_on_the_benchmarks_best_combination():
    # benchmarks/sifting.py's pick at stops 28-33, 35 and 36 (the most targets met by its medians on the tuning seeds):
    # pruning alone, no keep rule and no prefilter, a third of the steps in the pruning epochs
    job = parse_job(minimal(sifting={"enabled": True}))
    sifting = job.sifting
    assert sifting.beta == 0 and not sifting.prefilter_on
    prune = sifting.prune
    assert (prune.learnt_fraction, prune.hardest_fraction, prune.batch_factor) == (0.7, 0.1, 3.0)
    assert (prune.hardest_after, prune.until, prune.hardest_min_loss) == (0.25, 0.875, "chance")
    # (the delay waits for the rule the labels pick: 0 for the proxy's top quarter, 10 for pruning)
    assert (sifting.loss_history_length, sifting.delay_steps, sifting.min_class_fraction) == (500, None, 0.5)
    assert (sifting.adapted(noisy=False).delay_steps, sifting.adapted(noisy=True).delay_steps) == (0, 10)
    assert sifting.score == "loss"
    # reducible-loss scoring with no keep rule to rank by it is ignored (with a warning), and no prefilter comes of it
    ignored = parse_job(minimal(sifting={"enabled": True, "score": "reducible_loss"})).sifting
    assert ignored.beta == 0 and not ignored.by_reducible_loss and not ignored.prefilter_on
    # the spec dumped whole states the noisy channel's rule (pruning): resolved again, it is that rule, not measured
    assert parse_job(job.model_dump(mode="json")).sifting == sifting.adapted(noisy=True)
    # since stop 52 the labels pick the rule (sifting.noisy_share's default, 0.1: benchmarks/sifting.py's pick); the
    # pruning above is the noisy channel's rule, and the whole rule with noisy_share turned off (null)
    assert sifting.adaptive and sifting.noisy_share == 0.1
    unmeasured = parse_job(minimal(sifting={"enabled": True, "noisy_share": None})).sifting
    assert not unmeasured.adaptive and unmeasured.beta == 0 and unmeasured.prune == sifting.prune
    # a spec dumped whole states pruning: the rule is no longer the labels' to pick (client.submit sends it as written)
    picked = parse_job(minimal(sifting={"enabled": True, "noisy_share": 0.1})).sifting
    assert picked.adaptive and not parse_job(minimal(sifting=picked.model_dump(mode="json"))).sifting.adaptive
    # a streamed channel cannot prune: smart sifting's keep rule at beta 1, every candidate scored, no error
    streamed = {"train": {"s3_uri": "s3://bkt/train/", "label": "y", "mode": "stream", "format": "parquet"}}
    sifting = parse_job(minimal(inputs=streamed, sifting={"enabled": True})).sifting
    assert sifting.beta == 1 and not sifting.prune.active and sifting.loss_reuse_epochs(streamed=True) == 0
    # the keep rule asked for keeps its own default (the stop 16-24 pick): duplicates prefilter, losses reused
    # one epoch, and no pruning (the keep rule followed by pruning missed the targets at stop 27)
    sifting = parse_job(minimal(sifting={"enabled": True, "beta": 1})).sifting
    assert not sifting.prune.active and sifting.prefilter_on and sifting.loss_reuse_epochs(streamed=False) == 1
    prefilter = sifting.prefilter
    assert (prefilter.drop_learnt_fraction, prefilter.drop_unlearnable_fraction) == (0.0, 0.0)  # duplicates only
    assert prefilter.min_class_fraction == 0.5
    # pruning set by hand tunes the default combination (what it leaves out keeps the default's values, as a form
    # shows them: `prune: {until: 0.8}` prunes); beta 0 set by hand gets the default pruning
    given = parse_job(minimal(sifting={"enabled": True, "prune": {"learnt_fraction": 0.5}})).sifting
    assert given.beta == 0 and (given.prune.learnt_fraction, given.prune.batch_factor) == (0.5, 3.0)
    until = parse_job(minimal(sifting={"enabled": True, "prune": {"until": 0.8}})).sifting.prune
    assert (until.learnt_fraction, until.hardest_fraction, until.batch_factor, until.until) == (0.7, 0.1, 3.0, 0.8)
    assert parse_job(minimal(sifting={"enabled": True, "prune": {"until": 0.8}})).sifting.prunes
    assert parse_job(minimal(sifting={"enabled": True, "beta": 0})).sifting.prune.batch_factor == 3.0
    # a regressor has no chance-level loss to tell a wrong label by: InfoBatch's rule alone, no hardest rows out
    regressor = parse_job(minimal(algorithm={"builtin": "linear-regression"}, sifting={"enabled": True})).sifting
    prune = regressor.prune
    assert (prune.learnt_fraction, prune.hardest_fraction, prune.batch_factor) == (0.7, 0.0, 3.0)
    regressor_given = {"enabled": True, "prune": {"until": 0.8}}
    prune = parse_job(minimal(algorithm={"builtin": "linear-regression"}, sifting=regressor_given)).sifting.prune
    assert (prune.hardest_fraction, prune.until) == (0.0, 0.8)  # unless it sets hardest_fraction itself
    # the keep rule on (beta above 0) and prune left out: no pruning, stated in full (the defaults now prune)
    off = parse_job(minimal(sifting={"enabled": True, "beta": 1})).sifting.prune
    assert (off.learnt_fraction, off.hardest_fraction, off.batch_factor) == (0.0, 0.0, 1.0)
    # sifting off: nothing resolved, nothing reported as set
    assert parse_job(minimal()).sifting.beta is None and parse_job(minimal()).sifting.prune is None


def test_the_prefilters_reference_widths_are_checked():
    found = problems(minimal(sifting={"enabled": True, "prefilter": {"reference_hidden_sizes": [0]}}))
    assert found == [
        "sifting.prefilter.reference_hidden_sizes: every hidden size must be a positive integer, e.g. [128, 128]"
    ]


def test_keep_rule_settings_with_the_keep_rule_off_are_warned_of_and_train_no_reference_model():
    from trainyard import filtering
    from trainyard.spec import ignored_settings

    # sifting.enabled alone on a file-mode channel is pruning alone (beta 0): the keep rule ranks nothing
    job = parse_job(minimal(sifting={"enabled": True, "score": "reducible_loss", "delay_steps": 5}))
    (warning,) = [w for w in ignored_settings(job) if w.startswith("sifting.")]
    assert warning.startswith("sifting.delay_steps, sifting.score: settings of the keep rule, which is off")
    assert not filtering.needs_reference(job.sifting)  # reference models for a score nothing reads: not trained
    keeping = parse_job(minimal(sifting={"enabled": True, "beta": 1, "score": "reducible_loss", "delay_steps": 5}))
    assert not [w for w in ignored_settings(keeping) if w.startswith("sifting.")]
    assert filtering.needs_reference(keeping.sifting)


def test_sifting_that_leaves_no_row_out_is_warned_of():
    from trainyard.spec import ignored_settings

    def warned(sifting: dict, **spec) -> list[str]:
        job = parse_job(minimal(sifting={"enabled": True} | sifting, **spec))
        return [w for w in ignored_settings(job) if w.startswith("sifting.enabled")]

    inert = warned({"beta": 0, "prune": {"learnt_fraction": 0, "hardest_fraction": 0}})
    assert inert == [
        "sifting.enabled: with beta 0 and no pruning, no row is filtered; set sifting.beta above 0, or "
        "sifting.prune.learnt_fraction or hardest_fraction above 0"
    ]
    streamed = {"train": {"s3_uri": "s3://bkt/train/", "label": "y", "mode": "stream", "format": "parquet"}}
    assert warned({"beta": 0}, inputs=streamed) == [
        "sifting.enabled: with beta 0 and no pruning, no row is filtered; a streamed channel cannot prune: set "
        "sifting.beta above 0"
    ]
    assert warned({}) == warned({"beta": 0}) == warned({"prune": {"until": 0.8}}) == warned({"beta": 1}) == []
    # beside the keep rule, a prune given in part: what it leaves out is named (it meant off before 2026-12-06)
    job = parse_job(minimal(sifting={"enabled": True, "beta": 1, "prune": {"hardest_fraction": 0.1}}))
    assert [w for w in ignored_settings(job) if w.startswith("sifting.prune")] == [
        "sifting.prune: left out, learnt_fraction 0.7, batch_factor 3 are the default pruning's, beside the keep "
        "rule (beta 1); give them (0 turns that part off) if that is not what you meant"
    ]


def test_smart_sifting_names_pass_a_deployments_parameter_schema_as_they_pass_the_spec():
    import jsonschema
    from prefect.utilities.callables import parameter_schema

    from flows.training_pipeline import training_pipeline

    # what Prefect checks a REST or UI run's parameters against, before the flow's own validation
    schema = parameter_schema(training_pipeline.fn).model_dump_for_openapi()
    job = minimal(sifting={"enabled": True, "beta_value": 0.5, "sift_delay": 20})
    jsonschema.validate({"job": job}, schema)  # refused before: "'beta_value' ... were unexpected"
    assert parse_job(job).sifting.delay_steps == 20
    with pytest.raises(jsonschema.ValidationError, match="beta_valu"):
        jsonschema.validate({"job": minimal(sifting={"beta_valu": 0.5})}, schema)
    # a form's empty alias field is not a second value for the setting
    assert parse_job(minimal(sifting={"beta": 1, "beta_value": None})).sifting.beta == 1


def test_the_summary_names_no_ranking_where_the_keep_rule_is_off():
    from trainyard.status import sifting_section

    pruning = parse_job(minimal(sifting={"enabled": True}))  # the default: pruning alone, beta 0
    section = sifting_section(pruning, None, None)
    assert pruning.sifting.beta == 0 and (section["score"], section["selection"]) == (None, None)
    proxy = parse_job(minimal(sifting={"enabled": True, "beta": 2, "score": "proxy", "selection": "top"}))
    section = sifting_section(proxy, None, None)
    assert (section["score"], section["selection"]) == ("proxy", "top")
