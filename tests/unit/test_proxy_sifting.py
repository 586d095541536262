"""Selection via proxy (``sifting.score: proxy``, ``training/proxy.py``) and the keep rule's ``selection: top``:
the proxy ranks the candidates in place of the job's model, learns the rows each step trains on, is counted
as scoring and travels with a heal; ``top`` keeps exactly the highest-scored."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

from tests.conftest import rejoined, slow_until
from tests.unit.jobs import make_job, run
from tests.unit.specs import minimal
from trainyard.sifting import Sifter
from trainyard.spec import Sifting, ignored_settings, parse_job
from trainyard.spec.pruning import PRUNING_OFF


def top_sifter(**settings) -> Sifter:
    config = Sifting(enabled=True, beta=2.0, selection="top", prune=PRUNING_OFF, **settings)
    return Sifter(config, seed=0)


def test_top_selection_keeps_exactly_the_highest_scores_a_nan_first():
    sifter = top_sifter(min_class_fraction=0.0)
    losses = np.array([0.1, 5.0, 0.3, np.nan, 2.0, 0.2, 4.0, 0.0, 1.0])
    assert sorted(sifter.select(losses, None, 3, step=0, group=0)) == [1, 3, 6]
    # the same scores again: the same rows, whatever the history now says (no draw)
    assert sorted(sifter.select(losses, None, 3, step=1, group=0)) == [1, 3, 6]
    assert (sifter.scored, sifter.kept, sifter.passed_over) == (18, 6, 12)


def test_top_selection_still_guards_a_class_from_starving():
    sifter = top_sifter(min_class_fraction=0.5)
    losses = np.array([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    labels = np.array([0] * 6 + [1] * 6)
    chosen = sifter.select(losses, labels, 4, step=0, group=0)
    # class 1 holds half the candidates: at least half its share of 4 (1 row), its highest-scored
    assert list(chosen) == [0, 1, 2, 11]


def proxy_step_data(tmp_path, **sifting):
    """StepData over 512 rows whose label is whether the first feature is positive."""
    from trainyard import algorithms
    from trainyard.training.batches import StepData
    from trainyard.training.flops import FlopMeter
    from trainyard.training.plan import TrainingPlan

    proxy_top = {"enabled": True, "beta": 2.0, "delay_steps": 0, "score": "proxy", "selection": "top"}
    job = parse_job(minimal(hyperparameters={"batch_size": 32, "hidden_sizes": [4]}, sifting=proxy_top | sifting))
    x = np.random.default_rng(0).normal(size=(512, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    plan = TrainingPlan("j", job.model_dump(mode="json"), str(tmp_path / "train.npz"), None, {"num_outputs": 2}, 1, "")
    model, loss_fn = algorithms.build(job.algorithm, job.hyperparameters, x, y, 2)
    data = StepData(job, plan, torch.from_numpy(x), torch.from_numpy(y), tmp_path, loss_fn, FlopMeter(model, loss_fn))
    return data, x


def test_the_proxy_ranks_in_place_of_the_jobs_model_and_learns_what_it_trains_on(tmp_path):
    data, x = proxy_step_data(tmp_path, min_class_fraction=0.0)
    assert data.memory is None  # its losses are fresh every step: none remembered (reuse_loss_epochs 0)
    every_row = torch.from_numpy(x), torch.from_numpy((x[:, 0] > 0).astype(np.int64))
    first_loss = data.proxy.losses(*every_row).mean()
    spent_by_the_test = data.proxy.flops
    ranked, losses, score = [], data.proxy.losses, data.proxy.score
    data.proxy.score = lambda xs, ys: ranked.append((xs, *score(xs, ys))) or ranked[-1][1:]
    for epoch in range(6):  # 96 candidates a step, 32 kept: 5 steps an epoch (the short 6th left out)
        for index in range(5):
            # the job's model is never asked to score: with the proxy it is not passed at all
            xb, _, count = data.batch(None, epoch, index, 5 * epoch + index, 1, 0, 1)
            data.committed()
            candidates, scores, _ = ranked[-1]
            assert len(candidates) == 96 and len(xb) == count == 32
            top = candidates[np.argsort(-scores, kind="stable")[:32]]  # (no ties among these losses)
            assert sorted(map(tuple, xb.tolist())) == sorted(map(tuple, top.tolist()))
    # what the proxy cost is the sifter's scoring: its forwards over 96 candidates and its backward passes over the
    # 32 it learnt from (their forward was the scoring's)
    assert data.meter.scoring == data.proxy.flops - spent_by_the_test > 0
    assert data.proxy.meter.forward == 0 and data.proxy.meter.backward > 0
    # of it, the proxy's training is told apart (the summary's flops_scoring_proxy_training): its backward passes
    assert data.meter.proxy_training == data.proxy.meter.backward
    assert data.meter.forward == data.meter.backward == 0  # (the job's own steps are the trainer's to count)
    # it learnt from the rows it was handed (the hardest third each step)
    assert losses(*every_row).mean() < 0.7 * first_loss
    # the kept fraction is reported; candidate_loss is not: the losses ranked by are the proxy's, no loss of the
    # job's model (it read beside train_loss, as if it were)
    metrics = data.epoch_metrics()
    assert metrics["kept_fraction"] == pytest.approx(1 / 3) and "candidate_loss" not in metrics


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
)
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_the_proxys_own_gradients_are_autograds(task, device):
    """The proxy learns from its scoring pass with gradients written out by hand (ProxyScorer._backward)."""
    from trainyard.spec import Proxy
    from trainyard.training.proxy import ProxyScorer

    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, size=(40, 5)).astype(np.float32)
    y = (x[:, 0] > 3).astype(np.int64) if task == "classification" else (10 * x[:, 1] + 4).astype(np.float32)
    proxy = ProxyScorer(Proxy(hidden_sizes=[6, 4]), task, 0, x, y, 2 if task == "classification" else 1, device)
    xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    rows = torch.tensor([0, 3, 4, 9, 17, 30], device=device)
    proxy.model.zero_grad()
    proxy.loss_fn(proxy.model(xt[rows]), yt[rows]).mean().backward()
    expected = {name: p.grad.clone() for name, p in proxy.model.named_parameters()}
    _, done = proxy.score(xt, yt)
    proxy._backward(done.of(rows))
    assert len(expected) == (6 if task == "classification" else 2)
    for name, p in proxy.model.named_parameters():
        assert torch.allclose(p.grad, expected[name], rtol=1e-5, atol=1e-6), name


def test_a_scoring_pass_from_before_a_heal_is_run_again_before_the_proxy_learns_from_it(tmp_path):
    data, x = proxy_step_data(tmp_path)
    peer, _ = proxy_step_data(tmp_path)
    for step in range(5):
        peer.batch(None, 0, step, step, 1, 0, 1)
        peer.committed()
    xb, yb, _ = data.batch(None, 0, 0, 0, 1, 0, 1)  # scored with the fresh proxy's weights...
    data.load_state_dict(peer.state_dict(5))  # ...which a heal then replaced before the step committed
    learnt = copy.deepcopy(data.proxy)
    learnt.train(xb, yb)  # what learning these rows from the weights it has now gives
    data.committed()
    for mine, theirs in zip(data.proxy.model.parameters(), learnt.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_group_that_heals_takes_its_peers_proxy(tmp_path):
    data, x = proxy_step_data(tmp_path)
    for step in range(10):
        data.batch(None, step // 5, step % 5, step, 1, 0, 1)
        data.committed()
    healed, _ = proxy_step_data(tmp_path)
    probe = torch.from_numpy(x[:64]), torch.zeros(64, dtype=torch.int64)
    assert not np.array_equal(healed.proxy.losses(*probe), data.proxy.losses(*probe))
    # as torchft's transport carries it: saved, and loaded with weights_only
    sent = io.BytesIO()
    torch.save(data.state_dict(10), sent)
    sent.seek(0)
    healed.load_state_dict(torch.load(sent, weights_only=True))
    assert np.array_equal(healed.proxy.losses(*probe), data.proxy.losses(*probe))
    # and it goes on as its peer does: the same next batch, the same proxy after it
    ours, theirs = data.batch(None, 2, 0, 10, 1, 0, 1), healed.batch(None, 2, 0, 10, 1, 0, 1)
    data.committed()
    healed.committed()
    assert torch.equal(ours[0], theirs[0])
    assert np.array_equal(healed.proxy.losses(*probe), data.proxy.losses(*probe))


def test_a_redone_step_picks_as_its_first_try_did_and_the_proxy_learns_it_once(tmp_path):
    """torchft redoes a step that did not commit: the proxy must not have learnt its first try's rows."""
    data, _ = proxy_step_data(tmp_path)
    for step in range(4):
        data.batch(None, 0, step, step, 1, 0, 1)
        data.committed()
    before = copy.deepcopy(data.proxy.model.state_dict())
    first_try = data.batch(None, 0, 4, 4, 1, 0, 1)  # ...and the step does not commit
    redo = data.batch(None, 0, 4, 4, 1, 0, 1)
    assert torch.equal(first_try[0], redo[0])
    assert all(torch.equal(before[k], v) for k, v in data.proxy.model.state_dict().items())
    data.committed()  # the redo commits: now it has learnt them, once
    assert not all(torch.equal(before[k], v) for k, v in data.proxy.model.state_dict().items())


