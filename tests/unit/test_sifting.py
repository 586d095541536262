"""The online sifter: the keep rule's statistics, full batches, the class balance guard, redone steps,
and sifting inside a group's steps (reducible loss, reused losses, what an epoch reports); no processes."""

from __future__ import annotations

import numpy as np
import pytest

from trainyard.spec import parse_job


def test_the_keep_rule_keeps_one_in_one_plus_beta_in_steady_state():
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    rng = np.random.default_rng(0)
    for beta in (0.5, 1.0, 2.0):
        # A long history: its empirical distribution is the losses' own to within ~0.5%.
        sifter = Sifter(Sifting(enabled=True, beta=beta, loss_history_length=50_000), seed=0)
        sifter.history = rng.exponential(size=50_000).astype(np.float32)
        kept = rng.random(50_000) < sifter.keep_probability(rng.exponential(size=50_000))
        assert abs(kept.mean() - 1 / (1 + beta)) < 0.01


def test_the_mean_keep_probability_shows_what_the_rule_alone_would_keep_where_the_batch_keeps_a_fixed_share():
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    rng = np.random.default_rng(1)
    sifter = Sifter(Sifting(enabled=True, beta=1.0, loss_history_length=20_000), seed=0)
    sifter.history = rng.exponential(size=20_000).astype(np.float32)
    for step in range(100):  # losses drawn as the history's: the rule alone keeps 1 / (1 + beta)
        losses = rng.exponential(size=128)
        sifter.select(losses, None, 64, step, group=0)
    steady = sifter.report()
    assert steady["kept_fraction"] == 0.5 and abs(steady["mean_keep_probability"] - 0.5) < 0.02
    before = sifter.probability_sum
    for step in range(100, 110):  # losses falling against the history (a model learning fast): it keeps less
        sifter.history = rng.exponential(size=20_000).astype(np.float32)
        sifter.select(0.5 * rng.exponential(size=128), None, 64, step, group=0)
    falling = (sifter.probability_sum - before) / (10 * 128)
    assert sifter.report()["kept_fraction"] == 0.5 and falling < 0.4  # the batch still keeps half


def test_each_candidate_is_kept_with_smart_siftings_probability_and_batches_stay_full():
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    rng = np.random.default_rng(0)
    for beta in (1.0, 2.0):
        sifter = Sifter(Sifting(enabled=True, beta=beta, loss_history_length=20_000), seed=0)
        sifter.history = rng.exponential(size=20_000).astype(np.float32)
        kept, probability = [], []
        for step in range(400):
            losses = rng.exponential(size=sifter.candidate_batch(64))
            p = sifter.keep_probability(losses)
            chosen = sifter.select(losses, None, sifter.keep_count(len(losses)), step, group=0)
            assert len(chosen) == 64
            kept.append(np.isin(np.arange(len(losses)), chosen))
            probability.append(p)
            sifter.history = sifter.history[: 20_000 - len(losses)]  # keep the reference distribution fixed
            sifter.history = np.concatenate([sifter.history, rng.exponential(size=len(losses)).astype(np.float32)])
        kept, probability = np.concatenate(kept), np.concatenate(probability)
        # by percentile tenth: kept as often as percentile ** beta says (the 99th percentile ~99% at beta 1)
        for low in np.arange(0.0, 1.0, 0.1):
            tenth = (probability ** (1 / beta) >= low) & (probability ** (1 / beta) < low + 0.1)
            assert abs(kept[tenth].mean() - probability[tenth].mean()) < 0.03, (beta, low)


