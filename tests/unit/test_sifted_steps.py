"""Sifting inside a replica group's steps (``training/batches.py``'s ``StepData``, no processes): the delay,
what an epoch reports, reducible loss (RHO-LOSS), reused losses, redone steps, and validation never sifted."""

from __future__ import annotations

import numpy as np
import pytest

from trainyard.spec import parse_job


def test_sifting_is_off_for_the_first_delay_steps_and_their_rows_are_not_counted_as_ranked(tmp_path):
    data, model, _ = reducible_step_data(tmp_path, beta=1.0, score="loss", delay_steps=10, reuse_loss_epochs=0)
    for step in range(8):  # epoch 0: 8 steps of 64 candidates, all within the delay
        xb, _, count = data.batch(model, 0, step, step, 1, 0, 1)
        assert len(xb) == count == 32  # the first half of the (shuffled) candidates, unscored
    report = data.report()
    assert data.meter.scoring == 0 and (report["scored"], report["kept"], report["passed_over"]) == (0, 0, 0)
    assert (report["unsifted"], report["skipped"]) == (8 * 32, 8 * 32)
    assert data.epoch_metrics() == {"kept_fraction": None}  # nothing was ranked in this epoch
    for index in range(8):  # epoch 1: steps 8 and 9 still within the delay (it counts steps, not epochs)
        data.batch(model, 1, index, 8 + index, 1, 0, 1)
        assert (data.meter.scoring > 0) == (index >= 2)
    report = data.report()
    assert (report["scored"], report["kept"], report["passed_over"]) == (6 * 64, 6 * 32, 6 * 32)
    assert (report["unsifted"], report["skipped"]) == (10 * 32, 10 * 32)
    metrics = data.epoch_metrics()
    assert metrics["kept_fraction"] == 0.5 and set(metrics["kept_fraction_by_class"]) == {"0", "1"}
    # every row's loss is the same: 1 against the empty history of step 10, then the 50th percentile
    assert metrics["mean_keep_probability"] == pytest.approx((64 * 1.0 + 5 * 64 * 0.5) / (6 * 64))


def test_the_delays_training_losses_are_the_history_the_first_sifted_step_ranks_against(tmp_path):
    # the delay is there to gather the keep rule's history: its steps' training losses (free) join it, and the first
    # sifted step ranks against them, where it kept every candidate alike against an empty history
    data, model, _ = reducible_step_data(tmp_path, beta=1.0, score="loss", delay_steps=10, reuse_loss_epochs=0)
    for epoch, steps in ((0, range(8)), (1, range(8))):
        for index in steps:
            step = 8 * epoch + index
            for _ in range(2 if step == 3 else 1):  # step 3 did not commit and is done again: counted once
                xb, yb, _ = data.batch(model, epoch, index, step, 1, 0, 1)
                data.trained(data.loss_fn(model(xb), yb))
            if step == 9:
                assert len(data.sifter.history) == 10 * 32
    # every row's loss is the same: the 50th percentile from step 10 on (not 1 against an empty history)
    assert data.epoch_metrics()["mean_keep_probability"] == pytest.approx(0.5)


def test_a_delay_past_the_first_epoch_with_pruning_gives_the_keep_rules_history_the_rows_trained(tmp_path):
    # pruning drops learnt rows from a delay step's batch from epoch 1 on: the losses subtracted from the trained
    # rows' were still the whole batch's (a broadcast error, the group failing at every try of that step)
    import torch

    prune = {"learnt_fraction": 0.7, "hardest_fraction": 0.0, "batch_factor": 1}
    data, model, _ = reducible_step_data(
        tmp_path, beta=1.0, score="loss", delay_steps=10, reuse_loss_epochs=0, prune=prune
    )
    torch.manual_seed(0)
    torch.nn.init.normal_(model[-1].weight)  # the rows' losses differ: some are learnt
    trained = 0
    for step in range(10):  # 8 steps an epoch: steps 8 and 9 are epoch 1's, still in the delay
        epoch, index = divmod(step, 8)
        xb, yb, _ = data.batch(model, epoch, index, step, 1, 0, 1)
        data.trained(data.loss_fn(model(xb), yb))
        trained += len(xb)
    assert trained < 10 * 32  # epoch 1's pruned some
    assert len(data.sifter.history) == trained


def test_kept_fractions_per_class_are_named_by_the_classes_label_values(tmp_path):
    data, model, _ = reducible_step_data(tmp_path, classes=["ant", "moose"], score="loss", reuse_loss_epochs=0)
    for step in range(4):
        data.batch(model, 0, step, step, 1, 0, 1)
    assert set(data.epoch_metrics()["kept_fraction_by_class"]) == {"ant", "moose"}
    report = data.report()
    assert set(report["kept_fraction_by_class"]) == set(report["scored_by_class"]) == {"ant", "moose"}
    assert sum(report["kept_by_class"].values()) == report["kept"]


