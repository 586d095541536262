"""Stage 3, filtering: decide which training samples are worth their compute, before training.

The offline prefilter (``sifting.prefilter``) drops three kinds of rows, RHO-LOSS style:

- **duplicate**: an exact copy (features and label) of an earlier row;
- **learnt**: rows a reference model that never saw them already predicts best (the lowest
  held-out losses): training on them teaches little;
- **unlearnable**: rows with the highest held-out losses, beyond what the model class can fit:
  most often wrong labels, which training would only memorise.

The held-out losses come from cross-fitting (``reference_losses``): the rows are split in two halves, a
small reference model is trained briefly on each half and scores the other, so every row is scored by a
model that did not train on it. With ``reference: champion`` the registry's current champion of the
model name scores every row instead (no training; ``Champion``); a champion that is missing or
does not fit the data falls back to cross-fitting, and the report's ``reference`` says which was used.

What is kept is written as a filtered training file the replica groups read, with a filtered manifest
beside it: for each source object, which of its rows were dropped and why (``write_manifest``), and a
digest of the selection, the lineage of what training read. The report gives the counts by reason and
the FLOPs the scoring cost. The online sifter (``sifting``) then runs inside each
group's training loop (``trainyard.sifting``); with ``score: reducible_loss`` (RHO-LOSS) it needs
each row's reference loss, which this stage then computes and writes next to the rows.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from trainyard import label_noise
from trainyard.datasets import StagedData
from trainyard.errors import TrainingError
from trainyard.home import write_json_atomic
from trainyard.reference_losses import (
    HOLDOUT,
    Champion,
    JobLoss,
    champion_losses,
    fitting,
    held_out_losses,
    job_loss,
)
from trainyard.spec import Algorithm, Hyperparameters, Prefilter, Sifting
from trainyard.training import proxy

REASONS = ("kept", "duplicate", "learnt", "unlearnable")  # a row's fate; the report's and manifest's names


@dataclass(slots=True)
class FilterReport:
    """What the filtering stage kept, and the training data file the groups will read."""

    train_data: str
    total: int
    kept: int
    dropped: dict[str, int] = field(default_factory=dict)
    scoring_flops: int = 0
    sifting_enabled: bool = False
    train_layout: list[dict] | None = None
    """The layout of the filtered rows by object (for sharding), when rows were dropped."""
    reference: str | None = None
    """What scored the rows (for loss-based drops or reducible-loss sifting); None when nothing did."""
    manifest: str | None = None
    """The filtered manifest (``write_manifest``), when the prefilter ran."""
    manifest_digest: str | None = None
    """Its digest of which rows of which objects (and which bytes of them: their ETags) were kept."""
    manifest_uri: str | None = None
    """Where the filtered manifest was uploaded with the job's outputs, once it was."""
    kept_for_balance: int = 0
    """Rows the loss-based drops would have taken, kept so that no class falls below the guard's floor."""
    label_noise: dict | None = None
    """What was measured of the labels to pick online sifting's rule (``Sifting.adaptive``), and what was chosen."""
    sifting: Sifting | None = None
    """The sifting config training uses when it was picked here (``label_noise``), else None (the job's)."""

    @property
    def kept_fraction(self) -> float:
        return self.kept / self.total if self.total else 1.0

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("train_layout", "sifting")} | {
            "kept_fraction": self.kept_fraction
        }


@dataclass(slots=True)
class Prefiltered:
    """What the prefilter decided for each row."""

    keep: np.ndarray
    dropped: dict[str, int]
    flops: int
    reference: str | None
    """What scored the rows (None when no reference model was needed)."""
    reasons: np.ndarray
    """Each row's fate, an index into ``REASONS`` (0: kept)."""
    losses: np.ndarray | None = None
    """Each row's reference loss (NaN for exact duplicates), when one was computed."""
    kept_for_balance: int = 0
    """Rows the loss-based drops would have taken, kept by the class balance guard."""


def needs_reference(sifting: Sifting) -> bool:
    """Whether the prefilter scores rows with a reference model: for its loss-based drops, or for the
    online sifter's ``reducible_loss``."""
    drops = sifting.prefilter.drop_learnt_fraction or sifting.prefilter.drop_unlearnable_fraction
    return bool(sifting.prefilter_on and (drops or sifting.by_reducible_loss))


