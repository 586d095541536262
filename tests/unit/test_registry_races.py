"""The registry when jobs of one model name finish together, and other edges a review found: two gates at
once, two first registrations at once, a rerun finishing a gate an earlier run never reached, long model
cards, a tracking URI whose driver is missing, and the code version of a copy installed in another project."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import contextmanager, suppress

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

from tests.unit.models import register, trained
from trainyard import model_card, promotion, registry
from trainyard.registry_errors import translate


def _versions_without_their_gate(monkeypatch, tmp_path, job, model, x, accuracies: dict[str, float]) -> None:
    with monkeypatch.context() as m:
        m.setattr(promotion, "gate", lambda *a, **k: None)  # stopped between the version and the gate
        for job_id, accuracy in accuracies.items():
            register(job, model, x, job_id, accuracy, tmp_path)


def test_two_gates_of_one_model_name_at_once_leave_the_better_version_champion(tracking, tmp_path, monkeypatch):
    job, model, x = trained()
    register(job, model, x, "j1", 0.60, tmp_path)  # the champion both will read
    _versions_without_their_gate(monkeypatch, tmp_path, job, model, x, {"j2": 0.95, "j3": 0.70})
    both_read = threading.Barrier(2)
    decide = promotion.decide

    def racing(rule, ours, theirs, *args):
        decision = decide(rule, ours, theirs, *args)
        # without the lock both have read v1 here, before either writes; with it, the other waits for the
        # lock, and this one's wait breaks
        with suppress(threading.BrokenBarrierError):
            both_read.wait(timeout=2)
        if ours == 0.70:
            time.sleep(0.5)  # the worse one writes last: its alias would stand, better or not
        return decision

    monkeypatch.setattr(promotion, "decide", racing)
    lock = threading.Lock()

    @contextmanager
    def one_at_a_time(name):
        with lock:
            yield

    models = {}
    threads = [
        threading.Thread(target=lambda j=j: models.update({j: registry.finish_gate(job, j, one_at_a_time)}))
        for j in ("j2", "j3")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client = mlflow.MlflowClient(tracking)
    assert str(promotion.alias_version(client, job.model_name, promotion.CHAMPION).version) == "2"
    # whichever took the lock first was judged against v1 and the other against what it left
    if models["j2"]["gate"].startswith("champion: val_accuracy 0.95 beats the champion's 0.6"):  # j2 first
        assert models["j3"]["gate"].startswith("candidate: val_accuracy 0.7 does not beat the champion's 0.95")
        assert str(promotion.alias_version(client, job.model_name, promotion.CANDIDATE).version) == "3"
    else:  # j3 first: champion for a moment, until j2 beat it
        assert models["j3"]["gate"].startswith("champion: val_accuracy 0.7 beats the champion's 0.6")
        assert models["j2"]["gate"].startswith("champion: val_accuracy 0.95 beats the champion's 0.7")


def test_a_rerun_finishes_the_gate_an_earlier_run_never_reached(tracking, tmp_path, monkeypatch):
    job, model, x = trained()
    _versions_without_their_gate(monkeypatch, tmp_path, job, model, x, {"j1": 0.9})
    client = mlflow.MlflowClient(tracking)
    assert promotion.alias_version(client, job.model_name, promotion.CHAMPION) is None  # ungated
    finished = registry.finish_gate(job, "j1")
    assert finished["version"] == 1 and finished["aliases"] == ["champion"]
    assert finished["gate"] == "champion: no champion yet"
    assert registry.finish_gate(job, "j1") == finished  # gated once
    assert registry.finish_gate(job, "never-registered") is None
    # what a job ended inside its registration reports: its aliases too (a search's version has none)
    assert registry.registered(job.model_name, "j1") == finished


def test_a_rejection_waits_for_a_gate_in_progress(tracking, tmp_path):
    # landing between a job's gate reading the version and moving champion to it, it went unseen
    from trainyard import registry_admin
    from trainyard.home import flocked
    from trainyard.registry import gate_lock

    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    with flocked(gate_lock("reg-test"), wait_seconds=0):  # a job's gate of the model runs
        rejecting = threading.Thread(target=registry_admin.set_approval, args=("reg-test", "1", "Rejected"))
        rejecting.start()
        time.sleep(1.0)
        client = mlflow.MlflowClient(tracking)
        assert client.get_model_version("reg-test", "1").tags.get("approval_status") != "Rejected"
    rejecting.join(timeout=30)
    assert client.get_model_version("reg-test", "1").tags["approval_status"] == "Rejected"


def test_a_promotion_by_hand_sees_a_rejection_that_landed_while_it_waited_for_the_gate(tracking, tmp_path):
    # `models promote` looked at the version's approval before it waited for the gate's lock: a rejection landing
    # meanwhile (from another machine, or once the job's gate let go) went unseen, and a Rejected version became
    # champion
    from trainyard import registry_admin
    from trainyard.home import flocked
    from trainyard.registry import gate_lock

    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    register(job, model, x, "b", 0.70, tmp_path)  # candidate: below the champion
    client = mlflow.MlflowClient(tracking)
    outcome: dict = {}

    def promoting() -> None:
        try:
            outcome["info"] = registry_admin.promote("reg-test", "candidate")
        except registry_admin.VersionRejected as exc:
            outcome["refused"] = str(exc)

    with flocked(gate_lock("reg-test"), wait_seconds=0):  # a job's gate of the model runs
        waiting = threading.Thread(target=promoting)
        waiting.start()
        time.sleep(1.0)  # the promotion has found version 2 and waits for the lock
        client.set_model_version_tag("reg-test", "2", "approval_status", "Rejected")
    waiting.join(timeout=30)
    assert outcome == {"refused": "reg-test version 2 is Rejected; approve it first, or use --force"}
    assert str(client.get_model_version_by_alias("reg-test", "champion").version) == "1"
    forced = registry_admin.promote("reg-test", "2", force=True)  # the person's choice, said so
    champion = client.get_model_version_by_alias("reg-test", "champion")
    assert str(forced["version"]) == "2" and str(champion.version) == "2"


def test_two_first_registrations_of_a_model_name_at_once_both_register(tracking, monkeypatch):
    # each job looked before the other created the experiment and the registered model: one create fails
    client = mlflow.MlflowClient(tracking)
    experiment = client.create_experiment("race")
    client.create_registered_model("race")
    looks = {"experiment": 0}
    real_look = mlflow.MlflowClient.get_experiment_by_name

    def look(self, name):
        looks["experiment"] += 1
        return None if looks["experiment"] == 1 else real_look(self, name)  # the first look: not there yet

    missing = MlflowException("no such model", error_code=RESOURCE_DOES_NOT_EXIST)
    monkeypatch.setattr(mlflow.MlflowClient, "get_experiment_by_name", look)
    monkeypatch.setattr(mlflow.MlflowClient, "get_registered_model", lambda *a: (_ for _ in ()).throw(missing))
    assert registry._experiment(client, "race", tracking) == experiment  # "already exists": the other's
    assert registry._ensure_registered(client, "race") == "race"


def test_a_long_model_card_fits_mlflows_description_column():
    card = "# model\n\n" + "| tag | value |\n" * 200 + "\n## Job spec\n\n```json\n" + "{}\n" * 2000 + "```\n"
    cut = model_card.description(card)
    assert len(cut) <= model_card.DESCRIPTION_MAX and "## Job spec" not in cut and "model_card.md" in cut
    assert model_card.description("# small card\n") == "# small card\n"


def test_a_tracking_uri_whose_database_driver_is_missing_is_named_not_a_traceback():
    error = translate(ModuleNotFoundError("No module named 'psycopg2'", name="psycopg2"), "registering 'm'", "x")
    assert "needs the Python package 'psycopg2', which is not installed" in str(error)


def test_the_code_version_is_trainyards_own_not_an_enclosing_projects(tmp_path):
    # an installed copy of trainyard inside another project's git checkout (its .venv)
    project = tmp_path / "project"
    site = project / ".venv" / "site"
    site.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(
        ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty"]
        + ["-m", "x"],
        check=True,
    )
    theirs = subprocess.run(["git", "-C", str(project), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    import shutil

    import trainyard

    shutil.copytree(trainyard.__path__[0], site / "trainyard")
    code = "from trainyard import model_card; print(model_card.code_version())"
    found = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site)},
        cwd=tmp_path,  # not this checkout's folder, which python -c would put first on the path
        check=True,
    ).stdout.strip()
    assert theirs.strip() not in found and not found.startswith("git:")


def test_a_create_the_client_retried_leaves_the_job_one_version(tracking, tmp_path, monkeypatch):
    # the server made the version, a proxy answered 504, MLflow's client posted again: a second version
    create = mlflow.MlflowClient.create_model_version

    def twice(self, *args, **kwargs):
        create(self, *args, **kwargs)
        return create(self, *args, **kwargs)

    job, model, x = trained()
    monkeypatch.setattr(mlflow.MlflowClient, "create_model_version", twice)
    info = register(job, model, x, "j1", 0.9, tmp_path)
    client = mlflow.MlflowClient(tracking)
    assert [int(v.version) for v in client.search_model_versions(f"name='{job.model_name}'")] == [1]
    assert info["version"] == 1 and info["aliases"] == ["champion"]


def test_a_rerun_deletes_the_extra_version_a_run_left_when_it_died_before_its_clean_up(tracking, tmp_path, monkeypatch):
    create = mlflow.MlflowClient.create_model_version
    job, model, x = trained()
    with monkeypatch.context() as m:  # a retried create, then the run died before deleting the extra or gating
        m.setattr(
            mlflow.MlflowClient,
            "create_model_version",
            lambda self, *a, **k: (create(self, *a, **k), create(self, *a, **k))[1],
        )
        m.setattr(
            registry,
            "_one_version_of_job",
            lambda client, name, job_id, *_: registry._version_of_job(client, name, job_id),
        )
        m.setattr(promotion, "gate", lambda *a, **k: None)
        register(job, model, x, "j1", 0.9, tmp_path)
    client = mlflow.MlflowClient(tracking)
    assert sorted(int(v.version) for v in client.search_model_versions(f"name='{job.model_name}'")) == [1, 2]
    finished = registry.finish_gate(job, "j1")
    assert [int(v.version) for v in client.search_model_versions(f"name='{job.model_name}'")] == [1]
    assert finished["version"] == 1 and finished["aliases"] == ["champion"]


def test_a_model_name_as_long_as_names_go_has_a_gate_lock_of_its_own(tmp_path, monkeypatch):
    # a 236-255 character name made a lock file name over the file system's 255 bytes: every gate of the
    # model, the job's and `trainyard models gate/promote/reject`, failed as "MLflow unavailable"
    from trainyard.home import flocked
    from trainyard.registry import gate_lock

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))
    longest, sibling = "m" * 255, "m" * 254 + "n"
    with flocked(gate_lock(longest), wait_seconds=0), flocked(gate_lock(sibling), wait_seconds=0):
        assert gate_lock(longest) != gate_lock(sibling)  # two names alike for 200 characters lock apart
    assert gate_lock("reg-test").name == "trainyard-gate-reg-test.lock"  # (short names as before)


def test_a_rerun_keeps_the_run_of_its_version_under_a_name_it_no_longer_has(tracking, tmp_path):
    # the model renamed in MLflow's UI: the rerun found no version of the job under its name and deleted the
    # earlier run, the renamed version's lineage, as one that never became a version
    job, model, x = trained()
    first = register(job, model, x, "j1", 0.80, tmp_path)
    client = mlflow.MlflowClient(tracking)
    client.rename_registered_model(job.model_name, "renamed")
    again = register(job, model, x, "j1", 0.80, tmp_path)
    assert client.get_model_version("renamed", "1").run_id == first["run_id"] != again["run_id"]
    assert client.get_run(first["run_id"]).info.lifecycle_stage == "active"


def test_a_gate_between_versions_validated_on_different_data_says_so(tracking, tmp_path):
    # a refreshed validation channel: the metrics are compared as recorded, and the decision says they are of
    # different data (it read as a like-for-like comparison)
    job, model, x = trained()
    for job_id, accuracy, digest in (
        ("v1", 0.80, "sha256:aaaa"),
        ("v2", 0.90, "sha256:bbbb"),
        ("v3", 0.95, "sha256:bbbb"),
    ):
        registered = register(job, model, x, job_id, accuracy, tmp_path, {"data.validation.manifest_digest": digest})
        if job_id == "v2":
            assert registered["gate"].endswith(
                "; note: the champion was validated on other data (manifest sha256:aaaa, this version's sha256:bbbb)"
            )
    assert "other data" not in registered["gate"]  # v3 against v2: the same validation data
