"""One sifting benchmark run's record (``_sifting_data.train`` makes them): its per-epoch history, cumulative
training FLOPs and wall, and how they are read against a target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _sifting_data import Setting


@dataclass
class Run:
    setting: Setting
    lr: float
    epochs: int  # the schedule's length
    seed: int
    history: list[dict]
    cum_flops: list[int]  # training FLOPs (forward + backward + scoring + prefilter) at each epoch end
    cum_wall: list[float]  # training wall seconds (+ prefilter) at each epoch end
    eval_flops: int  # validation FLOPs of the whole run (excluded from the comparisons)
    train_rows: int
    median_step_ms: float
    stop_reason: str
    prefilter: dict | None = None  # what the prefilter dropped, and of which rows
    flop_check: str | None = None  # set when the rebuilt per-epoch FLOPs disagree with the outcome
    # Training FLOPs between the validations that count toward a target: the baseline's epoch (readings).
    cadence: int | None = None

    @property
    def accuracy(self) -> list[float | None]:
        """Each epoch's validation accuracy; None where the epoch was not validated (``stopping.validate_every_epochs``
        over 1; the benchmark's jobs validate every epoch)."""
        return [h.get("val_accuracy") for h in self.history]

    @property
    def validated(self) -> list[int]:
        return [i for i, h in enumerate(self.history) if "val_accuracy" in h]

    def readings(self) -> list[int]:
        """The epochs whose validation counts toward reaching a target: for each multiple of ``cadence`` training
        FLOPs the epoch that ends nearest it (ties to the earlier), and the last (a job always validates its
        final model). Every arm is so read as often per FLOP as the baseline, whose epochs are the cadence,
        and on average at the same FLOPs (taking the first epoch end past each multiple instead would read a
        filtering arm half of its epoch late, on average). Read at every epoch, an arm whose epochs cost less is
        validated more often, and the first of more readings to cross a target comes earlier by chance alone:
        on digits, where the accuracy wanders about the target by a row or two, pruning x3 read 0.80x the
        baseline's FLOPs to the target on its own epochs and 1.02x at the baseline's cadence (medians over
        twelve tuning seeds, stop 34; tabular's three reported seeds 0.40x and 0.43x)."""
        flops, validated = self.cum_flops, self.validated
        if not self.cadence or not validated:
            return validated
        kept, multiple = {validated[-1]}, 1
        while multiple * self.cadence <= flops[-1] + self.cadence / 2:
            kept.add(min(validated, key=lambda i: abs(flops[i] - multiple * self.cadence)))
            multiple += 1
        return sorted(kept)

    def first_reaching(self, target: float, every_epoch: bool = False) -> int | None:
        """Index of the first reading (``readings``; any epoch with ``every_epoch``) whose validation accuracy is
        at least ``target``."""
        accuracy = self.accuracy
        indices = self.validated if every_epoch else self.readings()
        return next((i for i in indices if accuracy[i] >= target - 1e-12), None)  # type: ignore[operator]

    def flops_to(self, target: float) -> int | None:
        i = self.first_reaching(target)
        return None if i is None else self.cum_flops[i]

    def steps_to(self, target: float) -> int | None:
        """Optimizer steps up to the end of the first epoch that reaches ``target``."""
        i = self.first_reaching(target)
        return None if i is None else sum(h["steps"] for h in self.history[: i + 1])

    def wall_to(self, target: float) -> float | None:
        i = self.first_reaching(target)
        return None if i is None else self.cum_wall[i]

    def accuracy_at(self, flops: float) -> float | None:
        """Validation accuracy at the last epoch whose cumulative FLOPs do not exceed ``flops``."""
        within = [i for i in self.validated if self.cum_flops[i] <= flops * (1 + 1e-9)]
        return self.accuracy[within[-1]] if within else None
