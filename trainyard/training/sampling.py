"""Which training rows each replica group trains on at each step, as groups come and go.

An epoch is dealt out to the groups that were in the quorum at its first step: ``groups`` slots,
each with its own rows for the epoch (a slice of a shared permutation for ``replicated``, the
slot's disjoint share for ``sharded``). Each step's global batch is the slots' batches at that step.
The groups in the step's quorum split the global batch between them, so a group that leaves or
joins mid-epoch loses or doubles no sample: while the quorum has as many groups as the epoch has
slots, group ``rank`` takes slot ``rank`` (its own share: data locality); otherwise the global batch
is split into near-equal contiguous parts, one per group. The next epoch is dealt to the new quorum.

Every answer is a function of (epoch, step in the epoch, slots, rank, groups in the quorum), so a
group that heals from a peer picks up exactly where the others are, without talking to them.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from numpy.random import default_rng  # imported at start-up, not lazily on the first batch's path

from trainyard import sharding, stream_sample, streaming
from trainyard.errors import DataError, TrainyardError
from trainyard.spec import TrainingJob
from trainyard.training.plan import TrainingPlan

_SEED_STRIDE = 1_000_003


def member_sizes(sampler, epoch: int, index: int, slots: int, members: int) -> list[int]:
    """Rows each of the quorum's ``members`` groups takes at step ``index`` of ``epoch`` (as ``step_batch`` deals)."""
    sizes = sampler.slot_sizes(index, slots, epoch)
    if members == slots:
        return sizes
    return np.diff(np.linspace(0, sum(sizes), members + 1).astype(int)).tolist()


def step_batch(sampler, epoch: int, index: int, slots: int, rank: int, members: int) -> tuple:
    """``(x, y, global_count)``: this group's rows of the step's global batch, and its size.

    ``slots`` groups were dealt the epoch; ``members`` groups are in this step's quorum and this
    group is number ``rank`` among them.
    """
    sizes = sampler.slot_sizes(index, slots, epoch)
    if members == slots:
        x, y = sampler.slot_batch(epoch, index, slots, rank)
        return x, y, sum(sizes)
    total = sum(sizes)
    bounds = np.linspace(0, total, members + 1).astype(int)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    xs, ys, start = [], [], 0
    for slot, size in enumerate(sizes):
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            x, y = sampler.slot_batch(epoch, index, slots, slot)
            xs.append(x[a - start : b - start])
            ys.append(y[a - start : b - start])
        start += size
    if not xs:  # more groups than rows in this step: an empty batch (its gradient counts as zero)
        x, y = sampler.slot_batch(epoch, index, slots, 0)
        return x[:0], y[:0], total
    return torch.cat(xs), torch.cat(ys), total


