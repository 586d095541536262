"""Stage 3, filtering: decide which training samples are worth their compute.

In this version the offline prefilter keeps every sample and reports so; the online sifter's
settings are validated and passed to the replica groups. The stage's contract (a filtered training
set and a report of what was dropped and why) is what later work fills in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from trainyard.datasets import StagedData
from trainyard.spec import Sifting


@dataclass(slots=True)
class FilterReport:
    """What the filtering stage kept, and the training data file the groups will read."""

    train_data: str
    total: int
    kept: int
    dropped: dict[str, int] = field(default_factory=dict)
    scoring_flops: int = 0
    sifting_enabled: bool = False

    @property
    def kept_fraction(self) -> float:
        return self.kept / self.total if self.total else 1.0

    def to_dict(self) -> dict:
        return asdict(self) | {"kept_fraction": self.kept_fraction}


def filter_samples(staged: StagedData, sifting: Sifting) -> FilterReport:
    """Choose the training samples; in this version every sample is kept."""
    total = staged.rows["train"]
    return FilterReport(train_data=staged.train_data, total=total, kept=total, sifting_enabled=False)