def wants_champion(sifting: Sifting, streamed: bool = False) -> bool:
    """Whether the prefilter will score rows with the registry's champion (so the caller loads it)."""
    return needs_reference(sifting) and sifting.prefilter.reference == "champion" and not streamed


def filter_samples(
    staged: StagedData,
    sifting: Sifting,
    task: str = "classification",
    champion: Champion | None = None,
    algorithm: Algorithm | None = None,
    hyperparameters: Hyperparameters | None = None,
) -> FilterReport:
    """Prefilter the training set (when ``sifting.prefilter.enabled``); otherwise keep every row. With
    ``sifting.adaptive``, first pick online sifting's rule from the labels (``label_noise``): the report's
    ``sifting`` is then the config training uses.

    With an entrypoint ``algorithm``, rows are scored with its own loss (``job_loss``), the loss its
    training and sifting use, so that reducible loss subtracts like from like."""
    total = staged.rows["train"]
    report = FilterReport(train_data=staged.train_data, total=total, kept=total, sifting_enabled=sifting.enabled)
    adapting = sifting.adaptive and not staged.streamed
    if not (sifting.prefilter_on or adapting) or staged.streamed:
        return report  # a streamed channel is never read whole before training: nothing to prefilter
    data = np.load(staged.train_data)
    x, y = data["x"], data["y"]
    num_outputs = staged.schema.get("num_outputs", 1)
    distinct, noise = ~duplicates(x, y), None
    if adapting:
        assert sifting.noisy_share is not None  # (adaptive: it is set)
        noise = label_noise.estimate(x, y, distinct, sifting.prefilter, num_outputs, sifting.noisy_share)
        if not noise.noisy and algorithm is not None:  # a clean channel's proxy must be far cheaper than the model
            hp = hyperparameters or Hyperparameters()
            noise = replace(noise, proxy_cost=proxy.relative_cost(sifting.proxy, algorithm, hp, x, y, num_outputs))
        sifting = report.sifting = sifting.adapted(noise.prunes)
        report.label_noise, report.scoring_flops = noise.to_dict(), noise.flops
        if not sifting.prefilter_on:
            return report
    if champion is not None:
        champion = fitting(champion, staged.schema)
    loss_fn = None
    if algorithm is not None and algorithm.entrypoint and needs_reference(sifting):
        loss_fn = job_loss(algorithm, hyperparameters or Hyperparameters(), x, y, num_outputs)
    result = prefilter(
        x,
        y,
        sifting.prefilter,
        task,
        num_outputs,
        champion,
        with_losses=sifting.by_reducible_loss,
        min_class_fraction=sifting.prefilter.min_class_fraction,
        loss_fn=loss_fn,
        distinct=distinct,
        held_out=noise.losses if noise is not None else None,  # the same rows, reference settings and seed
    )
    keep = result.keep
    arrays = {"x": x[keep], "y": y[keep]}
    if sifting.by_reducible_loss:  # the online sifter's RHO-LOSS score subtracts these, row by row
        assert result.losses is not None  # asked for (with_losses)
        arrays["irreducible"] = result.losses[keep].astype(np.float32)
    path = Path(staged.train_data).with_name("train.filtered.npz")
    np.savez(path, **arrays)
    report.train_data, report.kept, report.dropped = str(path), int(keep.sum()), result.dropped
    report.scoring_flops, report.reference = report.scoring_flops + result.flops, result.reference
    report.kept_for_balance = result.kept_for_balance
    report.train_layout = filtered_layout(staged.train_layout, keep)
    report.manifest = str(path.with_name("train.filtered.manifest.json"))
    report.manifest_digest = write_manifest(Path(report.manifest), report, staged, result.reasons)
    return report


