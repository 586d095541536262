"""The job's totals of what its replica groups computed (``training/accounting.py``): sifting's counts
added up over groups and attempts, each weighed by what it scored."""

from __future__ import annotations

import pytest

from trainyard.sifting import Sifter
from trainyard.spec import Sifting
from trainyard.training.accounting import sifting_totals


def test_the_jobs_kept_fraction_per_class_weighs_each_group_by_what_it_scored():
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
    flops = {"forward": 100, "backward": 200, "scoring": 50}
    groups = [{"scored": 1000, "kept": 500, "keep_probability_sum": 300.0}, {"scored": 10, "kept": 5}]
    groups[1] |= {"keep_probability_sum": 9.0}  # a restarted attempt: a few rows, each likely kept
    assert sifting_totals(groups, flops)["mean_keep_probability"] == pytest.approx(309 / 1010)
    assert sifting_totals([{"scored": 0, "kept": 0}], flops)["mean_keep_probability"] is None  # nothing ranked


def test_the_jobs_rule_is_named_when_the_first_report_is_a_killed_groups_counts():
    killed = {"scored": 40, "kept": 20, "passed_over": 20}  # counts.json only: it never ended an epoch
    finished = killed | {"score": "reducible_loss"}
    totals = sifting_totals([killed, finished], {"forward": 100, "backward": 200, "scoring": 50})
    assert totals["score"] == "reducible_loss"
    # and a group's counts, all a killed attempt leaves, carry it themselves
    config = Sifting(enabled=True, score="reducible_loss").resolved(streamed=False)  # as a job resolves it
    assert Sifter(config, seed=0).counts()["score"] == "reducible_loss"
