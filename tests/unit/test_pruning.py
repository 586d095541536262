"""Epoch-level pruning by each row's last loss (``sifting.prune``, InfoBatch's rule and the hardest rows
left out): the rates, the phases, unbiasedness, determinism across groups and redone steps, a heal, the
spec's checks, and a real two-group job with a killed group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import rejoined, slow_until
from tests.unit.jobs import make_job, run
from tests.unit.test_spec import minimal
from trainyard.errors import SpecError
from trainyard.pruning import LossMemory, Pruner
from trainyard.spec import Pruning, parse_job
from trainyard.status import compute_section, sifting_section


def known_memory(losses: np.ndarray) -> LossMemory:
    memory = LossMemory(len(losses), max_age=0)
    memory.remember(np.arange(len(losses)), losses.astype(np.float32), epoch=0)
    return memory


def decide_all(pruner: Pruner, memory: LossMemory, epoch: int, first_step: int = 0, batch: int = 128):
    """Every row through the pruner in batches: ``(left out, weight of each row: 0 when left out)``."""
    n = len(memory.loss)
    weight = np.zeros(n)
    for i, start in enumerate(range(0, n, batch)):
        rows = np.arange(start, min(start + batch, n))
        kept, w = pruner.decide(rows, memory, epoch, first_step + i)
        weight[rows[kept]] = w
    return weight == 0, weight


def test_learnt_rows_sit_out_at_the_rate_asked_and_the_kept_ones_make_up_for_them():
    losses = np.random.default_rng(0).exponential(1.0, 20_000)
    memory = known_memory(losses)
    pruner = Pruner(Pruning(learnt_fraction=0.7, hardest_fraction=0), epochs=10, seed=3)
    out, weight = decide_all(pruner, memory, epoch=1)
    below = losses < losses.astype(np.float32).mean()
    assert out[below].mean() == pytest.approx(0.7, abs=0.015)
    assert not out[~below].any()  # rows at or above the mean always train, at weight 1
    assert set(np.unique(weight[~below])) == {1.0}
    assert np.unique(weight[below & ~out]) == pytest.approx([1 / 0.3])
    counts = pruner.counts()
    assert counts == {"prune_dealt": 20_000, "pruned_learnt": int(out.sum()), "pruned_hardest": 0}
    # Unbiased: over many epochs (each draws afresh), the weighted loss of what trains averages the whole's.
    learnt_only = Pruning(learnt_fraction=0.7, hardest_fraction=0)
    sums = [np.sum(losses * decide_all(Pruner(learnt_only, 10, 3), memory, e)[1]) for e in range(40)]
    assert np.mean(sums) == pytest.approx(losses.sum(), rel=0.005)
    assert np.std(sums) > 0  # not the same rows every epoch


def test_the_hardest_rows_sit_out_from_hardest_after_and_learnt_rows_train_again_from_until():
    losses = np.random.default_rng(1).exponential(1.0, 5_000)
    memory = known_memory(losses)
    config = Pruning(learnt_fraction=0.5, hardest_fraction=0.1, hardest_after=0.25, until=0.875)
    top = losses > np.quantile(losses.astype(np.float32), 0.9)
    below = losses < losses.astype(np.float32).mean()
    for epoch, (learnt_on, hardest_on) in {0: (1, 0), 1: (1, 0), 2: (1, 1), 6: (1, 1), 7: (0, 1)}.items():
        pruner = Pruner(config, epochs=8, seed=0)
        assert pruner.phase(epoch) == (bool(learnt_on), bool(hardest_on))
        out, _ = decide_all(pruner, memory, epoch)
        assert out[top].all() == bool(hardest_on) and out[top].any() == bool(hardest_on)
        assert (out[below].mean() > 0.4) == bool(learnt_on)
        assert not out[~below & ~top].any()  # the middle always trains
        assert pruner.counts()["pruned_hardest"] == (top.sum() if hardest_on else 0)


def test_only_rows_the_model_finds_less_likely_than_chance_count_among_the_hardest():
    rng = np.random.default_rng(5)
    losses = np.where(np.arange(4_000) < 200, 3.0, rng.uniform(0.0, 1.0, 4_000))  # 5% far above ln 4 = 1.39
    memory = known_memory(losses)
    config = Pruning(learnt_fraction=0, hardest_fraction=0.1, hardest_after=0)  # hardest_min_loss: "chance" by default
    out, _ = decide_all(Pruner(config, 4, seed=0, classes=4), memory, epoch=1)
    np.testing.assert_array_equal(np.flatnonzero(out), np.arange(200))  # a clean set's hard rows are kept
    # a regression job (no classes), or hardest_min_loss 0: the top 10% whatever their loss
    assert decide_all(Pruner(config, 4, seed=0), memory, epoch=1)[0].sum() == 400
    plain = Pruning(learnt_fraction=0, hardest_fraction=0.1, hardest_after=0, hardest_min_loss=0)
    assert decide_all(Pruner(plain, 4, seed=0, classes=4), memory, epoch=1)[0].sum() == 400
    high = Pruning(learnt_fraction=0, hardest_fraction=0.1, hardest_after=0, hardest_min_loss=5.0)
    assert not decide_all(Pruner(high, 4, seed=0, classes=4), memory, epoch=1)[0].any()


def test_a_class_keeps_at_least_the_guards_fraction_of_its_rows_from_the_hardest_rule():
    # A 5% class the model still gets wrong: every row of it is harder than any other row. Counted over
    # all rows, the hardest 10% was that class whole, left out for good (a row left out is not measured again).
    rng = np.random.default_rng(2)
    labels = (np.arange(4_000) < 200).astype(np.int64)
    losses = np.where(labels == 1, rng.uniform(3.0, 4.0, 4_000), rng.uniform(0.0, 2.0, 4_000))
    config = Pruning(learnt_fraction=0, hardest_fraction=0.1, hardest_after=0, hardest_min_loss=0)
    out, _ = decide_all(Pruner(config, 4, seed=0, classes=2, labels=labels), known_memory(losses), epoch=1)
    # half of the hard class at most (min_class_fraction 0.5, the default); the other loses what the cut over
    # all rows took from it (its rows above it)
    assert out[labels == 1].sum() == 100 and out[labels == 0].sum() == 200
    strict = Pruner(config, 4, seed=0, classes=2, labels=labels, min_class_fraction=0.9)
    assert decide_all(strict, known_memory(losses), epoch=1)[0][labels == 1].sum() == 20
    # the cuts per class travel with the torchft state: a healed group leaves out the same rows
    peer = Pruner(config, 4, seed=0, classes=2, labels=labels)
    peer.decide(np.arange(10), known_memory(losses), epoch=1, step=0)
    healed = Pruner(config, 4, seed=0, classes=2, labels=labels)
    healed.load_state_dict({k: v.clone() for k, v in peer.state_dict().items()})
    np.testing.assert_array_equal(healed.thresholds[2], peer.thresholds[2])
    # a regression job (no classes): the hardest over all rows, as before
    assert decide_all(Pruner(config, 4, seed=0), known_memory(losses), epoch=1)[0][labels == 1].all()


def test_rows_with_no_known_loss_always_train():
    memory = LossMemory(1000, max_age=0)
    memory.remember(np.arange(500), np.linspace(0, 1, 500, dtype=np.float32), epoch=0)
    pruner = Pruner(Pruning(learnt_fraction=0.9, hardest_fraction=0.2, hardest_after=0), epochs=4, seed=0)
    out, weight = decide_all(pruner, memory, epoch=1)
    assert not out[500:].any() and (weight[500:] == 1).all()
    assert out[:500].mean() > 0.5
    # nothing known at all (a job's first epoch): every row trains at weight 1
    out, weight = decide_all(Pruner(Pruning(learnt_fraction=0.9, hardest_fraction=0.2), 4, 0), LossMemory(300, 0), 0)
    assert not out.any() and (weight == 1).all()


def test_a_loss_that_is_not_a_number_trains_its_row_and_leaves_the_others_pruned_as_before():
    losses = np.linspace(0, 1, 1000, dtype=np.float32)
    config = Pruning(learnt_fraction=0.9, hardest_fraction=0.1, hardest_after=0)
    clean_out, _ = decide_all(Pruner(config, epochs=4, seed=0), known_memory(losses), epoch=1)
    with_nan = losses.copy()
    with_nan[[3, 500]] = np.nan
    with_nan[998] = np.inf  # among the hardest by value, but trained as NaN is (the keep rule's reading)
    out, weight = decide_all(Pruner(config, epochs=4, seed=0), known_memory(with_nan), epoch=1)
    assert not out[[3, 500, 998]].any() and (weight[[3, 500, 998]] == 1).all()
    assert out.sum() > 400  # without the rows that are not numbers, thresholds were NaN: nothing was pruned
    others = np.setdiff1d(np.arange(1000), [3, 500, 998])
    assert (out[others] != clean_out[others]).mean() < 0.02  # thresholds of the rest, as without them


def test_every_group_and_a_redone_step_decide_alike_and_a_redo_counts_once():
    losses = np.random.default_rng(2).exponential(1.0, 2_000)
    memory = known_memory(losses)
    config = Pruning(learnt_fraction=0.6, hardest_fraction=0.05, hardest_after=0)
    a, b = Pruner(config, 10, seed=7), Pruner(config, 10, seed=7)
    rows = np.random.default_rng(3).choice(2_000, 256, replace=False)
    first = a.decide(rows, memory, epoch=4, step=40)
    again = a.decide(rows, memory, epoch=4, step=40)  # the step was not committed: torchft redoes it
    other = b.decide(rows[::-1], memory, epoch=4, step=40)  # another group, the rows in another order
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert set(rows[first[0]]) == set(rows[::-1][other[0]])
    assert a.counts() == b.counts() and a.counts()["prune_dealt"] == 256  # counted once
    later = a.decide(rows, memory, epoch=5, step=50)[0]
    assert set(rows[later]) != set(rows[first[0]])  # another epoch draws other learnt rows to sit out


def test_a_healed_group_prunes_with_its_peers_thresholds_for_the_epoch():
    losses = np.random.default_rng(4).exponential(1.0, 3_000)
    memory = known_memory(losses)
    config = Pruning(learnt_fraction=0.5, hardest_fraction=0.1, hardest_after=0)
    peer = Pruner(config, 10, seed=0)
    peer.decide(np.arange(10), memory, epoch=3, step=30)  # the epoch's thresholds are fixed here
    memory.remember(np.arange(1_500), losses[:1_500].astype(np.float32) * 4, epoch=3)  # the epoch goes on
    state = {k: v.clone() for k, v in peer.state_dict().items()}
    healed = Pruner(config, 10, seed=0)
    healed.load_state_dict(state)
    rows = np.arange(1_500, 3_000)
    np.testing.assert_array_equal(healed.decide(rows, memory, 3, 35)[0], peer.decide(rows, memory, 3, 35)[0])
    fresh = Pruner(config, 10, seed=0)  # thresholds from the memory as it is now: other rows
    assert not np.array_equal(fresh.decide(rows, memory, 3, 35)[0], peer.decide(rows, memory, 3, 36)[0])


def spec(**sifting) -> dict:
    """A job on a streamed train channel with sifting on and ``sifting``'s settings."""
    stream = {"train": {"s3_uri": "s3://bkt/train/", "label": "y", "mode": "stream"}}
    return minimal(inputs=stream, sifting={"enabled": True} | sifting)