def test_a_redone_step_selects_as_before_and_is_counted_once():
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    sifter = Sifter(Sifting(enabled=True, beta=1.0), seed=0)
    rng = np.random.default_rng(3)
    sifter.history = rng.random(500).astype(np.float32)
    sifter.select(rng.random(128), None, 64, step=20, group=0)
    losses, labels = rng.random(128), rng.integers(0, 2, 128)
    first = sifter.select(losses, labels, 64, step=21, group=0)
    counts = (sifter.scored, sifter.kept, sifter.passed_over, dict(sifter.kept_by_class), sifter.history.copy())
    probability = sifter.probability_sum
    again = sifter.select(losses, labels, 64, step=21, group=0)  # the step did not commit: torchft redoes it
    assert (again == first).all()
    assert (sifter.scored, sifter.kept, sifter.passed_over, sifter.kept_by_class) == counts[:4]
    assert sifter.probability_sum == probability  # its keep probabilities added once
    assert (sifter.history == counts[4]).all()  # its losses joined the history once
    sifter.record_uniform(128, 64, step=22, group=0)  # a step not ranked: trained on unsifted, the rest left out
    sifter.record_uniform(128, 64, step=22, group=0)
    assert (sifter.scored, sifter.unsifted, sifter.skipped) == (counts[0], 64, 64)


def test_a_step_redone_at_another_rank_is_counted_once():
    """A peer lost mid-step: the step is redone by a smaller quorum, where this group's rank and share
    changed (rank 2 of 3, then rank 1 of 2)."""
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    sifter = Sifter(Sifting(enabled=True, beta=1.0, delay_steps=0), seed=0)
    rng = np.random.default_rng(1)
    for step in range(5):
        sifter.select(rng.random(22), rng.integers(0, 2, 22), 11, step, 2)
    before, history = sifter.counts(), len(sifter.history)
    sifter.select(rng.random(22), rng.integers(0, 2, 22), 11, 5, 2)  # did not commit
    sifter.select(rng.random(32), rng.integers(0, 2, 32), 16, 5, 1)  # redone as rank 1
    after = sifter.counts()
    assert (after["scored"], after["kept"], after["passed_over"]) == (
        before["scored"] + 32,
        before["kept"] + 16,
        before["passed_over"] + 16,
    )
    assert len(sifter.history) == history + 32


def test_a_class_with_only_a_few_easy_candidates_keeps_at_least_one():
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    sifter = Sifter(Sifting(enabled=True, beta=1.0, min_class_fraction=0.5), seed=0)
    rng = np.random.default_rng(2)
    sifter.history = rng.random(500).astype(np.float32)
    for step in range(50):  # two groups' share of a batch of 64: 32 of 64 candidates, 3 of a rare class
        losses, labels = rng.random(64), np.array([0] * 61 + [1] * 3)
        losses[61:] = 0.0
        chosen = sifter.select(losses, labels, 32, step=step, group=0)
        assert (labels[chosen] == 1).sum() >= 1


def test_a_floor_whose_shares_add_up_to_more_than_the_batch_starves_no_class():
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    rng = np.random.default_rng(0)
    for floor in (0.5, 0.9, 1.0):
        for major in (0, 9):  # whichever class is the large one, in label order
            sifter = Sifter(Sifting(enabled=True, beta=1.0, min_class_fraction=floor), seed=0)
            sifter.history = rng.exponential(size=500).astype(np.float32)
            # 64 candidates, 32 kept: a large hard class and 9 easy ones of a row each; rounded up, the
            # 10 floors at 1.0 add up to 41 > 32
            labels = np.concatenate([np.full(55, major), [c for c in range(10) if c != major]])
            losses = np.concatenate([rng.exponential(size=55) * 5 + 1, np.full(9, 1e-4)])
            chosen = sifter.select(losses, labels, 32, step=0, group=0)
            assert len(chosen) == 32
            assert set(labels[chosen].tolist()) == set(range(10)), (floor, major)


