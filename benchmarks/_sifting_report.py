"""The sifting benchmark's results and report: each seed's arms, the tables (median [each seed]), the
targets met or not, and the best combination as ``sifting`` settings (``benchmarks/sifting.py`` runs them)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from _sifting_data import Setting
from _sifting_run import Run

CAP = 2.0  # an arm short of the target at the baseline's budget gets this many times it
# The targets: FLOPs and wall to the target as multiples of the baseline's, points below it at equal FLOPs
FLOPS_RATIO_MAX, WALL_RATIO_MAX, ACCURACY_POINTS = 0.65, 0.75, 0.5


@dataclass
class Arm:
    """One arm on one seed: its equal-budget run, and the 2x run if it fell short of the target."""

    run: Run
    extended: Run | None = None

    def to_target(self, target: float) -> tuple[int | None, float | None]:
        """``(FLOPs, wall seconds)`` to the target, from whichever run reached it."""
        for run in (self.run, self.extended):
            if run is not None and run.first_reaching(target) is not None:
                return run.flops_to(target), run.wall_to(target)
        return None, None


@dataclass
class SeedResult:
    seed: int
    target: float
    budget: int  # the baseline's training FLOPs
    short_budget: float  # the short-run baseline's
    short_from_combination: bool  # False: the combination saved nothing, so 1 - 35% of the baseline's
    arms: dict[str, Arm]


# --- the report ---------------------------------------------------------------------------------


def median(values: list[float | None]) -> float | None:
    """Median with None (not reached) counted as worse than any number; None if that is the median."""
    ranked = sorted(math.inf if v is None else v for v in values)
    m = statistics.median(ranked) if ranked else math.inf
    return None if math.isinf(m) else m


def cell(values: list[float | None], fmt: str, missing: str) -> str:
    """``median [each seed]``."""
    m = median(values)
    each = " ".join(missing if v is None else format(v, fmt) for v in values)
    return f"{missing if m is None else format(m, fmt)} [{each}]"


ROWS = (
    ("baseline", "baseline"),
    ("short", "baseline, short-run schedule"),
    ("online", "online sifting alone"),
    ("combination", "best combination"),
    ("noise", "noise floor: baseline, another init"),
)


def figures(results: list[SeedResult], key: str) -> dict[str, list]:
    """Per seed: FLOPs and wall to the target against the baseline's, accuracy at both budgets."""
    f = {k: [] for k in ("flops_x", "wall_x", "acc", "delta", "acc_short", "ms")}
    for r in results:
        arm, base = r.arms[key], r.arms["baseline"]
        flops, wall = arm.to_target(r.target)
        base_flops, base_wall = base.to_target(r.target)
        f["flops_x"].append(None if flops is None else flops / base_flops)
        f["wall_x"].append(None if wall is None else wall / base_wall)
        acc = arm.run.accuracy_at(r.budget) if key != "short" else None
        f["acc"].append(acc)
        f["delta"].append(None if acc is None else 100 * (acc - r.target))
        f["acc_short"].append(arm.run.accuracy_at(r.short_budget))
        f["ms"].append(arm.run.median_step_ms)
    return f


