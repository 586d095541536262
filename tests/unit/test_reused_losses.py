"""Sifting with reused losses (``sifting.reuse_loss_epochs``) end to end: two real replica groups rank
most candidates by a remembered loss instead of scoring them, and one that dies heals with its
peer's memory of the losses."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rejoined, slow_until
from tests.unit.jobs import make_job, run
from trainyard.status import sifting_section


def test_two_groups_reuse_losses_score_a_fraction_and_agree_after_a_heal(trainyard_home, tmp_path):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        # 100 ms forwards until the killed group is back: 170 steps left give it over 17 s (it takes 3-6 s idle,
        # more under a CI run's load), where the survivor would otherwise finish first on a busy machine
        hyperparameters={"epochs": 40, "batch_size": 64, "learning_rate": 0.01, "step_sleep": 0.1}
        | {"slow_while": str(tmp_path / "slow")},
        sifting={"enabled": True, "beta": 1.0, "delay_steps": 5, "reuse_loss_epochs": 2},
        elastic={"fault_injection": [{"replica": 1, "at_step": 30, "kind": "kill"}]},
    )
    with slow_until(tmp_path / "slow", lambda: rejoined(folder / "replicas/1/attempt-1")):
        outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed" and outcome.steps == 40 * 5
    sifting = outcome.sifting
    assert sifting["kept_fraction"] == pytest.approx(0.5, abs=0.02)  # batches stay full
    assert sifting["losses_reused"] > sifting["scored"] / 2
    # One linear layer: a scoring pass costs what a training forward does, per row. Scoring every
    # candidate would have cost `scored` of them; the reused losses spared most of that.
    per_row = outcome.flops["forward"] / sifting["kept"]
    assert 0 < outcome.flops["scoring"] < 0.5 * sifting["scored"] * per_row
    # Scoring every candidate of this model saves nothing (test_training's sifting test warns);
    # with reused losses it does, and the summary does not warn.
    assert sifting["scoring_flops"] < sifting["training_flops_skipped"]
    assert "warning" not in sifting_section(job, None, outcome)
    (recovery,) = outcome.recoveries
    assert recovery["source"] == "peer"
    states = [torch.load(folder / f"replicas/{r}/attempt-{a}/model.pt", weights_only=True) for r, a in ((0, 0), (1, 1))]
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)