def test_proxy_settings_with_the_keep_rule_off_are_named_and_the_proxy_reuses_no_losses():
    base = minimal()
    job = parse_job(base | {"sifting": {"enabled": True, "score": "proxy", "proxy": {"hidden_sizes": [16]}}})
    (warning,) = [w for w in ignored_settings(job) if "keep rule" in w]
    assert "sifting.proxy, sifting.score:" in warning and "set sifting.beta above 0" in warning
    job = parse_job(base | {"sifting": {"enabled": True, "beta": 2, "score": "proxy", "reuse_loss_epochs": 2}})
    assert job.sifting.loss_reuse_epochs(streamed=False) == 0
    assert ignored_settings(job) == ["sifting.reuse_loss_epochs: the proxy scores every candidate afresh (score proxy)"]
    job = parse_job(base | {"sifting": {"enabled": True, "beta": 2, "proxy": {"learning_rate": 0.1}}})
    assert ignored_settings(job) == ["sifting.proxy: the proxy model of sifting.score proxy; the score is loss"]
    # a spec dumped whole (the UI's form sends every field) gives the proxy's defaults: nothing to warn of
    job = parse_job(base | {"sifting": {"enabled": True, "beta": 2}})
    assert ignored_settings(parse_job(job.model_dump(mode="json"))) == []
    regression = base | {"algorithm": {"builtin": "linear-regression"}}
    job = parse_job(
        regression | {"sifting": {"enabled": True, "beta": 2, "score": "proxy", "proxy": {"hidden_sizes": [8]}}}
    )
    assert [w.split(":")[0] for w in ignored_settings(job)] == ["sifting.proxy.hidden_sizes", "sifting.score"]
    with pytest.raises(Exception, match="hidden_sizes"):
        parse_job(base | {"sifting": {"enabled": True, "beta": 2, "score": "proxy", "proxy": {"hidden_sizes": [0]}}})


