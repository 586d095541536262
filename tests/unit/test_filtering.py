"""The offline prefilter: planted duplicates and wrong labels go, clean rows mostly stay."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from trainyard import filtering, reference_losses
from trainyard.datasets import StagedData
from trainyard.errors import DataError
from trainyard.spec import Prefilter, Sifting

LOSS_BASED = Prefilter(enabled=True, drop_learnt_fraction=0.2, drop_unlearnable_fraction=0.05)


def noisy_blobs(rows: int = 2000, seed: int = 0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, rows)
    x = (rng.normal(size=(rows, 6)) + 2.5 * np.eye(3, 6)[y]).astype(np.float32)
    dup_of = rng.choice(rows, 100, replace=False)
    x, y = np.concatenate([x, x[dup_of]]), np.concatenate([y, y[dup_of]])  # 100 planted duplicates at the end
    flipped = rng.choice(np.setdiff1d(np.arange(rows), dup_of), 100, replace=False)  # originals stay exact
    y[flipped] = (y[flipped] + rng.integers(1, 3, 100)) % 3  # 100 planted wrong labels
    return x, y.astype(np.int64), flipped


def test_duplicates_and_wrong_labels_are_dropped_far_more_often_than_clean_rows():
    x, y, flipped = noisy_blobs()
    result = filtering.prefilter(x, y, LOSS_BASED, "classification", 3)
    keep, dropped, flops = result.keep, result.dropped, result.flops
    duplicates = np.arange(2000, 2100)
    clean = np.setdiff1d(np.arange(2000), flipped)
    assert dropped["duplicate"] >= 100 and not keep[duplicates].any()
    mislabelled_dropped = 1 - keep[flipped].mean()
    clean_dropped = 1 - keep[clean].mean()
    assert mislabelled_dropped > 0.6 and clean_dropped < 0.25
    assert mislabelled_dropped > 3 * clean_dropped
    assert dropped["learnt"] + dropped["unlearnable"] + dropped["duplicate"] == (~keep).sum()
    assert flops > 0  # the reference models' training and scoring are counted


def test_the_class_balance_guard_keeps_a_class_of_easy_rows_from_being_dropped_as_learnt(tmp_path):
    # Class 2 is 10% of the rows and far from the others: every one of its rows has a low held-out
    # loss, so dropping the lowest 20% as "learnt" would take nearly all of it.
    rng = np.random.default_rng(4)
    y = np.concatenate([rng.integers(0, 2, 2700), np.full(300, 2)])
    x = (rng.normal(size=(3000, 6)) + np.array([0.7, 0.7, 8.0])[y, None] * np.eye(3, 6)[y]).astype(np.float32)
    config = Prefilter(enabled=True, drop_learnt_fraction=0.2, reference_epochs=10)
    unguarded = filtering.prefilter(x, y, config, "classification", 3)
    assert unguarded.keep[y == 2].sum() < 60 and unguarded.kept_for_balance == 0  # what the guard is for
    guarded = filtering.prefilter(x, y, config, "classification", 3, min_class_fraction=0.5)
    # the floor: half of class 2's proportional share of the rows kept (those given back included: 2,474)
    assert guarded.keep[y == 2].sum() == math.ceil(0.5 * guarded.keep.sum() * 300 / 3000) == 124
    assert guarded.kept_for_balance == guarded.keep[y == 2].sum() - unguarded.keep[y == 2].sum()
    assert guarded.dropped["learnt"] == 600 - guarded.kept_for_balance
    assert (guarded.keep[y < 2] == unguarded.keep[y < 2]).all()  # the other classes' drops are as they were
    # those given back are class 2's rows nearest the kept band: its highest losses among the dropped
    back = guarded.keep & ~unguarded.keep
    assert guarded.losses[back].min() >= guarded.losses[(y == 2) & ~guarded.keep].max()
    # the stage applies the job's guard (sifting.prefilter.min_class_fraction, default 0.5) and reports it
    np.savez(tmp_path / "train.npz", x=x, y=y)
    staged = StagedData(str(tmp_path / "train.npz"), None, {"num_outputs": 3}, {"train": 3000}, [])
    report = filtering.filter_samples(staged, Sifting(prefilter=config), "classification")
    assert report.kept_for_balance == guarded.kept_for_balance and report.to_dict()["kept_for_balance"] > 0


def test_the_stage_writes_a_filtered_training_file_and_its_layout(tmp_path):
    x, y, _ = noisy_blobs(rows=400)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    layout = [{"id": "s3://bkt/a", "start": 0, "end": 250, "row_groups": [250]}]
    layout.append({"id": "s3://bkt/b", "start": 250, "end": 500, "row_groups": [250]})
    staged = StagedData(str(tmp_path / "train.npz"), None, {"num_outputs": 3}, {"train": 500}, layout)
    off = filtering.filter_samples(staged, Sifting(), "classification")
    assert off.train_data == staged.train_data and off.kept == 500 and off.train_layout is None
    report = filtering.filter_samples(staged, Sifting(prefilter=LOSS_BASED), "classification")
    kept = np.load(report.train_data)
    assert len(kept["x"]) == report.kept == 500 - sum(report.dropped.values())
    assert report.train_layout[-1]["end"] == report.kept and report.train_layout[0]["start"] == 0
    assert report.to_dict()["kept_fraction"] == report.kept / 500
    # the filtered manifest: per object, which rows went and why, numbered within the object
    manifest = json.loads(Path(report.manifest).read_text())
    assert manifest["digest"] == report.manifest_digest and manifest["train_data"] == report.train_data
    a, b = manifest["objects"]
    assert (a["id"], a["rows"], b["id"], b["rows"]) == ("s3://bkt/a", 250, "s3://bkt/b", 250)
    assert a["dropped"]["duplicate"] == [] and b["dropped"]["duplicate"] == list(range(150, 250))  # the planted ones
    assert {k: len(a["dropped"][k]) + len(b["dropped"][k]) for k in report.dropped} == report.dropped
    starts = {"s3://bkt/a": 0, "s3://bkt/b": 250}
    gone = {starts[o["id"]] + i for o in (a, b) for rows in o["dropped"].values() for i in rows}
    assert len(gone) == 500 - report.kept == 500 - a["kept"] - b["kept"]  # each dropped row once, for one reason
    source = np.load(staged.train_data)["x"]
    np.testing.assert_array_equal(source[sorted(set(range(500)) - gone)], kept["x"])  # what training reads
    again = filtering.filter_samples(staged, Sifting(prefilter=LOSS_BASED), "classification")
    assert again.manifest_digest == report.manifest_digest  # the same selection, the same lineage


def test_the_class_floor_is_of_the_rows_finally_kept_and_signed_zeros_are_one_value():
    # The easiest rows are all of class 1: a floor of the rows the drops alone keep gave back 8 of 20 (under the 9
    # of the 88 then kept) and 13 of 50 (under 17 of the 67)
    for labels, n_learnt, kept in (([1] * 20 + [0] * 80, 20, 9), ([1] * 50 + [0] * 50, 50, 17)):
        learnt, _ = filtering._guard_classes(np.array(labels), n_learnt, 0, 0.5)
        share = np.mean(labels)
        assert np.sum(labels) - np.isin(np.flatnonzero(labels), learnt).sum() == kept
        assert kept == math.ceil(0.5 * (len(labels) - len(learnt)) * share)
    zeros = filtering.duplicates(np.array([[0.0], [-0.0]], np.float32), np.array([1.5, 1.5], np.float32))
    assert zeros.tolist() == [False, True]  # rounding small negatives gives -0.0; its bytes differ
    assert filtering.duplicates(np.ones((2, 1), np.float32), np.array([0.0, -0.0], np.float32)).tolist() == [
        False,
        True,
    ]


def test_the_keep_rule_alone_prefilters_duplicates_only_without_a_reference_model(tmp_path):
    x, y, _ = noisy_blobs(rows=400)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    staged = StagedData(str(tmp_path / "train.npz"), None, {"num_outputs": 3}, {"train": 500}, [])
    report = filtering.filter_samples(staged, Sifting(enabled=True, beta=1.0), "classification")
    assert report.dropped == {"duplicate": 100} and report.scoring_flops == 0 and report.kept == 400
    # pruning alone (sifting.enabled's default on a file-mode channel, beta 0) was measured without it
    assert filtering.filter_samples(staged, Sifting(enabled=True, beta=0.0), "classification").dropped == {}


CHAMPION_BASED = LOSS_BASED.model_copy(update={"reference": "champion"})


def blobs_champion(features: int = 6) -> torch.nn.Module:
    """A model of noisy_blobs that scores each class by its shifted feature: near the best there is."""
    model = torch.nn.Linear(features, 3)
    with torch.no_grad():
        model.weight.copy_(2.5 * torch.eye(3, features))
        model.bias.zero_()
    return model.eval()


def test_the_champion_scores_the_rows_without_training_a_reference():
    x, y, flipped = noisy_blobs()
    holdout_flops = filtering.prefilter(x, y, LOSS_BASED, "classification", 3).flops
    champion = filtering.Champion(blobs_champion(), "blobs v4")
    result = filtering.prefilter(x, y, CHAMPION_BASED, "classification", 3, champion)
    keep, flops = result.keep, result.flops
    assert result.reference == "champion blobs v4"
    clean = np.setdiff1d(np.arange(2000), flipped)
    assert 1 - keep[flipped].mean() > 0.6 and 1 - keep[clean].mean() < 0.25
    assert 0 < flops < holdout_flops / 10  # one forward pass, no reference model trained


def test_a_champion_that_does_not_fit_the_data_falls_back_to_the_holdout_models():
    x, y, flipped = noisy_blobs()
    for champion, why in (
        (filtering.Champion(blobs_champion(features=5), "blobs v2"), "the champion blobs v2 does not fit this data"),
        (filtering.Champion(torch.nn.Linear(6, 2), "blobs v3"), "does not fit this data (it gives outputs of shape"),
        (filtering.Champion(None, "'blobs' has no champion yet"), "'blobs' has no champion yet"),
    ):
        result = filtering.prefilter(x, y, CHAMPION_BASED, "classification", 3, champion)
        assert result.reference.startswith(filtering.HOLDOUT) and why in result.reference
        assert 1 - result.keep[flipped].mean() > 0.6 and result.flops > 0


def test_a_regression_champions_losses_are_on_the_loss_scale_training_will_use():
    from trainyard import algorithms
    from trainyard.spec import Algorithm, Hyperparameters

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4)).astype(np.float32)
    y = (1000 * x[:, 0] + rng.normal(scale=50, size=300)).astype(np.float32)  # in large units
    y[:15] += 20_000  # gross outliers: the unlearnable drop takes them, and the labels' spread with them
    champion = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Flatten(0))
    with torch.no_grad():
        champion[0].weight.copy_(torch.tensor([[1000.0, 0, 0, 0]]))
        champion[0].bias.zero_()
    config = Prefilter(reference="champion", drop_learnt_fraction=0.0, drop_unlearnable_fraction=0.05)
    result = filtering.prefilter(x, y, config, "regression", 1, filtering.Champion(champion, "r v1"), with_losses=True)
    keep = result.keep
    assert not keep[:15].any() and keep[15:].all()
    # the loss training will use: built on the kept rows (algorithms._scaled_mse over their spread)
    _, job_loss = algorithms.build(Algorithm(builtin="linear-regression"), Hyperparameters(), x[keep], y[keep], 1)
    same = job_loss(champion(torch.from_numpy(x[keep])), torch.from_numpy(y[keep])).detach().numpy()
    assert np.allclose(result.losses[keep], same, rtol=1e-4)  # what reducible loss subtracts is on its scale


def test_a_regression_jobs_holdout_reference_losses_are_on_one_scale_the_kept_rows_labels(monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 4)).astype(np.float32)
    y = (1000 * x[:, 0] + rng.normal(scale=50, size=400)).astype(np.float32)
    y[:20] += 20_000  # gross outliers, dropped as unlearnable
    known = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Flatten(0))
    with torch.no_grad():
        known[0].weight.copy_(torch.tensor([[1000.0, 0, 0, 0]]))
        known[0].bias.zero_()
    # each half's reference: a known model, so each row's error is known (the halves' labels differ in spread)
    monkeypatch.setattr(reference_losses, "_reference", lambda *args: (known, 0))
    config = Prefilter(drop_learnt_fraction=0.0, drop_unlearnable_fraction=0.05)
    result = filtering.prefilter(x, y, config, "regression", 1, with_losses=True)
    keep = result.keep
    assert not keep[:20].any() and keep[20:].all()
    squared = (1000 * x[:, 0] - y) ** 2
    np.testing.assert_allclose(result.losses[keep], squared[keep] / y[keep].std() ** 2, rtol=1e-4)


def test_only_a_loss_based_champion_prefilter_needs_the_registry():
    assert filtering.wants_champion(Sifting(enabled=True, prefilter=CHAMPION_BASED))
    assert not filtering.wants_champion(Sifting(enabled=True, prefilter=CHAMPION_BASED), streamed=True)
    assert not filtering.wants_champion(Sifting(enabled=True, prefilter=LOSS_BASED))
    assert not filtering.wants_champion(Sifting(enabled=True, prefilter=Prefilter(reference="champion")))


def test_reducible_loss_sifting_gets_every_kept_rows_reference_loss(tmp_path):
    x, y, flipped = noisy_blobs()
    np.savez(tmp_path / "train.npz", x=x, y=y)
    staged = StagedData(str(tmp_path / "train.npz"), None, {"num_outputs": 3}, {"train": 2100}, [])
    sifting = Sifting(enabled=True, score="reducible_loss")
    assert filtering.needs_reference(sifting) and not filtering.needs_reference(Sifting(enabled=True))
    report = filtering.filter_samples(staged, sifting, "classification")
    assert report.reference == filtering.HOLDOUT and report.scoring_flops > 0
    assert report.dropped == {"duplicate": 100, "learnt": 0, "unlearnable": 0}  # nothing else dropped
    kept = np.load(report.train_data)
    reference = kept["irreducible"]
    assert len(reference) == len(kept["x"]) == 2000 and np.isfinite(reference).all()
    clean = np.setdiff1d(np.arange(2000), flipped)  # the kept rows are the first 2000, in order
    # Wrong labels are what a reference cannot fit: most of them rank above nine in ten clean rows.
    assert np.median(reference[flipped]) > np.percentile(reference[clean], 90)


def warned_job(**fields):
    """A classifier's job, ``fields`` added, and an outcome of 1,000 FLOPs a row trained (forward and backward)."""
    from types import SimpleNamespace

    from trainyard.spec import parse_job

    job = parse_job(
        {
            "name": "warn",
            "algorithm": {"builtin": "mlp-classifier"},
            "inputs": {"train": {"s3_uri": "s3://data/train/", "label": "label"}},
            "output": {"s3_uri": "s3://data/out/"},
            **fields,
        }
    )
    outcome = SimpleNamespace(
        flops={"forward": 1_000_000, "backward": 2_000_000, "evaluation": 0, "scoring": 0},
        samples_trained=3_000,
        history=[{}, {}, {}],
        sifting=None,
    )
    return job, outcome


