"""Carbon accounting with codecarbon's offline tracker: per-stage records and the job roll-up."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from codecarbon.input import DataSource

from tests.unit.specs import minimal, problems
from trainyard import carbon, esg
from trainyard.spec import Carbon, ignored_settings, parse_job


@pytest.fixture
def no_network(monkeypatch):
    """Fail the test if anything tries to connect beyond loopback."""
    real_connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (host.startswith("127.") or host in ("localhost", "::1")):
            raise AssertionError(f"network call attempted to {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def test_meter_records_energy_offline(no_network):
    with carbon.meter("training", Carbon(country_iso_code="IRL", pue=1.2)) as record:
        busy(1.2)
    assert record.stage == "training"
    assert record.energy_kwh > 0 and record.emissions_kg > 0
    assert record.duration_seconds >= 1.2
    assert "cpu:" in record.measurement_mode


def test_rollup_adds_up_and_uses_the_grid_intensity():
    settings = Carbon(country_iso_code="IRL", pue=1.2)
    records = []
    for stage in ("staging", "training"):
        with carbon.meter(stage, settings) as record:
            busy(0.6)
        records.append(record)
    report = carbon.rollup(records, settings)
    assert report["energy_kwh"] == pytest.approx(sum(s["energy_kwh"] for s in report["by_stage"].values()))
    assert report["emissions_kg"] == pytest.approx(sum(s["emissions_kg"] for s in report["by_stage"].values()))
    grid = DataSource().get_global_energy_mix_data()["IRL"]["carbon_intensity"]
    assert report["intensity_g_per_kwh"] == pytest.approx(grid, rel=1e-6)
    assert report["emissions_kg"] == pytest.approx(report["energy_kwh"] * grid / 1000, rel=1e-6)
    assert report["pue"] == 1.2
    assert set(report["by_stage"]) == {"staging", "training"}
    assert report["energy_kwh"] == pytest.approx(sum(report["by_device_kwh"].values()))
    esg_report = esg.report(report, settings)
    assert esg_report["scope2_market_based_kg"] is None and esg_report["scope2_market_basis"] == "not provided"
    assert esg_report["emissions_kg"] == pytest.approx(
        esg_report["it_energy_kwh"] * esg_report["intensity_g_per_kwh"] * esg_report["pue"] / 1000
    )
    supplier = esg.report(report, Carbon(country_iso_code="IRL", pue=1.2, supplier_g_per_kwh=100.0), None)
    assert supplier["scope2_market_based_kg"] == pytest.approx(report["energy_kwh"] * 0.1)
    assert "| emissions |" in esg.markdown("job-1", esg_report)


def test_the_esg_report_counts_every_row_sifting_left_untrained_against_what_scoring_cost():
    from types import SimpleNamespace

    # 1,000 rows trained at 10 FLOPs each (forward and backward); the sifter passed over 600 it ranked and
    # left 400 out unscored during its delay; its scoring passes cost 2,000 FLOPs; the prefilter dropped
    # 50 rows (3 epochs of them not trained) and scored for 500.
    outcome = SimpleNamespace(
        samples_trained=1000,
        flops={"forward": 4000, "backward": 6000, "evaluation": 0, "scoring": 2000},
        history=[{"epoch": e} for e in (1, 2, 3)],
        sifting={"scored": 1200, "kept": 600, "passed_over": 600, "unsifted": 400, "skipped": 400}
        | {"pruned_learnt": 70, "pruned_hardest": 30},  # sifting.prune: 100 of the kept rows sat out
        energy_by_replica={},
    )
    prefilter = SimpleNamespace(dropped={"duplicate": 50}, scoring_flops=500)
    carbon_report = {
        "energy_kwh": 1.2,
        "emissions_kg": 0.3,
        "intensity_g_per_kwh": 250.0,
        # 1e-6 kWh per training FLOP (12,000 of them); the filtering stage, where the prefilter scored, measured
        "by_stage": {"training": {"energy_kwh": 0.012}, "filtering": {"energy_kwh": 0.0007}},
    }
    saved = esg.report(carbon_report, Carbon(country_iso_code="IRL"), outcome, prefilter)["sifting_saved"]
    assert saved["flops_not_spent"] == (600 + 400 + 100 + 50 * 3) * 10
    # apart: the keep rule's (what the summary's sifting warning weighs), the delay's, pruning's, the prefilter's
    assert (saved["flops_not_spent_by_keep_rule"], saved["flops_not_spent_before_delay"]) == (6000, 4000)
    assert (saved["flops_not_spent_by_pruning"], saved["flops_not_spent_by_prefilter"]) == (1000, 1500)
    assert saved["flops_spent_scoring"] == 2000 + 500
    # online scoring at the training stage's kWh per FLOP; the prefilter's as its stage measured it
    assert saved["energy_kwh"] == pytest.approx((12500 - 2000) * 1e-6 - 0.0007)
    assert saved["emissions_kg"] == pytest.approx(saved["energy_kwh"] * 0.25)


def test_a_groups_share_carries_the_jobs_pue_as_the_stages_do():
    from types import SimpleNamespace

    outcome = SimpleNamespace(samples_trained=0, flops={}, history=[], sifting=None, energy_by_replica={"0": 0.002})
    carbon_report = {"energy_kwh": 0.01, "emissions_kg": 0.003, "intensity_g_per_kwh": 300.0, "by_stage": {}}
    share = esg.report(carbon_report, Carbon(country_iso_code="IRL", pue=1.5), outcome)["by_replica"]["0"]
    assert share == {"energy_kwh": pytest.approx(0.003), "emissions_kg": pytest.approx(0.003 * 0.3)}


def test_live_watch_reports_and_stops_once_past_the_budget():
    samples, over = [], []
    with carbon.meter("training", Carbon(country_iso_code="IRL")) as record:
        watch = carbon.LiveWatch(record, 0.3, 0.0, 1e-9, 1e-9, samples.append, over.append)
        with watch:
            busy(1.0)
    assert len(samples) >= 3 and samples[-1]["emissions_kg"] >= samples[0]["emissions_kg"] > 1e-9
    assert len(over) == 1  # the budget callback fires once, not at every reading
    # past the budget only at the last reading, once the stage's work has ended: nothing left to stop
    samples, over = [], []
    with (
        carbon.meter("training", Carbon(country_iso_code="IRL")) as record,
        carbon.LiveWatch(record, 60.0, 0.0, 0.0, 1e-9, samples.append, over.append),
    ):
        busy(0.5)
    assert samples[-1]["emissions_kg"] > 1e-9 and over == []


def test_live_watch_stops_at_the_budget_while_its_reporting_fails():
    # the Prefect or MLflow API down for the rest of training: the budget is still watched
    over, tries = [], []

    def reporting(sample):
        raise ConnectionError("the Prefect API did not answer")

    def stopping(kg):  # the first try fails too (stop.json not written): tried again at the next sample
        tries.append(kg)
        if len(tries) == 1:
            raise OSError("disk full")
        over.append(kg)

    # (a first reading waits for codecarbon's import, about a second in a fresh process)
    with (
        carbon.meter("training", Carbon(country_iso_code="IRL")) as record,
        carbon.LiveWatch(record, 0.05, 0.0, 1e-9, 1e-9, reporting, stopping),
    ):
        busy(1.5)
    assert len(tries) == 2 and len(over) == 1


def test_the_ledger_aggregates_jobs_across_runs(s3_server, bucket, tmp_path):
    from typer.testing import CliRunner

    from trainyard.cli import app

    for i, day in enumerate(("2026-11-01", "2026-11-20")):
        row = {"job_id": f"job-{i}-churn-mlp-2026110{i}-101500-a3f9c{i}", "finished_at": f"{day}T10:00:00"}
        row |= {"status": "Completed"}
        row |= {"energy_kwh": 0.5, "emissions_kg": 0.1 * (i + 1), "measurement_mode": "cpu:cpu_load"}
        row |= {"scope2_market_based_kg": 0.0123456789 * (i + 1)}
        esg.write_ledger_row(f"s3://{bucket}/out/", row)
    assert [r["job_id"] for r in esg.read_ledger(f"s3://{bucket}/out/", since="2026-11-10")] == [
        "job-1-churn-mlp-20261101-101500-a3f9c1"
    ]
    files = ["--csv", str(tmp_path / "l.csv"), "--png", str(tmp_path / "l.png")]
    result = CliRunner().invoke(app, ["report", "carbon", f"s3://{bucket}/out/", *files])
    assert result.exit_code == 0, result.output
    assert "2 job(s)" in result.output
    # in a pipe, as here, the table is as wide as it needs: each id on one line, not wrapped at 80 columns
    assert "job-0-churn-mlp-20261100-101500-a3f9c0" in result.output
    assert (tmp_path / "l.csv").read_text().count("\n") == 3 and (tmp_path / "l.png").stat().st_size > 1000
    assert "0.01235" in result.output and "0.03704" in result.output  # each job's market-based kg, and their total
    # the chart names each bar by when its job finished, and its legend sits inside the axes
    figure = esg.ledger_figure(esg.read_ledger(f"s3://{bucket}/out/"))
    bars = figure.axes[0]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["2026-11-01 10:00", "2026-11-20 10:00"]
    assert [t.get_text() for t in bars.get_legend().get_texts()] == ["per job (g)", "running total (g)"]
    for args, code, says in (
        (["--since", "yesterday"], 2, "--since 'yesterday': not a date"),
        (["--csv", str(tmp_path / "no-such-folder" / "l.csv")], 2, "no-such-folder does not exist"),
        (["--png", str(tmp_path / "l.csv" / "l.png")], 2, "does not exist"),  # a file where the folder should be
        (["--png", str(tmp_path / "ledger.csv")], 2, "the chart is a PNG"),  # (a traceback from matplotlib)
    ):
        failed = CliRunner().invoke(app, ["report", "carbon", f"s3://{bucket}/out/", *args])
        assert failed.exit_code == code and says in failed.output, failed.output
        assert failed.exception is None or isinstance(failed.exception, SystemExit)
    # none finished since: an answer (exit 0), not the mistake of a wrong prefix
    later = CliRunner().invoke(app, ["report", "carbon", f"s3://{bucket}/out/", "--since", "2030-01-01"])
    flat = " ".join(later.output.split())
    assert later.exit_code == 0 and "no jobs finished since 2030-01-01 (2 ledger line(s) before it" in flat, flat
    # the parent of the output prefix (or one job's folder): no lines there, said so, not a total of 0
    for where in (f"s3://{bucket}/", f"s3://{bucket}/out/job-0-churn-mlp-20261100-101500-a3f9c0/"):
        failed = CliRunner().invoke(app, ["report", "carbon", where])
        flat = " ".join(failed.output.split())
        assert failed.exit_code == 1 and "no ledger lines under" in flat and "0 job(s)" not in flat, flat


GROUP_METER = """
import json, sys, time
from trainyard.carbon import BackgroundMeter
meter = BackgroundMeter("replica-0")
meter._thread.join()  # started (with no saved hardware probe here, that takes codecarbon's probe)
end = time.monotonic() + 0.5
while time.monotonic() < end:
    sum(range(1000))
