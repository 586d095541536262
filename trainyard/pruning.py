"""Remembered losses, and epoch-level pruning by them (``sifting.prune``, InfoBatch).

``LossMemory`` keeps each training row's last known loss: the keep rule ranks by it instead of scoring a
row again (``reuse_loss_epochs``), and the ``Pruner`` decides by it which rows sit out their step. Both
are part of a replica group's torchft state.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trainyard.sifting import counts_by_class
from trainyard.spec import Pruning


class LossMemory:
    """Each training row's last known loss and the epoch it was measured in (``reuse_loss_epochs``).

    A candidate whose loss is at most ``max_age`` epochs old is ranked by that loss instead of by a
    fresh scoring pass (Selective-Backprop's stale variant). The losses come from scoring passes and
    from the training forward pass itself, which computes each kept row's loss anyway, so a row that
    keeps being kept is never scored again. Rows skipped as easy are scored again once their loss is
    too old. Part of the group's torchft state, so a healed group reuses what its peer knew.
    """

    def __init__(self, rows: int, max_age: int):
        self.max_age = max_age
        self.loss = np.full(rows, np.nan, dtype=np.float32)
        self.epoch = np.full(rows, -1, dtype=np.int32)
        self.reused = 0
        # the step, the reused count before it and what its writes replaced: a redone step starts from it
        self._undo: tuple[int, int, list] | None = None

    def begin(self, step: int) -> None:
        """A step that did not commit is done again (torchft), with the same parameters: undo what its
        first try remembered and counted, so the redo scores and keeps as the first try did (the training
        forward's losses, in training mode, are not a scoring pass's) and its reused losses count once."""
        if self._undo is not None and self._undo[0] == step:
            _, self.reused, replaced = self._undo
            for rows, loss, epoch in reversed(replaced):
                self.loss[rows], self.epoch[rows] = loss, epoch
        self._undo = (step, self.reused, [])

    def committed(self) -> None:
        """The last try committed: it is never redone, and a heal from now on keeps what it counted."""
        self._undo = None

    def fresh(self, rows: np.ndarray, epoch: int) -> np.ndarray:
        """Which of ``rows`` have a loss recent enough to reuse at ``epoch``."""
        measured = self.epoch[rows]
        return (measured >= 0) & (epoch - measured <= self.max_age)

    def remember(self, rows: np.ndarray, losses: np.ndarray, epoch: int) -> None:
        if self._undo is not None:
            self._undo[2].append((rows, self.loss[rows], self.epoch[rows]))  # fancy indexing: copies
        self.loss[rows] = losses
        self.epoch[rows] = epoch

    def state_dict(self, step: int | None = None) -> dict:
        """The remembered losses; without what an uncommitted try of ``step`` (the group's current step)
        wrote, which its redo will undo (``Sifter.state_dict``)."""
        loss, epoch = self.loss.copy(), self.epoch.copy()
        if step is not None and self._undo is not None and self._undo[0] == step:
            for rows, was_loss, was_epoch in reversed(self._undo[2]):
                loss[rows], epoch[rows] = was_loss, was_epoch
        return {"memory_loss": torch.from_numpy(loss), "memory_epoch": torch.from_numpy(epoch)}

    def load_state_dict(self, state: dict) -> None:
        if "memory_loss" in state:
            if self._undo is not None:  # its last try never committed (it is behind): its reused count goes
                self.begin(self._undo[0])
            self.loss = state["memory_loss"].numpy().astype(np.float32)
            self.epoch = state["memory_epoch"].numpy().astype(np.int32)
            self._undo = None  # a healed group's memory is its peer's


class Pruner:
    """Which of a group's rows sit out their step, by their last known losses (``sifting.prune``).

    InfoBatch's rule, decided row by row inside each group's own batch, so groups need not agree on
    anything but the epoch's thresholds; the kept learnt rows' weight ``1 / (1 - r)`` keeps the
    step's gradient an unbiased estimate of its whole batch's. With ``batch_factor`` above 1 the pruning
    epochs are dealt larger batches, fewer of them (``Pruning.dealt_batch``, a function of the epoch
    alone, so every group takes the same steps). The thresholds (the mean of the known
    losses, and the loss above which a row is among the hardest) are fixed once per epoch from the
    group's loss memory and are part of the torchft state, so a group that heals from a peer
    mid-epoch prunes as its peer does. In a classification job each class keeps at least
    ``min_class_fraction`` of its rows from the hardest rule (``labels``, each row's class index; the class
    balance guard of sifting): a row sits out when its loss is above both the cut over all rows and its
    class's ``min_class_fraction`` quantile. A class the model still gets wrong, all of whose rows are harder
    than the others', would otherwise sit out whole, and for good (a row left out is not measured again);
    a class the cut over all rows takes less of loses what it did. The learnt rule needs no floor: its kept
    rows' weights keep each class's share of the gradient in expectation. Which learnt rows sit out is a
    hash of (seed, epoch, row): the same in every group and on a redone step. Rows with no known loss
    yet always train.
    """

    def __init__(
        self,
        config: Pruning,
        epochs: int,
        seed: int,
        classes: int | None = None,
        labels: np.ndarray | None = None,
        min_class_fraction: float = 0.5,
    ):
        self.config, self.epochs, self.seed, self.min_class_fraction = config, epochs, seed, min_class_fraction
        self.classes, self.labels = classes or 0, labels if classes and labels is not None else None
        # the loss a row must also exceed to count among the hardest (hardest_min_loss)
        floor = config.hardest_min_loss
        self.hardest_floor = (math.log(classes) if classes and classes > 1 else 0.0) if floor == "chance" else floor
        # (epoch, mean, hardest cut: one per class, or one for all rows) of the epoch
        self.thresholds: tuple[int, float, np.ndarray] | None = None
        self.dealt = 0  # rows that came to the pruner (those with no known loss included)
        self.pruned = 0  # learnt rows left out
        self.hardest = 0  # rows left out as among the hardest
        # per class (classification): rows dealt, and rows left out (learnt or hardest), by class index
        self.dealt_by_class = np.zeros(self.classes if self.labels is not None else 0, dtype=np.int64)
        self.out_by_class = np.zeros_like(self.dealt_by_class)
        self._undo: tuple[int, tuple] | None = None  # the step, and the counts before it

    def phase(self, epoch: int) -> tuple[bool, bool]:
        """``(learnt rows pruned, hardest rows left out)`` in ``epoch`` (0-based)."""
        hardest = self.config.hardest_fraction > 0 and epoch / max(self.epochs, 1) >= self.config.hardest_after
        return self.config.prunes_learnt(epoch, self.epochs), hardest

    def decide(self, rows: np.ndarray, memory: LossMemory, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(kept, weights)``: the positions in ``rows`` that train this step, and each one's loss weight."""
        self._begin(step)
        self.dealt += len(rows)
        if self.labels is not None:
            np.add.at(self.dealt_by_class, self.labels[rows], 1)
        learnt_on, hardest_on = self.phase(epoch)
        weights = np.ones(len(rows), dtype=np.float32)
        if not (learnt_on or hardest_on) or not len(rows):
            return np.arange(len(rows)), weights
        _, mean, cuts = self._epoch_thresholds(memory, epoch)
        cut = cuts[self.labels[rows]] if self.labels is not None else cuts[0]
        loss = memory.loss[rows]
        known = (memory.epoch[rows] >= 0) & np.isfinite(loss)  # a loss that is not a number: its row trains
        out = np.zeros(len(rows), dtype=bool)
        if hardest_on:
            hard = known & (loss > cut) & (loss > self.hardest_floor)
            out |= hard
            self.hardest += int(hard.sum())
        if learnt_on:
            r = self.config.learnt_fraction
            learnt = known & (loss < mean) & ~out
            drawn = learnt & (_uniform(self.seed, epoch, rows) < r)
            out |= drawn
            weights[learnt & ~drawn] = 1.0 / (1.0 - r)
            self.pruned += int(drawn.sum())
        if self.labels is not None:
            np.add.at(self.out_by_class, self.labels[rows[out]], 1)
        kept = np.flatnonzero(~out)
        return kept, weights[kept]

    def _epoch_thresholds(self, memory: LossMemory, epoch: int) -> tuple[int, float, np.ndarray]:
        if self.thresholds is None or self.thresholds[0] != epoch:
            # a loss that is not a number would make every threshold one (nothing pruned): left out, and
            # its row, compared with no threshold, trains
            is_known = (memory.epoch >= 0) & np.isfinite(memory.loss)
            known = memory.loss[is_known]
            cuts = np.array([self._cut(known)])
            if self.labels is not None:  # each class's floor, where above the cut over all rows
                by_class = [self._floor(memory.loss[is_known & (self.labels == c)]) for c in range(self.classes)]
                cuts = np.maximum(cuts[0], np.array(by_class))
            # nothing known yet (a job's first epoch): every row trains
            self.thresholds = (epoch, float(known.mean()) if len(known) else -np.inf, cuts)
        return self.thresholds

    def _cut(self, known: np.ndarray) -> float:
        """The loss above which a row of ``known`` losses is among the hardest (inf: none is)."""
        if not self.config.hardest_fraction or not len(known):
            return np.inf
        return float(np.quantile(known, 1.0 - self.config.hardest_fraction))

    def _floor(self, known: np.ndarray) -> float:
        """The loss a class's row must also exceed to sit out as among the hardest: its class's
        ``min_class_fraction`` quantile, so that at least that fraction of the class trains."""
        if not len(known):
            return np.inf
        return float(np.quantile(known, self.min_class_fraction))

    def _begin(self, step: int) -> None:
        """A redone step (torchft) counts once."""
        if self._undo is not None and self._undo[0] == step:
            self.dealt, self.pruned, self.hardest, dealt_by_class, out_by_class = self._undo[1]
            self.dealt_by_class, self.out_by_class = dealt_by_class.copy(), out_by_class.copy()
        counts = (self.dealt, self.pruned, self.hardest, self.dealt_by_class.copy(), self.out_by_class.copy())
        self._undo = (step, counts)

    def counts(self) -> dict:
        """Rows dealt to the pruner, and those it left out: learnt, and among the hardest; and per class
        (by class index, classification), the rows dealt and those left out either way."""
        counts = {"prune_dealt": self.dealt, "pruned_learnt": self.pruned, "pruned_hardest": self.hardest}
        if self.labels is None:
            return counts
        by_class = {
            "prune_dealt_by_class": counts_by_class(self.dealt_by_class),
            "pruned_by_class": counts_by_class(self.out_by_class),
        }
        return counts | by_class

    def state_dict(self) -> dict:
        epoch, mean, cuts = self.thresholds or (-1, 0.0, np.zeros(1))
        return {"prune_thresholds": torch.tensor([epoch, mean, *cuts.tolist()], dtype=torch.float64)}

    def load_state_dict(self, state: dict) -> None:
        if "prune_thresholds" in state:
            epoch, mean, *cuts = state["prune_thresholds"].tolist()
            self.thresholds = (int(epoch), mean, np.array(cuts)) if epoch >= 0 else None
            if self._undo is not None:  # its last try never committed (it is behind): its counts go
                self._begin(self._undo[0])
            self._undo = None

    def committed(self) -> None:
        """The last try committed: it is never redone, and a heal from now on keeps what it counted."""
        self._undo = None


def _uniform(seed: int, epoch: int, rows: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) for each row, a function of (seed, epoch, row) alone (splitmix64)."""
    with np.errstate(over="ignore"):
        z = rows.astype(np.uint64) + np.uint64((seed * 1_000_003 + epoch * 7919) % 2**63) * np.uint64(
            0x9E3779B97F4A7C15
        )
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)
