"""The registry's champion as the prefilter's reference model: loaded from the store it was registered in,
never unpickled, and a missing one a fallback, not a failure."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.models import register, trained
from trainyard import filtering
from trainyard.champion import load as load_champion
from trainyard.errors import RegistryError
from trainyard.registry_errors import RegistryUnavailable
from trainyard.spec import Prefilter


def test_the_champion_loads_as_the_prefilters_reference(tracking, tmp_path):
    assert load_champion("reg-test") is None  # nothing registered yet
    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    register(job, model, x, "b", 0.90, tmp_path)
    loaded = load_champion("reg-test")
    champion, label = loaded.model, loaded.label
    assert label == "reg-test v2" and loaded.io is None  # registered without the plan's schema
    with torch.no_grad():
        np.testing.assert_allclose(champion(torch.from_numpy(x)).numpy(), model(torch.from_numpy(x)).numpy(), atol=1e-5)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    y[:20] = 1 - y[:20]  # wrong labels: the champion finds them the least learnable
    config = Prefilter(enabled=True, drop_unlearnable_fraction=0.05, reference="champion")
    result = filtering.prefilter(x, y, config, "classification", 2, filtering.Champion(champion, label))
    assert result.reference == "champion reg-test v2"
    assert (~result.keep[:20]).sum() >= 15 and (~result.keep[20:]).sum() <= 5


class Untraceable(torch.nn.Module):
    """A model torch.export cannot trace (a branch on the data): registered pickled."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = torch.nn.Linear(features, 2)

    def forward(self, x):
        return self.linear(x) if float(x.sum()) > 0 else -self.linear(x)


def test_a_pickled_champion_is_not_unpickled_as_the_prefilters_reference(tracking, tmp_path, monkeypatch):
    # Unpickled, a model runs whatever it holds in the pipeline's process, credentials and all: only a
    # pt2 archive free of pickles loads, unless the operator allows pickles.
    job, _, x = trained()
    register(job, Untraceable(x.shape[1]), x, "p", 0.9, tmp_path)
    switches = ("MLFLOW_ALLOW_MODEL_CODE_EXECUTION", "MLFLOW_ALLOW_PICKLE_DESERIALIZATION")
    for name in switches:
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings():
        # by the switch this MLflow reads: 3.18 warns of the older one, deprecated, at every load
        warnings.simplefilter("error", FutureWarning)
        with pytest.raises(RegistryError, match="pickle") as refused:
            load_champion("reg-test")
    assert "could not be loaded here" in str(refused.value) and not isinstance(refused.value, RegistryUnavailable)
    assert not any(name in os.environ for name in switches)  # as it was
    for name in switches:  # the operator's choice stands, in either switch
        with monkeypatch.context() as operator, warnings.catch_warnings():
            operator.setenv(name, "true")
            warnings.simplefilter("ignore", FutureWarning)  # MLflow's, of the operator's deprecated switch
            loaded = load_champion("reg-test")
        assert isinstance(loaded.model, Untraceable) and loaded.label == "reg-test v1"