def test_a_prefilter_that_cost_more_than_the_training_it_spared_is_warned_about():
    from types import SimpleNamespace

    from trainyard.status import sifting_section

    job, outcome = warned_job()  # 3 epochs: 10 dropped rows spared at most 30,000 FLOPs

    def report(scoring_flops: int) -> filtering.FilterReport:
        return filtering.FilterReport("train.npz", total=1_010, kept=1_000, scoring_flops=scoring_flops)

    warning = sifting_section(job, report(30_000), outcome)["warning"]
    assert warning.startswith("the prefilter cost more compute than it saved") and "at most 3e+04" in warning
    assert "warning" not in sifting_section(job, report(29_999), outcome)
    assert "warning" not in sifting_section(job, report(0), outcome)  # exact duplicates: nothing scored
    rho = job.model_copy(
        update={"sifting": job.sifting.model_copy(update={"enabled": True, "score": "reducible_loss"})}
    )
    assert "warning" not in sifting_section(rho, report(30_000), outcome)  # its reference ranks every candidate
    # the measure of the labels that picked the rule (sifting.noisy_share) is not the prefilter's cost: it runs with the
    # prefilter off too (was: every default job on a noisy channel, 0 rows dropped, warned to turn the prefilter off)
    measured = filtering.FilterReport("train.npz", total=1_010, kept=1_010, scoring_flops=10_000)
    measured.label_noise = {"flops": 10_000, "noisy": True}
    sifted = {"kept_fraction": 1.0, "passed_over": 0, "pruned_learnt": 20}
    pruned = SimpleNamespace(**vars(outcome) | {"sifting": sifted})
    assert "warning" not in sifting_section(job, measured, pruned)  # 20 rows pruned spared 20,000: more than it cost
    measured.scoring_flops += 30_000  # and the prefilter's own scoring beside it, which dropped nothing
    warning = sifting_section(job, measured, pruned)["warning"]
    assert "scoring the rows took 3e+04 FLOPs" in warning and "measuring the labels" not in warning  # its own alone


