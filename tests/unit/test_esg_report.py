"""The ESG report as a sustainability team reads it: every figure with its unit, how it was obtained (measured or
estimated, which grid figure, the PUE, the market-based basis), a saving that was a cost said as one, and the
ledger's chart and lines carrying what a reader needs to weigh them."""

from __future__ import annotations

from trainyard import esg
from trainyard.spec import Carbon


def _carbon(**changes) -> dict:
    """A job's carbon roll-up (``carbon.rollup``'s shape): 12 Wh at PUE 1.2 in Ireland, CPU and RAM estimated."""
    return {
        "energy_kwh": 0.012,
        "emissions_kg": 0.0036,
        "measurement_mode": "cpu:cpu_load,ram:estimate",
        "country_iso_code": "IRL",
        "region": None,
        "intensity_g_per_kwh": 300.0,
        "intensity_source": "codecarbon offline energy mix for IRL",
        "pue": 1.2,
        "scope2_location_based_kg": 0.0036,
        "budget_kg": None,
        "by_stage": {"training": {"energy_kwh": 0.012, "emissions_kg": 0.0036}},
        "by_device_kwh": {"cpu": 0.004, "gpu": 0.0, "ram": 0.008},
        "merge": "one tracker per stage",
    } | changes


def test_every_figure_has_its_unit_and_none_stands_alone():
    report = esg.report(_carbon(), Carbon(country_iso_code="IRL", pue=1.2, supplier_g_per_kwh=100.0))
    text = esg.markdown("job-1", report)
    assert "| Scope 2, market-based | 0.0012 kgCO2e (supplier emission factor 100.0 gCO2e/kWh) |" in text
    assert "| budget | n/a |" in text and "n/a gCO2e" not in text  # was "n/a kgCO2e", a unit beside no figure
    assert "| stage | kWh (facility) | kgCO2e |" in text and "| device | kWh (facility) |" in text


def test_the_report_says_how_its_figures_were_obtained():
    report = esg.report(_carbon(), Carbon(country_iso_code="IRL", pue=1.2, renewable_share=0.25))
    method = report["method"]  # in the summary's JSON too
    assert method[0].startswith("Energy: codecarbon ") and "CPU power estimated from its load and its TDP" in method[0]
    assert "RAM power estimated from its size" in method[0] and method[0].endswith("(estimates, not meter readings).")
    assert "codecarbon offline energy mix for IRL" in method[1] and method[2].startswith("PUE 1.2: facility energy")
    assert method[3] == (
        "Market-based emissions: renewable share 25% of the energy (contracts), the energy it does not cover priced "
        "at the location-based grid intensity."
    )
    assert "## Method" in esg.markdown("job-1", report) and f"- {method[2]}" in esg.markdown("job-1", report)
    measured = esg.method(_carbon(measurement_mode="cpu:intel_rapl,gpu:nvml"))
    assert "estimates" not in measured[0] and "GPU energy read through NVML" in measured[0]


def test_a_saving_that_cost_more_than_it_saved_is_said_as_a_cost():
    report = esg.report(_carbon(), Carbon(country_iso_code="IRL", pue=1.2))
    report["sifting_saved"] = {"energy_kwh": -2e-5, "emissions_kg": -6e-6}
    text = esg.markdown("job-1", report)
    assert "Sifting cost 2e-05 kWh more than it saved (6e-06 kgCO2e)." in text and "saved -2e-05" not in text


def test_the_ledger_line_carries_the_grid_figure_and_the_market_basis_and_its_chart_starts_at_zero():
    report = esg.report(_carbon(), Carbon(country_iso_code="IRL", pue=1.2, supplier_g_per_kwh=100.0))
    summary = {"job_id": "j-1", "status": "Completed", "carbon": report, "secondary_status_transitions": [{}]}
    row = esg.ledger_row(summary)
    assert row["intensity_source"] == "codecarbon offline energy mix for IRL"
    assert row["scope2_market_basis"] == "supplier emission factor 100.0 gCO2e/kWh"
    assert {"intensity_source", "scope2_market_basis"} <= set(esg.LEDGER_FIELDS)
    rows = [{"emissions_kg": "0.003", "finished_at": "2026-11-01T10:00:00"}]
    rows += [{"emissions_kg": "0.004", "finished_at": "2026-11-02T10:00:00"}]
    figure = esg.ledger_figure(rows)
    assert figure.axes[1].get_ylim()[0] == 0  # the running total's axis began at 3 g: its line seemed to start at 0
    assert figure.axes[0].get_title() == "Emissions by job (every stage)"


def test_the_grid_figure_names_a_region_only_where_codecarbon_has_one():
    # codecarbon has regional figures for six countries; elsewhere it used the national one, which the report named
    # as the region's ("for IRL/Dublin") for an auditor to read as regional
    from trainyard.carbon import StageEnergy, rollup

    record = StageEnergy("training", 0.01, 0.003)
    national = rollup([record], Carbon(country_iso_code="IRL", region="Dublin"))
    assert (national["intensity_source"], national["region"]) == ("codecarbon offline energy mix for IRL", None)
    regional = rollup([record], Carbon(country_iso_code="USA", region="california"))
    assert regional["intensity_source"] == "codecarbon offline energy mix for USA/california"
