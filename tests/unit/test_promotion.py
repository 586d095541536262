"""The promotion gate's rule (``promotion.decide``): direction, min_gain, the carbon ceiling, NaN metrics."""

from __future__ import annotations

from trainyard.promotion import decide
from trainyard.spec import PromoteIf


def test_gate_rule_gain_direction_and_carbon_ceiling():
    rule = PromoteIf(metric="val_loss", mode="min", min_gain=0.05, max_emissions_kg=1.0)
    assert decide(rule, 0.5, None, has_champion=False, emissions_kg=0.1).wins
    assert decide(rule, 0.40, 0.50, has_champion=True, emissions_kg=0.1).wins
    assert not decide(rule, 0.48, 0.50, has_champion=True, emissions_kg=0.1).wins  # gain 0.02 < min_gain
    assert not decide(rule, 0.60, 0.50, has_champion=True, emissions_kg=0.1).wins  # worse
    over = decide(rule, 0.10, 0.50, has_champion=True, emissions_kg=2.0)
    assert not over.wins and "ceiling" in over.reason
    assert not decide(rule, 0.10, None, has_champion=False, emissions_kg=None).wins  # a ceiling needs a figure
    assert not decide(None, 0.9, 0.1, has_champion=True, emissions_kg=None).wins  # no gate: only by hand


def test_a_gain_of_exactly_min_gain_never_wins_however_the_subtraction_rounds():
    rule = PromoteIf(metric="val_accuracy", min_gain=0.1)
    # 0.8 - 0.7 is 0.10000000000000009 and 0.3 - 0.2 is 0.09999999999999998: both exactly min_gain
    assert not decide(rule, 0.8, 0.7, has_champion=True, emissions_kg=None).wins
    assert not decide(rule, 0.3, 0.2, has_champion=True, emissions_kg=None).wins
    assert decide(rule, 0.8001, 0.7, has_champion=True, emissions_kg=None).wins


def test_a_metric_that_is_not_a_number_never_wins_and_loses_to_any_number():
    rule = PromoteIf(metric="val_loss")
    nan = float("nan")
    diverged = decide(rule, nan, None, has_champion=False, emissions_kg=None)
    assert not diverged.wins and "val_loss is nan (did training diverge?)" in diverged.reason
    assert decide(rule, 0.1, nan, has_champion=True, emissions_kg=None).wins  # every comparison with NaN is false
