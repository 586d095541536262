"""The training curves' PNG: what each panel plots."""

from __future__ import annotations

import matplotlib.pyplot as plt
from PIL import Image

from trainyard import plots

HISTORY = [
    {"epoch": 1, "train_loss": 0.9, "val_loss": 0.8, "val_accuracy": 0.6, "kept_fraction": None},
    {
        "epoch": 2,
        "train_loss": 0.5,
        "candidate_loss": 0.35,
        "val_loss": 0.5,
        "val_accuracy": 0.8,
        "kept_fraction": 0.5,
        "mean_keep_probability": 0.42,
        "kept_fraction_by_class": {"0": 0.3, "1": 0.7},
    },
    {
        "epoch": 3,
        "train_loss": 0.4,
        "candidate_loss": 0.3,
        "val_loss": 0.45,
        "val_accuracy": 0.85,
        "kept_fraction": 0.5,
        "mean_keep_probability": 0.47,
        "kept_fraction_by_class": {"0": 0.2, "1": 0.8},
    },
]


def lines(ax) -> dict[str, list]:
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


def test_a_sifted_jobs_curves_plot_its_kept_fraction_overall_and_per_class_over_the_epochs():
    fig = plots.history_figure(HISTORY, "job")
    loss, metric, kept = fig.axes
    assert lines(loss)["train_loss"] == [0.9, 0.5, 0.4] and lines(metric)["val_accuracy"] == [0.6, 0.8, 0.85]
    # over all the candidates drawn, once sifting started: the epochs that have it, as one line
    (candidates,) = [line for line in loss.get_lines() if line.get_label() == "candidate_loss"]
    assert list(candidates.get_xdata()) == [2, 3] and list(candidates.get_ydata()) == [0.35, 0.3]
    # epoch 1: sifting had not started (a gap); then the classes' own fractions around the overall one
    assert lines(kept) == {
        "all": [None, 0.5, 0.5],
        "keep rule alone": [None, 0.42, 0.47],  # what the rule would keep without full batches
        "class 0": [None, 0.3, 0.2],
        "class 1": [None, 0.7, 0.8],
    }
    plt.close(fig)


def test_a_job_without_sifting_has_two_panels_and_the_png_is_written(tmp_path):
    plain = [{k: v for k, v in h.items() if not k.startswith("kept")} for h in HISTORY]
    fig = plots.history_figure(plain, "job")
    assert len(fig.axes) == 2
    plt.close(fig)
    path = plots.plot_history(HISTORY, tmp_path / "curves.png", "job")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > image.size[1]


def test_a_pruned_jobs_kept_fraction_panel_shows_the_share_that_trained_after_pruning():
    pruned = [h | {"pruned_fraction": p} for h, p in zip(HISTORY, (0.0, 0.25, 0.5), strict=True)]
    fig = plots.history_figure(pruned, "job")
    assert lines(fig.axes[2])["trained after pruning"] == [1.0, 0.75, 0.5]
    plt.close(fig)
    # pruning alone (nothing ranked by the keep rule): each class's line is the share of its rows that trained
    alone = [
        {k: v for k, v in h.items() if k not in ("kept_fraction_by_class", "mean_keep_probability")}
        | {"kept_fraction": None, "trained_fraction_by_class": {"a": t}}
        for h, t in zip(HISTORY, (1.0, 0.6, 0.9), strict=True)
    ]
    fig = plots.history_figure(alone, "job")
    assert lines(fig.axes[2])["class a"] == [1.0, 0.6, 0.9]
    assert "all" not in lines(fig.axes[2])  # no line (and no legend entry) for a kept fraction never ranked
    plt.close(fig)