def test_sifting_keeps_full_batches_of_the_hardest_samples_and_guards_classes():
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    sifter = Sifter(Sifting(enabled=True, beta=1.0, min_class_fraction=0.5), seed=0)
    assert sifter.candidate_batch(64) == 128 and sifter.keep_count(128) == 64
    rng = np.random.default_rng(1)
    sifter.history = rng.random(500).astype(np.float32)
    losses = rng.random(128)
    labels = np.array([0] * 120 + [1] * 8)
    losses[120:] = 0.0  # class 1 is all easy: the rule alone would starve it
    before = sifter.history.copy()
    chosen = sifter.select(losses, labels, 64, step=20, group=0)
    assert len(chosen) == len(set(chosen.tolist())) == 64  # a full batch, no sample twice
    assert (labels[chosen] == 1).sum() >= 2  # half of its 4-sample share
    assert np.median(losses[chosen][labels[chosen] == 0]) > np.median(losses[:120])  # harder ones kept
    again = Sifter(Sifting(enabled=True, beta=1.0), seed=0)
    again.history = before
    assert (again.select(losses, labels, 64, step=20, group=0) == chosen).all()  # a redone step keeps the same


def _guard_by_loop(floor, chosen, order, labels, keep):
    """The class balance guard as it was first written, a class and a swap at a time (the reference)."""
    import math

    classes, counts = np.unique(labels, return_counts=True)
    need = {c: math.ceil(floor * keep * n / len(labels)) for c, n in zip(classes.tolist(), counts, strict=True)}
    for _ in range(sum(need.values()) - keep):
        need[max(need, key=lambda c: (need[c], c))] -= 1
    kept = np.zeros(len(labels), dtype=bool)
    kept[chosen] = True
    have = {c: int((labels[chosen] == c).sum()) for c in need}
    for cls, minimum in need.items():
        if have[cls] >= minimum:
            continue
        spare = [i for i in order if labels[i] == cls and not kept[i]][: minimum - have[cls]]
        for i in spare:
            donor = next((j for j in order[::-1] if kept[j] and have[labels[j]] > need[labels[j]]), None)
            if donor is None:
                break
            kept[donor], kept[i] = False, True
            have[labels[donor]] -= 1
            have[cls] += 1
    return np.flatnonzero(kept)


def test_the_class_balance_guard_swaps_as_the_loop_it_replaced():
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    rng = np.random.default_rng(0)
    swapped = 0
    for _ in range(400):
        n = int(rng.integers(2, 200))
        keep, classes = int(rng.integers(1, n + 1)), int(rng.integers(1, 40))
        floor = float(rng.choice([0.0, 0.5, 0.9, 1.0, rng.random()]))  # 0.9 and 1.0: floors over the batch
        labels = rng.integers(0, classes, n) * int(rng.choice([1, 7]))  # class values need not be 0..K-1
        order = np.lexsort((rng.random(n), -(rng.random(n) ** 4)))
        chosen = np.sort(order[:keep] if rng.random() < 0.5 else rng.choice(n, keep, replace=False))
        expected = _guard_by_loop(floor, chosen, order, labels, keep)
        sifter = Sifter(Sifting(enabled=True, beta=1.0, min_class_fraction=floor), seed=0)
        assert np.array_equal(sifter._balance(chosen, order, labels, keep), expected)
        swapped += not np.array_equal(expected, chosen)
    assert swapped > 100  # the cases exercise the swaps, not only batches that needed none


def test_the_class_balance_guard_keeps_every_floor_at_a_thousand_classes():
    """An ImageNet-like step: 4,096 of 8,192 candidates kept, 1,000 classes, some much easier than
    others (the keep rule alone starves them). A guard in Python loops took 0.4 s a step here: the
    test waited on it, its speed is not asserted (timings belong in benchmarks)."""
    import math

    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    rng = np.random.default_rng(0)
    sifter = Sifter(Sifting(enabled=True, beta=1.0, min_class_fraction=0.5), seed=0)
    difficulty = rng.exponential(size=1000) ** 2
    labels = rng.integers(0, 1000, 8192)
    sifter.history = (difficulty[labels] * rng.exponential(size=8192)).astype(np.float32)
    losses = difficulty[labels] * rng.exponential(size=8192)
    chosen = sifter.select(losses, labels, 4096, step=1, group=0)
    assert len(chosen) == 4096
    kept = np.bincount(labels[chosen], minlength=1000)
    candidates = np.bincount(labels, minlength=1000)
    floors = [math.ceil(0.5 * 4096 * n / 8192) for n in candidates.tolist()]
    assert (kept >= floors).all()  # these floors add up to less than the batch: each is met


