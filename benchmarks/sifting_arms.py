"""Measure named sifting settings against the baseline on given seeds, without the search.

``benchmarks/sifting.py`` tunes, picks one combination and measures it. This measures settings you
name, with the same runs (``_sifting_data.train``: real one-group Trainyard jobs, each filtering arm's
epochs filling the baseline's FLOPs) and the same figures: FLOPs and wall time to the baseline's final
validation accuracy as multiples of the baseline's (measured in the same run, one run at a time, each
done ``--repeats`` times and its wall time the median, as ``sifting.py``'s measured runs), and accuracy
at equal FLOPs. No targets, no tuning: the learning rate is given (``sifting.py``'s tuning
has picked 0.003 for both datasets at every stop since 16).

    .venv/bin/python benchmarks/sifting_arms.py                          # the stop 26 table, about 18 minutes
    .venv/bin/python benchmarks/sifting_arms.py --settings prune-x3 prune-x2             # stop 27 (about 9 minutes)
    .venv/bin/python benchmarks/sifting_arms.py --datasets digits --seeds 0 1 2 3 --settings prune-x2 keep
    .venv/bin/python benchmarks/sifting_arms.py --datasets digits --baseline-lr 0.003 --lr 0.005 --settings prune-x3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (REPO, os.path.join(REPO, "benchmarks")) if p not in sys.path]

import _sifting_data as sd  # noqa: E402
from _sifting_data import Setting  # noqa: E402
from _sifting_datasets import load  # noqa: E402
from _sifting_report import median  # noqa: E402  (None, not reached, ranks worse than any number)

SETTINGS = {
    "prune-x1": Setting(0.0, None, prune=(0.7, 0.1, 1.0)),  # sifting.py's pick at stops 25 to 27
    "prune-x2": Setting(0.0, None, prune=(0.7, 0.1, 2.0)),
    "keep": Setting(1.0, (0.0, 0.0), reuse=1),  # the keep rule's defaults (sifting.enabled: true alone until stop 27)
    "keep-prune-x2": Setting(1.0, (0.0, 0.0), reuse=1, prune=(0.7, 0.1, 2.0)),
    "online-2": Setting(2.0),
    # stop 27: a third of the steps (sifting.py's pick and the default of sifting.enabled: true since stop 28), and
    # the keep rule with x3 or with the hardest 20% left out (each missed tabular's target on 2 of seeds 100-103)
    "prune-x3": Setting(0.0, None, prune=(0.7, 0.1, 3.0)),
    "prune-x4": Setting(0.0, None, prune=(0.7, 0.1, 4.0)),  # stop 27 probes: neither beats x3 on both datasets
    "prune-0.85-x3": Setting(0.0, None, prune=(0.85, 0.1, 3.0)),
    "keep-prune-x3": Setting(1.0, (0.0, 0.0), reuse=1, prune=(0.7, 0.1, 3.0)),
    "keep-prune-0.2-x2": Setting(1.0, (0.0, 0.0), reuse=1, prune=(0.7, 0.2, 2.0)),
    # stop 29 probes on tuning seeds 100-103: x3 on the baseline's own epochs (the user's job with sifting turned on)
    # or 1.5 times them, not filling the budget (fewer steps: behind x3 on both datasets), and x3 keeping the
    # hardest rows (digits, clean: no gain)
    "prune-x3-1x-epochs": Setting(0.0, None, prune=(0.7, 0.1, 3.0), epochs=1),
    "prune-x3-1.5x-epochs": Setting(0.0, None, prune=(0.7, 0.1, 3.0), epochs=1.5),
    "prune-x3-no-hardest": Setting(0.0, None, prune=(0.7, 0.0, 3.0)),
    # the keep rule with the hardest rows left out: sifting.py's tuning on digits (clean labels) at stop 30
    "keep-hardest": Setting(1.0, (0.0, 0.0), reuse=1, prune=(0.0, 0.1, 1.0)),
    # stop 36 probes on digits, seeds 100-107: InfoBatch as published (half the learnt rows out, none as the hardest,
    # the unpruned job's steps, every row back from 0.875 of the epochs on: fewer FLOPs than x3, more wall), and its
    # rate with x3's steps
    "infobatch": Setting(0.0, None, prune=(0.5, 0.0, 1.0)),
    "prune-0.5-x3": Setting(0.0, None, prune=(0.5, 0.0, 3.0)),
    # stop 38 probes on digits, seeds 100-107: a harder keep rule (a third or a fifth kept) on losses up to two
    # epochs old: about 1.0x the baseline's FLOPs, as sifting_bound.py's top third by remembered losses
    "keep-2-reuse-2": Setting(2.0, (0.0, 0.0), reuse=2),
    "keep-4-reuse-2": Setting(4.0, (0.0, 0.0), reuse=2),
    # stop 47: selection via proxy, the top third by a small model's fresh losses (sifting_bound.py: 0.60x on digits,
    # as the oracle's; never its target on tabular, whose highest losses are its flipped labels), and the top quarter.
    # Since stop 51 both rank from the first step (delay_steps left unset: 0 for the proxy's top selection); the
    # figures of stops 47-50 waited 10 steps (stop 50's .git/probe-stop50-proxy-variants.py with
    # PATCH='{"delay_steps": 10}' runs them so again)
    "proxy-top-2": Setting(2.0, proxy=True),
    "proxy-top-3": Setting(3.0, proxy=True),
    # stop 48: sifting.noisy_share 0.1, the filtering stage's pick from the labels (noisy: prune-x3, clean: the
    # proxy's top third until stop 51, its top quarter since, proxy-top-3), its work (the labels measured, duplicates
    # out) counted and timed
    "auto": Setting(auto=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["tabular", "digits"], choices=["tabular", "digits"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (sifting.py reports 0 1 2)")
    parser.add_argument("--lr", type=float, default=0.003, help="learning rate of every arm")
    parser.add_argument(
        "--baseline-lr", type=float, default=None, help="the baseline's learning rate, if not --lr (its target)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="each run done this many times, its wall time the median (sifting.py's)"
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["prune-x1", "prune-x2", "keep-prune-x2"],
        choices=sorted(SETTINGS),
        help="; ".join(f"{name}: {setting.label()}" for name, setting in SETTINGS.items()),
    )
    args = parser.parse_args()
    home = tempfile.TemporaryDirectory(prefix="sifting-arms-")
    os.environ["TRAINYARD_HOME"] = home.name
    os.environ["TRAINYARD_STEP_LOG"] = "1"
    figures: dict[tuple[str, str], list[tuple[float | None, float | None, float]]] = {}
    for name in args.datasets:
        epochs = load(name, 0).epochs
        for seed in args.seeds:
            base = sd.timed(args.repeats, name, seed, False, Setting(), args.baseline_lr or args.lr, epochs=epochs)
            target, budget = base.accuracy[-1], base.cum_flops[-1]
            print(f"{name} seed {seed}: baseline final accuracy {target:.4f}, {base.median_step_ms:.1f} ms/step")
            for key in args.settings:
                setting = SETTINGS[key]
                run = sd.timed(args.repeats, name, seed, False, setting, args.lr, **setting.length(epochs, budget))
                flops, wall = run.flops_to(target), run.wall_to(target)
                row = (
                    None if flops is None else flops / base.flops_to(target),
                    None if wall is None else wall / base.wall_to(target),
                    100 * (run.accuracy_at(budget) - target),
                )
                figures.setdefault((name, key), []).append(row)
                steps = [entry["steps"] for entry in run.history]
                print(
                    f"  {setting.label():70} {run.epochs} ep, FLOPs {fmt(row[0])}, wall {fmt(row[1])}, "
                    f"{row[2]:+.2f} pts at equal FLOPs; steps of the first epochs {steps[:3]}, "
                    f"{run.median_step_ms:.1f} ms/step",
                    flush=True,
                )
    seeds = " ".join(map(str, args.seeds))
    print(f"\nMedians [each seed] over seeds {seeds}; x the baseline's, to its final accuracy:")
    for (name, key), rows in figures.items():
        cells = [" ".join(fmt(r[i]) for r in rows) for i in range(2)] + [" ".join(f"{r[2]:+.2f}" for r in rows)]
        print(
            f"  {name:8} {key:14} FLOPs {fmt(median([r[0] for r in rows]))} [{cells[0]}]  "
            f"wall {fmt(median([r[1] for r in rows]))} [{cells[1]}]  "
            f"Δ acc {statistics.median(r[2] for r in rows):+.2f} pts [{cells[2]}]"
        )
    print("  '-': the target not reached within the baseline's FLOPs (counted as worse than any number)")
    home.cleanup()


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
