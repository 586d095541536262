"""The online sifter (``trainyard/sifting.py``): the keep rule's statistics, full batches, the class balance
guard, redone steps, and the groups' shares of a kept batch; no processes. Sifting inside a group's steps
is ``test_sifted_steps.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch


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


def test_a_loss_that_is_not_a_number_is_trained_on_and_not_remembered():
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    sifter = Sifter(Sifting(enabled=True, beta=1.0, loss_history_length=100), seed=0)
    losses = np.array([0.1, 0.2, np.nan, 0.3, 0.4, np.inf, 0.5, 0.6], dtype=np.float32)
    chosen = sifter.select(losses, None, keep=4, step=10, group=0)
    assert np.isfinite(sifter.history).all() and sorted(sifter.history.tolist()) == pytest.approx(
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    )
    assert sifter.scored == 8 and len(chosen) == 4
    # ranked hardest against the history: kept for sure, where a real loss above the history is too
    assert sifter.keep_probability(np.array([np.nan, 0.65, 0.35])).tolist() == pytest.approx([1.0, 1.0, 0.5])


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


def test_a_group_healed_while_its_peer_redoes_a_step_gets_the_committed_state():
    """torchft may hand a peer's state to a joining group between a try that did not commit and its redo:
    the try's losses are not part of it (the peer's redo undoes them; the healed group could not)."""
    from trainyard.pruning import LossMemory
    from trainyard.sifting import Sifter
    from trainyard.spec import Sifting

    sifter = Sifter(Sifting(enabled=True, beta=1.0, delay_steps=0), seed=0)
    memory = LossMemory(100, max_age=1)
    rng = np.random.default_rng(3)
    for step in range(4):
        memory.begin(step)
        memory.remember(rng.choice(100, 10, replace=False), rng.random(10).astype(np.float32), epoch=0)
        sifter.select(rng.random(22), None, 11, step, 0)
    committed = sifter.state_dict(step=4)["history"].clone(), memory.state_dict(step=4)
    memory.begin(4)
    memory.remember(np.arange(10), np.full(10, 9.0, dtype=np.float32), epoch=1)  # step 4's try: not committed
    sifter.select(rng.random(22), None, 11, 4, 0)
    # asked at step 4 (still the current step: the try did not commit), the state is the committed one
    assert torch.equal(sifter.state_dict(step=4)["history"], committed[0])
    for key, value in memory.state_dict(step=4).items():  # (rows never measured are NaN)
        torch.testing.assert_close(value, committed[1][key], rtol=0, atol=0, equal_nan=True)
    # once step 4 commits (the current step is 5), it is part of the state
    assert len(sifter.state_dict(step=5)["history"]) == len(committed[0]) + 22
    assert (memory.state_dict(step=5)["memory_loss"][:10] == 9.0).all()


def test_a_heal_after_a_try_that_did_not_commit_leaves_that_try_uncounted():
    """torchft agrees a commit within a group, not across groups: a peer may commit a step this group's try did
    not, and heal this group past it. That try's counts went with it; those of a try that committed stay."""
    from trainyard.pruning import LossMemory, Pruner
    from trainyard.sifting import Sifter
    from trainyard.spec import Pruning, Sifting

    sifter, memory = Sifter(Sifting(enabled=True, beta=1.0, delay_steps=0), seed=0), LossMemory(100, max_age=1)
    pruner = Pruner(Pruning(learnt_fraction=0.5, hardest_fraction=0.0), epochs=4, seed=0)
    rng = np.random.default_rng(5)

    def step(number: int, commit: bool) -> None:
        memory.begin(number)
        memory.reused += 3  # (as a step's scoring pass counts the losses it reused)
        sifter.select(rng.random(22), rng.integers(0, 2, 22), 11, number, 0)
        pruner.decide(np.arange(10), memory, 0, number)
        for part in (sifter, memory, pruner) if commit else ():
            part.committed()

    for number in range(4):
        step(number, commit=True)
    peer = sifter.state_dict(4) | memory.state_dict(4) | pruner.state_dict()
    counted = sifter.counts(), memory.reused, pruner.counts()
    step(4, commit=False)  # its peer committed step 4; this group's try did not, and it heals to step 5
    for part in (sifter, memory, pruner):
        part.load_state_dict(peer)
    assert (sifter.counts(), memory.reused, pruner.counts()) == counted
    step(5, commit=True)  # a heal after a committed try (a peer ran ahead alone) keeps it
    counted = sifter.counts(), memory.reused, pruner.counts()
    for part in (sifter, memory, pruner):
        part.load_state_dict(peer)
    assert (sifter.counts(), memory.reused, pruner.counts()) == counted


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


def test_the_top_order_and_class_counts_are_numpys_own_by_a_cheaper_way():
    # _highest_first and _classes replaced a lexsort with a seeded tie-break and np.unique (a digits step's sifting
    # work was twice as long): the same answers, ties, NaN and infinite scores included
    from trainyard.sifting import _classes, _highest_first

    rng = np.random.default_rng(0)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0])
    for case in range(2000):
        n = int(rng.integers(0, 12))
        scores = rng.random(n).astype(np.float32 if case % 2 else np.float64)
        if case % 3 == 0 and n:  # ties and special values drawn in
            scores[rng.integers(0, n, n // 2)] = rng.choice(specials, n // 2)
        seed = [7, case, 1]
        old = np.lexsort((np.random.default_rng(seed).random(n), -np.nan_to_num(scores, nan=np.inf)))
        assert (_highest_first(scores, seed) == old).all(), scores
        labels = rng.integers(0, 5, n)
        if n:
            numpys = np.unique(labels, return_inverse=True, return_counts=True)
            assert all((a == b).all() for a, b in zip(_classes(labels), numpys, strict=True))