record = meter.stop()
print(json.dumps({"record": record, "geo_imported": "codecarbon.external.geography" in sys.modules}))
"""


def test_a_group_meter_measures_energy_without_the_emissions_lookup(tmp_path):
    # A group's meter only needs kWh: its stop must not pull in codecarbon's geography (requests,
    # pycountry: ~50 ms of CPU at every group's exit, on the job's critical path).
    env = {**os.environ, "TRAINYARD_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", GROUP_METER], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    record = result["record"]
    assert record["energy_kwh"] > 0 and record["cpu_energy_kwh"] > 0
    assert record["energy_kwh"] == pytest.approx(
        record["cpu_energy_kwh"] + record["gpu_energy_kwh"] + record["ram_energy_kwh"]
    )
    assert "cpu:" in record["measurement_mode"] and "emissions_kg" not in record
    assert not result["geo_imported"]


PARTIAL_METER = """
import json, sys, time
from pathlib import Path
from trainyard.carbon import BackgroundMeter
path = Path(sys.argv[1])
meter = BackgroundMeter("replica-0")
meter.keep_writing(path, {"machine": "m-1"}, every=0.2)
end = time.monotonic() + 30  # (the meter's start probes the hardware first: a second or two)
while time.monotonic() < end and not path.exists():
    sum(range(1000))
