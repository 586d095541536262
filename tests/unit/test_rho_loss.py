"""RHO-LOSS sifting end to end: the filtering stage writes each row's reference loss, and two replica
groups rank their candidates by reducible loss from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.jobs import make_job, run
from trainyard import filtering
from trainyard.datasets import StagedData


def test_two_groups_sift_by_reducible_loss_from_the_filtering_stages_reference(trainyard_home):
    sifting = {"enabled": True, "beta": 1.0, "delay_steps": 3, "score": "reducible_loss"}
    job, _, folder, plan = make_job(trainyard_home, sifting=sifting)
    staged = StagedData(plan.train_data, plan.validation_data, plan.schema, {"train": 600}, [])
    report = filtering.filter_samples(staged, job.sifting, "classification")
    assert report.reference == filtering.HOLDOUT and "irreducible" in np.load(report.train_data).files
    plan.train_data = report.train_data
    outcome, _ = run(job, job.name, folder, plan)
    assert outcome.stop_reason == "Completed" and outcome.replicas_finished == [0, 1]
    assert outcome.sifting["score"] == "reducible_loss"
    assert outcome.sifting["kept_fraction"] == pytest.approx(0.5, abs=0.02)  # batches stay full
    states = [torch.load(folder / f"replicas/{r}/attempt-0/model.pt", weights_only=True) for r in (0, 1)]
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)
