"""How an epoch's rows are dealt to replica groups as the quorum changes, and the learning rate by step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainyard.spec import parse_job
from trainyard.training.sampling import Sampler, step_batch


def sampler(distribution: str, rows: int = 203, batch_size: int = 24, epoch_batch=None) -> Sampler:
    job = parse_job(
        {
            "name": "s",
            "algorithm": {"builtin": "mlp-classifier"},
            "hyperparameters": {"batch_size": batch_size},
            "inputs": {"train": {"s3_uri": "s3://bkt/t/", "label": "y", "distribution": distribution}},
            "output": {"s3_uri": "s3://bkt/o/"},
        }
    )
    x = np.arange(rows, dtype=np.float32)[:, None]  # a row's feature is its index
    layout = [
        {"id": f"o{i}", "start": a, "end": min(a + 50, rows), "row_groups": []}
        for i, a in enumerate(range(0, rows, 50))
    ]
    return Sampler(x, np.zeros(rows, dtype=np.int64), job, layout, epoch_batch=epoch_batch)


@pytest.mark.parametrize("distribution", ["replicated", "sharded"])
@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("members", [1, 2, 3, 4])
def test_every_step_is_split_between_the_quorum_without_loss_or_doubling(distribution, slots, members):
    s = sampler(distribution)
    epoch_rows = []
    for index in range(s.steps_per_epoch(slots)):
        parts = [step_batch(s, 1, index, slots, rank, members) for rank in range(members)]
        rows = sorted(int(v) for x, _, _ in parts for v in x[:, 0])
        dealt = sorted(int(v) for slot in range(slots) for v in s.slot_batch(1, index, slots, slot)[0][:, 0])
        assert rows == dealt  # the quorum trains exactly the epoch's slots' rows of this step
        assert {total for *_, total in parts} == {len(dealt)}
        epoch_rows += rows
    if distribution == "replicated":
        assert sorted(epoch_rows) == list(range(203))  # every row once an epoch
    else:  # every row at least once; smaller shares wrap around to the largest share's length
        assert set(epoch_rows) == set(range(203))


@pytest.mark.parametrize("distribution", ["replicated", "sharded"])
def test_an_epoch_dealt_larger_batches_takes_fewer_steps_and_still_deals_every_row(distribution):
    s = sampler(distribution, epoch_batch=lambda epoch: 48 if epoch == 1 else 24)  # sifting.prune.batch_factor
    assert [s.steps_per_epoch(1, epoch) for epoch in range(3)] == [9, 5, 9]  # ceil(203 / 48) in epoch 1
    assert s.steps_per_epoch(2, 1) == math.ceil(s.steps_per_epoch(2, 0) / 2)  # 24 rows a slot a step, not 12
    for slots, members in ((1, 1), (2, 2), (2, 3)):
        rows = []
        for index in range(s.steps_per_epoch(slots, 1)):
            parts = [step_batch(s, 1, index, slots, rank, members) for rank in range(members)]
            assert {total for *_, total in parts} == {sum(s.slot_sizes(index, slots, 1))}
            assert sum(s.slot_sizes(index, slots, 1)) <= 48
            rows += [int(v) for x, _, _ in parts for v in x[:, 0]]
        if distribution == "replicated":
            assert sorted(rows) == list(range(203))
        else:
            assert set(rows) == set(range(203))


def test_a_sharded_slots_order_is_shuffled_once_an_epoch_not_every_step(monkeypatch):
    # a permutation of the whole share at every step: 48 ms a step at 1M rows, O(rows^2 / batch) an epoch
    import torch

    s, shuffles = sampler("sharded"), []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: shuffles.append(a) or real(*a, **k))
    dealt = {}
    for epoch in (1, 2):
        for index in range(s.steps_per_epoch(2)):
            for slot in (0, 1):
                dealt.setdefault((epoch, slot), []).extend(s.slot_batch(epoch, index, 2, slot)[0][:, 0].tolist())
    assert len(shuffles) == 2 * 2  # two epochs, two slots
    assert dealt[1, 0] != dealt[2, 0] and sorted(dealt[1, 0]) == sorted(dealt[2, 0])  # reshuffled each epoch


def test_the_epoch_is_a_function_of_the_step():
    a, b = sampler("replicated"), sampler("replicated")
    assert a.slot_batch(2, 3, 2, 1)[0].tolist() == b.slot_batch(2, 3, 2, 1)[0].tolist()
    assert a.slot_batch(2, 3, 2, 1)[0].tolist() != a.slot_batch(3, 3, 2, 1)[0].tolist()  # reshuffled per epoch
    assert a.steps_per_epoch(1) == a.steps_per_epoch(3) == 9  # ceil(203 / 24): the global batch is fixed


def test_learning_rate_schedules():
    from trainyard.spec import Hyperparameters
    from trainyard.training.epochs import learning_rate

    constant = Hyperparameters(learning_rate=0.1)
    assert learning_rate(constant, 500, 0.5) == 0.1
    linear = Hyperparameters(learning_rate=0.1, lr_schedule="linear")
    assert learning_rate(linear, 50, 0.25) == pytest.approx(0.075)
    # 100 steps: warm-up over the first 10, then the cosine from its peak to the floor over the other 90
    cosine = Hyperparameters(learning_rate=0.1, lr_schedule="cosine", warmup_steps=10, min_lr_fraction=0.1)
    assert learning_rate(cosine, 0, 0.0, 0.09) == pytest.approx(0.01)  # warm-up from near zero
    assert learning_rate(cosine, 4, 0.04, 0.09) == pytest.approx(0.05)
    assert learning_rate(cosine, 10, 0.1, 0.09) == pytest.approx(0.1, rel=1e-3)  # the peak: the decay after the ramp
    assert learning_rate(cosine, 55, 0.545, 0.09) == pytest.approx(0.055)  # half way through the decay
    assert learning_rate(cosine, 99, 1.0, 0.09) == pytest.approx(0.01)


def test_a_warm_up_reaches_the_rate_and_the_decay_goes_on_from_it_whatever_the_epochs_steps():
    # the decay ran under the ramp from step 0 (a warm-up of half the run peaked at half the rate with cosine); and
    # placed by a step count, it jumped where the warm-up ran into pruned epochs of fewer steps (100, 34, 34 steps)
    import copy

    from trainyard.spec import Hyperparameters
    from trainyard.training.epochs import step_rate

    for epochs_steps, warmup, healed_at in (([50, 50], 50, 70), ([100, 34, 34], 150, 120), ([100, 34, 34], 150, 160)):
        hp = Hyperparameters(learning_rate=0.1, lr_schedule="cosine", warmup_steps=warmup, epochs=len(epochs_steps))
        rates, cursor, step = [], {}, 0
        for epoch, spe in enumerate(epochs_steps):  # as the trainer walks them
            for index in range(spe):
                if step == healed_at:  # a group healed here loads its peer's cursor (the torchft state), a copy
                    cursor = copy.deepcopy(cursor)
                rates.append(step_rate(hp, step, (epoch + index / spe) / hp.epochs, cursor))
                step += 1
        assert max(rates) == pytest.approx(0.1, rel=1e-3) and rates[warmup - 1] == pytest.approx(0.1)
        decay = rates[warmup - 1 :]
        assert all(b <= a for a, b in zip(decay, decay[1:], strict=False))  # then only down
        assert max(a - b for a, b in zip(decay, decay[1:], strict=False)) < 0.02  # and without a jump
        assert decay[-1] < 0.002
    # a group's state saved before the warm-up's end was recorded (an older checkpoint): the decay goes on from
    # the rate it is at, not from the run's start
    hp = Hyperparameters(learning_rate=0.1, lr_schedule="cosine", warmup_steps=10, epochs=1)
    recorded = {}
    assert step_rate(hp, 60, 0.6, recorded) == pytest.approx(0.1) and recorded == {"warm_progress": 0.6}
    assert step_rate(hp, 61, 0.61, recorded) == pytest.approx(0.05 * (1 + math.cos(math.pi * 0.01 / 0.4)))


def test_a_warm_up_as_long_as_the_run_is_refused():
    from trainyard.errors import SpecError
    from trainyard.spec import Hyperparameters
    from trainyard.training.epochs import check_warmup

    hp = Hyperparameters(epochs=10, batch_size=250, warmup_steps=400)
    check_warmup(hp, 10_000 + 1)  # 41 steps an epoch: 410
    refused = r"warmup_steps: 400 is not below the run's 400 steps \(10 epochs of 40: .*below 400"
    with pytest.raises(SpecError, match=refused):
        check_warmup(hp, 10_000)  # 40 steps an epoch


def test_slot_sizes_split_a_step_as_numpy_would():
    dealt = sampler("replicated", rows=23, batch_size=10)
    for slots in range(1, 13):
        for index in range(4):  # the last step is short (3 rows), the one after it empty
            rows = max(0, min(10, 23 - index * 10))
            assert dealt.slot_sizes(index, slots) == [len(p) for p in np.array_split(np.arange(rows), slots)]


def test_a_warm_up_is_counted_against_a_pruned_run_s_fewer_steps():
    # counted as the first epoch's steps times the epochs (400), a warm-up of 300 passed for a run of 192 steps: its
    # pruning epochs deal three batches a step, and the rate never reached learning_rate
    from tests.conftest import job_dict
    from trainyard.errors import SpecError
    from trainyard.spec import parse_job
    from trainyard.training.preflight import check_rows

    spec = job_dict({"train": "s3://bkt/t/", "validation": "s3://bkt/v/", "output": "s3://bkt/o/"})
    spec["hyperparameters"] |= {"epochs": 10, "batch_size": 250, "warmup_steps": 300}
    spec["sifting"] = {"enabled": True, "noisy_share": None}  # pruning x3 (the first and last epochs deal 250)
    job = parse_job(spec)
    refused = (
        r"warmup_steps: 300 is not below the run's 192 steps \(epochs of \[40, 14, 14, 14, 14, 14, 14, 14, 14, 40\]"
    )
    with pytest.raises(SpecError, match=refused):
        check_rows(job, 10_000)
    check_rows(
        job.model_copy(update={"hyperparameters": job.hyperparameters.model_copy(update={"warmup_steps": 191})}), 10_000
    )