def report(name: str, results: list[SeedResult]) -> None:
    """One dataset's table, each arm's settings and learning rate read from its runs, and its targets."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    title = f"{name}: median [each seed] over seeds {', '.join(str(r.seed) for r in results)}"
    table = Table(title=escape(title), title_justify="left")
    for col in ("arm", "settings", "FLOPs to target", "wall to target", "acc at baseline budget", "Δ pts"):
        table.add_column(col, justify="left" if col in ("arm", "settings") else "right")
    table.add_column("acc at short budget", justify="right")
    table.add_column("ms/step", justify="right")
    miss = f">{CAP:g}x"
    out = {}
    for key, title in ROWS:
        f = out[key] = figures(results, key)
        run = results[0].arms[key].run  # one setting and rate per arm and dataset
        within = "-" if key in ("short", "noise") else miss  # runs never extended past the budget
        row = (
            title,
            f"{run.setting.label()}, lr {run.lr:g}",
            cell(f["flops_x"], ".2f", within),
            cell(f["wall_x"], ".2f", within),
            "-" if key == "short" else f"{median(f['acc']):.4f}",
            "-" if key == "short" else cell(f["delta"], "+.1f", "-"),
            cell(f["acc_short"], ".4f", "-"),
            cell(f["ms"], ".1f", "-"),
        )
        table.add_row(*(escape(c) for c in row))  # brackets are rich markup otherwise
    Console(width=240).print(table)
    base = [r.arms["baseline"] for r in results]
    gflop = " ".join(f"{b.to_target(r.target)[0] / 1e9:.2f}" for b, r in zip(base, results, strict=True))
    wall = " ".join(f"{b.to_target(r.target)[1]:.2f}" for b, r in zip(base, results, strict=True))
    shorts = " ".join(
        f"{r.short_budget / r.arms['baseline'].to_target(r.target)[0]:.2f}x{'' if r.short_from_combination else '*'}"
        for r in results
    )
    print(
        f"  FLOPs and wall are to the target (each seed's baseline final accuracy: "
        f"{' '.join(f'{r.target:.4f}' for r in results)}), as multiples of the baseline's: "
        f"{gflop} GFLOP, {wall} s; read at the baseline's validation cadence (for each baseline epoch's FLOPs "
        f"the arm's epoch ending nearest, and its last), not at every cheaper epoch of a filtering arm.\n"
        f"  {miss}: not reached with {CAP:g}x the baseline's budget; '-' not reached within the run. "
        f"Short budget, x the baseline's FLOPs to target: {shorts} (* the combination saved nothing: "
        f"{FLOPS_RATIO_MAX:.2f}x). Validation, left out of every count: "
        f"{base[0].run.eval_flops / 1e9 / len(base[0].run.validated):.3f} GFLOP per validation."
    )
    targets(out, results)


def targets(f: dict[str, dict[str, list]], results: list[SeedResult]) -> None:
    comb, online, short = f["combination"], f["online"], f["short"]
    x, w, d = median(comb["flops_x"]), median(comb["wall_x"]), median(comb["delta"])
    rows = [
        (f">= {1 - FLOPS_RATIO_MAX:.0%} fewer FLOPs to the target", x is not None and x <= FLOPS_RATIO_MAX, fmt_x(x)),
        (f">= {1 - WALL_RATIO_MAX:.0%} less wall time to the target", w is not None and w <= WALL_RATIO_MAX, fmt_x(w)),
        (f"accuracy within {ACCURACY_POINTS} pts at equal FLOPs", d >= -ACCURACY_POINTS - 1e-9, f"{d:+.2f} pts"),
    ]
    ox = median(online["flops_x"])
    if x is None and ox is None:
        od = median(online["delta"])
        ahead, how = d > od, f"neither reaches the target; accuracy at equal FLOPs {d:+.1f} vs {od:+.1f} pts"
    else:
        ahead, how = (ox is None or (x is not None and x < ox)), f"FLOPs to the target {fmt_x(x)} vs {fmt_x(ox)}"
    rows.append(("combination ahead of online sifting alone", ahead, how))
    gained = [i for i, r in enumerate(results) if r.short_from_combination]
    held = [i for i in gained if short["flops_x"][i] is None]
    how = (
        f"the combination saved FLOPs on {len(gained)} of {len(results)} seeds; the short-run baseline missed the "
        f"target at the same FLOPs on {len(held)} of them"
    )
    rows.append(("gains hold against the short-run baseline", len(held) > len(results) / 2, how))
    for text, met, detail in rows:
        print(f"  {'met    ' if met else 'NOT MET'}  {text}: {detail}")
    noise = f["noise"]  # its run fills the baseline's budget exactly, so every seed has a delta
    print(
        f"  (not a target) noise floor, the baseline with another init: FLOPs to the target "
        f"{fmt_x(median(noise['flops_x']))}, wall {fmt_x(median(noise['wall_x']))}, "
        f"{median(noise['delta']):+.2f} pts at equal FLOPs"
    )


def fmt_x(v: float | None) -> str:
    return "not reached" if v is None else f"{v:.2f}x"


# What `sifting.enabled: true` with nothing else set turns on for a classifier's file-mode channel since stop 52:
# sifting.noisy_share 0.1 (DEFAULT_NOISY_SHARE), the labels picking the rule; a channel they read as noisy gets
# DEFAULT_PRUNING (pruning x3, the default until then)
DEFAULT = Setting(auto=True)


def print_best(setting: Setting, named: bool = False) -> None:
    """The combination picked (or named by ``--combination``), whether it is the default of ``sifting.enabled:
    true``, and the settings that turn it on."""
    learnt, unlearnable = setting.prefilter or (0.0, 0.0)
    if named:
        print(f"Combination measured (named by --combination, not searched): {setting.label()}")
    else:
        print(f"Best combination found: {setting.label()}")
    if dataclasses.replace(setting, epochs=None) == DEFAULT:
        print("  It is the default of `sifting.enabled: true` (trainyard/spec/sifting.py); as settings:")
    else:
        print(
            f"  It is NOT the default of `sifting.enabled: true` ({DEFAULT.label()}, trainyard/spec/sifting.py's "
            "DEFAULT_NOISY_SHARE); to turn it on:"
        )
    if setting.auto:  # the filtering stage picks from the labels: pruning x3 (noisy) or the proxy's top quarter (clean)
        print("  sifting:\n    enabled: true\n    noisy_share: 0.1")
        return
    print("  sifting:")
    print(f"    enabled: {str(setting.beta is not None).lower()}")  # beta 0: pruning alone, no keep rule
    print(f"    beta: {setting.beta}")
    print(f"    score: {'reducible_loss' if setting.reducible else 'proxy' if setting.proxy else 'loss'}")
    print(f"    selection: {'top' if setting.proxy else 'keep_rule'}")
    print(f"    reuse_loss_epochs: {setting.reuse}")
    print(
        f"    prefilter: {{enabled: {str(setting.prefilter is not None).lower()}, drop_learnt_fraction: {learnt}, "
        f"drop_unlearnable_fraction: {unlearnable}}}"
    )
    if setting.prune:
        learnt, hardest, factor = setting.prune
        print(f"    prune: {{learnt_fraction: {learnt}, hardest_fraction: {hardest}, batch_factor: {factor}}}")