def test_a_job_sifted_by_a_proxy_trains_full_batches_and_heals_a_killed_group_with_it(trainyard_home, tmp_path):
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 40, "batch_size": 64, "learning_rate": 0.01, "step_sleep": 0.15}
        | {"slow_while": str(tmp_path / "slow")},
        sifting={"enabled": True, "beta": 2.0, "delay_steps": 5, "score": "proxy", "selection": "top"},
        elastic={"fault_injection": [{"replica": 1, "at_step": 30, "kind": "kill"}]},
    )
    # slow steps until the restarted group is back (see test_training's sifting test), then full speed: one forward
    # of the job's model a step (the proxy scores), so 100 ms, and the 130 steps after the kill give the restart 13 s
    with slow_until(tmp_path / "slow", lambda: rejoined(folder / "replicas/1/attempt-1")):
        outcome, _ = run(job, job_id, folder, plan)
    assert outcome.stop_reason == "Completed"
    assert outcome.steps_per_epoch == 4  # 192 candidates a step over 600 rows: 3 and a short 4th of 24
    assert outcome.sifting["score"] == "proxy" and outcome.sifting["kept_fraction"] == pytest.approx(1 / 3, abs=0.02)
    assert outcome.flops["scoring"] > 0  # the proxy's passes and training (an entrypoint's job: the proxy is built in)
    (recovery,) = outcome.recoveries
    assert (
        recovery["source"] == "peer"
    )  # (the proxy's part of that state: test_a_group_that_heals_takes_its_peers_proxy)
    states = [torch.load(folder / f"replicas/{r}/attempt-{a}/model.pt", weights_only=True) for r, a in ((0, 0), (1, 1))]
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)
