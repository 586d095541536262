"""What a replica group trains on at each step: its share of the step's rows, sifted when sifting is on.

Without sifting, a group's share of the step's global batch (``sampling.step_batch``) is its batch.
With sifting, the global batch is of candidates, ``batch_size * (1 + beta)`` rows; the group scores
its share with a no-grad forward pass and keeps ``1 / (1 + beta)`` of it (``sifting.Sifter``), so the
kept batches add up to ``batch_size`` across the quorum. With ``sifting.score: reducible_loss`` the
score is the loss minus the row's reference loss (RHO-LOSS), which the filtering stage wrote next to
the rows; it rides through the sampler as one more feature column, cut off before the model sees it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trainyard import algorithms
from trainyard.errors import TrainingError
from trainyard.sifting import Sifter
from trainyard.spec import TrainingJob
from trainyard.training.flops import FlopMeter
from trainyard.training.plan import TrainingPlan
from trainyard.training.sampling import Sampler, StreamSampler, member_sizes, step_batch


class StepData:
    """Each step's batch for one replica group."""

    def __init__(
        self, job: TrainingJob, plan: TrainingPlan, x, y, cache_dir: Path, loss_fn, meter: FlopMeter, device=None
    ):
        hp = job.hyperparameters
        self.device = device or torch.device("cpu")  # batches are cut on the CPU and moved here
        self.sifter = Sifter(job.sifting, hp.seed) if job.sifting.enabled else None
        batch = self.sifter.candidate_batch(hp.batch_size) if self.sifter else hp.batch_size
        self.classification = job.algorithm.task == "classification"
        self.loss_fn, self.meter = loss_fn, meter
        self._mark = (0, 0)
        self.reducible = job.sifting.by_reducible_loss
        if plan.streamed:
            self.sampler = StreamSampler(job, plan, cache_dir, batch_size=batch)
        else:
            if self.reducible:
                x = torch.cat([torch.as_tensor(x), _reference_losses(plan.train_data, len(x))[:, None]], dim=1)
            self.sampler = Sampler(x, y, job, plan.train_layout, batch_size=batch)

    def steps_per_epoch(self, slots: int) -> int:
        return self.sampler.steps_per_epoch(slots)

    def batch(self, model, epoch: int, index: int, step: int, slots: int, rank: int, members: int) -> tuple:
        """``(x, y, global_count)``: this group's rows at this step and the rows trained across the quorum."""
        xb, yb, global_count = step_batch(self.sampler, epoch, index, slots, rank, members)
        reference = None
        if self.reducible:
            xb, reference = xb[:, :-1], xb[:, -1].numpy().astype(np.float64)
        if self.sifter is None:
            return xb.to(self.device), yb.to(self.device), global_count
        keep = self.sifter.keep_count(len(xb))
        global_count = sum(self.sifter.keep_count(n) for n in member_sizes(self.sampler, index, slots, members))
        labels = yb.numpy() if self.classification else None
        if not self.sifter.active(step):
            self.sifter.record_uniform(labels, len(xb), keep)  # candidates are in random order already
            return xb[:keep].to(self.device), yb[:keep].to(self.device), global_count
        xb, yb = xb.to(self.device), yb.to(self.device)
        model.eval()  # scoring is inference: no dropout, batch-norm statistics left alone
        with torch.no_grad():
            losses = self.loss_fn(model(xb), yb)
        model.train()
        algorithms.check_per_sample(losses, len(xb))
        self.meter.add_scoring(xb)
        scores = losses.cpu().numpy().astype(np.float64)
        if reference is not None:  # RHO-LOSS: what is left to learn, not noise the reference could not fit either
            scores = scores - reference
        chosen = torch.from_numpy(self.sifter.select(scores, labels, keep, step, rank)).to(self.device)
        return xb[chosen], yb[chosen], global_count

    def epoch_metrics(self) -> dict:
        """The kept fraction since the last call (an epoch's), when sifting is on."""
        if self.sifter is None:
            return {}
        scored, kept = self.sifter.scored - self._mark[0], self.sifter.kept - self._mark[1]
        self._mark = (self.sifter.scored, self.sifter.kept)
        return {"kept_fraction": kept / scored if scored else 1.0}

    def report(self) -> dict | None:
        """What this group's sifter scored and kept (None without sifting)."""
        return self.sifter.report() if self.sifter else None

    def state_dict(self) -> dict:
        return self.sifter.state_dict() if self.sifter else {}

    def load_state_dict(self, state: dict) -> None:
        if self.sifter and state:
            self.sifter.load_state_dict(state)


def _reference_losses(train_data: str, rows: int) -> torch.Tensor:
    """Each training row's reference loss, written by the filtering stage for ``reducible_loss``."""
    with np.load(train_data) as data:
        if "irreducible" not in data.files:
            raise TrainingError(
                f"{train_data} has no reference losses for sifting.score reducible_loss: the filtering stage "
                "writes them when the prefilter runs; leave sifting.prefilter.enabled unset or true"
            )
        losses = data["irreducible"]
    if len(losses) != rows or not np.isfinite(losses).all():
        raise TrainingError(f"{train_data}: its reference losses do not match its {rows} rows")
    return torch.from_numpy(losses.astype(np.float32))
