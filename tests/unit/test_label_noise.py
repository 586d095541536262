"""sifting.noisy_share on a classifier's file-mode channel, the rule left unset: the filtering stage measures how
noisy the labels look (``label_noise``) and picks online sifting's rule, pruning for a noisy channel and the
proxy's top quarter for a clean one (``Sifting.adaptive``, ``Sifting.adapted``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.specs import minimal
from trainyard import filtering, label_noise
from trainyard.datasets import StagedData
from trainyard.spec import Prefilter, Sifting, parse_job
from trainyard.spec.pruning import DEFAULT_PRUNING


def blobs(flipped: float, rows: int = 1500, seed: int = 0):
    """Three well separated classes, ``flipped`` of the labels moved to another class, and 100 exact duplicates."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, rows)
    x = (rng.normal(size=(rows, 6)) + 6.0 * np.eye(3, 6)[y]).astype(np.float32)
    wrong = rng.random(rows) < flipped
    y[wrong] = (y[wrong] + rng.integers(1, 3, wrong.sum())) % 3
    twice = rng.choice(rows, 100, replace=False)
    return np.concatenate([x, x[twice]]), np.concatenate([y, y[twice]]).astype(np.int64)


def staged_blobs(tmp_path, flipped: float) -> StagedData:
    x, y = blobs(flipped)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    return StagedData(str(tmp_path / "train.npz"), None, {"num_outputs": 3}, {"train": len(x)}, [])


STREAMED = {"s3_uri": "s3://bkt/t/", "label": "y", "mode": "stream"}


def sifting_of(spec: dict, **job) -> Sifting:
    return parse_job(minimal(sifting=spec, **job)).sifting


@pytest.mark.parametrize("flipped", [0.0, 0.05, 0.2])
def test_the_share_above_chance_rises_with_the_labels_flipped(flipped):
    x, y = blobs(flipped)
    distinct = ~filtering.duplicates(x, y)
    measured = label_noise.estimate(x, y, distinct, Prefilter(), 3, 0.1)
    assert measured.rows == int(distinct.sum()) == 1500 and measured.flops > 0
    # a wrong label is found less likely than chance; a clean row of these classes almost never
    assert flipped * 0.8 <= measured.above_chance <= flipped + 0.03
    assert measured.noisy == (flipped > 0.1)


def test_a_large_channel_is_measured_on_a_sample_and_the_prefilter_then_scores_every_row(tmp_path, monkeypatch):
    monkeypatch.setattr(label_noise, "MEASURED_ROWS", 500)  # (20,000: a channel of 1,500 rows stands for a larger one)
    x, y = blobs(0.2)
    distinct = ~filtering.duplicates(x, y)
    measured = label_noise.estimate(x, y, distinct, Prefilter(), 3, 0.1)
    monkeypatch.undo()
    whole = label_noise.estimate(x, y, distinct, Prefilter(), 3, 0.1)
    assert (measured.rows, measured.distinct_rows, measured.losses) == (500, 1500, None)
    assert measured.noisy and 0.15 <= measured.above_chance <= 0.23  # the share, read on a third of the rows
    assert measured.flops < 0.5 * whole.flops  # the cost stops growing with the channel
    assert measured.to_dict()["distinct_rows"] == 1500 and "distinct_rows" not in whole.to_dict()
    # a clean channel's loss-based drops cannot reuse a sample's losses: the prefilter scores every row itself
    monkeypatch.setattr(label_noise, "MEASURED_ROWS", 500)
    drops = {"drop_learnt_fraction": 0.2, "drop_unlearnable_fraction": 0.02}
    report = filtering.filter_samples(staged_blobs(tmp_path, 0.0), sifting_of(PICK | {"prefilter": drops}))
    assert report.label_noise["rows"] == 500 and not report.label_noise["noisy"]
    x, y = blobs(0.0)
    alone = filtering.prefilter(x, y, Prefilter(**drops), "classification", 3, min_class_fraction=0.5)
    assert report.dropped == alone.dropped and report.scoring_flops == report.label_noise["flops"] + alone.flops


