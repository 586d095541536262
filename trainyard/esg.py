"""The job's ESG report: energy and emissions as a sustainability team files them.

``report`` extends the carbon roll-up with what GHG Protocol Scope 2 reporting asks for (location-
and market-based; market-based only from a supplier factor or a renewable share the spec gives,
never invented), energy by device kind and by replica group, emissions per sample trained and per
point of the validation metric, and the energy sifting saved. ``markdown`` renders it for the
Prefect artifact; ``ledger_row`` is its line in the CSV ledger kept in ``output.s3_uri``
(``carbon-ledger/<job id>.csv``: one object per job, so concurrent jobs never race on one file).

Energy: codecarbon's figures include the PUE (facility energy), so ``it_energy_kwh = energy_kwh /
pue`` and ``emissions_kg = it_energy_kwh * intensity * pue``.
"""

from __future__ import annotations

import csv
import io

from trainyard import s3
from trainyard.energy_journal import EARLIER_STAGE
from trainyard.errors import DataError
from trainyard.spec import Carbon
from trainyard.status import flops_spared, prefilter_flops_spared, pruned_rows, training_flops_per_sample

LEDGER_FIELDS = (
    "job_id",
    "job_name",
    "finished_at",
    "status",
    "energy_kwh",
    "it_energy_kwh",
    "emissions_kg",
    "scope2_location_based_kg",
    "scope2_market_based_kg",
    "intensity_g_per_kwh",
    "pue",
    "country_iso_code",
    "region",
    "measurement_mode",
    "intensity_source",
    "scope2_market_basis",
    "samples_trained",
    "g_per_1k_samples",
    "sifting_saved_kwh",
)


def report(carbon: dict, settings: Carbon, outcome=None, prefilter=None, metrics: dict | None = None) -> dict:
    """The carbon roll-up plus the ESG fields (``outcome``: the training outcome, when there is one)."""
    out = dict(carbon)
    energy, emissions = carbon["energy_kwh"], carbon["emissions_kg"]
    intensity = carbon.get("intensity_g_per_kwh")
    out["it_energy_kwh"] = energy / settings.pue
    out |= _market_based(energy, emissions, settings)
    out["budget_exceeded"] = settings.budget_kg is not None and emissions > settings.budget_kg
    samples = outcome.samples_trained if outcome else 0
    # this run's emissions for its samples and accuracy: an earlier run of the job id trained neither here
    this_run = emissions - carbon["by_stage"].get(EARLIER_STAGE, {}).get("emissions_kg", 0.0)
    out["g_per_1k_samples_trained"] = this_run * 1e6 / samples if samples else None
    accuracy = (metrics or {}).get("val_accuracy")
    out["g_per_val_accuracy_point"] = this_run * 1000 / (accuracy * 100) if accuracy else None
    # A group's own meter starts before its process has read the job, so it measures at PUE 1; the
    # stages' meters apply the job's PUE, and so, for the shares to be comparable, does this.
    out["by_replica"] = {
        r: {
            "energy_kwh": kwh * settings.pue,
            "emissions_kg": kwh * settings.pue * intensity / 1000 if intensity else None,
        }
        for r, kwh in (outcome.energy_by_replica if outcome else {}).items()
    }
    out["sifting_saved"] = _sifting_saved(carbon, outcome, prefilter)
    out["method"] = method(out)
    out["merge"] = (
        "job total = one machine-wide tracker per stage in the orchestrating process (stages never overlap), "
        "the groups that ran on other machines' own trackers added to the training stage, and as 'earlier runs' "
        "what the job id's earlier runs on this machine spent (their energy journals); by_replica = each group's "
        "own process-mode tracker (times the job's PUE, as the stages are): its share of the training stage, "
        "shown for attribution (added to the total only for groups on other machines)"
    )
    return out


# How codecarbon got each device's power (carbon.measurement_mode), in a report reader's words.
_MODES = {
    "cpu:intel_rapl": "CPU energy read from its RAPL counters",
    "cpu:cpu_load": "CPU power estimated from its load and its TDP (no RAPL counters readable)",
    "cpu:constant": "CPU power estimated at half its TDP (neither counters nor load readable)",
    "gpu:nvml": "GPU energy read through NVML",
    "ram:estimate": "RAM power estimated from its size (codecarbon's watts per GB)",
}


