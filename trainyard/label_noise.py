"""How noisy a classifier's training labels look, for the filtering stage to pick online sifting's rule.

With ``sifting.noisy_share`` set and the online rule left unset (``Sifting.adaptive``), sifting trains on
the rows that teach the model most, and which those are depends on the labels: on a clean channel, the
rows a small proxy model finds hardest (``sifting.score: proxy``, the top quarter of each step's
candidates: ``spec.sifting.CLEAN_CHANNEL``); on a noisy one those are its wrong labels, and pruning
(InfoBatch's rule, the hardest rows left out once the model has fitted the clean ones) is what gains
(``benchmarks/README.md``, stops 47-48 and 51).

The measure is the prefilter's cross-fitting (``reference_losses.held_out_losses``, its reference
settings): two small reference models, each trained briefly on half of the distinct rows, score the
other half, and the share of rows whose held-out loss is above chance (``ln(classes)``: the reference
finds the label less likely than a uniform guess) is compared with ``sifting.noisy_share``. It rises
with label noise and with rows too hard for the reference to learn: both are where ranking by loss
picks what training cannot use, so both count as noisy. On the benchmark's datasets: its tabular set
(10% of labels flipped) 0.15 to 0.24, digits (clean) 0.03 to 0.05, over seeds 0-2 and 100-103.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from trainyard.reference_losses import held_out_losses
from trainyard.spec import Prefilter
from trainyard.spec.sifting import CLEAN_CHANNEL

# The most distinct rows the measure trains and scores on: a seeded sample of a larger channel, so its cost stops
# growing with the channel (a share read on 20,000 rows is within a percentage point). The benchmark calibrated the
# threshold on 1,437 and 8,000 rows (digits, its tabular set): a sample's references, 10,000 rows each, see more.
MEASURED_ROWS = 20_000

# The most a clean channel's proxy may cost, its forward over the job's model's, for the labels to pick it: it scores
# four candidates and learns one a trained row, about twice this ratio of the model's training (on digits a
# thirty-sixth: 6%); over a tenth (a fifth of the training's FLOPs), or a proxy as large as a small model, the
# labels pick pruning, which costs no scoring.
PROXY_COST_MAX = 0.1


@dataclass(frozen=True, slots=True)
class NoiseEstimate:
    """What the filtering stage measured of a train channel's labels, and what it chose."""

    above_chance: float | None
    """Share of the distinct rows whose held-out loss is above chance; None when it could not be measured."""
    rows: int
    """Distinct rows measured."""
    noisy_share: float
    """The threshold (``sifting.noisy_share``)."""
    flops: int
    """What the reference models' training and scoring cost."""
    losses: np.ndarray | None = field(default=None, repr=False, compare=False)
    """Each row's held-out loss (NaN outside the rows measured): the prefilter's own, if it needs them; None
    where a sample was measured (the prefilter then scores every row itself)."""
    distinct_rows: int | None = None
    """The channel's distinct rows, where more than were measured (a sample of ``MEASURED_ROWS``)."""
    proxy_cost: float | None = None
    """A clean channel's proxy's forward FLOPs over the job's model's (``proxy.relative_cost``), where known."""

    @property
    def noisy(self) -> bool:
        """Whether the channel counts as noisy (so sifting prunes). Unmeasured counts as noisy: pruning
        is the rule that leaves a noisy channel's wrong labels out, and costs a clean one no accuracy."""
        return self.above_chance is None or self.above_chance > self.noisy_share

    @property
    def prunes(self) -> bool:
        """Whether the labels pick pruning: a noisy channel, or a clean one whose proxy would cost more than
        ``PROXY_COST_MAX`` of the job's model's forward."""
        return self.noisy or (self.proxy_cost is not None and self.proxy_cost > PROXY_COST_MAX)

    def to_dict(self) -> dict:
        beta = CLEAN_CHANNEL["beta"]
        top = f"the proxy's top {1 / (1 + beta):.0%}"
        proxy = f"{top} (beta {beta:g}, score proxy, selection top)"
        chose = "pruning (sifting.prune)" if self.prunes else proxy
        if self.prunes and not self.noisy:
            chose += (
                f": the labels read clean, but the proxy's forward costs {self.proxy_cost:.2g}x the model's, more "
                f"than {PROXY_COST_MAX:g}x (shrink sifting.proxy.hidden_sizes for {top})"
            )
        said = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "losses"}  # (asdict copies arrays)
        for unknown in ("distinct_rows", "proxy_cost"):  # every distinct row measured; a noisy channel's, not asked
            if said[unknown] is None:
                del said[unknown]
        said |= {"noisy": self.noisy, "online_rule": chose}
        if not self.prunes:  # what a user who left the rule to the labels may not expect of the proxy's
            said["note"] = (
                f"each epoch trains {1 / (1 + beta):.0%} of its candidates: at the job's own epochs it spends about "
                "that share of an unfiltered job's compute and may end less accurate; its gains came with more "
                "epochs (benchmarks/sifting.py on digits: 29 where the unfiltered job ran 8): raise "
                "hyperparameters.epochs, with stopping.target_metric or patience_epochs to end it early"
            )
        return said


def estimate(
    x: np.ndarray, y: np.ndarray, rows: np.ndarray, config: Prefilter, num_classes: int, noisy_share: float
) -> NoiseEstimate:
    """Measure the share of ``x``, ``y``'s ``rows`` (a mask: the distinct ones) a held-out reference finds
    less likely than chance: of them all, or of a seeded sample of ``MEASURED_ROWS`` where there are more."""
    distinct = int(rows.sum())
    if distinct < 2 * num_classes or num_classes < 2:  # too few to train a reference on each half
        return NoiseEstimate(None, distinct, noisy_share, 0)
    sampled = distinct > MEASURED_ROWS
    if sampled:
        pick = np.random.default_rng(config.seed).choice(np.flatnonzero(rows), MEASURED_ROWS, replace=False)
        rows = np.zeros(len(x), dtype=bool)
        rows[pick] = True
    losses, flops = held_out_losses(x, y, rows, config, "classification", num_classes)
    scored = losses[rows]
    above = float(np.mean(~(scored <= math.log(num_classes))))  # a loss that is not a number counts as above
    if sampled:
        return NoiseEstimate(above, MEASURED_ROWS, noisy_share, flops, None, distinct)
    return NoiseEstimate(above, distinct, noisy_share, flops, losses)
