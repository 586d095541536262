"""``trainyard report carbon``: the carbon ledger across jobs, as a table, a CSV file and a chart."""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from trainyard.cli_text import out, say
from trainyard.errors import TrainyardError
from trainyard.spec.base import check_s3_uri

report_app = typer.Typer(help="Reports across jobs.", no_args_is_help=True, rich_markup_mode="markdown")
console = Console(stderr=True)


@report_app.command("carbon")
def carbon(
    output_uri: Annotated[str, typer.Argument(help="The jobs' output.s3_uri, where carbon-ledger/ is kept.")],
    since: Annotated[str | None, typer.Option(help="Only jobs finished on or after this date (YYYY-MM-DD).")] = None,
    csv_out: Annotated[Path | None, typer.Option("--csv", help="Write the lines to this CSV file.")] = None,
    png_out: Annotated[Path | None, typer.Option("--png", help="Write a chart of emissions by job here.")] = None,
) -> None:
    """Energy and emissions of every job whose ledger line is under OUTPUT_URI/carbon-ledger/."""
    from trainyard import esg

    if since is not None:
        try:
            since = date.fromisoformat(since).isoformat()
        except ValueError:
            say(console, f"--since {since!r}: not a date; write it as YYYY-MM-DD, e.g. 2026-11-01", "red")
            raise typer.Exit(2) from None
    try:
        check_s3_uri(output_uri)
    except ValueError as exc:
        say(console, f"OUTPUT_URI: {exc} (the jobs' output.s3_uri)", "red")
        raise typer.Exit(2) from None
    for path in (csv_out, png_out):  # before reading S3: a path found wrong afterwards wasted the report
        if path is not None and not path.parent.is_dir():
            say(console, f"{path}: its folder {path.parent} does not exist", "red")
            raise typer.Exit(2)
    if png_out is not None and png_out.suffix.lower() != ".png":  # (matplotlib took the suffix for the format)
        say(console, f"--png {png_out}: the chart is a PNG; name it ending in .png", "red")
        raise typer.Exit(2)
    try:
        rows = esg.read_ledger(output_uri, since)
    except TrainyardError as exc:
        say(console, exc, "red")
        raise typer.Exit(1) from None
    if not rows and since and (earlier := _ledger_lines(output_uri)):
        # the ledger is there: none finished since then is an answer, not a mistake
        say(console, f"no jobs finished since {since} ({earlier} ledger line(s) before it under {output_uri})")
        return
    if not rows:  # not an empty table with a total of 0: that reads as "no emissions"
        where = f"{output_uri.rstrip('/')}/carbon-ledger/"
        say(
            console,
            f"no ledger lines under {where}"
            + (f" for jobs finished since {since}" if since else "")
            + "; OUTPUT_URI is the jobs' output.s3_uri (each job writes its line there)",
            "red",
        )
        raise typer.Exit(1)
    table = Table(title=f"Carbon ledger: {output_uri}" + (f" since {since}" if since else ""))
    figures = ("facility kWh", "kgCO2e", "market-based kg")
    for column in ("job", "finished (UTC)", "status", *figures, "mode"):
        table.add_column(column, justify="right" if column in figures else "left", overflow="fold")
    for r in rows:
        table.add_row(
            r["job_id"],
            (r["finished_at"] or "")[:19],
            r["status"],
            f"{float(r['energy_kwh']):.4g}",
            f"{float(r['emissions_kg']):.4g}",
            f"{float(r['scope2_market_based_kg']):.4g}" if r.get("scope2_market_based_kg") else "not provided",
            r["measurement_mode"],
        )
    energy = sum(float(r["energy_kwh"]) for r in rows)
    emissions = sum(float(r["emissions_kg"]) for r in rows)
    market = [float(r["scope2_market_based_kg"]) for r in rows if r.get("scope2_market_based_kg")]
    # a market-based total only where every job has a figure: a partial sum would read as the whole
    market_total = f"{sum(market):.4g}" if rows and len(market) == len(rows) else ""
    table.add_row(
        "total", f"{len(rows)} job(s)", "", f"{energy:.4g}", f"{emissions:.4g}", market_total, "", style="bold"
    )
    out().print(table)
    for path, write in ((csv_out, esg.write_csv), (png_out, esg.plot_ledger)):
        if path is None:
            continue
        try:
            write(rows, path)
        except OSError as exc:
            say(console, f"{path}: cannot be written ({exc.strerror or exc})", "red")
            raise typer.Exit(1) from None
        say(console, f"wrote {path}")


def _ledger_lines(output_uri: str) -> int:
    """How many lines the ledger under ``output_uri`` has, whenever their jobs finished (0 where unreadable)."""
    from trainyard import esg

    try:
        return len(esg.read_ledger(output_uri, None))
    except TrainyardError:
        return 0
