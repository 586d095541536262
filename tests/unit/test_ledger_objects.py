"""``trainyard report carbon`` over a ledger with an object that is not a ledger's (saved over by hand, another tool's
CSV): the object and its line named, exit 1, no traceback. A spreadsheet's byte-order mark is read through."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trainyard import esg, s3
from trainyard.cli import app

GOOD = "job_id,finished_at,status,energy_kwh,emissions_kg,scope2_market_based_kg,measurement_mode\n"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            GOOD.encode() + b"x,2026-11-01T10:00:00,Completed,n/a,0.1,,cpu\n",
            "line 2: energy_kwh is 'n/a', not a number",
        ),
        (b"name,kwh\nx,1\n", "line 2: no job_id, finished_at, status, measurement_mode, energy_kwh, emissions_kg"),
        (GOOD.encode() + b"x,2026-11-01,Completed,\xff\xfe,0.1,,cpu\n", "not a carbon ledger's CSV"),
        (GOOD.encode() + b"x,2026-11-01T10:00:00,Completed,0.5,0.1,lots,cpu\n", "scope2_market_based_kg is 'lots'"),
    ],
)
def test_an_object_that_is_not_a_ledgers_is_named_with_its_line(s3_server, bucket, body, says):
    esg.write_ledger_row(
        f"s3://{bucket}/out/",
        {
            "job_id": "good",
            "finished_at": "2026-11-01T09:00:00",
            "status": "Completed",
            "energy_kwh": 0.5,
            "emissions_kg": 0.1,
            "measurement_mode": "cpu:cpu_load",
        },
    )
    s3.client().put_object(Bucket=bucket, Key="out/carbon-ledger/edited.csv", Body=body)
    result = CliRunner().invoke(app, ["report", "carbon", f"s3://{bucket}/out/"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output  # (no traceback)
    assert f"s3://{bucket}/out/carbon-ledger/edited.csv" in result.output and says in result.output


def test_a_ledger_saved_by_a_spreadsheet_with_a_byte_order_mark_is_read(s3_server, bucket):
    body = "\ufeff".encode() + GOOD.encode() + b"x,2026-11-01T10:00:00,Completed,0.5,0.1,,cpu\n"
    s3.client().put_object(Bucket=bucket, Key="out/carbon-ledger/x.csv", Body=body)
    assert [r["job_id"] for r in esg.read_ledger(f"s3://{bucket}/out/")] == ["x"]