@pytest.mark.parametrize("beta", [0.3, 0.5, 1.0, 2.0])
def test_the_groups_kept_batches_add_up_to_the_batch_size_for_any_number_of_groups(beta):
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    sifter = Sifter(Sifting(enabled=True, beta=beta), seed=0)
    for batch in (64, 100, 128):
        candidates = sifter.candidate_batch(batch)
        for groups in range(1, 9):
            # the candidates dealt among the quorum as step_batch deals them (member_sizes)
            sizes = np.diff(np.linspace(0, candidates, groups + 1).astype(int)).tolist()
            keeps = sifter.keep_counts(sizes)
            assert sum(keeps) == batch, (batch, groups, sizes, keeps)
            assert all(0 < k <= n for k, n in zip(keeps, sizes, strict=True))
    # a last, short step: what is there, 1 / (1 + beta) of it, still at least one row for each group
    assert sum(sifter.keep_counts([5, 4, 4])) == round(13 / (1 + beta))
    assert sifter.keep_counts([0, 3]) == [0, sifter.keep_count(3)] and sifter.keep_counts([0, 0]) == [0, 0]
    # a tied odd row goes round the groups step by step, not always to the first: over steps, groups with
    # as many candidates keep as many rows (so each group's kept fraction is the job's)
    for groups in (2, 3, 4):
        sizes = [45] * groups
        if sum(sifter.keep_counts(sizes)) % groups:  # there is an odd row to deal
            kept = np.sum([sifter.keep_counts(sizes, step) for step in range(120)], axis=0)
            assert len(set(kept.tolist())) == 1, (groups, kept)


def test_sifting_is_off_for_the_first_delay_steps_and_their_rows_are_not_counted_as_ranked(tmp_path):
    data, model, _ = reducible_step_data(tmp_path, beta=1.0, score="loss", delay_steps=10, reuse_loss_epochs=0)
    for step in range(8):  # epoch 0: 8 steps of 64 candidates, all within the delay
        xb, _, count = data.batch(model, 0, step, step, 1, 0, 1)
        assert len(xb) == count == 32  # the first half of the (shuffled) candidates, unscored
    report = data.report()
    assert data.meter.scoring == 0 and (report["scored"], report["kept"], report["passed_over"]) == (0, 0, 0)
    assert (report["unsifted"], report["skipped"]) == (8 * 32, 8 * 32)
    assert data.epoch_metrics() == {"kept_fraction": None}  # nothing was ranked in this epoch
    for index in range(8):  # epoch 1: steps 8 and 9 still within the delay (it counts steps, not epochs)
        data.batch(model, 1, index, 8 + index, 1, 0, 1)
        assert (data.meter.scoring > 0) == (index >= 2)
    report = data.report()
    assert (report["scored"], report["kept"], report["passed_over"]) == (6 * 64, 6 * 32, 6 * 32)
    assert (report["unsifted"], report["skipped"]) == (10 * 32, 10 * 32)
    metrics = data.epoch_metrics()
    assert metrics["kept_fraction"] == 0.5 and set(metrics["kept_fraction_by_class"]) == {"0", "1"}
    # every row's loss is the same: 1 against the empty history of step 10, then the 50th percentile
    assert metrics["mean_keep_probability"] == pytest.approx((64 * 1.0 + 5 * 64 * 0.5) / (6 * 64))


def test_kept_fractions_per_class_are_named_by_the_classes_label_values(tmp_path):
    data, model, _ = reducible_step_data(tmp_path, classes=["ant", "moose"], score="loss", reuse_loss_epochs=0)
    for step in range(4):
        data.batch(model, 0, step, step, 1, 0, 1)
    assert set(data.epoch_metrics()["kept_fraction_by_class"]) == {"ant", "moose"}
    report = data.report()
    assert set(report["kept_fraction_by_class"]) == set(report["scored_by_class"]) == {"ant", "moose"}
    assert sum(report["kept_by_class"].values()) == report["kept"]