def test_a_measure_of_the_labels_that_cost_more_than_filtering_spared_is_warned_about():
    from trainyard.status import sifting_section

    job, outcome = warned_job(sifting={"enabled": True})
    # 20 rows pruned and 10 dropped by the prefilter over 2 epochs spared 40,000 FLOPs
    outcome.history = [{}, {}]
    outcome.sifting = {"kept_fraction": 1.0, "passed_over": 0, "pruned_learnt": 15, "pruned_hardest": 5}

    def measured(flops: int) -> filtering.FilterReport:
        report = filtering.FilterReport("train.npz", total=1_010, kept=1_000, scoring_flops=flops)
        report.label_noise = {"flops": flops, "noisy": True}
        return report

    warning = sifting_section(job, measured(40_000), outcome)["warning"]
    assert warning.startswith("measuring the labels to pick sifting's rule cost 4e+04 FLOPs")
    assert "(4e+04 at most)" in warning and "sifting.noisy_share: null" in warning
    assert "prefilter cost more" not in warning  # the prefilter itself scored nothing
    assert "warning" not in sifting_section(job, measured(39_999), outcome)
    assert "warning" not in sifting_section(job, filtering.FilterReport("train.npz", 1_010, 1_000), outcome)


def test_a_channel_of_one_distinct_row_is_named_not_scored_as_nan():
    x, y = np.ones((50, 3), np.float32), np.zeros(50, np.int64)  # every row the same
    with pytest.raises(DataError, match=r"1 distinct row\(s\) are left once duplicates are dropped"):
        filtering.prefilter(x, y, LOSS_BASED, "classification", 2)


