"""What a replica group trains on at each step: its share of the step's rows, sifted when sifting is on.

Without sifting, a group's share of the step's global batch (``sampling.step_batch``) is its batch.
With sifting, the global batch is of candidates, ``batch_size * (1 + beta)`` rows; the group scores
its share with a no-grad forward pass and keeps its part of the step's kept batch
(``Sifter.keep_counts``: ``1 / (1 + beta)`` of the candidates, dealt among the quorum so that the
kept batches add up to ``batch_size``). Before ``delay_steps`` nothing is scored: the first of the
(shuffled) candidates are trained on and the rest left out.

With ``sifting.score: reducible_loss`` the score is the loss minus the row's reference loss
(RHO-LOSS), which the filtering stage wrote next to the rows; it rides through the sampler as one
more feature column, cut off before the model sees it.
With ``sifting.reuse_loss_epochs`` each row's index rides along the same way (two columns, exact to
2**32 rows), so the group can look up the row's last known loss (``pruning.LossMemory``) and score
only the candidates whose loss is unknown or too old.
With ``sifting.score: proxy`` a small model trained alongside (``proxy.ProxyScorer``) scores the
candidates instead of the job's model, and learns the rows each step trains on once the step commits.
With ``sifting.prune`` (``pruning.Pruner``) the rows the keep rule kept (or all the group's rows, with
beta 0) are pruned by those remembered losses: some sit out the step, the kept learnt ones get a loss
weight (``StepData.weights``), and the step's normaliser stays the rows dealt (over ``batch_factor``,
whose epochs are dealt that many times the rows a step).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trainyard import algorithms
from trainyard.errors import TrainingError
from trainyard.pruning import LossMemory, Pruner
from trainyard.sifting import Sifter, fractions_by_class
from trainyard.spec import TrainingJob
from trainyard.status import pruned_fraction, trained_fraction_by_class
from trainyard.training.ddp import alone
from trainyard.training.flops import FlopMeter
from trainyard.training.plan import TrainingPlan
from trainyard.training.proxy import Pass, ProxyScorer
from trainyard.training.sampling import Sampler, StreamSampler, member_sizes, step_batch


class StepData:
    """Each step's batch for one replica group."""

    def __init__(
        self, job: TrainingJob, plan: TrainingPlan, x, y, cache_dir: Path, loss_fn, meter: FlopMeter, device=None
    ):
        hp = job.hyperparameters
        self.device = device or torch.device("cpu")  # batches are cut on the CPU and moved here
        self.sifter = Sifter(job.sifting, hp.seed) if job.sifting.enabled else None
        self.batch_size, self.epochs = hp.batch_size, hp.epochs
        batch = self.sifter.candidate_batch(hp.batch_size) if self.sifter else hp.batch_size
        self.classification = job.algorithm.task == "classification"
        # the sifter counts class indices; reports name the classes by their label values
        self._class_names = [str(c) for c in plan.schema.get("classes") or []]
        self.loss_fn, self.meter = loss_fn, meter
        self._mark: dict = {}  # the sifter's counts at the last epoch's end
        # Each step's candidates ranked this epoch: their loss sum and count (a redone step's replaces its first
        # try's). train_loss is over the kept rows, the hard ones; this is over what an unsifted job trains on.
        self._candidate_losses: dict[int, tuple[float, int]] = {}
        self.reducible = job.sifting.by_reducible_loss
        self.proxy = None
        # the proxy's learning of the last batch handed out, done at the step's commit (committed)
        self._proxy_learns: Callable[[], None] | None = None
        self._pass: Pass | None = None  # the proxy's scoring pass over this step's candidates
        # Before sifting starts: the trained rows' reference losses (zeros where none), their training losses then
        # joining the keep rule's history (trained); None on a step that ranks
        self._before_sifting: np.ndarray | None = None
        if self.sifter and job.sifting.score == "proxy" and self.sifter.beta > 0:
            outputs = plan.schema["num_outputs"]
            self.proxy = ProxyScorer(
                job.sifting.proxy, job.algorithm.task, hp.seed, np.asarray(x), np.asarray(y), outputs, self.device
            )
        reuse = job.sifting.loss_reuse_epochs(plan.streamed) if self.sifter else 0
        prune = job.sifting.settled()[1] if job.sifting.prunes else None
        classes = len(plan.schema.get("classes") or []) or plan.schema.get("num_outputs")
        classes = classes if self.classification else None
        labels = np.asarray(y) if classes and prune and not plan.streamed else None  # each row's class index
        guard = job.sifting.min_class_fraction  # the class balance guard: pruning's hardest rule too
        self.pruner = Pruner(prune, hp.epochs, hp.seed, classes, labels, guard) if prune else None
        # the keep rule reuses losses only up to `reuse` epochs old; pruning reads any age (InfoBatch)
        self.memory = LossMemory(len(x), reuse) if reuse or prune else None
        self.weights: torch.Tensor | None = None  # the last batch's loss weights (pruning), None when all are 1
        self._trained: tuple[np.ndarray, int] | None = None  # rows of the batch handed out, and its epoch
        self._side = int(self.reducible) + (2 if self.memory else 0)  # columns riding after the features
        self.sampler: Sampler | StreamSampler
        if plan.streamed:
            self.sampler = StreamSampler(job, plan, cache_dir, batch_size=batch)
        else:
            side = [_reference_losses(plan.train_data, len(x))[:, None]] if self.reducible else []
            side += [_row_id_columns(len(x))] if self.memory else []
            if side:
                x = torch.cat([torch.as_tensor(x), *side], dim=1)
            # with sifting.prune.batch_factor, the pruning epochs deal more rows a step, about batch_size to train
            sifter = self.sifter
            epoch_batch = (lambda e: sifter.candidate_batch(self._dealt(e))) if sifter and self.pruner else None
            self.sampler = Sampler(x, y, job, plan.train_layout, batch_size=batch, epoch_batch=epoch_batch)

    def _dealt(self, epoch: int) -> int:
        """Rows dealt (kept by the keep rule) a step of ``epoch``, across the quorum (pruning jobs)."""
        assert self.pruner is not None
        return self.pruner.config.dealt_batch(self.batch_size, epoch, self.epochs)

    def steps_per_epoch(self, slots: int, epoch: int) -> int:
        return self.sampler.steps_per_epoch(slots, epoch)

    def batch(self, model, epoch: int, index: int, step: int, slots: int, rank: int, members: int) -> tuple:
        """``(x, y, normaliser)``: this group's rows at this step, and what the quorum's summed loss is divided
        by: the rows trained across the quorum, or with pruning the rows dealt; in the epochs that
        ``sifting.prune.batch_factor`` deals more rows, those over the factor (about ``batch_size``)."""
        xb, yb, global_count = step_batch(self.sampler, epoch, index, slots, rank, members)
        self._epoch = epoch
        reference = rows = None
        self._pass = None
        if self._side:
            xb, side = xb[:, : -self._side], xb[:, -self._side :]
            reference = side[:, 0].numpy().astype(np.float64) if self.reducible else None
            rows = _row_ids(side[:, -2:]) if self.memory else None
        self.weights = None
        if self.sifter is None:
            return xb.to(self.device), yb.to(self.device), global_count
        if self.memory is not None:
            self.memory.begin(step)
        keeps = self.sifter.keep_counts(member_sizes(self.sampler, epoch, index, slots, members), step)
        keep, global_count = keeps[rank], sum(keeps)
        labels = yb.numpy() if self.classification else None
        self._before_sifting = None
        if not self.sifter.active(step) or keep == 0:
            self.sifter.record_uniform(len(xb), keep, step, rank)  # candidates are in random order already
            chosen = np.arange(min(keep, len(xb)))
            # (with the keep rule on, in its delay; not with a proxy, whose history holds its own losses)
            if self.sifter.beta > 0 and not self.sifter.active(step) and self.proxy is None:
                self._before_sifting = reference[chosen] if reference is not None else np.zeros(len(chosen))
        else:
            xb, yb = xb.to(self.device), yb.to(self.device)
            scores = self._losses(model, xb, yb, rows, epoch)
            if self.proxy is None:  # (the proxy's losses are a side model's: no loss of the job's model to report)
                self._candidate_losses[step] = (float(scores.sum()), len(scores))
            if reference is not None:  # RHO-LOSS: what is left to learn, not noise the reference could not fit either
                scores = scores - reference
            chosen = self.sifter.select(scores, labels, keep, step, rank)
        if self.pruner is not None:
            assert rows is not None and self.memory is not None  # pruning remembers losses by row
            # The step's normaliser stays the rows dealt (global_count): the kept learnt rows' weights make
            # up for the pruned ones, and the hardest are left out of the gradient altogether. With a
            # batch_factor, the rows dealt over the factor: InfoBatch's mean over a batch of about batch_size
            # rows, so an epoch's steps add up to a whole epoch's gradient in fewer, larger steps.
            kept, weights = self.pruner.decide(rows[chosen], self.memory, epoch, step)
            chosen = chosen[kept]
            if self._before_sifting is not None:  # (the delay's: its history takes the rows trained)
                self._before_sifting = self._before_sifting[kept]
            self.weights = torch.from_numpy(weights).to(self.device) if (weights != 1).any() else None
            global_count = global_count * self.batch_size / self._dealt(epoch)
        self._trained = (rows[chosen], epoch) if rows is not None else None
        picked = torch.from_numpy(chosen).to(xb.device)
        xb, yb = xb[picked].to(self.device), yb[picked].to(self.device)
        if self.proxy is not None:  # learnt once the step commits: from its scoring pass, or rows unscored
            scored = self._pass
            self._proxy_learns = (
                partial(self.proxy.learn, scored.of(picked))
                if scored is not None
                else partial(self.proxy.train, xb, yb)
            )
        self._pass = None
        return xb, yb, global_count

    def committed(self) -> None:
        """The step whose batch was handed out last has committed: with ``sifting.score: proxy`` the proxy
        learns its rows now (before sifting starts too), not when they were dealt, so a step torchft redoes
        ranks and picks as its first try did, and a healing group gets a proxy of committed steps only. A heal
        after a try that did not commit undoes that try's counts; after one that did, keeps them."""
        for part in (self.sifter, self.pruner, self.memory):
            if part is not None:
                part.committed()
        if self._proxy_learns is not None:
            before = self.meter.scoring
            self._proxy_flops(self._proxy_learns)
            self.meter.proxy_training += self.meter.scoring - before  # of scoring, what its training took
            self._proxy_learns = None

    def share_losses(self, manager, closes_epoch: bool) -> None:
        """At an epoch's last step, before it commits: the losses each group remembered in the epoch, merged
        over the quorum, so that every group prunes (and reuses losses) by every row's, not by the share of
        rows it was dealt (a half, with two groups), and reckons the next epoch's thresholds as the others
        do. One group measures a row in an epoch (its rows are dealt); a collective that fails leaves the
        step uncommitted, and the redo undoes what this remembered (``LossMemory.begin``)."""
        memory = self.memory
        if memory is None or not closes_epoch or alone(manager):
            return
        epoch = self._epoch
        mine = memory.epoch == epoch
        shared = torch.from_numpy(np.stack([np.where(mine, memory.loss, 0), mine]).astype(np.float32))
        shared = shared.to(self.device)  # (where the process group's collectives run)
        if not manager.allreduce(shared, reduce_op=dist.ReduceOp.SUM).wait():
            return  # the collective failed (the tensor may be garbage): the step will not commit, and is redone
        total, count = shared.cpu().numpy()
        rows = np.flatnonzero(count > 0)
        memory.remember(rows, total[rows] / count[rows], epoch)

    def trained(self, losses: torch.Tensor) -> None:
        """The per-sample losses of the training forward pass over the last batch handed out: with
        ``reuse_loss_epochs``, remembered as those rows' latest losses (no scoring pass needed for them); during
        the keep rule's ``delay_steps``, added to its history (less their reference losses, ranking by reducible
        loss), free: the delay is there to gather the history its first sifted steps rank against, which was
        empty then (a first sifted step kept every candidate alike)."""
        values = None
        if self.memory is not None and self._trained is not None:
            rows, epoch = self._trained
            values = losses.detach().float().cpu().numpy()
            self.memory.remember(rows, values, epoch)
        if self.sifter is not None and self._before_sifting is not None:
            values = losses.detach().float().cpu().numpy() if values is None else values
            self.sifter.remember_trained(values.astype(np.float64) - self._before_sifting)

    def _losses(self, model, xb: torch.Tensor, yb: torch.Tensor, rows: np.ndarray | None, epoch: int) -> np.ndarray:
        """Each candidate's loss: a no-grad forward pass over those without a recent enough known loss (or
        the proxy's over all of them: its losses are not remembered, pruning's are the job's model's)."""
        if self.proxy is not None:
            losses, self._pass = self._proxy_flops(self.proxy.score, xb, yb)
            return losses
        scored = np.ones(len(xb), dtype=bool)
        losses = np.empty(len(xb), dtype=np.float64)
        memory = self.memory
        if rows is not None and memory is not None:
            scored = ~memory.fresh(rows, epoch)
            losses[~scored] = memory.loss[rows[~scored]]
            memory.reused += int((~scored).sum())
        if scored.any():
            pick = torch.from_numpy(np.flatnonzero(scored)).to(xb.device)
            xs, ys = (xb, yb) if len(pick) == len(xb) else (xb[pick], yb[pick])
            model.eval()  # scoring is inference: no dropout, batch-norm statistics left alone
            with torch.no_grad():
                fresh = self.loss_fn(model(xs), ys)
            model.train()
            fresh = algorithms.check_per_sample(fresh, len(xs))
            self.meter.add_scoring(xs)
            losses[scored] = fresh.float().cpu().numpy()  # numpy has no bfloat16
            if rows is not None and memory is not None:
                memory.remember(rows[scored], losses[scored], epoch)
        return losses

    def _proxy_flops(self, work, *args):
        """``work(*args)``, its FLOPs counted as the sifter's scoring: what ranking the candidates cost."""
        assert self.proxy is not None
        before = self.proxy.flops
        result = work(*args)
        self.meter.scoring += self.proxy.flops - before
        return result

    def epoch_metrics(self) -> dict:
        """The kept fraction since the last call (an epoch's), overall and per class, of the candidates
        the keep rule ranked (None before sifting started), their mean keep probability (the share the
        rule would keep on its own), and their mean loss (``candidate_loss``, the job's model's loss they were
        ranked by, fresh or remembered (``reuse_loss_epochs``), without the reference loss; none with
        ``score: proxy``, whose ranking losses are the proxy's), when sifting is on."""
        if self.sifter is None:
            return {}
        now, then = self.sifter.counts() | (self.pruner.counts() if self.pruner else {}), self._mark
        self._mark = now
        since = {k: now[k] - then.get(k, 0) for k in ("scored", "kept", "keep_probability_sum")}
        pruned: dict[str, float | dict] = {}
        if self.pruner is not None:
            epoch = {k: now[k] - then.get(k, 0) for k in ("prune_dealt", "pruned_learnt", "pruned_hardest")}
            pruned = {"pruned_fraction": pruned_fraction(epoch)}
            if "prune_dealt_by_class" in now:
                dealt, left_out = (_since(now, then, which) for which in ("prune_dealt_by_class", "pruned_by_class"))
                if trained := trained_fraction_by_class(dealt, left_out):
                    pruned["trained_fraction_by_class"] = self._named(trained)
        kept_by_class, ranked_by_class = (_since(now, then, which) for which in ("kept_by_class", "scored_by_class"))
        by_class = fractions_by_class(kept_by_class, ranked_by_class)
        scored = since["scored"]
        metrics = {"kept_fraction": since["kept"] / scored if scored else None}
        if scored:
            metrics["mean_keep_probability"] = since["keep_probability_sum"] / scored
        if self._candidate_losses:
            loss_sum, ranked = np.sum(list(self._candidate_losses.values()), axis=0)
            metrics["candidate_loss"] = float(loss_sum / ranked)
            self._candidate_losses = {}
        return metrics | pruned | ({"kept_fraction_by_class": self._named(by_class)} if by_class else {})

    def counts(self) -> dict | None:
        """The sifter's running counts (what the job adds up of a group), classes named, without the
        report's derived fractions: cheap enough for every step. None without sifting."""
        if self.sifter is None:
            return None
        counts = self.sifter.counts()
        for key in ("kept_by_class", "scored_by_class"):
            counts[key] = self._named(counts[key])
        if self.pruner is not None:
            counts |= self.pruner.counts()
            for key in ("prune_dealt_by_class", "pruned_by_class"):
                if key in counts:
                    counts[key] = self._named(counts[key])
        # candidates ranked by a remembered loss, without a scoring pass
        return counts | ({"losses_reused": self.memory.reused} if self.memory is not None else {})

    def report(self) -> dict | None:
        """What this group's sifter scored and kept, and its kept fractions (None without sifting)."""
        if self.sifter is None:
            return None
        report = self.sifter.report()
        report["kept_fraction_by_class"] = self._named(report["kept_fraction_by_class"])
        return report | (self.counts() or {})

    def _named(self, by_class: dict) -> dict:
        """``{class index: value}`` keyed by the classes' label values instead."""
        names = self._class_names
        return {names[int(c)] if int(c) < len(names) else c: v for c, v in by_class.items()}

    def state_dict(self, step: int | None = None) -> dict:
        """What a healing group takes from this one; ``step``: this group's current step (what a try of it
        that did not commit added is left out)."""
        state = self.sifter.state_dict(step) if self.sifter else {}
        state |= self.pruner.state_dict() if self.pruner else {}
        state |= self.proxy.state_dict() if self.proxy else {}  # (of committed steps: see committed)
        return state | (self.memory.state_dict(step) if self.memory else {})

    def load_state_dict(self, state: dict) -> None:
        if self.sifter and state:
            self.sifter.load_state_dict(state)
        if self.memory and state:
            self.memory.load_state_dict(state)
        if self.pruner and state:
            self.pruner.load_state_dict(state)
        if self.proxy and state:
            self.proxy.load_state_dict(state)