def test_too_few_rows_to_measure_count_as_noisy():
    x, y = blobs(0.0)
    measured = label_noise.estimate(x[:4], y[:4], np.ones(4, dtype=bool), Prefilter(), 3, 0.1)
    assert measured.above_chance is None and measured.noisy and measured.flops == 0


PICK = {"enabled": True, "noisy_share": 0.1}


def test_the_labels_pick_on_a_clean_channel_is_the_proxys_top_quarter(tmp_path):
    sifting = sifting_of(PICK)
    assert sifting.adaptive and sifting.beta == 0 and sifting.prune.learnt_fraction > 0  # pruning until measured
    report = filtering.filter_samples(staged_blobs(tmp_path, 0.0), sifting, "classification")
    chosen = report.sifting
    assert (chosen.beta, chosen.score, chosen.selection, chosen.prunes) == (3.0, "proxy", "top", False)
    assert chosen.delay_steps == 0  # the proxy's top selection ranks from its first step (Sifting.default_delay)
    assert not chosen.adaptive  # picked once
    assert report.label_noise["noisy"] is False and report.label_noise["above_chance"] < 0.1
    assert report.label_noise["online_rule"] == "the proxy's top 25% (beta 3, score proxy, selection top)"
    # which trains a quarter of each epoch's candidates: said, with the fix (the filtering stage logs it)
    assert report.label_noise["note"].startswith("each epoch trains 25% of its candidates")
    assert "raise hyperparameters.epochs" in report.label_noise["note"]
    assert report.label_noise["rows"] == 1500 and report.scoring_flops == report.label_noise["flops"] > 0
    # the keep rule's own default applies with it: exact duplicates out, no reference model trained again
    assert report.dropped == {"duplicate": 100} and report.kept == 1500
    assert "sifting" not in report.to_dict() and report.to_dict()["label_noise"] == report.label_noise


@pytest.mark.parametrize("hidden_sizes, proxy_picked", [([256, 256], True), ([16], False)])
def test_a_clean_channel_gets_the_proxy_only_if_it_is_far_cheaper_than_the_jobs_model(
    tmp_path, hidden_sizes, proxy_picked
):
    job = parse_job(minimal(sifting=PICK, hyperparameters={"hidden_sizes": hidden_sizes}))
    staged = staged_blobs(tmp_path, 0.0)
    report = filtering.filter_samples(staged, job.sifting, "classification", None, job.algorithm, job.hyperparameters)
    noise = report.label_noise
    assert noise["noisy"] is False and (report.sifting.score == "proxy") == proxy_picked
    if proxy_picked:  # six features: the proxy of 32 a two-hundredth of the model of 256 and 256
        assert noise["proxy_cost"] < 0.01 and noise["online_rule"].startswith("the proxy's top 25%")
    else:  # a model of 16 costs half the proxy of 32: pruning, which scores nothing, and the report says why
        assert noise["proxy_cost"] == pytest.approx(2.0, rel=0.05) and report.sifting.prunes
        assert noise["online_rule"].startswith("pruning (sifting.prune): the labels read clean, but the proxy's")
        assert "shrink sifting.proxy.hidden_sizes" in noise["online_rule"]


def test_a_measured_jobs_loss_based_drops_reuse_the_measures_reference_losses(tmp_path):
    staged = staged_blobs(tmp_path, 0.0)
    drops = {"drop_learnt_fraction": 0.2, "drop_unlearnable_fraction": 0.02}
    report = filtering.filter_samples(staged, sifting_of(PICK | {"prefilter": drops}), "classification")
    assert report.label_noise["noisy"] is False and report.dropped["learnt"] > 0 and report.dropped["unlearnable"] > 0
    # the reference models trained once: their FLOPs counted once, the drops those of the prefilter's own losses
    assert report.scoring_flops == report.label_noise["flops"] > 0
    x, y = blobs(0.0)
    alone = filtering.prefilter(x, y, Prefilter(**drops), "classification", 3, min_class_fraction=0.5)
    assert alone.dropped == report.dropped and alone.flops == report.scoring_flops