def hundredfold_loss_build(num_features, num_outputs, hyperparameters):
    """An entrypoint whose loss is on its own scale: 100 times cross-entropy."""
    model = torch.nn.Linear(num_features, num_outputs)
    return model, lambda out, y: 100 * torch.nn.functional.cross_entropy(out, y, reduction="none")


def log_softmax_nll_build(num_features, num_outputs, hyperparameters):
    """The common PyTorch classifier: LogSoftmax last, NLLLoss (of log-probabilities)."""
    model = torch.nn.Sequential(torch.nn.Linear(num_features, num_outputs), torch.nn.LogSoftmax(dim=1))
    return model, lambda out, y: torch.nn.functional.nll_loss(out, y, reduction="none")


def softmax_probabilities_build(num_features, num_outputs, hyperparameters):
    """A classifier giving probabilities, its loss the negative log of the true class's."""
    model = torch.nn.Sequential(torch.nn.Linear(num_features, num_outputs), torch.nn.Softmax(dim=1))
    return model, lambda out, y: -torch.log(out.gather(1, y[:, None])[:, 0])


def column_mse_build(num_features, num_outputs, hyperparameters):
    """A regression entrypoint giving (N, 1), with a loss that needs that shape."""
    model = torch.nn.Linear(num_features, 1)
    return model, lambda out, y: (out[:, 0] - y) ** 2