def _refused_one_row_short(config, batch_size: int, rows: int) -> list[str]:
    """What ``check_fits`` refuses a channel of one row fewer than ``rows``, which it takes."""
    from trainyard.sifting import check_fits

    check_fits(config, batch_size, rows)
    with pytest.raises(SpecError) as refused:
        check_fits(config, batch_size, rows - 1)
    return refused.value.problems


def test_batch_factor_deals_more_rows_a_step_and_is_checked_against_the_rows():
    from trainyard.sifting import check_fits
    from trainyard.spec import Sifting

    assert Pruning(learnt_fraction=0.5, batch_factor=2).dealt_batch(64) == 128
    assert Pruning(learnt_fraction=0, batch_factor=2).dealt_batch(64) == 64  # no pruning: nothing to make up for
    config = Sifting(enabled=True, beta=1, prune={"learnt_fraction": 0.5, "batch_factor": 2})
    (problem,) = _refused_one_row_short(config, 64, 256)  # 64 * 2 * (1 + 1) = 256 candidates
    assert "batch_size * sifting.prune.batch_factor 2 * (1 + beta) = 128 * 2" in problem
    # pruning alone (beta 0): the batch factor is what to lower
    alone = Sifting(enabled=True, beta=0, prune={"learnt_fraction": 0.7, "batch_factor": 3})
    assert _refused_one_row_short(alone, 64, 192) == [
        "sifting.prune.batch_factor: each step draws hyperparameters.batch_size * sifting.prune.batch_factor 3 * "
        "(1 + beta) = 192 * 1 = 192 candidates, more than the 191 training rows; lower sifting.prune.batch_factor "
        "or hyperparameters.batch_size"
    ]
    # sifting.noisy_share: the labels may call for the proxy's top quarter (4 * batch_size a step), said before any
    # compute, not after the filtering stage has measured them
    picking = parse_job(minimal(sifting={"enabled": True, "noisy_share": 0.1})).sifting
    assert picking.adaptive
    assert _refused_one_row_short(picking, 64, 256) == [
        "sifting.noisy_share: on a channel whose labels read clean, each step draws hyperparameters.batch_size * "
        "(1 + beta 3) = 256 candidates, more than the 255 training rows; lower hyperparameters.batch_size, or set "
        "sifting.noisy_share: null (pruning, no measure) or give the rule (sifting.beta)"
    ]
    # checked again on the rows the clean pick's prefilter kept (its duplicates dropped): the rule is the labels'
    # pick, which the user did not give; was "sifting.beta: ...; lower sifting.beta"
    with pytest.raises(SpecError) as refused:
        check_fits(picking.adapted(noisy=False), 64, 250, "rows the prefilter kept", picked=True)
    (problem,) = refused.value.problems
    assert problem.startswith("sifting.noisy_share: the rule the labels picked draws hyperparameters.batch_size * ")
    assert "256 candidates a step, more than the 250 rows the prefilter kept" in problem