class Sampler:
    """Rows of an in-memory training set.

    replicated: each epoch, one permutation of all rows (the same in every group); a step's global
    batch is the next ``batch_size`` rows of it, cut into one contiguous part per slot. sharded:
    each slot permutes only its own share (``sharding``) and takes ``batch_size / slots`` rows a
    step; smaller shares wrap around so that every slot takes the same number of steps.
    ``epoch_batch``, when given, is the global batch of each epoch instead (``sifting.prune.batch_factor``
    deals more rows a step in the epochs that prune): a function of the epoch alone, as every answer here.
    """

    def __init__(
        self,
        x: np.ndarray,
        y: np.ndarray,
        job: TrainingJob,
        layout: list[dict],
        batch_size: int | None = None,
        epoch_batch: Callable[[int], int] | None = None,
    ):
        self.x, self.y = torch.as_tensor(x), torch.as_tensor(y)
        self.seed, self.num_rows = job.hyperparameters.seed, len(x)
        self.batch_size = batch_size or job.hyperparameters.batch_size  # the global batch (of candidates)
        self._epoch_batch = epoch_batch
        self.layout = layout if job.inputs.train.distribution == "sharded" else None
        self._shares: dict[int, list[np.ndarray]] = {}
        self._perm: tuple[int, torch.Tensor] | None = None
        self._share_orders: dict[tuple[int, int, int], torch.Tensor] = {}  # (epoch, slots, slot): _share_order

    def steps_per_epoch(self, slots: int, epoch: int = 0) -> int:
        """Steps in ``epoch`` dealt to ``slots`` groups."""
        if self.layout is None:
            return max(1, math.ceil(self.num_rows / self.global_batch(epoch)))
        return max(1, math.ceil(self._rows_per_slot(slots) / self._slot_batch(slots, epoch)))

    def global_batch(self, epoch: int) -> int:
        """The global batch (of candidates) of each step of ``epoch``."""
        return self._epoch_batch(epoch) if self._epoch_batch else self.batch_size

    def slot_sizes(self, index: int, slots: int, epoch: int = 0) -> list[int]:
        """Rows of each slot's batch at step ``index`` of ``epoch``."""
        if self.layout is None:
            batch = self.global_batch(epoch)
            count = max(0, min(batch, self.num_rows - index * batch))
            # np.array_split's parts, by arithmetic (that call took 15 us, twice a sifting step)
            whole, extra = divmod(count, slots)
            return [whole + 1] * extra + [whole] * (slots - extra)
        b = self._slot_batch(slots, epoch)
        return [max(0, min(b, self._rows_per_slot(slots) - index * b))] * slots

    def slot_batch(self, epoch: int, index: int, slots: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and labels of slot ``slot``'s batch at step ``index`` of ``epoch``."""
        if self.layout is None:
            batch = self.global_batch(epoch)
            rows = self._permutation(epoch)[index * batch : (index + 1) * batch]
            rows = torch.tensor_split(rows, slots)[slot]
        else:
            order = self._share_order(epoch, slots, slot)
            b = self._slot_batch(slots, epoch)
            positions = torch.arange(index * b, min((index + 1) * b, self._rows_per_slot(slots)))
            rows = order[positions % len(order)]
        return self.x[rows], self.y[rows]

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + epoch)
            self._perm = (epoch, torch.randperm(self.num_rows, generator=gen))
        return self._perm[1]

    def _share_order(self, epoch: int, slots: int, slot: int) -> torch.Tensor:
        """Slot ``slot``'s share of a sharded channel in its shuffled order for ``epoch``: made once per
        (epoch, slots, slot), not at every step (a permutation of the whole share was 48 ms a step at 1M rows)."""
        key = (epoch, slots, slot)
        if key not in self._share_orders:
            if self._share_orders and next(iter(self._share_orders))[0] != epoch:
                self._share_orders.clear()  # an earlier epoch's: not asked for again
            share = self._shares_for(slots)[slot]
            gen = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + epoch * 1009 + slot)
            self._share_orders[key] = torch.from_numpy(share)[torch.randperm(len(share), generator=gen)]
        return self._share_orders[key]

    def _shares_for(self, slots: int) -> list[np.ndarray]:
        if slots not in self._shares:
            assert self.layout is not None  # only a sharded channel is dealt in shares
            shares = [sharding.share_rows(self.layout, slots, g) for g in range(slots)]
            if any(not len(share) for share in shares):
                raise DataError(f"the sharded train channel has too few rows for {slots} replica groups")
            self._shares[slots] = shares
        return self._shares[slots]

    def _rows_per_slot(self, slots: int) -> int:
        return max(len(share) for share in self._shares_for(slots))

    def _slot_batch(self, slots: int, epoch: int) -> int:
        return max(1, math.ceil(self.global_batch(epoch) / slots))


_PART = "@rows"  # in a unit's id: a range of a row group's rows, "<row group id>@rows<first>:<last>"


def _part_of(unit_id: str) -> tuple[str, slice | None]:
    """A unit's row group id, and the range of its rows the unit is (None: all of them)."""
    found = re.fullmatch(rf"(.*){_PART}(\d+):(\d+)", unit_id, flags=re.DOTALL)  # a key may hold "@rows", or "\n"
    return (found[1], slice(int(found[2]), int(found[3]))) if found else (unit_id, None)


