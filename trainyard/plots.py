"""PNG plots of a job, for MLflow and Prefect artifacts."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on workers
import matplotlib.pyplot as plt  # noqa: E402


def plot_history(history: list[dict], path: Path, title: str) -> Path:
    """Loss and validation metrics per epoch, and the kept fraction when sifting was on."""
    sifted = any("kept_fraction" in h for h in history)
    fig, axes = plt.subplots(1, 3 if sifted else 2, figsize=(15 if sifted else 10, 4))
    loss_ax, metric_ax = axes[0], axes[1]
    epochs = [h["epoch"] for h in history]
    for key in ("train_loss", "val_loss"):
        if any(key in h for h in history):
            loss_ax.plot(epochs, [h.get(key) for h in history], marker="o", label=key)
    loss_ax.set(xlabel="epoch", ylabel="loss", title="loss")
    loss_ax.legend()
    for key in ("val_accuracy", "val_rmse"):
        if any(key in h for h in history):
            metric_ax.plot(epochs, [h.get(key) for h in history], marker="o", label=key)
            metric_ax.set(xlabel="epoch", ylabel=key, title=key)
            metric_ax.legend()
    if sifted:
        axes[2].plot(epochs, [h.get("kept_fraction") for h in history], marker="o", color="tab:green")
        axes[2].set(xlabel="epoch", ylabel="kept fraction", title="sifting: kept fraction", ylim=(0, 1.05))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
