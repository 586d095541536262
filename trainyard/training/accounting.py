"""What a job's replica groups computed, from the counts every attempt wrote: FLOPs by kind, samples
trained, sifting's and pruning's counts added up over the groups, and energy per group. Read for a
finished job's outcome and for one that gave up (its summary still counts the compute it spent).
"""

from __future__ import annotations

import json
from pathlib import Path

from trainyard.job_folder import EARLIER
from trainyard.sifting import fractions_by_class
from trainyard.status import pruned_fraction, pruned_rows, trained_fraction_by_class
from trainyard.training.attempt_files import latest_counts


def work_done(job_dir: Path) -> dict:
    """What every group attempt of the job computed, finished or not: FLOPs by kind, samples trained,
    the furthest step committed, each attempt's sifting counts and their totals (``sifting_totals``, as
    an outcome's ``sifting``), and the epochs the furthest attempt validated (``history``, as an outcome's).
    A training stage that gave up or was stopped has no outcome; its summary still counts the compute it
    spent and gives the last metrics it reached."""
    flops = {"forward": 0, "backward": 0, "evaluation": 0, "scoring": 0, "proxy_training": 0}
    samples, step = 0, 0
    sifted: list[dict] = []
    history: list[dict] = []
    for folder in job_dir.glob("replicas/*/attempt-*"):
        progress = latest_counts(folder)
        if progress is None:
            continue
        samples += progress["samples_trained"]
        step = max(step, progress["step"])
        for key in flops:
            flops[key] += progress["flops"].get(key, 0)
        if progress.get("sifting"):
            sifted.append(progress["sifting"])
        if len(progress.get("epochs") or []) > len(history):  # a healed attempt's history starts with its peer's
            history = progress["epochs"]
    totals = sifting_totals(sifted, flops) if sifted else None
    return {
        "flops": flops,
        "samples_trained": samples,
        "steps": step,
        "sifting": sifted,
        "sifting_totals": totals,
        "history": history,
    }


def energy_by_replica(job_dir: Path) -> dict[str, float]:
    """Energy (kWh) every attempt of each replica group measured, added up per group."""
    totals: dict[str, float] = {}
    for path in job_dir.glob("replicas/*/attempt-*/energy.json"):
        replica = path.parent.parent.name
        totals[replica] = totals.get(replica, 0.0) + _read(path)["energy_kwh"]
    return dict(sorted(totals.items()))


def energy_elsewhere(job_dir: Path, machine: str, launch: str) -> dict | None:
    """What launch ``launch``'s group attempts that ran on another machine than ``machine`` measured (their
    process-mode meters, at PUE 1): ``energy_kwh``, by device, how (``measurement_mode``) and how many attempts;
    None when every group ran on ``machine``, whose stage meters (machine-wide) counted them already. The
    attempts are found by the launch their files name, wherever the job's folder keeps them: in its ``replicas``,
    or set aside by a later run (``earlier-runs/<n>/replicas``, the last few). A group of an earlier launch that
    outlived its run (killed) may write its last figures into this run's ``replicas``: not this launch's."""
    pattern = "replicas/*/attempt-*/energy.json"
    # a file without a launch (a group of an older Trainyard, a pool's worker not yet upgraded; or started with no
    # TRAINYARD_LAUNCH_ID, written null) is this launch's where this launch's groups write, never in a folder set
    # aside (an earlier run's, counted by that run)
    records = [r for r in map(_read, job_dir.glob(pattern)) if r.get("launch") in (None, launch)]
    records += [r for r in map(_read, job_dir.glob(f"{EARLIER}/*/{pattern}")) if r.get("launch") == launch]
    # (none named: written before groups named theirs)
    return _summed([r for r in records if r.get("machine", machine) != machine])


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _summed(records: list[dict]) -> dict | None:
    total = {"energy_kwh": 0.0, "cpu_energy_kwh": 0.0, "gpu_energy_kwh": 0.0, "ram_energy_kwh": 0.0}
    for record in records:
        for key in total:
            total[key] += record.get(key, 0.0)
    if not records:
        return None
    modes = ",".join(sorted({r.get("measurement_mode", "unknown") for r in records}))
    return total | {"measurement_mode": modes, "attempts": len(records)}


def sifting_totals(reports: list[dict], flops: dict) -> dict:
    """Every group's sifting, added up: kept fraction overall and per class, and what scoring cost."""
    scored = sum(r["scored"] for r in reports)
    kept = sum(r["kept"] for r in reports)
    # Weighted by what each group scored: a restarted attempt that scored a few rows counts for a few.
    kept_by_class, scored_by_class = _by_class(reports, "kept_by_class"), _by_class(reports, "scored_by_class")
    unsifted = sum(r.get("unsifted", 0) for r in reports)
    pruned = {k: sum(r.get(k, 0) for r in reports) for k in ("prune_dealt", "pruned_learnt", "pruned_hardest")}
    # the rows the training passes' FLOPs were spent on: pruning leaves some of the kept ones out
    trained = kept + unsifted - pruned_rows(pruned)
    train_per_sample = (flops["forward"] + flops["backward"]) / trained if trained else 0.0
    totals = {
        # one job, one rule; a group killed before its first epoch ended left counts without it
        "score": next((r["score"] for r in reports if "score" in r), "loss"),
        "scored": scored,
        "kept": kept,
        "passed_over": sum(r.get("passed_over", 0) for r in reports),
        # steps not ranked (before delay_steps, or a group's share of a short step's kept batch was 0):
        # candidates trained on unranked, and those left out unscored
        "unsifted": unsifted,
        "skipped": sum(r.get("skipped", 0) for r in reports),
        "kept_fraction": kept / scored if scored else None,  # None: sifting never started (delay_steps)
        # what the keep rule alone would have kept (the batch keeps 1 / (1 + beta), always)
        "mean_keep_probability": sum(r.get("keep_probability_sum", 0.0) for r in reports) / scored if scored else None,
        "kept_fraction_by_class": fractions_by_class(kept_by_class, scored_by_class),
        # Measured, not assumed: scoring every candidate saves compute only when this exceeds 1 / beta.
        "backward_forward_ratio": flops["backward"] / flops["forward"] if flops["forward"] else None,
        # What the scoring passes cost, against the training passes of the candidates the rule passed over.
        "scoring_flops": flops["scoring"],
        "training_flops_skipped": round(sum(r.get("passed_over", 0) for r in reports) * train_per_sample),
    }
    if any("prune_dealt" in r for r in reports):  # sifting.prune: rows left out of their steps by their last loss
        totals |= pruned | {"pruned_fraction": pruned_fraction(pruned)}
        if dealt_by_class := _by_class(reports, "prune_dealt_by_class"):
            totals["trained_fraction_by_class"] = trained_fraction_by_class(
                dealt_by_class, _by_class(reports, "pruned_by_class")
            )
    if any("losses_reused" in r for r in reports):
        totals["losses_reused"] = sum(r.get("losses_reused", 0) for r in reports)
    return totals


def _by_class(reports: list[dict], key: str) -> dict[str, int]:
    """The groups' per-class counts under ``key``, added up."""
    totals: dict[str, int] = {}
    for report in reports:
        for cls, n in report.get(key, {}).items():
            totals[cls] = totals.get(cls, 0) + n
    return totals