def _even_shares(units: list[tuple[str, int, int]], slots: int) -> list[list[tuple[str, int, int]]]:
    """Shares for more slots than row groups (``units``): the channel's rows cut into ``slots`` ranges of
    near-equal size, each range's pieces of row groups as its units (``<row group id>@rows<a>:<b>``,
    rows ``a`` to ``b`` of that row group). Every slot gets a share, and shares of one size: a smaller one
    would be walked round again to fill the epoch. Deterministic."""
    units = sorted(units, key=lambda u: u[1])
    edges = np.linspace(units[0][1], units[-1][2], slots + 1).astype(int) if units else np.zeros(slots + 1, int)
    shares = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        share = []
        for unit_id, start, end in units:
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                whole = (lo, hi) == (start, end)
                share.append((unit_id if whole else f"{unit_id}{_PART}{lo - start}:{hi - start}", int(lo), int(hi)))
        shares.append(share)
    return shares


class StreamSampler:
    """Rows of a channel streamed from S3 by parquet row group (``mode: stream``).

    The row groups are dealt to the slots (``sharding.assign``; with fewer row groups than slots, or
    sizes that cannot be dealt evenly (``sharding.balanced``), the rows are cut into even ranges,
    ``_even_shares``); with ``replicated`` the shares rotate each epoch, so over
    ``slots`` epochs every slot sees the whole channel. Within an epoch
    a slot visits its row groups in a shuffled order and each row group's rows shuffled; the next
    row groups are read ahead in a background thread while the current one trains.
    """

    READ_AHEAD = 2
    KEEP_IN_MEMORY = 8

    def __init__(self, job: TrainingJob, plan: TrainingPlan, cache_dir: Path, batch_size: int | None = None):
        self.seed, self.batch_size = job.hyperparameters.seed, batch_size or job.hyperparameters.batch_size
        self.rotate = job.inputs.train.distribution == "replicated"
        # One copy per machine: groups on the same node share what any of them read.
        self.source = streaming.RowGroupSource(plan.train_layout, plan.schema, cache_dir)
        self.units = streaming.units(plan.train_layout)
        self.warm = stream_sample.sampled_units(plan.train_layout)  # the row groups staging read (in the cache)
        self._shares: dict[int, list[list[tuple[str, int, int]]]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead")
        self._loaded: dict[str, Future] = {}
        self._shuffled: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()
        # The slots this group's steps cover (more than one while fewer groups than the epoch's slots train): each
        # needs its current row group and its read-ahead kept, or every step drops and reads again another's.
        self._step: tuple[int, int] | None = None
        self._covered: set[int] = set()
        self._covering = 1  # the most slots a recent step covered

    def steps_per_epoch(self, slots: int, epoch: int = 0) -> int:
        """Steps in an epoch dealt to ``slots`` groups (the same every epoch)."""
        return max(1, math.ceil(self._rows_per_slot(slots) / self._slot_batch(slots)))

    def slot_sizes(self, index: int, slots: int, epoch: int = 0) -> list[int]:
        """Rows of each slot's batch at step ``index`` of any epoch."""
        b = self._slot_batch(slots)
        return [max(0, min(b, self._rows_per_slot(slots) - index * b))] * slots

    def slot_batch(self, epoch: int, index: int, slots: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and labels of slot ``slot``'s batch at step ``index`` of ``epoch``."""
        if self._step != (epoch, index):  # a new step: room for as many slots as the last one covered, to start
            self._step, self._covering, self._covered = (epoch, index), max(1, len(self._covered)), set()
        self._covered.add(slot)
        self._covering = max(self._covering, len(self._covered))
        units, ends = self._order(epoch, slots, slot)
        b = self._slot_batch(slots)
        positions = np.arange(index * b, min((index + 1) * b, self._rows_per_slot(slots)))
        positions %= ends[-1]  # a smaller share wraps around
        which = np.searchsorted(ends, positions, side="right")
        xs, ys = [], []
        # sorted(set()), not np.unique: its first call imports numpy.ma (~20 ms before a group's first batch)
        for k in sorted(set(which.tolist())):
            x, y, order = self._rows(epoch, units[k])
            rows = order[positions[which == k] - (ends[k - 1] if k else 0)]
            xs.append(x[rows])
            ys.append(y[rows])
        last = int(which.max()) if len(which) else 0
        for ahead in range(last + 1, min(last + 1 + self.READ_AHEAD, len(units))):
            self._future(_part_of(units[ahead][0])[0])
        if not xs:
            x, y, _ = self._rows(epoch, units[0])
            return torch.from_numpy(x[:0]), torch.from_numpy(y[:0])
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    def _shares_for(self, slots: int) -> list[list[tuple[str, int, int]]]:
        if slots not in self._shares:
            # Row groups dealt whole, unless there are fewer than groups or they cannot be dealt evenly
            # (a large one among small ones): then the rows are cut into even ranges.
            shares = sharding.assign(self.units, slots) if len(self.units) >= slots else None
            if shares is None or not sharding.balanced(shares):
                shares = _even_shares(self.units, slots)
            if any(not share for share in shares):
                raise DataError(f"the streamed train channel has fewer rows than the {slots} replica groups")
            self._shares[slots] = shares
        return self._shares[slots]

    def _rows_per_slot(self, slots: int) -> int:
        return max(sum(end - start for _, start, end in share) for share in self._shares_for(slots))

    def _slot_batch(self, slots: int) -> int:
        return max(1, math.ceil(self.batch_size / slots))

    def _order(self, epoch: int, slots: int, slot: int) -> tuple[list[tuple[str, int, int]], np.ndarray]:
        shares = self._shares_for(slots)
        share = shares[(slot + epoch) % slots if self.rotate else slot]
        gen = default_rng(self.seed * _SEED_STRIDE + epoch * 1009 + slot)
        units = [share[i] for i in gen.permutation(len(share))]
        if epoch == 0:  # begin with the row groups staging already read (its scaling sample): no wait on S3
            units.sort(key=lambda u: _part_of(u[0])[0] not in self.warm)
        return units, np.cumsum([end - start for _, start, end in units])

    def _rows(self, epoch: int, unit: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A row group's (or part's) arrays and this epoch's order of its rows (batches gather through it:
        shuffling the arrays themselves would copy the whole row group before its first batch)."""
        key = (epoch, unit[0])
        if key not in self._shuffled:
            row_group, part = _part_of(unit[0])
            x, y = self._load(row_group)
            if part:  # a part of the row group: a view of its rows, no copy
                x, y = x[part], y[part]
            order = default_rng([self.seed, epoch, unit[1]]).permutation(len(x))
            # Batches walk a row group in order; a group covering other slots walks a few at once.
            while len(self._shuffled) >= max(4, 2 * self._covering):
                self._shuffled.pop(next(iter(self._shuffled)))
            self._shuffled[key] = (x, y, order)
        return self._shuffled[key]

    def _load(self, unit_id: str) -> tuple[np.ndarray, np.ndarray]:
        """A row group's arrays. A read ahead that failed is tried once more now that it is needed: it
        may have been a network failure some time ago, and pyarrow spends its own retries within seconds.
        A second failure is raised (the group fails, and the elastic retries take over)."""
        future = self._future(unit_id)
        try:
            return future.result()
        except (TrainyardError, OSError):
            with self._lock:
                if self._loaded.get(unit_id) is future:
                    del self._loaded[unit_id]
            return self._future(unit_id).result()

    def _future(self, unit_id: str) -> Future:
        with self._lock:
            if unit_id not in self._loaded:
                self._loaded[unit_id] = self._pool.submit(self.source.load, unit_id)
                # a slot's last row group, its current one and its read-ahead (with one fewer, a slot covering
                # test re-read 3 of 32): a few row groups a slot, only while one group covers several
                while len(self._loaded) > max(self.KEEP_IN_MEMORY, (self.READ_AHEAD + 2) * self._covering):
                    self._loaded.pop(next(iter(self._loaded)))
            return self._loaded[unit_id]