def test_the_jobs_kept_fraction_per_class_weighs_each_group_by_what_it_scored():
    from trainyard.training.accounting import sifting_totals

    def report(scored: dict, kept: dict) -> dict:
        return {"scored": sum(scored.values()), "kept": sum(kept.values()), "passed_over": 0, "score": "loss"} | {
            "scored_by_class": scored,
            "kept_by_class": kept,
            "kept_fraction_by_class": {c: kept.get(c, 0) / n for c, n in scored.items()},
        }

    # a group that scored 1,000 rows of class 0 and a restarted attempt that scored 10 (and kept them all)
    totals = sifting_totals(
        [report({"0": 1000}, {"0": 500}), report({"0": 10, "1": 4}, {"0": 10, "1": 1})],
        {
            "forward": 100,
            "backward": 200,
            "scoring": 50,
        },
    )
    assert totals["kept_fraction_by_class"] == {"0": 510 / 1010, "1": 0.25}  # not the mean of 0.5 and 1.0


def test_the_jobs_mean_keep_probability_weighs_each_group_by_what_it_scored():
    from trainyard.training.accounting import sifting_totals

    flops = {"forward": 100, "backward": 200, "scoring": 50}
    groups = [{"scored": 1000, "kept": 500, "keep_probability_sum": 300.0}, {"scored": 10, "kept": 5}]
    groups[1] |= {"keep_probability_sum": 9.0}  # a restarted attempt: a few rows, each likely kept
    assert sifting_totals(groups, flops)["mean_keep_probability"] == pytest.approx(309 / 1010)
    assert sifting_totals([{"scored": 0, "kept": 0}], flops)["mean_keep_probability"] is None  # nothing ranked


def test_the_jobs_rule_is_named_when_the_first_report_is_a_killed_groups_counts():
    from trainyard.training.accounting import sifting_totals

    killed = {"scored": 40, "kept": 20, "passed_over": 20}  # counts.json only: it never ended an epoch
    finished = killed | {"score": "reducible_loss"}
    totals = sifting_totals([killed, finished], {"forward": 100, "backward": 200, "scoring": 50})
    assert totals["score"] == "reducible_loss"
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    # and a group's counts, all a killed attempt leaves, carry it themselves
    assert Sifter(Sifting(enabled=True, score="reducible_loss"), seed=0).counts()["score"] == "reducible_loss"


def reducible_step_data(tmp_path, with_reference: bool = True, classes: list | None = None, **sifting):
    """StepData for 512 rows whose first half carries a high reference loss (noise a reference model
    could not fit either), under a model whose own loss is the same for every row."""
    import torch

    from trainyard import algorithms
    from trainyard.training.batches import StepData
    from trainyard.training.flops import FlopMeter
    from trainyard.training.plan import TrainingPlan

    job = parse_job(
        {
            "name": "s",
            "algorithm": {"builtin": "mlp-classifier"},
            "hyperparameters": {"batch_size": 32, "hidden_sizes": [4]},
            "inputs": {"train": {"s3_uri": "s3://bkt/t/", "label": "y"}},
            "output": {"s3_uri": "s3://bkt/o/"},
            "sifting": {"enabled": True, "beta": 2.0, "delay_steps": 0, "score": "reducible_loss"} | sifting,
        }
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(512, 3)).astype(np.float32), rng.integers(0, 2, 512)
    reference = np.where(np.arange(512) < 256, 5.0, 0.0).astype(np.float32)
    arrays = {"x": x, "y": y} | ({"irreducible": reference} if with_reference else {})
    np.savez(tmp_path / "train.filtered.npz", **arrays)
    schema = {"classes": classes} if classes else {}
    plan = TrainingPlan("j", job.model_dump(mode="json"), str(tmp_path / "train.filtered.npz"), None, schema, 1, "")
    model, loss_fn = algorithms.build(job.algorithm, job.hyperparameters, x, y, 2)
    torch.nn.init.zeros_(model[-1].weight)  # equal outputs: every row's own loss is ln 2
    torch.nn.init.zeros_(model[-1].bias)
    data = StepData(job, plan, torch.from_numpy(x), torch.from_numpy(y), tmp_path, loss_fn, FlopMeter(model, loss_fn))
    return data, model, x