def method(esg: dict) -> list[str]:
    """How the figures were obtained, a sentence each: what a reader needs to weigh them (measured or
    estimated, which grid figure, the PUE, the market-based basis)."""
    from importlib.metadata import version

    modes = {m for part in str(esg.get("measurement_mode", "")).split(";") for m in part.split(",") if m}
    devices = [_MODES.get(m.split(" ")[0], m) for m in sorted(modes)]
    estimated = any(m.split(" ")[0] not in ("cpu:intel_rapl", "gpu:nvml") for m in modes)
    lines = [
        f"Energy: codecarbon {version('codecarbon')}, offline; {'; '.join(devices) or 'no device measured'}"
        + (" (estimates, not meter readings)." if estimated else "."),
        f"Location-based emissions: energy times the grid intensity, {esg.get('intensity_source')}.",
        f"PUE {esg.get('pue')}: facility energy is IT energy times the PUE; emissions are counted on facility "
        "energy, and energy by device and by replica group is facility energy too.",
    ]
    basis = esg.get("scope2_market_basis") or "not provided"
    if basis.startswith("renewable share"):
        basis += ", the energy it does not cover priced at the location-based grid intensity"
    lines.append(f"Market-based emissions: {basis}.")
    return lines


def _market_based(energy_kwh: float, location_kg: float, settings: Carbon) -> dict:
    if settings.supplier_g_per_kwh is not None:
        return {
            "scope2_market_based_kg": energy_kwh * settings.supplier_g_per_kwh / 1000,
            "scope2_market_basis": f"supplier emission factor {settings.supplier_g_per_kwh} gCO2e/kWh",
        }
    if settings.renewable_share is not None:
        return {
            "scope2_market_based_kg": location_kg * (1 - settings.renewable_share),
            "scope2_market_basis": f"renewable share {settings.renewable_share:.0%} of the energy (contracts)",
        }
    return {"scope2_market_based_kg": None, "scope2_market_basis": "not provided"}


def _sifting_saved(carbon: dict, outcome, prefilter) -> dict | None:
    """Energy of the training FLOPs sifting did not spend, net of what scoring cost: online scoring at
    the training stage's measured energy per FLOP, the prefilter's as the filtering stage measured it."""
    sifting = outcome.sifting if outcome else None
    dropped_rows = sum((prefilter.dropped or {}).values()) if prefilter else 0
    if not outcome or (not sifting and not dropped_rows) or not outcome.samples_trained:
        return None
    flops = outcome.flops
    per_sample = training_flops_per_sample(outcome)
    # Four sources, kept apart: what the keep rule passed over (the part its scoring paid for, and what
    # the summary's "sifting cost more than it saved" warning weighs), what was left out unscored before
    # delay_steps (no scoring, but not trained either), what sifting.prune left out (by the training
    # passes' own losses: no scoring either), and the prefilter's dropped rows.
    by_rule = (sifting["passed_over"] if sifting else 0) * per_sample
    unscored = (sifting.get("skipped", 0) if sifting else 0) * per_sample
    by_pruning = (pruned_rows(sifting) if sifting else 0) * per_sample
    by_prefilter = prefilter_flops_spared(outcome, dropped_rows)
    saved = flops_spared(outcome, dropped_rows)  # the four together
    spent = flops.get("scoring", 0) + (prefilter.scoring_flops if prefilter else 0)
    train_kwh = carbon["by_stage"].get("training", {}).get("energy_kwh", 0.0)
    train_flops = flops["forward"] + flops["backward"] + flops.get("evaluation", 0) + flops.get("scoring", 0)
    kwh_per_flop = train_kwh / train_flops if train_flops else 0.0
    intensity = carbon.get("intensity_g_per_kwh") or 0.0
    # The prefilter's scoring is what the filtering stage measured, not its FLOPs at the training stage's
    # kWh per FLOP: a short stage's fixed costs would price a few FLOPs at many times the whole job.
    prefilter_kwh = (
        carbon["by_stage"].get("filtering", {}).get("energy_kwh", 0.0) if prefilter and prefilter.scoring_flops else 0.0
    )
    net = (saved - flops.get("scoring", 0)) * kwh_per_flop - prefilter_kwh
    return {
        "flops_not_spent": saved,
        "flops_not_spent_by_keep_rule": by_rule,
        "flops_not_spent_before_delay": unscored,
        "flops_not_spent_by_pruning": by_pruning,
        "flops_not_spent_by_prefilter": by_prefilter,
        "flops_spent_scoring": spent,
        "energy_kwh": net,
        "emissions_kg": net * intensity / 1000,
    }