def _since(now: dict, then: dict, key: str) -> dict[str, int]:
    """A per-class count (``key``) since the last epoch's end: ``now``'s less ``then``'s."""
    return {c: n - then.get(key, {}).get(c, 0) for c, n in now[key].items()}


def _reference_losses(train_data: str, rows: int) -> torch.Tensor:
    """Each training row's reference loss, written by the filtering stage for ``reducible_loss``."""
    with np.load(train_data) as data:
        if "irreducible" not in data.files:
            raise TrainingError(
                f"{train_data} has no reference losses for sifting.score reducible_loss: the filtering stage "
                "writes them when the prefilter runs; leave sifting.prefilter.enabled unset or true"
            )
        losses = data["irreducible"]
    if len(losses) != rows:
        raise TrainingError(f"{train_data}: its {len(losses)} reference losses do not match its {rows} rows")
    if not np.isfinite(losses).all():  # (the filtering stage refuses these: a file written otherwise)
        bad = int((~np.isfinite(losses)).sum())
        raise TrainingError(f"{train_data}: {bad} of its reference losses are not numbers")
    return torch.from_numpy(losses.astype(np.float32))


def _row_id_columns(rows: int) -> torch.Tensor:
    """Row indices as two float32 columns (high and low 16 bits: each exact in a float32)."""
    ids = torch.arange(rows, dtype=torch.int64)
    return torch.stack([ids // 65536, ids % 65536], dim=1).to(torch.float32)


def _row_ids(columns: torch.Tensor) -> np.ndarray:
    pair = columns.to(torch.int64)
    return (pair[:, 0] * 65536 + pair[:, 1]).numpy()
