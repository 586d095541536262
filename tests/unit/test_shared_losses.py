"""Groups share the losses they remembered in an epoch (``StepData.share_losses``): each is dealt a share of
the rows, and pruned (and reused losses) by its own share's alone, so that with two groups pruning left out
half the learnt rows it was set to. Real replica processes and a lighthouse, no Prefect."""

from __future__ import annotations

from tests.unit.jobs import make_job, run


def test_two_groups_prune_learnt_rows_at_the_rate_asked_as_one_group_does(trainyard_home):
    prune = {"learnt_fraction": 0.9, "hardest_fraction": 0.0, "batch_factor": 1, "until": 1.0}
    outcomes = {}
    for groups in (1, 2):
        job, *rest = make_job(
            trainyard_home,
            hyperparameters={"epochs": 4, "batch_size": 64, "learning_rate": 0.01, "hidden_sizes": [16]},
            sifting={"enabled": True, "beta": 0, "prune": prune},  # every row dealt is a candidate for pruning
            resources={"replicas": groups},
        )
        outcomes[groups], _ = run(job, *rest)
    pruned = {}
    for groups, outcome in outcomes.items():
        assert outcome.stop_reason == "Completed"
        sifting = outcome.sifting
        # 600 rows dealt an epoch, the first epoch's with nothing known
        assert sifting["prune_dealt"] == 4 * 600
        pruned[groups] = sifting["pruned_learnt"] / (3 * 600)
    # each group knew the losses of the rows it was dealt last epoch only, about half of them: it pruned fewer
    # (0.35 of the rows against one group's 0.48, measured); merged, the two read alike (0.48 and 0.48)
    assert pruned[2] > 0.9 * pruned[1], pruned