def markdown(job_id: str, esg: dict) -> str:
    """The report as Markdown, for the Prefect artifact."""
    lines = [
        f"# Carbon and energy: {job_id}",
        "",
        "| | |",
        "|---|---|",
        f"| energy (facility, incl. PUE) | {esg['energy_kwh']:.6g} kWh |",
        f"| energy (IT) | {esg['it_energy_kwh']:.6g} kWh |",
        f"| emissions | {esg['emissions_kg']:.6g} kgCO2e |",
        f"| grid intensity | {_fmt(esg.get('intensity_g_per_kwh'))} gCO2e/kWh ({esg.get('intensity_source')}) |",
        f"| PUE | {esg['pue']} |",
        f"| Scope 2, location-based | {esg['scope2_location_based_kg']:.6g} kgCO2e |",
        f"| Scope 2, market-based | {_unit(esg.get('scope2_market_based_kg'), 'kgCO2e')} "
        f"({esg['scope2_market_basis']}) |",
        f"| measurement | {esg['measurement_mode']} |",
        f"| per 1,000 samples trained | {_unit(esg.get('g_per_1k_samples_trained'), 'gCO2e')} |",
        f"| per point of val_accuracy | {_unit(esg.get('g_per_val_accuracy_point'), 'gCO2e')} |",
        f"| budget | {_unit(esg.get('budget_kg'), 'kgCO2e')}{' (exceeded)' if esg.get('budget_exceeded') else ''} |",
        "",
        "| stage | kWh (facility) | kgCO2e |",
        "|---|---|---|",
        *(f"| {s} | {v['energy_kwh']:.6g} | {v['emissions_kg']:.6g} |" for s, v in esg["by_stage"].items()),
        "",
        "| device | kWh (facility) |",
        "|---|---|",
        *(f"| {d} | {kwh:.6g} |" for d, kwh in esg.get("by_device_kwh", {}).items()),
    ]
    if esg.get("by_replica"):
        lines += ["", "| replica group (attribution) | kWh (facility) |", "|---|---|"]
        lines += [f"| {r} | {v['energy_kwh']:.6g} |" for r, v in esg["by_replica"].items()]
    if esg.get("sifting_saved"):
        saved = esg["sifting_saved"]
        net, kg = saved["energy_kwh"], saved["emissions_kg"]
        lines.append("")
        if net >= 0:
            lines.append(f"Sifting saved {net:.6g} kWh net ({kg:.6g} kgCO2e).")
        else:  # its scoring cost more than the training it left out
            lines.append(f"Sifting cost {-net:.6g} kWh more than it saved ({-kg:.6g} kgCO2e).")
    lines += ["", "## Method", "", *(f"- {line}" for line in esg.get("method") or method(esg))]
    lines += ["", f"How figures were merged: {esg['merge']}."]
    return "\n".join(lines) + "\n"


def ledger_row(summary: dict) -> dict:
    """The job's line in the carbon ledger."""
    esg = summary["carbon"]
    transitions = summary.get("secondary_status_transitions") or [{}]
    return {
        "job_id": summary["job_id"],
        "job_name": summary.get("job_name"),
        "finished_at": transitions[-1].get("start_time"),
        "status": summary["status"],
        "energy_kwh": esg["energy_kwh"],
        "it_energy_kwh": esg.get("it_energy_kwh"),
        "emissions_kg": esg["emissions_kg"],
        "scope2_location_based_kg": esg.get("scope2_location_based_kg"),
        "scope2_market_based_kg": esg.get("scope2_market_based_kg"),
        "intensity_g_per_kwh": esg.get("intensity_g_per_kwh"),
        "pue": esg.get("pue"),
        "country_iso_code": esg.get("country_iso_code"),
        "region": esg.get("region"),
        "measurement_mode": esg.get("measurement_mode"),
        "intensity_source": esg.get("intensity_source"),
        "scope2_market_basis": esg.get("scope2_market_basis"),
        "samples_trained": (summary.get("compute") or {}).get("samples_trained"),
        "g_per_1k_samples": esg.get("g_per_1k_samples_trained"),
        "sifting_saved_kwh": (esg.get("sifting_saved") or {}).get("energy_kwh"),
    }


