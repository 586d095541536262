"""Online sifting: train only on the samples a no-grad forward pass finds informative.

The keep rule is smart sifting's (Selective-Backprop's): a sample whose loss sits at percentile
``p`` of the recent losses (``loss_history_length`` of them) is kept with probability ``p ** beta``.
Percentiles of fresh losses against their own recent history are uniform in steady state, so the
expected kept fraction is ``E[U ** beta] = 1 / (1 + beta)``.

Batches stay full and every group takes the same number of steps: each step draws
``batch_size * (1 + beta)`` candidates (the sampler's global batch), scores them, and keeps exactly
``batch_size`` of them by systematic sampling with inclusion probabilities ``c * p ** beta`` (capped
at 1), ``c`` making them sum to ``batch_size`` (``inclusion_sample``; seeded by the step and group, so a
redone step keeps the same samples). In steady state ``c`` is 1: each candidate is kept with
smart sifting's own probability, not a flattened one (drawing ``batch_size`` without replacement
with weights ``p ** beta`` keeps a 99th-percentile loss about 80% of the time instead of 99%, at
beta 1). A fixed number of candidates per step keeps each group's data position tied to the step
rather than to its own sifting history.

With ``sifting.selection: top`` the ``batch_size`` highest-scored candidates are kept instead (RHO-LOSS's
rule; selection via proxy's with ``sifting.score: proxy``): no draw, the same counts.

A class balance guard keeps every class present among the candidates at no less than
``min_class_fraction`` of its proportional share of the kept batch, rounded up: a class with only a
few candidates in a group's share keeps at least one. The loss history is part of
the replica group's torchft state, so a group that heals from a peer sifts as its peer does.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trainyard.errors import SpecError
from trainyard.spec import Sifting


def check_fits(config: Sifting, batch_size: int, rows: int, whose: str = "training rows", picked: bool = False) -> None:
    """Refuse a sifting job whose step would draw more candidates than there are rows: its one step an
    epoch would keep ``1 / (1 + beta)`` of them, not a full batch, and most of the data would go untrained.
    ``picked``: ``config`` is the rule the labels picked (``Sifting.adapted``), which the user did not give."""
    if not config.enabled:
        return
    beta, prune = config.settled()
    dealt = prune.dealt_batch(batch_size)
    candidates = candidate_batch(beta, dealt)
    if candidates > rows and picked:  # (the duplicates the clean pick's prefilter dropped took the rows below it)
        raise SpecError(
            [
                f"sifting.noisy_share: the rule the labels picked draws hyperparameters.batch_size * (1 + beta "
                f"{beta:g}) = {candidates} candidates a step, more than the {rows} {whose}; lower "
                "hyperparameters.batch_size, or set sifting.noisy_share: null (pruning, no measure) or give the "
                "rule (sifting.beta)"
            ]
        )
    if candidates > rows:
        factor = f" * sifting.prune.batch_factor {prune.batch_factor:g}" if dealt != batch_size else ""
        # with beta 0 (pruning alone, sifting.enabled's default) only the batch factor makes a step draw more
        knobs = (["sifting.beta"] if beta else []) + (["sifting.prune.batch_factor"] if factor else [])
        fixes = ", ".join(knobs) + (" or " if knobs else "") + "hyperparameters.batch_size"
        raise SpecError(
            [
                f"{(knobs or ['hyperparameters.batch_size'])[0]}: each step draws hyperparameters.batch_size{factor} "
                f"* (1 + beta) = {dealt} * {1 + beta:g} = {candidates} candidates, more than the {rows} "
                f"{whose}; lower {fixes}"
            ]
        )
    if config.adaptive:  # the labels may call for the proxy's top quarter, which draws more: said before any compute
        clean_beta = config.adapted(noisy=False).settled()[0]
        clean = candidate_batch(clean_beta, batch_size)
        if clean > rows:
            raise SpecError(
                [
                    f"sifting.noisy_share: on a channel whose labels read clean, each step draws "
                    f"hyperparameters.batch_size * (1 + beta {clean_beta:g}) = {clean} candidates, more "
                    f"than the {rows} {whose}; lower hyperparameters.batch_size, or set sifting.noisy_share: null "
                    "(pruning, no measure) or give the rule (sifting.beta)"
                ]
            )


def candidate_batch(beta: float, batch_size: int) -> int:
    """The global batch of candidates a step draws for ``batch_size`` kept samples."""
    return max(batch_size, round(batch_size * (1.0 + beta)))


class Sifter:
    """The keep rule and its loss history, for one replica group."""

    def __init__(self, config: Sifting, seed: int):
        assert config.beta is not None, "sifting used before Sifting.resolved"
        self.config, self.seed, self.beta = config, seed, config.beta
        self.history = np.empty(0, dtype=np.float32)
        self.scored = 0
        self.kept = 0
        self.passed_over = 0  # candidates the keep rule ranked and did not keep
        # Before delay_steps, and in a step where a group's share of the kept batch is 0, the candidates
        # are not ranked: the first ones are trained on (a uniform draw), the rest left out unscored.
        self.unsifted = 0
        self.skipped = 0
        # candidates ranked and kept, per class index (replaced at each count, never changed in place: _begin's undo
        # keeps references)
        self._scored_counts = np.zeros(0, dtype=np.int64)
        self._kept_counts = np.zeros(0, dtype=np.int64)
        # The ranked candidates' keep probabilities, added up: the share smart sifting's rule would keep
        # on its own, which moves as the losses move against the history. The batch keeps 1 / (1 + beta)
        # of the candidates whatever it is (full batches), so the kept fraction alone cannot show that.
        self.probability_sum = 0.0
        self._undo: tuple | None = None  # the step and the state before it: a redone step starts from it

    @property
    def kept_by_class(self) -> dict[str, int]:
        """Candidates the keep rule kept, per class (index, as a string)."""
        return counts_by_class(self._kept_counts)

    @property
    def scored_by_class(self) -> dict[str, int]:
        """Candidates the keep rule ranked, per class (index, as a string)."""
        return counts_by_class(self._scored_counts)

    def candidate_batch(self, batch_size: int) -> int:
        """The global batch of candidates to draw for ``batch_size`` kept samples."""
        return candidate_batch(self.beta, batch_size)

    def keep_count(self, candidates: int) -> int:
        """How many of ``candidates`` one group alone keeps (0 only when it has none)."""
        return self.keep_counts([candidates])[0]

    def keep_counts(self, candidates: list[int], step: int = 0) -> list[int]:
        """How many each of the quorum's groups keeps of its ``candidates``: the step's kept batch,
        ``1 / (1 + beta)`` of all of them, dealt in proportion by largest remainder (ties to the rank
        ``step`` comes to first, so no group always gets the odd row and each group's kept fraction is the
        job's), so that the groups' batches add up to it whatever their number (each rounding its own
        share could miss it by a row or two per step). A group with candidates keeps at least one unless
        the step keeps fewer rows than there are such groups (a short last step of an epoch): one that
        keeps none trains on an empty batch and its candidates count as skipped. Every group computes
        the same counts on its own."""
        total = sum(candidates)
        if total <= 0:
            return [0] * len(candidates)
        keep = max(1, round(total / (1.0 + self.beta)))  # (1 + beta candidates a kept row)
        quotas = [n * keep / total for n in candidates]
        counts = [math.floor(q) for q in quotas]
        n = len(counts)
        for i in sorted(range(n), key=lambda i: (counts[i] - quotas[i], (i - step) % n))[: keep - sum(counts)]:
            counts[i] += 1
        for i, n in enumerate(candidates):
            donor = max(range(len(counts)), key=lambda j: (counts[j], -j))
            if n > 0 and counts[i] == 0 and counts[donor] > 1:
                counts[i], counts[donor] = 1, counts[donor] - 1
        return counts

    def active(self, step: int) -> bool:
        """Sifting starts after ``delay_steps``; before, the kept samples are a uniform draw. With beta 0
        there is no keep rule: every candidate trains, unscored."""
        return self.beta > 0 and step >= self.config.delay

    def keep_probability(self, losses: np.ndarray) -> np.ndarray:
        """``percentile(loss) ** beta`` against the history (1 while the history is empty)."""
        if not len(self.history):
            return np.ones(len(losses))
        ranked = np.sort(self.history)
        below = np.searchsorted(ranked, losses, side="left")
        through = np.searchsorted(ranked, losses, side="right")
        percentile = (below + through) / (2.0 * len(ranked))  # ties count half
        return percentile**self.beta

    def select(self, losses: np.ndarray, labels: np.ndarray | None, keep: int, step: int, group: int) -> np.ndarray:
        """Indices of the ``keep`` candidates to train on; the losses then join the history. ``labels``: each
        candidate's class index, for the class balance guard and the counts by class (None: a regression)."""
        self._begin(step)
        weights = self.keep_probability(losses)
        if self.config.selection == "top":  # the highest scores (a NaN the highest: see _remember), ties at random
            order = _highest_first(losses, [self.seed, step, group])
            chosen = order[:keep]
        else:
            rng = np.random.default_rng([self.seed, step, group])
            chosen = inclusion_sample(weights, keep, rng)
            order = np.lexsort((rng.random(len(losses)), -weights))  # most likely kept first, ties at random
        if labels is not None:
            chosen = self._balance(chosen, order, labels, keep)
        self.probability_sum += float(weights.sum())
        self._remember(losses, labels, chosen)
        return np.sort(chosen)

    def record_uniform(self, candidates: int, keep: int, step: int, group: int) -> None:
        """Count a step whose candidates were not ranked (before sifting starts): its first ``keep`` were
        trained on, the others left out unscored. Neither counts as scored or kept by the keep rule."""
        self._begin(step)
        self.unsifted += keep
        self.skipped += candidates - keep

    def _begin(self, step: int) -> None:
        """A step that did not commit is done again (torchft): undo what its first try added to the
        history and the counts, so it selects as before and is counted once."""
        # Keyed on the step alone: a sifter is one group's, and its rank (``group``) changes when the redo's
        # quorum lost a lower-ranked peer, which is when steps are redone.
        if self._undo is not None and self._undo[0] == step:
            history, counts, self._kept_counts, self._scored_counts = self._undo[1]
            self.history = history
            self.scored, self.kept, self.passed_over, self.unsifted, self.skipped, self.probability_sum = counts
        # (the arrays are replaced, never changed in place: keeping references is enough)
        counts = (self.scored, self.kept, self.passed_over, self.unsifted, self.skipped, self.probability_sum)
        self._undo = (step, (self.history, counts, self._kept_counts, self._scored_counts))

    def _balance(self, chosen: np.ndarray, order: np.ndarray, labels: np.ndarray, keep: int) -> np.ndarray:
        """Swap in each starved class's best candidates for the weakest kept ones of classes with
        some to spare (``order``: the candidates by keep probability, or by score with ``selection: top``,
        highest first).

        Array operations, not a loop over the classes (a 1,000-class batch of 4,096 took half a second
        a step in Python). The swaps are those of taking the starved classes in label order, each its
        best candidates not kept, and for each the weakest kept candidate of a class still above its
        floor: a class above its floor never falls below it nor takes candidates in, so the donors are
        each such class's weakest ``surplus`` kept candidates, taken weakest first."""
        classes, inverse, counts = _classes(labels)
        need = np.ceil(self.config.min_class_fraction * keep * counts / len(labels)).astype(np.int64)
        # Rounded up, the floors can add up to more than the batch (a floor near 1, many small classes):
        # the largest give way first, so every class keeps one whenever the batch has room for each.
        need = _give_way(need, int(need.sum()) - keep)
        kept = np.zeros(len(labels), dtype=bool)
        kept[chosen] = True
        have = np.bincount(inverse[chosen], minlength=len(classes))
        short, surplus = np.maximum(need - have, 0), np.maximum(have - need, 0)
        if not short.any():
            return np.flatnonzero(kept)
        best_left_out = order[~kept[order]]
        spare = best_left_out[_occurrence(inverse[best_left_out]) < short[inverse[best_left_out]]]
        spare = spare[np.argsort(inverse[spare], kind="stable")]  # class by class, in label order
        weakest_kept = order[::-1][kept[order[::-1]]]
        donors = weakest_kept[_occurrence(inverse[weakest_kept]) < surplus[inverse[weakest_kept]]]
        swaps = min(len(spare), len(donors))
        kept[donors[:swaps]], kept[spare[:swaps]] = False, True
        return np.flatnonzero(kept)

    def remember_trained(self, losses: np.ndarray) -> None:
        """Losses of rows trained before sifting starts (``delay_steps``; the training forward's, free) into the
        history the first sifted steps rank against. Part of the step's try: a redone step undoes them (_begin)."""
        self._add_history(losses)

    def _add_history(self, losses: np.ndarray) -> None:
        # A loss that is not a number is trained on (ranked hardest: the job's divergence check sees it) but
        # not remembered: in the history it would sit above every real loss for ``loss_history_length`` steps.
        finite = losses[np.isfinite(losses)].astype(np.float32)
        self.history = np.concatenate([self.history, finite])[-self.config.loss_history_length :]

    def _remember(self, losses: np.ndarray, labels: np.ndarray | None, chosen: np.ndarray) -> None:
        self._add_history(losses)
        self.scored += len(losses)
        self.kept += len(chosen)
        self.passed_over += len(losses) - len(chosen)
        if labels is not None:
            self._scored_counts = _counted(self._scored_counts, labels)
            self._kept_counts = _counted(self._kept_counts, labels[chosen])

    def state_dict(self, step: int | None = None) -> dict:
        """What a healing group takes from its peer. ``step``: the group's current (next uncommitted) step;
        when its last try was of that step, the try did not commit and is left out, as its redo will undo it
        here (a group healed now would otherwise keep it, and rank against another history)."""
        history = self._undo[1][0] if step is not None and self._undo is not None and self._undo[0] == step else None
        return {"history": torch.from_numpy((self.history if history is None else history).copy())}

    def load_state_dict(self, state: dict) -> None:
        if self._undo is not None:  # behind its peers, its last try never committed: its counts go, as its history
            self._begin(self._undo[0])
        self.history = state["history"].numpy().astype(np.float32)
        self._undo = None  # a healed group's history is its peer's

    def committed(self) -> None:
        """The last try committed: it is never redone, and a heal from now on keeps what it counted."""
        self._undo = None

    def counts(self) -> dict:
        """The running counts: what ranked, kept and passed over, overall and per class, and the candidates
        not ranked (trained on, or left out, before sifting started). Groups' counts add up to the job's."""
        return {
            "score": self.config.score,  # in every count: a killed attempt's counts are all the job may have
            "scored": self.scored,
            "kept": self.kept,
            "passed_over": self.passed_over,
            "unsifted": self.unsifted,
            "skipped": self.skipped,
            "kept_by_class": self.kept_by_class,
            "scored_by_class": self.scored_by_class,
            "keep_probability_sum": self.probability_sum,
        }

    def report(self) -> dict:
        """The counts, and the kept fraction overall and per class (of the candidates this group ranked)."""
        return (
            {"score": self.config.score}
            | self.counts()
            | {
                "kept_fraction": self.kept / self.scored if self.scored else None,  # nothing ranked yet
                "mean_keep_probability": self.probability_sum / self.scored if self.scored else None,
                # groups' reports are added up by count (above), not by averaging these fractions
                "kept_fraction_by_class": fractions_by_class(self.kept_by_class, self.scored_by_class),
            }
        )


def fractions_by_class(kept: dict[str, int], ranked: dict[str, int]) -> dict[str, float]:
    """Each class's kept fraction of its candidates the keep rule ranked (classes ranked at least once)."""
    return {c: kept.get(c, 0) / n for c, n in sorted(ranked.items()) if n}


def _highest_first(scores: np.ndarray, seed: list[int]) -> np.ndarray:
    """Indices of ``scores``, highest first (a NaN the highest), ties in a random order seeded by ``seed``.
    The generator is made only where two scores tie: made and sorted with, it was a third of the keep rule's
    time on digits' 192 candidates a step, and without a tie the order is the one it would give."""
    key = -scores
    if not np.isfinite(key).all():  # a NaN first, then an infinite loss (nan_to_num copies: only where needed)
        key = -np.nan_to_num(scores, nan=np.inf)
    order = np.argsort(key, kind="stable")
    ranked = key[order]
    if (ranked[1:] != ranked[:-1]).all():
        return order
    return np.lexsort((np.random.default_rng(seed).random(len(scores)), key))


def _classes(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(labels, return_inverse=True, return_counts=True)`` of class indices (non-negative integers,
    as ``select`` takes them), by a count."""
    counts = np.bincount(labels)
    classes = np.flatnonzero(counts)
    position = np.zeros(len(counts), dtype=np.int64)
    position[classes] = np.arange(len(classes))
    return classes, position[labels], counts[classes]


def _counted(counts: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``counts`` (per class index) with ``labels`` (class indices) counted in: a new array."""
    added = np.bincount(labels, minlength=len(counts))
    added[: len(counts)] += counts
    return added


def counts_by_class(counts: np.ndarray) -> dict[str, int]:
    """Per-class counts (an array by class index) as reports hold them: ``{class index as a string: count}``,
    classes counted once or more (the sifter's and the pruner's)."""
    counted = np.flatnonzero(counts)
    return dict(zip(map(str, counted.tolist()), counts[counted].tolist(), strict=True))


def _give_way(need: np.ndarray, excess: int) -> np.ndarray:
    """``need`` lowered by ``excess`` in all, a row at a time from the largest (ties to the last class):
    every floor above some level comes down to it, and the last classes at it one row below."""
    if excess <= 0:
        return need
    ascending = np.sort(need)
    above = np.concatenate([np.cumsum(ascending[::-1])[::-1], [0]])  # above[i]: the sum of ascending[i:]
    levels = np.arange(ascending[-1] + 1)
    first_above = np.searchsorted(ascending, levels, side="right")
    given = above[first_above] - (len(need) - first_above) * levels  # rows given way to bring all to a level
    level = int(np.argmax(given <= excess))  # the lowest level that this excess reaches
    lowered = np.minimum(need, level)
    at_level = np.flatnonzero(need >= level)
    lowered[at_level[len(at_level) - (excess - int(given[level])) :]] -= 1
    return lowered


def _occurrence(keys: np.ndarray) -> np.ndarray:
    """Each item's count of earlier items with its key: 0 for a key's first, 1 for its second..."""
    by_key = np.argsort(keys, kind="stable")
    ranked = keys[by_key]
    occurrence = np.empty(len(keys), dtype=np.int64)
    occurrence[by_key] = np.arange(len(keys)) - np.searchsorted(ranked, ranked, side="left")
    return occurrence


def inclusion_sample(weights: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` distinct indices, index ``i`` among them with probability ``min(1, c * weights[i])``, ``c``
    such that these sum to ``k``: Madow's systematic sampling, over the items in a random order (the
    order decides only which items tend to be drawn together)."""
    n = len(weights)
    if k >= n:
        return np.arange(n)
    w = np.maximum(np.asarray(weights, dtype=np.float64), 1e-12)
    certain = np.zeros(n, dtype=bool)
    while True:  # an item whose scaled weight reaches 1 is taken for certain, and the rest rescaled
        scale = (k - certain.sum()) / w[~certain].sum()
        over = ~certain & (w * scale >= 1.0)
        if not over.any():
            break
        certain |= over
    probability = np.where(certain, 1.0, w * scale)
    order = rng.permutation(n)
    edges = np.cumsum(probability[order])
    edges *= k / edges[-1]  # exactly k, whatever the rounding
    # One point in each unit interval: every item's span is at most 1 long, so it catches at most one.
    hits = np.minimum(np.searchsorted(edges, rng.random() + np.arange(k), side="right"), n - 1)
    picked = np.unique(order[hits])
    if len(picked) < k:  # a point on a rounding edge: top up with the likeliest items not picked
        ranked = np.argsort(-probability, kind="stable")
        taken = np.zeros(n, dtype=bool)
        taken[picked] = True
        picked = np.union1d(picked, ranked[~taken[ranked]][: k - len(picked)])
    return picked