def test_batch_factor_deals_its_larger_batches_only_in_the_epochs_that_prune_learnt_rows():
    config = Pruning(learnt_fraction=0.7, hardest_fraction=0.1, until=0.75, batch_factor=1.5)
    # epoch 0: no loss known yet; epochs 6 and 7: from until on, no learnt rows pruned
    assert [config.dealt_batch(64, epoch, 8) for epoch in range(8)] == [64] + [96] * 5 + [64] * 2
    assert config.dealt_batch(64) == 96  # the most any epoch deals (what check_fits checks)
    hardest_only = Pruning(learnt_fraction=0, hardest_fraction=0.1, batch_factor=2)
    assert hardest_only.dealt_batch(64, 3, 8) == 64  # no learnt rows pruned


def test_an_epoch_dealt_larger_batches_takes_fewer_steps_and_its_gradient_adds_up_to_a_whole_epoch(tmp_path):
    from trainyard import algorithms
    from trainyard.training.batches import StepData
    from trainyard.training.flops import FlopMeter
    from trainyard.training.plan import TrainingPlan

    prune = {"learnt_fraction": 0.7, "hardest_fraction": 0, "batch_factor": 2}
    job = parse_job(
        minimal(hyperparameters={"batch_size": 64, "epochs": 8}, sifting={"enabled": True, "beta": 0, "prune": prune})
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(4096, 3)).astype(np.float32), rng.integers(0, 2, 4096)
    plan = TrainingPlan("j", job.model_dump(mode="json"), str(tmp_path / "unused.npz"), None, {}, 1, "")
    model, loss_fn = algorithms.build(job.algorithm, job.hyperparameters, x, y, 2)
    data = StepData(job, plan, torch.from_numpy(x), torch.from_numpy(y), tmp_path, loss_fn, FlopMeter(model, loss_fn))
    assert [data.steps_per_epoch(1, epoch) for epoch in (0, 1, 6, 7)] == [64, 32, 32, 64]

    def epoch_gradient(epoch: int, start: int) -> tuple[float, list[int]]:
        """The epoch's summed step losses (each weighted and over its normaliser), and the rows each step trained."""
        total, trained = 0.0, []
        for index in range(data.steps_per_epoch(1, epoch)):
            xb, yb, normaliser = data.batch(model, epoch, index, start + index, 1, 0, 1)
            with torch.no_grad():
                losses = loss_fn(model(xb), yb)
            data.trained(losses)
            weights = data.weights if data.weights is not None else torch.ones_like(losses)
            total += float((losses * weights).sum()) / normaliser
            trained.append(len(xb))
        return total, trained

    whole, trained = epoch_gradient(0, 0)  # nothing known: every row trains, 64 a step, normalised by 64
    assert trained == [64] * 64
    pruned, trained = epoch_gradient(1, 64)  # 128 rows dealt a step, about 128 * (1 - 0.7 * below mean) train
    assert len(trained) == 32 and 64 < np.mean(trained) < 128
    # the model is unchanged, so each row's loss is its remembered one: InfoBatch's rescaling keeps the
    # epoch's gradient (a sum over half the steps, each over batch_size) that of a whole epoch
    assert pruned == pytest.approx(whole, rel=0.03)