def write_manifest(path: Path, report: FilterReport, staged: StagedData, reasons: np.ndarray) -> str:
    """Write the filtered manifest and return its digest: for each source object (its S3 URI, a pinned
    version included, and its ETag), its rows, how many were kept, and the numbers of the dropped ones by
    reason (counted from 0 within the object, in the order staging read it), so a dropped row can be found
    in the data; the digest covers which rows of which objects, as which bytes, were kept."""
    objects = staged.train_layout or [{"id": staged.train_data, "start": 0, "end": len(reasons)}]
    entries, digest = [], hashlib.sha256()
    for obj in objects:
        fates = reasons[obj["start"] : obj["end"]]
        dropped = {name: np.flatnonzero(fates == code).tolist() for code, name in enumerate(REASONS) if code}
        entry = {"id": obj["id"], "etag": obj.get("etag"), "rows": len(fates), "kept": int((fates == 0).sum())}
        entries.append(entry | {"dropped": dropped})
        digest.update(
            f"{obj['id']}\0{obj.get('etag') or ''}\0{len(fates)}\0".encode() + np.packbits(fates == 0).tobytes() + b"\n"
        )
    digest_text = "sha256:" + digest.hexdigest()
    manifest = {
        "train_data": report.train_data,  # this machine's arrays: the objects below say where the rows came from
        "source_arrays": staged.train_data,
        "rows": report.total,
        "kept": report.kept,
        "dropped": report.dropped,
        "reference": report.reference,
        "digest": digest_text,
        "objects": entries,
    }
    write_json_atomic(path, manifest)
    return digest_text


def prefilter(
    x: np.ndarray,
    y: np.ndarray,
    config: Prefilter,
    task: str,
    num_outputs: int,
    champion: Champion | None = None,
    with_losses: bool = False,
    min_class_fraction: float = 0.0,
    loss_fn: JobLoss | None = None,
    distinct: np.ndarray | None = None,
    held_out: np.ndarray | None = None,
) -> Prefiltered:
    """Which rows of ``x``, ``y`` to keep, and why the others go; ``with_losses``: compute every row's
    reference loss even when no loss-based drop is asked for. ``min_class_fraction``: the class balance
    guard of the loss-based drops (classification; ``Prefilter.min_class_fraction``): no class keeps less
    than this fraction of its proportional share of the kept rows. ``loss_fn``: the job's per-row loss
    (``job_loss``), scoring the reference's outputs; by default the built-in algorithm's for ``task``.
    ``distinct``: the rows that are not exact duplicates, when the caller has them (``~duplicates(x, y)``);
    ``held_out``: their cross-fitted losses by ``config``'s reference settings, when the caller has them
    (``label_noise``: counted there)."""
    keep = ~duplicates(x, y) if distinct is None else distinct.copy()
    dropped = {"duplicate": int((~keep).sum())}
    reasons = np.where(keep, 0, REASONS.index("duplicate")).astype(np.int8)
    if not config.drop_learnt_fraction and not config.drop_unlearnable_fraction and not with_losses:
        return Prefiltered(keep, dropped, 0, None, reasons)  # duplicates only: no reference model
    losses, flops, reference = None, 0, HOLDOUT
    if config.reference == "champion":
        losses, flops, reference = champion_losses(x, y, keep, champion, task, num_outputs, loss_fn)
    if losses is None and held_out is not None and loss_fn is None:
        losses = held_out
    elif losses is None:
        losses, flops = held_out_losses(x, y, keep, config, task, num_outputs, loss_fn)
    candidates = np.flatnonzero(keep)
    _check_finite(losses, candidates, reference, loss_fn is not None)
    order = candidates[np.argsort(losses[candidates], kind="stable")]
    n_learnt = math.floor(config.drop_learnt_fraction * len(order))
    n_unlearnable = math.floor(config.drop_unlearnable_fraction * len(order))
    floor = min_class_fraction if task == "classification" else 0.0
    learnt, unlearnable = _guard_classes(y[order], n_learnt, n_unlearnable, floor)
    learnt, unlearnable = order[learnt], order[unlearnable]
    keep[learnt] = keep[unlearnable] = False
    reasons[learnt], reasons[unlearnable] = REASONS.index("learnt"), REASONS.index("unlearnable")
    dropped |= {"learnt": len(learnt), "unlearnable": len(unlearnable)}
    if task == "regression" and loss_fn is None:
        # On the built-in loss's scale (algorithms._scaled_mse: over the spread of the labels it trains on,
        # the kept rows'), or reducible loss (loss - reference) would be dominated by one of them.
        losses = losses / ((float(y[keep].std()) or 1.0) ** 2)
    balanced = n_learnt + n_unlearnable - len(learnt) - len(unlearnable)
    return Prefiltered(keep, dropped, flops, reference, reasons, losses, kept_for_balance=balanced)