def reducible_step_data(tmp_path, with_reference: bool = True, classes: list | None = None, **sifting):
    """StepData for 512 rows whose first half carries a high reference loss (noise a reference model
    could not fit either), under a model whose own loss is the same for every row."""
    import torch

    from trainyard import algorithms
    from trainyard.training.batches import StepData
    from trainyard.training.flops import FlopMeter
    from trainyard.training.plan import TrainingPlan

    job = parse_job(
        {
            "name": "s",
            "algorithm": {"builtin": "mlp-classifier"},
            "hyperparameters": {"batch_size": 32, "hidden_sizes": [4]},
            "inputs": {"train": {"s3_uri": "s3://bkt/t/", "label": "y"}},
            "output": {"s3_uri": "s3://bkt/o/"},
            "sifting": {"enabled": True, "beta": 2.0, "delay_steps": 0, "score": "reducible_loss"} | sifting,
        }
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(512, 3)).astype(np.float32), rng.integers(0, 2, 512)
    reference = np.where(np.arange(512) < 256, 5.0, 0.0).astype(np.float32)
    arrays = {"x": x, "y": y} | ({"irreducible": reference} if with_reference else {})
    np.savez(tmp_path / "train.filtered.npz", **arrays)
    schema = {"classes": classes} if classes else {}
    plan = TrainingPlan("j", job.model_dump(mode="json"), str(tmp_path / "train.filtered.npz"), None, schema, 1, "")
    model, loss_fn = algorithms.build(job.algorithm, job.hyperparameters, x, y, 2)
    torch.nn.init.zeros_(model[-1].weight)  # equal outputs: every row's own loss is ln 2
    torch.nn.init.zeros_(model[-1].bias)
    data = StepData(job, plan, torch.from_numpy(x), torch.from_numpy(y), tmp_path, loss_fn, FlopMeter(model, loss_fn))
    return data, model, x


def test_reducible_loss_skips_rows_the_reference_could_not_fit_either(tmp_path):
    data, model, x = reducible_step_data(tmp_path)
    noise = set(map(tuple, x[:256].tolist()))
    kept_noise = kept = 0
    for step in range(5):  # 96 candidates a step, 32 kept (the 6th step would be the short last one)
        xb, yb, global_count = data.batch(model, 0, step, step, 1, 0, 1)
        assert xb.shape == (32, 3) and global_count == 32  # the reference column never reaches the model
        if step > 0:  # the first step has no history to rank against: it keeps a uniform draw
            kept += len(xb)
            kept_noise += sum(tuple(row) in noise for row in xb.tolist())
    # Half the candidates are "noise". By loss alone they tie with the rest and half the kept would be
    # noise; by reducible loss they sit at the 25th percentile against the 75th: weights 1:9 at beta 2.
    assert kept_noise / kept < 0.25


def test_reducible_loss_without_reference_losses_says_what_to_do(tmp_path):
    from trainyard.errors import TrainingError

    with pytest.raises(TrainingError, match="no reference losses for sifting.score reducible_loss"):
        reducible_step_data(tmp_path, with_reference=False)


@pytest.mark.parametrize("score", ["loss", "reducible_loss"])
def test_reused_losses_spare_scoring_passes_and_batches_stay_full(tmp_path, score):
    import torch

    data, model, x = reducible_step_data(tmp_path, beta=1.0, score=score, reuse_loss_epochs=1)
    index = {tuple(row): i for i, row in enumerate(x.tolist())}
    scored_flops, kept_rows = [], []
    for epoch in range(3):  # 64 candidates a step, 8 steps an epoch over 512 rows, 32 kept a step
        before, kept = data.meter.scoring, set()
        for step in range(8):
            xb, yb, global_count = data.batch(model, epoch, step, 8 * epoch + step, 1, 0, 1)
            assert xb.shape == (32, 3) and global_count == 32  # full, and no side column reaches the model
            data.trained(data.loss_fn(model(xb), yb))  # the training forward's per-sample losses
            kept |= {index[tuple(row)] for row in xb.tolist()}
        scored_flops.append(data.meter.scoring - before)  # FLOPs of this epoch's scoring passes
        kept_rows.append(kept)
    per_row = scored_flops[0] / 512  # epoch 0 knows no loss: every candidate is scored
    assert scored_flops[0] > 0 and scored_flops[1] == 0  # epoch 1 reuses every loss from epoch 0
    # epoch 2: the rows trained on in epoch 1 have a recent loss; only the others are scored again
    assert scored_flops[2] == pytest.approx((512 - len(kept_rows[1])) * per_row, rel=0.01)
    assert data.report()["losses_reused"] == 512 + len(kept_rows[1])
    # A group that heals from this one reuses the same losses.
    healed, _, _ = reducible_step_data(tmp_path, beta=1.0, score=score, reuse_loss_epochs=1)
    healed.load_state_dict({k: v.clone() for k, v in data.state_dict().items()})
    assert np.array_equal(healed.memory.loss, data.memory.loss) and np.array_equal(
        healed.memory.epoch, data.memory.epoch
    )
    assert torch.equal(healed.state_dict()["history"], data.state_dict()["history"])


