"""PNG plots of a job, for MLflow and Prefect artifacts."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on workers
import matplotlib.pyplot as plt  # noqa: E402


def plot_history(history: list[dict], path: Path, title: str, restored_epoch: int | None = None) -> Path:
    """Loss and validation metrics per epoch, and the kept fraction when sifting was on, as a PNG; a line
    marks ``restored_epoch``, the epoch whose parameters the model holds where not the last."""
    fig = history_figure(history, title, restored_epoch)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def history_figure(history: list[dict], title: str, restored_epoch: int | None = None) -> plt.Figure:
    """The figure ``plot_history`` saves: loss, the validation metric and, when sifting was on, its
    kept fraction, one panel each."""
    sifted = any("kept_fraction" in h for h in history)
    fig, axes = plt.subplots(1, 3 if sifted else 2, figsize=(15 if sifted else 10, 4))
    loss_ax, metric_ax = axes[0], axes[1]
    epochs = [h["epoch"] for h in history]
    # with sifting, train_loss is over the kept (harder) rows; candidate_loss over all the rows drawn
    for key in ("train_loss", "candidate_loss", "val_loss"):
        if shown := [h for h in history if key in h]:  # (validation: not every epoch with validate_every_epochs)
            loss_ax.plot([h["epoch"] for h in shown], [h[key] for h in shown], marker="o", label=key)
    loss_ax.set(xlabel="epoch", ylabel="loss", title="loss")
    loss_ax.legend()
    for key in ("val_accuracy", "val_rmse"):
        if shown := [h for h in history if key in h]:
            metric_ax.plot([h["epoch"] for h in shown], [h[key] for h in shown], marker="o", label=key)
            metric_ax.set(xlabel="epoch", ylabel=key, title=key)
            metric_ax.legend()
    if restored_epoch is not None:
        for ax in (loss_ax, metric_ax):
            ax.axvline(restored_epoch, color="grey", linestyle=":", label=f"model: epoch {restored_epoch} (best)")
            ax.legend()
    if sifted:
        _plot_kept_fraction(axes[2], epochs, history)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _plot_kept_fraction(ax, epochs: list[int], history: list[dict]) -> None:
    """Sifting's kept fraction per epoch, overall and per class (of the candidates the keep rule ranked;
    a gap where sifting had not started). The overall fraction is ``1 / (1 + beta)`` by construction
    (full batches); the dashed line is what the keep rule alone would have kept (the mean keep
    probability), which falls while the losses fall faster than the history it ranks them against;
    the classes' show which ones the sifter found informative as training went on. With
    ``sifting.prune``, the dotted line is the share of the rows dealt that trained once pruned, and with
    pruning alone the classes' lines are their own such shares."""
    if any(h.get("kept_fraction") is not None for h in history):  # none with pruning alone: nothing ranked
        ax.plot(epochs, [h.get("kept_fraction") for h in history], marker="o", color="black", label="all")
    if any(h.get("mean_keep_probability") is not None for h in history):
        rule = [h.get("mean_keep_probability") for h in history]
        ax.plot(epochs, rule, linestyle="--", color="grey", label="keep rule alone")
    if any("pruned_fraction" in h for h in history):  # sifting.prune: the share of the rows dealt that trained
        trained = [1 - h["pruned_fraction"] if "pruned_fraction" in h else None for h in history]
        ax.plot(epochs, trained, linestyle=":", marker="x", color="tab:red", label="trained after pruning")
    # per class: the keep rule's kept fraction; with pruning alone (beta 0: nothing ranked), the share of
    # each class's rows that trained once pruned, which shows a class sitting out
    by_class = "kept_fraction_by_class"
    if not any(h.get(by_class) for h in history):
        by_class = "trained_fraction_by_class"
    classes = sorted({c for h in history for c in h.get(by_class, {})})
    for cls in classes:
        fractions = [h.get(by_class, {}).get(cls) for h in history]
        ax.plot(epochs, fractions, marker=".", linewidth=1, label=f"class {cls}")
    ax.set(xlabel="epoch", ylabel="kept fraction", title="sifting: kept fraction", ylim=(0, 1.05))
    if len(classes) <= 12:  # a legend of more would hide the plot
        ax.legend(fontsize="small")