def test_reducible_loss_skips_rows_the_reference_could_not_fit_either(tmp_path):
    data, model, x = reducible_step_data(tmp_path)
    noise = set(map(tuple, x[:256].tolist()))
    kept_noise = kept = 0
    for step in range(5):  # 96 candidates a step, 32 kept (the 6th step would be the short last one)
        xb, yb, global_count = data.batch(model, 0, step, step, 1, 0, 1)
        assert xb.shape == (32, 3) and global_count == 32  # the reference column never reaches the model
        if step > 0:  # the first step has no history to rank against: it keeps a uniform draw
            kept += len(xb)
            kept_noise += sum(tuple(row) in noise for row in xb.tolist())
    # Half the candidates are "noise". By loss alone they tie with the rest and half the kept would be
    # noise; by reducible loss they sit at the 25th percentile against the 75th: weights 1:9 at beta 2.
    assert kept_noise / kept < 0.25


def test_reducible_loss_without_reference_losses_says_what_to_do(tmp_path):
    from trainyard.errors import TrainingError

    with pytest.raises(TrainingError, match="no reference losses for sifting.score reducible_loss"):
        reducible_step_data(tmp_path, with_reference=False)


@pytest.mark.parametrize("score", ["loss", "reducible_loss"])
def test_reused_losses_spare_scoring_passes_and_batches_stay_full(tmp_path, score):
    import torch

    data, model, x = reducible_step_data(tmp_path, beta=1.0, score=score, reuse_loss_epochs=1)
    index = {tuple(row): i for i, row in enumerate(x.tolist())}
    scored_flops, kept_rows = [], []
    for epoch in range(3):  # 64 candidates a step, 8 steps an epoch over 512 rows, 32 kept a step
        before, kept = data.meter.scoring, set()
        for step in range(8):
            xb, yb, global_count = data.batch(model, epoch, step, 8 * epoch + step, 1, 0, 1)
            assert xb.shape == (32, 3) and global_count == 32  # full, and no side column reaches the model
            data.trained(data.loss_fn(model(xb), yb))  # the training forward's per-sample losses
            kept |= {index[tuple(row)] for row in xb.tolist()}
        scored_flops.append(data.meter.scoring - before)  # FLOPs of this epoch's scoring passes
        kept_rows.append(kept)
    per_row = scored_flops[0] / 512  # epoch 0 knows no loss: every candidate is scored
    assert scored_flops[0] > 0 and scored_flops[1] == 0  # epoch 1 reuses every loss from epoch 0
    # epoch 2: the rows trained on in epoch 1 have a recent loss; only the others are scored again
    assert scored_flops[2] == pytest.approx((512 - len(kept_rows[1])) * per_row, rel=0.01)
    assert data.report()["losses_reused"] == 512 + len(kept_rows[1])
    # A group that heals from this one reuses the same losses.
    healed, _, _ = reducible_step_data(tmp_path, beta=1.0, score=score, reuse_loss_epochs=1)
    healed.load_state_dict({k: v.clone() for k, v in data.state_dict().items()})
    assert np.array_equal(healed.memory.loss, data.memory.loss) and np.array_equal(
        healed.memory.epoch, data.memory.epoch
    )
    assert torch.equal(healed.state_dict()["history"], data.state_dict()["history"])