time.sleep(0.3)  # written again, at least once
partial = json.loads(path.read_text())
record = meter.stop()
stopped = path.read_text()
time.sleep(0.5)
print(json.dumps({"partial": partial, "record": record, "written_after_stop": path.read_text() != stopped}))
"""


def test_a_group_meter_writes_its_figures_so_far_while_it_runs(tmp_path):
    # a group killed outright (SIGKILL, the OOM killer) wrote no energy.json: its energy was in no job total
    env = {**os.environ, "TRAINYARD_HOME": str(tmp_path)}
    path = tmp_path / "energy.json"
    command = [sys.executable, "-c", PARTIAL_METER, str(path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    partial, record = result["partial"], result["record"]
    assert partial["partial"] is True and partial["machine"] == "m-1" and "emissions_kg" not in partial
    assert 0 < partial["energy_kwh"] <= record["energy_kwh"]
    assert partial["energy_kwh"] == pytest.approx(
        partial["cpu_energy_kwh"] + partial["gpu_energy_kwh"] + partial["ram_energy_kwh"]
    )
    assert not result["written_after_stop"]  # (the group writes its final record itself)


def test_a_stage_stopped_while_its_meter_starts_raises_the_stop_not_a_key_error(monkeypatch):
    import contextlib

    from tasks._metering import stage_meter
    from tests.conftest import job_dict
    from trainyard.spec import parse_job

    @contextlib.contextmanager
    def interrupted(*args, **kwargs):  # the signal lands in codecarbon's start, before the meter yields
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(carbon, "meter", interrupted)
    job = parse_job(job_dict({"train": "s3://bkt/t/", "validation": "s3://bkt/v/", "output": "s3://bkt/o/"}))
    with pytest.raises(KeyboardInterrupt), stage_meter("staging", job):
        pass


def test_a_grid_codecarbon_has_no_figures_for_is_refused_not_priced_at_the_world_average():
    def carbon_problems(**carbon) -> list[str]:
        return problems(minimal(carbon=carbon))

    assert carbon_problems(country_iso_code="GER")[0].startswith(
        "carbon.country_iso_code: 'GER': codecarbon has no grid figures for it; give an ISO 3166-1 alpha-3 code"
    )
    (found,) = carbon_problems(country_iso_code="CAN", region="ontari")
    assert "region 'ontari': not a CAN region codecarbon has figures for; did you mean 'ontario'?" in found
    assert carbon_problems(country_iso_code="USA", region="atlantis")
    # as codecarbon matches them: USA and Canadian names in lower case, Nordic zones in either case
    assert parse_job(minimal(carbon={"country_iso_code": "usa", "region": "New  York"})).carbon.region == "new york"
    assert parse_job(minimal(carbon={"country_iso_code": "SWE", "region": "se3"})).carbon.region == "se3"
    assert parse_job(minimal(carbon={"country_iso_code": "CHN", "region": "Beijing"})).carbon.country_iso_code == "CHN"
    # a region where codecarbon has only the national figure: valid, and said to be ignored
    ireland = parse_job(minimal(carbon={"country_iso_code": "IRL", "region": "dublin"}))
    assert any(
        w.startswith("carbon.region: codecarbon has regional figures for USA") for w in ignored_settings(ireland)
    )


def test_groups_on_other_machines_are_added_to_the_training_stage_and_this_machines_are_not(tmp_path):
    from tasks._metering import stage_meter
    from trainyard.carbon_probe import machine_id
    from trainyard.training import accounting

    def attempt(replica: int, machine: str, kwh: float, mode: str) -> None:
        folder = tmp_path / "replicas" / str(replica) / "attempt-0"
        folder.mkdir(parents=True)
        record = {"energy_kwh": kwh, "cpu_energy_kwh": kwh * 0.4, "gpu_energy_kwh": kwh * 0.5}
        record |= {"ram_energy_kwh": kwh * 0.1, "measurement_mode": mode, "machine": machine}
        (folder / "energy.json").write_text(json.dumps(record))

    assert accounting.energy_elsewhere(tmp_path, machine_id(), "launch-1") is None  # no group has run
    attempt(0, machine_id(), 1.0, "cpu:load")  # inside this machine's machine-wide meter already
    assert accounting.energy_elsewhere(tmp_path, machine_id(), "launch-1") is None
    attempt(1, "a-gpu-node", 0.5, "cpu:load,gpu:nvml")  # a GPU pool's node: outside it
    elsewhere = accounting.energy_elsewhere(tmp_path, machine_id(), "launch-1")
    assert elsewhere == {
        "energy_kwh": 0.5,
        "cpu_energy_kwh": 0.2,
        "gpu_energy_kwh": 0.25,
        "ram_energy_kwh": 0.05,
        "measurement_mode": "cpu:load,gpu:nvml",
        "attempts": 1,
    }
    job = parse_job(minimal(carbon={"pue": 1.5, "measure_power_secs": 1}))
    with stage_meter("training", job) as plain:
        pass
    with stage_meter("training", job) as record:
        record["elsewhere"] = elsewhere
    energy, alone = record["energy"], plain["energy"]
    assert "elsewhere" not in record
    # at the job's PUE, and at the stage's own grid intensity
    assert energy["energy_kwh"] == pytest.approx(alone["energy_kwh"] + 0.75, abs=1e-4)
    assert energy["gpu_energy_kwh"] == pytest.approx(alone["gpu_energy_kwh"] + 0.375, abs=1e-4)
    intensity = energy["emissions_kg"] / energy["energy_kwh"]
    assert intensity == pytest.approx(alone["emissions_kg"] / alone["energy_kwh"], rel=1e-3) and intensity > 0
    assert energy["measurement_mode"].endswith(" (other machines' groups: cpu:load,gpu:nvml)")
    # a training stage that failed or was stopped counts them too
    with pytest.raises(KeyboardInterrupt) as stopped, stage_meter("training", job) as record:
        record["elsewhere"] = elsewhere
        raise KeyboardInterrupt
    assert stopped.value.stage_record["energy"]["energy_kwh"] >= 0.75


def test_failed_attempts_kept_for_retries_are_bounded(monkeypatch):
    # a task that failed for good leaves its attempts' record (nothing says it will not be retried); a worker
    # process running job after job keeps only the newest EARLIER_KEPT
    from types import SimpleNamespace

    from tasks import _metering

    monkeypatch.setattr(_metering, "_EARLIER_ATTEMPTS", {})
    monkeypatch.setattr(_metering, "EARLIER_KEPT", 2)
    job = parse_job(minimal(carbon={"measure_power_secs": 1}))
    for run in ("a", "b", "c"):
        context = SimpleNamespace(task_run=SimpleNamespace(id=run))
        monkeypatch.setattr(_metering.TaskRunContext, "get", staticmethod(lambda c=context: c))
        with pytest.raises(ValueError), _metering.stage_meter("staging", job):
            raise ValueError("failed for good")
    assert list(_metering._EARLIER_ATTEMPTS) == ["b", "c"]


def test_a_meter_codecarbon_could_not_start_says_so_and_reports_no_figure(monkeypatch, caplog):
    import codecarbon

    # codecarbon logs a failed start and carries on; its tracker then has no final figures
    monkeypatch.setattr(codecarbon.OfflineEmissionsTracker, "start", lambda self: None)
    with carbon.meter("training", Carbon(country_iso_code="IRL")) as record:
        pass
    assert record.measurement_mode == "unavailable" and record.energy_kwh == 0.0
    assert "training's energy could not be measured (codecarbon did not start" in caplog.text


def test_a_stage_counts_its_whole_time_however_short_and_first_in_its_process(tmp_path):
    # RAM's power is a constant estimate, so its energy over a stage's duration is the power the meter counted.
    # A process's first meter spent its hardware probe (1-2 s) uncounted, and a stage under 50 ms counted only
    # codecarbon's first reading (a few ms): each read as a tenth of the power of a longer stage.
    script = (
        "import json, time\n"
        "from trainyard import carbon\n"
        "from trainyard.spec import Carbon\n"
        "watts = []\n"
        "for seconds in (0.3, 0.04, 1.0):\n"
        "    with carbon.meter('stage', Carbon()) as record:\n"
        "        time.sleep(seconds)\n"
        "    watts.append(record.ram_energy_kwh * 3.6e6 / record.duration_seconds)\n"
        "print(json.dumps(watts))\n"
    )
    env = {**os.environ, "TRAINYARD_HOME": str(tmp_path)}  # no hardware probe saved: the first meter probes
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    first, short, long = json.loads(out.stdout.strip().splitlines()[-1])
    assert first == pytest.approx(long, rel=0.2) and short == pytest.approx(long, rel=0.3), (first, short, long)
