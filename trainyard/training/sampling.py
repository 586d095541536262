"""Which training rows a replica group uses at each step.

Both samplers answer ``batch(epoch, index)`` from the step alone, so a group that heals from a peer
(and jumps to the peer's step) picks up exactly where the others are, and every group agrees on
``steps_per_epoch`` without talking to the others.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from trainyard import sharding, streaming
from trainyard.errors import DataError
from trainyard.spec import TrainingJob
from trainyard.training.plan import TrainingPlan

_SEED_STRIDE = 1_000_003


class Sampler:
    """Rows of an in-memory training set.

    replicated: each epoch, one permutation of all rows (the same in every group) dealt out to the
    groups in turn. sharded: each group permutes only its own share (``sharding``); smaller shares
    wrap around so that every group takes the same number of steps.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, job: TrainingJob, layout: list[dict], group: int, groups: int):
        self.x, self.y = torch.as_tensor(x), torch.as_tensor(y)
        self.seed, self.group, self.groups, self.num_rows = job.hyperparameters.seed, group, groups, len(x)
        self.batch_size = max(1, math.ceil(job.hyperparameters.batch_size / groups))
        self.share: np.ndarray | None = None
        if job.inputs.train.distribution == "sharded":
            shares = [sharding.share_rows(layout, groups, g) for g in range(groups)]
            self.share, self.rows_per_group = shares[group], max(len(s) for s in shares)
            if not len(self.share):
                raise DataError(f"replica group {group} has no rows of the sharded train channel")
        else:
            self.rows_per_group = self.num_rows // groups
        self.steps_per_epoch = max(1, math.ceil(self.rows_per_group / self.batch_size))

    def batch(self, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and labels of the batch at ``index`` within ``epoch``."""
        gen = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + epoch)
        positions = torch.arange(index * self.batch_size, min((index + 1) * self.batch_size, self.rows_per_group))
        if self.share is None:
            rows = torch.randperm(self.num_rows, generator=gen)[self.group :: self.groups][positions]
        else:
            gen.manual_seed(self.seed * _SEED_STRIDE + epoch * 1009 + self.group)
            order = torch.from_numpy(self.share)[torch.randperm(len(self.share), generator=gen)]
            rows = order[positions % len(order)]
        return self.x[rows], self.y[rows]


class StreamSampler:
    """Rows of a channel streamed from S3 by parquet row group (``mode: stream``).

    The row groups are dealt to the groups (``sharding.assign``); with ``replicated`` the shares
    rotate each epoch, so over ``groups`` epochs every group sees the whole channel. Within an epoch
    a group visits its row groups in a shuffled order and each row group's rows shuffled; the next
    row groups are read ahead in a background thread while the current one trains.
    """

    READ_AHEAD = 2
    KEEP_IN_MEMORY = 8

    def __init__(self, job: TrainingJob, plan: TrainingPlan, group: int, groups: int, cache_dir: Path):
        self.seed, self.group, self.groups = job.hyperparameters.seed, group, groups
        self.rotate = job.inputs.train.distribution == "replicated"
        # One copy per machine: groups on the same node share what any of them read.
        self.source = streaming.RowGroupSource(plan.train_layout, plan.schema, cache_dir)
        self.shares = sharding.assign(streaming.units(plan.train_layout), groups)
        if any(not share for share in self.shares):
            raise DataError(f"the streamed train channel has fewer row groups than the {groups} replica groups")
        self.batch_size = max(1, math.ceil(job.hyperparameters.batch_size / groups))
        self.rows_per_group = max(sum(end - start for _, start, end in share) for share in self.shares)
        self.warm_rows = streaming.SAMPLE_ROWS  # row groups starting below this were read by staging
        self.steps_per_epoch = max(1, math.ceil(self.rows_per_group / self.batch_size))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead")
        self._loaded: dict[str, Future] = {}
        self._shuffled: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def batch(self, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and labels of the batch at ``index`` within ``epoch``."""
        units, ends = self._order(epoch)
        positions = np.arange(index * self.batch_size, min((index + 1) * self.batch_size, self.rows_per_group))
        positions %= ends[-1]  # a smaller share wraps around
        which = np.searchsorted(ends, positions, side="right")
        xs, ys = [], []
        for k in np.unique(which):
            x, y = self._rows(epoch, units[k])
            offsets = positions[which == k] - (ends[k - 1] if k else 0)
            xs.append(x[offsets])
            ys.append(y[offsets])
        for ahead in range(int(which.max()) + 1, min(int(which.max()) + 1 + self.READ_AHEAD, len(units))):
            self._future(units[ahead][0])
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    def _order(self, epoch: int) -> tuple[list[tuple[str, int, int]], np.ndarray]:
        share = self.shares[(self.group + epoch) % self.groups if self.rotate else self.group]
        gen = np.random.default_rng(self.seed * _SEED_STRIDE + epoch * 1009 + self.group)
        units = [share[i] for i in gen.permutation(len(share))]
        if epoch == 0:  # begin with the row groups staging already read (its scaling sample): no wait on S3
            units.sort(key=lambda u: u[1] >= self.warm_rows)
        return units, np.cumsum([end - start for _, start, end in units])

    def _rows(self, epoch: int, unit: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray]:
        key = (epoch, unit[0])
        if key not in self._shuffled:
            x, y = self._future(unit[0]).result()
            order = np.random.default_rng([self.seed, epoch, unit[1]]).permutation(len(x))
            self._shuffled = {key: (x[order], y[order])}  # batches walk a row group in order: keep one
        return self._shuffled[key]

    def _future(self, unit_id: str) -> Future:
        with self._lock:
            if unit_id not in self._loaded:
                self._loaded[unit_id] = self._pool.submit(self.source.load, unit_id)
                while len(self._loaded) > self.KEEP_IN_MEMORY:
                    self._loaded.pop(next(iter(self._loaded)))
            return self._loaded[unit_id]