def test_the_spec_checks_pruning():
    with pytest.raises(SpecError, match=r"sifting\.prune: a streamed channel"):
        parse_job(spec(reuse_loss_epochs=0, prune={"learnt_fraction": 0.5}))
    with pytest.raises(SpecError, match=r"sifting\.prune\.hardest_fraction"):
        parse_job(spec(prune={"hardest_fraction": 0.6}))
    with pytest.raises(SpecError, match=r"sifting\.prune\.learnt_fraction"):
        parse_job(spec(prune={"learnt_fraction": 1.0}))
    job = parse_job(spec(beta=0))  # beta 0: no keep rule; pruning off: nothing to refuse on a stream
    assert job.sifting.beta == 0 and not job.sifting.prune.active


def test_two_groups_prune_by_their_losses_and_agree_after_a_heal(trainyard_home, tmp_path):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        # 0.1 s a step until the restart is back: the survivor's last 100 steps outlast a restart on a busy
        # machine (3.5 s idle; at 0.04 s a step a CI run's survivor finished first and nothing healed)
        hyperparameters={"epochs": 24, "batch_size": 64, "learning_rate": 0.01, "step_sleep": 0.1}
        | {"slow_while": str(tmp_path / "slow")},
        # no keep rule: every row dealt is a candidate for pruning alone
        sifting={"enabled": True, "beta": 0}
        | {"prune": {"learnt_fraction": 0.7, "hardest_fraction": 0.1, "batch_factor": 2}},
        elastic={"fault_injection": [{"replica": 1, "at_step": 40, "kind": "kill"}]},
    )
    with slow_until(tmp_path / "slow", lambda: rejoined(folder / "replicas/1/attempt-1")):
        outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed"
    # 600 rows, 128 dealt a step (batch_factor 2) in epochs 1-20: 5 steps each, about 64 rows trained a step
    # once pruned; the first epoch (nothing known) and the last three (from until, 0.875) take 10 steps of 64
    assert [h["steps"] for h in outcome.history] == [10] + [5] * 20 + [10] * 3
    assert outcome.steps == 140 and outcome.steps_per_epoch == 10
    sifting = outcome.sifting
    assert outcome.flops["scoring"] == 0 and sifting["scored"] == 0  # pruning reads the training passes' losses
    assert sifting["pruned_learnt"] > 0 and sifting["pruned_hardest"] > 0
    left_out = sifting["pruned_learnt"] + sifting["pruned_hardest"]
    assert sifting["pruned_fraction"] == pytest.approx(left_out / sifting["prune_dealt"])
    assert outcome.samples_trained == sifting["prune_dealt"] - left_out  # dealt rows either train or sit out
    assert compute_section(outcome)["samples_seen"] == sifting["prune_dealt"]
    assert outcome.history[0]["pruned_fraction"] == 0  # nothing known yet
    # per class, what trained of what was dealt: the keep rule ranks nothing here, so this is what shows a
    # class sitting out (under a tenth of each class as the hardest, the learnt ones drawn at 0.7)
    trained = sifting["trained_fraction_by_class"]
    assert set(trained) == {"0", "1"} and all(0.3 < f < 1 for f in trained.values()), trained
    assert outcome.history[0]["trained_fraction_by_class"] == {"0": 1.0, "1": 1.0}
    assert all(set(h["trained_fraction_by_class"]) == {"0", "1"} for h in outcome.history)
    assert all(h["pruned_fraction"] > 0.1 for h in outcome.history[6:21])  # hardest out from epoch 6 (0.25)
    section = sifting_section(job, None, outcome)
    assert section["pruned_fraction_by_epoch"] == [h["pruned_fraction"] for h in outcome.history]
    assert "warning" not in section  # nothing was scored
    (recovery,) = outcome.recoveries
    assert recovery["source"] == "peer"
    states = [torch.load(folder / f"replicas/{r}/attempt-{a}/model.pt", weights_only=True) for r, a in ((0, 0), (1, 1))]
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)
