"""``trainyard report carbon``: the carbon ledger across jobs, as a table, a CSV file and a chart."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from trainyard.errors import TrainyardError

report_app = typer.Typer(help="Reports across jobs.", no_args_is_help=True)
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

    try:
        rows = esg.read_ledger(output_uri, since)
    except TrainyardError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    table = Table(title=f"Carbon ledger: {output_uri}" + (f" since {since}" if since else ""))
    for column in ("job", "finished", "status", "kWh", "kgCO2e", "market-based kg", "mode"):
        table.add_column(column, justify="right" if column in ("kWh", "kgCO2e", "market-based kg") else "left")
    for r in rows:
        table.add_row(
            r["job_id"],
            (r["finished_at"] or "")[:19],
            r["status"],
            f"{float(r['energy_kwh']):.4g}",
            f"{float(r['emissions_kg']):.4g}",
            r["scope2_market_based_kg"] or "not provided",
            r["measurement_mode"],
        )
    energy = sum(float(r["energy_kwh"]) for r in rows)
    emissions = sum(float(r["emissions_kg"]) for r in rows)
    table.add_row("total", f"{len(rows)} job(s)", "", f"{energy:.4g}", f"{emissions:.4g}", "", "", style="bold")
    Console().print(table)
    if csv_out is not None:
        esg.write_csv(rows, csv_out)
        console.print(f"wrote {csv_out}")
    if png_out is not None:
        esg.plot_ledger(rows, png_out)
        console.print(f"wrote {png_out}")
