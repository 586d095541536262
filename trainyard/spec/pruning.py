"""``sifting.prune``: epoch-level pruning of rows by their last known loss (InfoBatch), and its defaults."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainyard.spec.base import _Model


class Pruning(_Model):
    """Epoch-level pruning by each row's last known loss, in every replica group's training loop.

    InfoBatch's rule (Qin et al., ICLR 2024): a row whose last loss is below the mean of the known
    losses is left out of its step with probability ``learnt_fraction``, and the ones kept count
    ``1 / (1 - learnt_fraction)``, so a step's gradient stays an unbiased estimate of its whole batch's;
    from ``until`` of the epochs on, every such row trains again. With label noise, the rows whose
    loss stays highest once the network has fitted the clean labels (networks fit clean labels
    before noisy ones) are mostly mislabelled: ``hardest_fraction`` of them are left out from
    ``hardest_after`` of the epochs on, those above ``hardest_min_loss`` only (a classifier's: less likely
    than chance). The losses are the training forward pass's own (and any scoring pass's): pruning
    costs no extra FLOPs. ``batch_factor`` cuts the pruning epochs' steps as well as their rows.
    """

    # The defaults are the combination benchmarks/sifting.py found best (DEFAULT_PRUNING), so that a prune section
    # giving one setting (a form's, or `prune: {until: 0.8}`) tunes that combination, not an inert one.
    learnt_fraction: float = Field(
        default=0.7,
        ge=0,
        lt=1,
        description="Probability that a row whose last loss is below the mean is left out of its step; the kept "
        "ones count 1 / (1 - this). 0 turns it off.",
    )
    hardest_fraction: float = Field(
        default=0.1,
        ge=0,
        lt=0.5,
        description="Share of the rows with the highest last losses left out (likely mislabelled), from "
        "hardest_after on. 0 turns it off. Default: 0.1 for a classifier, 0 for regression.",
    )
    hardest_min_loss: float | Literal["chance"] = Field(
        default="chance",
        description="A row is left out as among the hardest only if its last loss is also above this. 'chance': "
        "ln(number of classes) for a classification job, the cross-entropy of a uniform guess, so only rows whose "
        "label the model finds less likely than chance go (wrong labels, not a clean set's hard rows); no floor for "
        "regression. Give a number (0: none) for a classifier whose loss is not cross-entropy.",
    )
    hardest_after: float = Field(
        default=0.25,
        ge=0,
        le=1,
        description="Fraction of the epochs before the hardest rows are left out: earlier, they are mostly "
        "clean rows not learnt yet.",
    )
    until: float = Field(
        default=0.875,
        ge=0,
        le=1,
        description="Fraction of the epochs after which every row below the mean trains again (InfoBatch's "
        "annealing); the hardest rows stay out.",
    )

    batch_factor: float = Field(
        default=3.0,
        ge=1,
        le=8,
        description="Rows dealt a step in the epochs that prune learnt rows (the second epoch on, until `until`), as "
        "a multiple of batch_size (with beta > 0, of the keep rule's kept batch): about batch_size rows still train a "
        "step once pruning has left some out, and such an epoch has 1 / batch_factor of the steps, as InfoBatch's "
        "pruned epochs do (a step's fixed costs are paid less often). A step's loss is then divided by batch_size, "
        "not by the rows dealt, so an epoch's gradient adds up to a whole epoch's. 1: the steps of an unpruned job, "
        "each on fewer rows.",
    )

    @property
    def active(self) -> bool:
        """Whether any row can be left out."""
        return self.learnt_fraction > 0 or self.hardest_fraction > 0

    def prunes_learnt(self, epoch: int, epochs: int) -> bool:
        """Whether learnt rows are left out in ``epoch`` (0-based) of a job of ``epochs`` epochs."""
        return self.learnt_fraction > 0 and epoch / max(epochs, 1) < self.until

    def dealt_batch(self, batch_size: int, epoch: int | None = None, epochs: int = 1) -> int:
        """The rows dealt a step (kept by the keep rule, with beta > 0) for ``batch_size`` in ``epoch`` of
        ``epochs``; without ``epoch``, the most any epoch deals. The first epoch has no known losses to prune
        by, and the epochs that prune no learnt rows (from ``until`` on, or all with ``learnt_fraction`` 0)
        are dealt ``batch_size``."""
        if not self.learnt_fraction or (epoch is not None and (epoch == 0 or not self.prunes_learnt(epoch, epochs))):
            return batch_size
        return max(batch_size, round(batch_size * self.batch_factor))


# sifting.prune left unset with no keep rule, on a file-mode channel: benchmarks/sifting.py's pick (stops 28-33, 35, 36,
# 49, 50)
DEFAULT_PRUNING = {
    name: Pruning.model_fields[name].default for name in ("learnt_fraction", "hardest_fraction", "batch_factor")
}
# No row left out: sifting.prune left unset beside the keep rule, or on a streamed channel.
PRUNING_OFF = {"learnt_fraction": 0.0, "hardest_fraction": 0.0, "batch_factor": 1.0}