def test_a_redone_step_neither_reuses_its_first_trys_losses_nor_counts_them_twice(tmp_path):
    """A step that did not commit is done again with the same parameters (torchft): it must score,
    keep and count as if done once. Its first try remembered the candidates' losses, the kept ones'
    from the training forward, which dropout makes differ from a scoring pass's."""
    import torch

    def train(redone: set[int]) -> tuple:
        data, model, _ = reducible_step_data(tmp_path, beta=1.0, score="loss", reuse_loss_epochs=1)
        torch.manual_seed(0)
        torch.nn.init.normal_(model[-1].weight)
        model = torch.nn.Sequential(torch.nn.Dropout(0.5), model)
        batches = []
        for step in range(16):  # epochs 0 and 1, 8 steps each
            epoch, index = divmod(step, 8)
            for _ in range(2 if step in redone else 1):
                xb, yb, _ = data.batch(model, epoch, index, step, 1, 0, 1)
                torch.manual_seed(step)  # the same dropout in both tries
                data.trained(data.loss_fn(model(xb), yb))
            batches.append(xb)
        return data, batches

    once, batches_once = train(set())
    redone, batches_redone = train({3, 11})  # one step of each epoch did not commit
    for step, (a, b) in enumerate(zip(batches_once, batches_redone, strict=True)):
        assert torch.equal(a, b), step
    assert np.array_equal(once.memory.loss, redone.memory.loss, equal_nan=True)
    assert np.array_equal(once.memory.epoch, redone.memory.epoch)
    assert redone.report() == once.report()  # losses_reused among them


def test_an_epochs_candidate_loss_is_over_every_candidate_ranked_not_only_the_kept_ones(tmp_path):
    """``train_loss`` is over the rows trained on, the hard ones the keep rule kept; ``candidate_loss``
    is over the uniform draw of candidates, the loss an unsifted job's ``train_loss`` is over."""
    import torch

    data, model, x = reducible_step_data(tmp_path, beta=1.0)  # ranked by reducible loss, reported as loss
    torch.manual_seed(0)
    torch.nn.init.normal_(model[-1].weight)
    kept_losses = []
    for step in range(8):  # 64 candidates a step: the epoch ranks all 512 rows
        for _ in range(2 if step == 3 else 1):  # step 3 did not commit and is done again
            xb, yb, _ = data.batch(model, 0, step, step, 1, 0, 1)
        kept_losses.append(data.loss_fn(model(xb), yb).detach())
    y = torch.from_numpy(np.load(tmp_path / "train.filtered.npz")["y"])
    with torch.no_grad():
        every_row = float(data.loss_fn(model(torch.from_numpy(x)), y).mean())
    metrics = data.epoch_metrics()
    assert metrics["candidate_loss"] == pytest.approx(every_row, rel=1e-5)
    assert float(torch.cat(kept_losses).mean()) > every_row  # what train_loss averages: the kept rows, harder
    assert "candidate_loss" not in data.epoch_metrics()  # an epoch that ranked nothing has none


def test_validation_is_never_sifted(tmp_path):
    # Validation scores every row once with the model as it is: no row is ranked, kept or passed over,
    # no scoring FLOPs are counted, and the loss history the keep rule ranks against does not move.
    import torch

    from trainyard.training.epochs import evaluate

    data, model, x = reducible_step_data(tmp_path, beta=1.0, score="loss", reuse_loss_epochs=0)
    for step in range(4):
        data.batch(model, 0, step, step, 1, 0, 1)
    sifter = data.sifter
    before = (sifter.history.copy(), data.report(), data.meter.scoring, data.meter.evaluation)
    y = torch.from_numpy(np.load(tmp_path / "train.filtered.npz")["y"])
    metrics = evaluate(model, data.loss_fn, torch.from_numpy(x), y, "classification", data.meter)
    assert np.array_equal(sifter.history, before[0]) and data.report() == before[1]
    assert data.meter.scoring == before[2] and data.meter.evaluation > before[3]  # counted as evaluation
    with torch.no_grad():
        every_row = float(data.loss_fn(model(torch.from_numpy(x)), y).mean())
    assert metrics["val_loss"] == pytest.approx(every_row, rel=1e-6)  # over all 512 rows, none dropped