def test_an_entrypoints_reference_losses_are_on_its_own_loss_scale(tmp_path):
    from trainyard.spec import Algorithm, Hyperparameters

    x, y, _ = noisy_blobs()
    np.savez(tmp_path / "train.npz", x=x, y=y)
    staged = StagedData(str(tmp_path / "train.npz"), None, {"num_outputs": 3}, {"train": 2100}, [])
    sifting = Sifting(enabled=True, score="reducible_loss")
    builtin = np.load(filtering.filter_samples(staged, sifting, "classification").train_data)["irreducible"]
    entrypoint = Algorithm(entrypoint="tests.unit.test_filtering:hundredfold_loss_build")
    report = filtering.filter_samples(staged, sifting, "classification", None, entrypoint, Hyperparameters())
    own = np.load(report.train_data)["irreducible"]
    # the same reference models (seeded), scored with the job's loss: what sifting subtracts from
    np.testing.assert_allclose(own, 100 * builtin, rtol=1e-4)


@pytest.mark.parametrize("build", ["log_softmax_nll_build", "softmax_probabilities_build"])
def test_a_classifier_giving_probabilities_is_scored_on_the_reference_models_probabilities(tmp_path, build):
    from trainyard.spec import Algorithm, Hyperparameters

    x, y, _ = noisy_blobs()
    np.savez(tmp_path / "train.npz", x=x, y=y)
    staged = StagedData(str(tmp_path / "train.npz"), None, {"num_outputs": 3}, {"train": 2100}, [])
    sifting = Sifting(enabled=True, score="reducible_loss")
    builtin = np.load(filtering.filter_samples(staged, sifting, "classification").train_data)["irreducible"]
    entrypoint = Algorithm(entrypoint=f"tests.unit.test_filtering:{build}")
    report = filtering.filter_samples(staged, sifting, "classification", None, entrypoint, Hyperparameters())
    # the reference's logits as the job's model gives its outputs: its loss is then cross-entropy (NLLLoss
    # of raw logits was negative for most rows)
    np.testing.assert_allclose(np.load(report.train_data)["irreducible"], builtin, rtol=1e-4, atol=1e-5)