def test_the_labels_pick_on_a_noisy_channel_is_pruning(tmp_path):
    sifting = sifting_of(PICK)
    report = filtering.filter_samples(staged_blobs(tmp_path, 0.2), sifting, "classification")
    assert report.label_noise["noisy"] is True and not report.sifting.adaptive  # picked: not measured again
    assert "note" not in report.label_noise  # (pruning trains every epoch's rows but the pruned: nothing to say)
    # the same config, its delay (left open until the rule is known) now the keep rule's default
    assert report.sifting.model_dump() == sifting.model_dump() | {"delay_steps": 10} and sifting.delay_steps is None
    assert {k: getattr(report.sifting.prune, k) for k in DEFAULT_PRUNING} == DEFAULT_PRUNING
    assert report.dropped == {} and report.kept == 1600 and report.train_data.endswith("train.npz")


@pytest.mark.parametrize(
    "spec, job",
    [
        ({"enabled": True, "noisy_share": None}, {}),  # measuring off: pruning, nothing measured
        (PICK | {"beta": 0}, {}),  # pruning asked for
        (PICK | {"score": "proxy", "beta": 2}, {}),
        (PICK | {"prune": {"until": 0.8}}, {}),
        (PICK | {"reuse_loss_epochs": 0}, {}),
        (PICK | {"selection": "top"}, {}),
        (PICK | {"enabled": False}, {}),
        (PICK, {"algorithm": {"builtin": "linear-regression"}}),  # no chance level to tell noise by
    ],
)
def test_without_noisy_share_or_with_a_rule_given_nothing_is_measured(tmp_path, spec, job):
    sifting = sifting_of(spec, **job)
    assert not sifting.adaptive
    report = filtering.filter_samples(staged_blobs(tmp_path, 0.0), sifting, "classification")
    assert report.sifting is None and report.label_noise is None


def test_a_forms_empty_fields_and_defaults_still_leave_the_rule_to_the_labels():
    # the Prefect UI's form sends the fields it shows: an empty beta, score and selection at their defaults
    assert sifting_of(PICK | {"beta_value": None, "score": "loss", "selection": "keep_rule"}).adaptive
    assert not sifting_of(PICK, inputs={"train": STREAMED}).adaptive


def test_the_keep_rules_settings_serve_the_clean_pick_and_a_given_rules_noisy_share_is_named():
    from trainyard.spec import ignored_settings

    alone = parse_job(minimal(sifting=PICK | {"delay_steps": 3, "proxy": {"hidden_sizes": [16]}}))
    assert alone.sifting.adaptive and ignored_settings(alone) == []  # they apply if the labels read clean
    clean = alone.sifting.adapted(noisy=False)
    assert (clean.delay_steps, clean.proxy.hidden_sizes, clean.selection) == (3, [16], "top")  # what you set wins
    assert alone.sifting.adapted(noisy=True).delay_steps == 3
    # left unset (or empty, as a form sends it), the picked rule's default: 0 for the proxy's top, 10 for pruning's
    for unset in (PICK, PICK | {"delay_steps": None, "sift_delay": None}):
        sifting = parse_job(minimal(sifting=unset)).sifting
        assert (sifting.adapted(noisy=False).delay_steps, sifting.adapted(noisy=True).delay_steps) == (0, 10)
    # and the prefilter's reference settings are the measure's
    measured = parse_job(minimal(sifting=PICK | {"prefilter": {"reference_epochs": 5, "seed": 3}}))
    assert ignored_settings(measured) == []
    # the default share (0.1) where it cannot apply is not warned about; one given is
    assert ignored_settings(parse_job(minimal(sifting=PICK, algorithm={"builtin": "linear-regression"}))) == []
    regression = parse_job(minimal(sifting=PICK | {"noisy_share": 0.2}, algorithm={"builtin": "linear-regression"}))
    assert ignored_settings(regression) == [
        "sifting.noisy_share: nothing is measured, as a regression job's labels have no chance level to tell noise "
        "by; the rule is sifting's default or yours"
    ]
    given = parse_job(minimal(sifting={"enabled": True, "beta": 0, "delay_steps": 3, "noisy_share": 0.2}))
    warned = ignored_settings(given)
    assert any(w.startswith("sifting.delay_steps: settings of the keep rule") for w in warned)
    assert any(w.startswith("sifting.noisy_share: nothing is measured, as the rule is given") for w in warned)