def write_ledger_row(output_uri: str, row: dict) -> str:
    """Put the job's ledger line at ``<output>/carbon-ledger/<job id>.csv``; returns its URI."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=LEDGER_FIELDS)
    writer.writeheader()
    writer.writerow({k: "" if row.get(k) is None else row[k] for k in LEDGER_FIELDS})
    target = s3.S3Uri.parse(output_uri).join("carbon-ledger", f"{row['job_id']}.csv")
    return s3.put_bytes(str(target), buffer.getvalue().encode())


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def _unit(value, unit: str) -> str:
    """``value`` with its unit; "n/a" alone (a unit beside no figure reads as one)."""
    return "n/a" if value is None else f"{_fmt(value)} {unit}"


def read_ledger(output_uri: str, since: str | None = None) -> list[dict]:
    """Every job's ledger line under ``<output>/carbon-ledger/``, oldest first (``since``: an ISO date)."""
    from botocore.exceptions import BotoCoreError, ClientError

    where = s3.S3Uri.parse(output_uri).join("carbon-ledger/")
    client, rows = s3.client(), []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=where.key):
            for obj in page.get("Contents", []):
                if obj["Key"].endswith(".csv"):
                    body = client.get_object(Bucket=where.bucket, Key=obj["Key"])["Body"].read()
                    rows += _ledger_rows(body, f"s3://{where.bucket}/{obj['Key']}")
    except (ClientError, BotoCoreError) as exc:
        raise s3.describe_error(exc, str(where)) from exc
    rows = [r for r in rows if not since or (r.get("finished_at") or "") >= since]
    return sorted(rows, key=lambda r: r.get("finished_at") or "")


# what the report reads of each line: text, and figures (the market-based one may be empty: no supplier factor)
_READ = ("job_id", "finished_at", "status", "measurement_mode")
_FIGURES = ("energy_kwh", "emissions_kg")


def _ledger_rows(body: bytes, uri: str) -> list[dict]:
    """The lines of one ledger object; a ``DataError`` naming it and the line where it is not a ledger's (a file
    saved over by hand, another tool's CSV): the report read on, and failed with a traceback naming nothing."""
    try:
        rows = list(csv.DictReader(io.StringIO(body.decode("utf-8-sig"))))  # (a spreadsheet's save adds a BOM)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{uri}: not a carbon ledger's CSV ({exc}); remove or restore it") from None
    for line, row in enumerate(rows, start=2):
        missing = [name for name in (*_READ, *_FIGURES) if row.get(name) is None]
        if missing:
            raise DataError(
                f"{uri}, line {line}: no {', '.join(missing)}; not a carbon ledger's line: remove or restore it"
            )
        for name in (*_FIGURES, "scope2_market_based_kg"):
            if name not in _FIGURES and not row.get(name):
                continue  # no supplier factor: no market-based figure
            try:
                float(row[name])
            except ValueError:
                raise DataError(
                    f"{uri}, line {line}: {name} is {row[name]!r}, not a number; remove or restore it"
                ) from None
    return rows


def write_csv(rows: list[dict], path) -> None:
    """The ledger lines as one CSV file."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=LEDGER_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot_ledger(rows: list[dict], path) -> None:
    """Emissions per job over time, and the running total (PNG)."""
    from trainyard.plots import plt

    fig = ledger_figure(rows)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ledger_figure(rows: list[dict]):
    """``plot_ledger``'s figure: a bar per job, named by when it finished, and the running total."""
    from trainyard.plots import plt

    kg = [float(r["emissions_kg"] or 0) for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bars = ax.bar(range(len(rows)), [v * 1000 for v in kg], color="tab:green", label="per job (g)")
    ax.set(xlabel="job, by when it finished (UTC)", ylabel="gCO2e", title="Emissions by job (every stage)")
    # each bar named by when its job finished (a job id is too long to read under a bar); at most ~20 names
    every = max(1, -(-len(rows) // 20))
    shown = range(0, len(rows), every)
    ax.set_xticks(list(shown), [str(rows[i].get("finished_at") or "")[:16].replace("T", " ") for i in shown])
    ax.tick_params(axis="x", labelrotation=45, labelsize="small")
    total = ax.twinx()
    running = [sum(kg[: i + 1]) * 1000 for i in range(len(kg))]
    (line,) = total.plot(range(len(rows)), running, color="black", marker=".", label="running total (g)")
    total.set_ylabel("running total, gCO2e")
    total.set_ylim(bottom=0)  # from zero, as the line's first point reads
    ax.legend(handles=[bars, line], loc="upper left", fontsize="small")  # inside the axes, not over the frame
    fig.tight_layout()
    return fig