def _check_finite(losses: np.ndarray, rows: np.ndarray, reference: str, entrypoint: bool) -> None:
    """Refuse reference losses that are not numbers: ranked, they would sit at the unlearnable end, and as
    RHO-LOSS's irreducible losses every later score of their rows would be NaN."""
    bad = rows[~np.isfinite(losses[rows])]
    if not len(bad):
        return
    fix = (
        "algorithm.entrypoint's loss must be finite on every row (a -log p where p underflows to 0 is inf: take "
        "log_softmax, or clamp)"
        if entrypoint
        else "the champion's outputs are not finite on them: use sifting.prefilter.reference holdout"
        if reference.startswith("champion")
        else "lower sifting.prefilter.reference_learning_rate"
    )
    raise TrainingError(
        f"sifting.prefilter: the reference loss ({reference.split(':')[0]}) is {losses[bad[0]]} on {len(bad)} of "
        f"{len(rows)} training rows (row {int(bad[0])} first); {fix}"
    )


def _guard_classes(
    labels: np.ndarray, n_learnt: int, n_unlearnable: int, floor: float
) -> tuple[np.ndarray, np.ndarray]:
    """Positions (in ``labels``, rows ranked by loss, lowest first) of the learnt and unlearnable drops:
    the first ``n_learnt`` and last ``n_unlearnable``, less the rows given back to each class these
    would leave below ``floor`` of its proportional share of the kept rows (rounded up), its dropped
    rows nearest the kept band first. A class of easy rows would otherwise go almost whole as learnt.

    The floor is of the rows finally kept: rows given back raise that count, and with it every class's
    floor, so the guard gives back until no class is short (a few rounds; each gives back at least one row)."""
    total = len(labels)
    rank = np.arange(total)
    dropped = (rank < n_learnt) | (rank >= total - n_unlearnable)
    if floor > 0:
        # how far each dropped row is from the kept band: learnt ranks count down to it, unlearnable up
        distance = np.where(rank < n_learnt, n_learnt - rank, rank - (total - n_unlearnable) + 1)
        classes = [(labels == cls) for cls in np.unique(labels)]
        gave = True
        while gave:
            gave, kept_total = False, total - int(dropped.sum())
            for members in classes:
                need = math.ceil(floor * kept_total * members.sum() / total)
                short = need - int((members & ~dropped).sum())
                if short > 0:
                    candidates = np.flatnonzero(members & dropped)
                    back = candidates[np.argsort(distance[candidates], kind="stable")][:short]
                    dropped[back], gave = False, gave or len(back) > 0
    return np.flatnonzero(dropped & (rank < n_learnt)), np.flatnonzero(dropped & (rank >= total - n_unlearnable))


def duplicates(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """True for each row that repeats an earlier one exactly (features and label, as the float32 training reads
    them: 0.0 and -0.0 are one value)."""
    x, y = _signless_zeros(x), _signless_zeros(y)
    rows = np.concatenate([np.ascontiguousarray(x).view(np.uint8).reshape(len(x), -1), _label_bytes(y)], axis=1)
    _, first = np.unique(rows, axis=0, return_index=True)
    repeated = np.ones(len(x), dtype=bool)
    repeated[first] = False
    return repeated


def filtered_layout(layout: list[dict], keep: np.ndarray) -> list[dict]:
    """The objects' row ranges after filtering (row groups are gone: each object is one unit)."""
    out, start = [], 0
    for obj in layout:
        kept = int(keep[obj["start"] : obj["end"]].sum())
        out.append({"id": obj["id"], "start": start, "end": start + kept, "row_groups": [kept]})
        start += kept
    return out


def _signless_zeros(values: np.ndarray) -> np.ndarray:
    """Floats with -0.0 made 0.0 (their bytes differ; rounding small negatives gives them), others as they are."""
    if values.dtype.kind != "f":
        return values
    negative_zero = (values == 0) & np.signbit(values)
    # copied only where there is one: a channel's rows may be gigabytes
    return np.where(negative_zero, values.dtype.type(0), values) if negative_zero.any() else values


def _label_bytes(y: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(y.reshape(len(y), -1)).view(np.uint8).reshape(len(y), -1)