def test_a_redone_step_neither_reuses_its_first_trys_losses_nor_counts_them_twice(tmp_path):
    """A step that did not commit is done again with the same parameters (torchft): it must score,
    keep and count as if done once. Its first try remembered the candidates' losses, the kept ones'
    from the training forward, which dropout makes differ from a scoring pass's."""
    import torch

    def train(redone: set[int]) -> tuple:
        data, model, _ = reducible_step_data(tmp_path, beta=1.0, score="loss", reuse_loss_epochs=1)
        torch.manual_seed(0)
        torch.nn.init.normal_(model[-1].weight)
        model = torch.nn.Sequential(torch.nn.Dropout(0.5), model)
        batches = []
        for step in range(16):  # epochs 0 and 1, 8 steps each
            epoch, index = divmod(step, 8)
            for _ in range(2 if step in redone else 1):
                xb, yb, _ = data.batch(model, epoch, index, step, 1, 0, 1)
                torch.manual_seed(step)  # the same dropout in both tries
                data.trained(data.loss_fn(model(xb), yb))
            batches.append(xb)
        return data, batches

    once, batches_once = train(set())
    redone, batches_redone = train({3, 11})  # one step of each epoch did not commit
    for step, (a, b) in enumerate(zip(batches_once, batches_redone, strict=True)):
        assert torch.equal(a, b), step
    assert np.array_equal(once.memory.loss, redone.memory.loss, equal_nan=True)
    assert np.array_equal(once.memory.epoch, redone.memory.epoch)
    assert redone.report() == once.report()  # losses_reused among them


def test_an_epochs_candidate_loss_is_over_every_candidate_ranked_not_only_the_kept_ones(tmp_path):
    """``train_loss`` is over the rows trained on, the hard ones the keep rule kept; ``candidate_loss``
    is over the uniform draw of candidates, the loss an unsifted job's ``train_loss`` is over."""
    import torch

    data, model, x = reducible_step_data(tmp_path, beta=1.0)  # ranked by reducible loss, reported as loss
    torch.manual_seed(0)
    torch.nn.init.normal_(model[-1].weight)
    kept_losses = []
    for step in range(8):  # 64 candidates a step: the epoch ranks all 512 rows
        for _ in range(2 if step == 3 else 1):  # step 3 did not commit and is done again
            xb, yb, _ = data.batch(model, 0, step, step, 1, 0, 1)
        kept_losses.append(data.loss_fn(model(xb), yb).detach())
    y = torch.from_numpy(np.load(tmp_path / "train.filtered.npz")["y"])
    with torch.no_grad():
        every_row = float(data.loss_fn(model(torch.from_numpy(x)), y).mean())
    metrics = data.epoch_metrics()
    assert metrics["candidate_loss"] == pytest.approx(every_row, rel=1e-5)
    assert float(torch.cat(kept_losses).mean()) > every_row  # what train_loss averages: the kept rows, harder
    assert "candidate_loss" not in data.epoch_metrics()  # an epoch that ranked nothing has none


def test_validation_is_never_sifted(tmp_path):
    # Validation scores every row once with the model as it is: no row is ranked, kept or passed over,
    # no scoring FLOPs are counted, and the loss history the keep rule ranks against does not move.
    import torch

    from trainyard.training.epochs import evaluate

    data, model, x = reducible_step_data(tmp_path, beta=1.0, score="loss", reuse_loss_epochs=0)
    for step in range(4):
        data.batch(model, 0, step, step, 1, 0, 1)
    sifter = data.sifter
    before = (sifter.history.copy(), data.report(), data.meter.scoring, data.meter.evaluation)
    y = torch.from_numpy(np.load(tmp_path / "train.filtered.npz")["y"])
    metrics = evaluate(model, data.loss_fn, torch.from_numpy(x), y, "classification", data.meter)
    assert np.array_equal(sifter.history, before[0]) and data.report() == before[1]
    assert data.meter.scoring == before[2] and data.meter.evaluation > before[3]  # counted as evaluation
    with torch.no_grad():
        every_row = float(data.loss_fn(model(torch.from_numpy(x)), y).mean())
    assert metrics["val_loss"] == pytest.approx(every_row, rel=1e-6)  # over all 512 rows, none dropped