def test_a_regression_entrypoints_loss_gets_the_shape_its_model_gives():
    from trainyard.spec import Algorithm, Hyperparameters

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3)).astype(np.float32)
    y = (3 * x[:, 0] + rng.normal(scale=0.1, size=200)).astype(np.float32)
    algorithm = Algorithm(entrypoint="tests.unit.test_filtering:column_mse_build", task="regression")
    loss = reference_losses.job_loss(algorithm, Hyperparameters(), x, y, 1)
    losses = loss(torch.zeros(200), torch.from_numpy(y))  # a built-in reference gives (N,)
    np.testing.assert_allclose(losses.numpy(), y**2, rtol=1e-6)


def sharp_probabilities_build(num_features, num_outputs, hyperparameters):
    """A loss that is inf where the true class's probability underflows to 0 (-log of a softmax)."""
    model = torch.nn.Linear(num_features, num_outputs)
    return model, lambda out, y: -torch.log(torch.softmax(out * 200, dim=1).gather(1, y[:, None])[:, 0])


def test_reference_losses_that_are_not_numbers_are_named_before_training(tmp_path):
    from trainyard.errors import TrainingError
    from trainyard.spec import Algorithm, Hyperparameters

    x, y, _ = noisy_blobs()
    np.savez(tmp_path / "train.npz", x=x, y=y)
    staged = StagedData(str(tmp_path / "train.npz"), None, {"num_outputs": 3}, {"train": 2100}, [])
    entrypoint = Algorithm(entrypoint="tests.unit.test_filtering:sharp_probabilities_build")
    sifting = Sifting(enabled=True, score="reducible_loss")
    # (written as irreducible losses, every later score of those rows was NaN, and the groups failed saying
    # the file's losses did not match its rows)
    with pytest.raises(TrainingError, match=r"the reference loss \(holdout\) is inf on \d+ of 2000 training rows"):
        filtering.filter_samples(staged, sifting, "classification", None, entrypoint, Hyperparameters())
    assert not (tmp_path / "train.filtered.npz").exists()