def test_the_champion_loads_from_the_embedded_store_in_a_process_that_did_not_register_it(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    from pathlib import Path

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the embedded default, under TRAINYARD_HOME
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    # A new process (the filtering task's, before any registration): MLflow's process-wide store is its
    # default there, ./mlflow.db, not ours.
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    code = "from trainyard.champion import load; print(load('reg-test').label)"
    root = Path(__file__).parents[2]
    env["PYTHONPATH"] = str(root)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "reg-test v1", done.stderr[-2000:]
    assert not (tmp_path / "mlflow.db").exists()  # nothing was looked for in the working directory


def test_the_filtering_task_falls_back_when_there_is_no_champion_to_load(tracking, monkeypatch):
    from tasks.filtering import _champion

    job, _, _ = trained()
    assert _champion(job) == filtering.Champion(None, "'reg-test' has no champion yet")
    # A registry that cannot be reached is not fatal to the prefilter either: it says so and falls back.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    down = _champion(job)
    assert down.model is None and down.label.startswith("the registry could not be read")


def test_a_champion_this_torch_cannot_load_is_a_fallback_not_a_crash(tracking, tmp_path, monkeypatch):
    # A damaged archive, or one a different torch saved: torch's own error, not MLflow's. The prefilter
    # falls back to its own reference models and says why, as for a missing champion.
    import mlflow

    from tasks.filtering import _champion

    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    uri = mlflow.MlflowClient(tracking).get_model_version_download_uri("reg-test", "1")
    archives = list(Path(uri.removeprefix("file://")).rglob("*.pt2"))
    assert archives, uri
    for archive in archives:
        archive.write_bytes(b"not a pt2 archive")
    with pytest.raises(RegistryError, match=r"the champion reg-test v1 could not be loaded here"):
        load_champion("reg-test")  # MLflow's pickle check refuses what it cannot read
    fallback = _champion(job)
    assert fallback.model is None and "could not be loaded here" in fallback.label
    # with pickles allowed (the operator's choice), torch itself reads the archive, and fails: the same fallback
    monkeypatch.setenv("MLFLOW_ALLOW_MODEL_CODE_EXECUTION", "true")
    with pytest.raises(RegistryError, match=r"could not be loaded here \((?!MlflowException)"):
        load_champion("reg-test")
    assert "could not be loaded here" in _champion(job).label


def test_a_rejected_champion_is_not_the_prefilters_reference(tracking, tmp_path):
    from trainyard import registry_admin
    from trainyard.champion import ChampionUnloadable

    job, model, x = trained()
    register(job, model, x, "a", 0.80, tmp_path)
    registry_admin.set_approval("reg-test", "1", "Rejected")  # a person judged it unfit: its losses too
    with pytest.raises(ChampionUnloadable, match="the champion reg-test v1 is Rejected; not used as a reference"):
        load_champion("reg-test")


def test_a_champion_of_other_columns_or_classes_is_not_the_reference_even_where_its_shapes_fit(tracking, tmp_path):
    # The same count of columns in another order (a new export of the table), or of classes under other names,
    # passes the outputs' shape check: each row would be scored by the wrong features, or against the wrong class.
    from trainyard import registry
    from trainyard.datasets import StagedData
    from trainyard.spec import Sifting

    job, model, x = trained()
    logged = {"features": ["a", "b", "c"], "label": "y", "task": "classification", "classes": ["no", "yes"]}
    history = [{"epoch": 1, "train_loss": 0.5, "val_accuracy": 0.9}]
    registry.register(model, job, "a", x[:5], history, {}, {}, {}, schema=logged)
    loaded = load_champion("reg-test")
    assert loaded.io is not None and loaded.io["features"] == ["a", "b", "c"]
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    sifting = Sifting(prefilter=Prefilter(enabled=True, drop_unlearnable_fraction=0.05, reference="champion"))

    def reference(**schema) -> str:
        staged = StagedData(str(tmp_path / "train.npz"), None, logged | schema | {"num_outputs": 2}, {"train": 400})
        return filtering.filter_samples(staged, sifting, "classification", loaded).reference

    assert reference() == "champion reg-test v1"
    reordered = reference(features=["b", "a", "c"])
    assert reordered.startswith(filtering.HOLDOUT)
    assert "the champion reg-test v1 takes other features (a, b, c; this data's: b, a, c)" in reordered
    renamed = reference(classes=["no", "maybe"])
    assert "the champion reg-test v1 takes other classes (no, yes; this data's: no, maybe)" in renamed


def test_a_champion_giving_probabilities_is_scored_by_their_log():
    # a champion ending in Softmax (an entrypoint's model, say): cross-entropy read probabilities as logits, every
    # row's loss near ln(classes), and RHO-LOSS's reducible loss subtracted that from each row's training loss
    x = np.random.default_rng(0).normal(size=(300, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    logits = torch.nn.Linear(3, 2)
    with torch.no_grad():
        logits.weight.copy_(torch.tensor([[-3.0, 0, 0], [3.0, 0, 0]]))
        logits.bias.zero_()
    config = Prefilter(enabled=True, drop_learnt_fraction=0.3, reference="champion")

    def scored(model, label):
        return filtering.prefilter(
            x, y, config, "classification", 2, filtering.Champion(model, label), with_losses=True
        )

    by_logits = scored(logits, "m v1")
    by_probabilities = scored(torch.nn.Sequential(logits, torch.nn.Softmax(dim=1)), "m v2")
    assert (by_probabilities.keep == by_logits.keep).all()
    np.testing.assert_allclose(by_probabilities.losses, by_logits.losses, rtol=1e-4, atol=1e-6)
