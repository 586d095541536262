"""The sifting benchmark's datasets (``benchmarks/sifting.py``).

Two datasets, each drawn afresh per seed (a different split or draw, and a different model seed):

- ``tabular``: synthetic, with the redundancy and label noise of logged business data. A base of
  unique rows from ``make_classification`` (4 classes, 3 clusters each, 8 informative, 8 redundant
  and 8 noise features); to it, near-duplicates (other rows with a little jitter: the same entity
  logged twice), exact duplicates, and dense clusters of easy points (many rows around a few base
  rows far from any class boundary). 10% of the training labels are flipped to another class.
  Validation rows are fresh draws from the base distribution with their true labels.
- ``digits``: scikit-learn's bundled digits (1,797 8x8 images, 10 classes), a stratified 70/30
  split, unmodified.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np

SYNTH_CLASSES = 4


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int
    noisy: np.ndarray | None = None  # True for training rows whose label was flipped
    batch_size: int = 128
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])
    epochs: int = 12  # the baseline's run: about where its accuracy stops improving

    def fingerprint(self) -> str:
        """The first 12 hex digits of a sha256 of the training rows and labels: whether two runs drew the same."""
        digest = hashlib.sha256(self.x_train.tobytes())
        digest.update(self.y_train.tobytes())
        return digest.hexdigest()[:12]


def tabular(
    seed: int, unique_rows: int = 4000, val_rows: int = 2000, noise: float = 0.1, class_sep: float = 1.5
) -> Dataset:
    """The synthetic dataset: ``unique_rows`` base rows, padded to twice as many with redundancy."""
    from sklearn.datasets import make_classification

    rng = np.random.default_rng(seed)
    x, y = make_classification(
        n_samples=unique_rows + val_rows,
        n_features=24,
        n_informative=8,
        n_redundant=8,
        n_classes=SYNTH_CLASSES,
        n_clusters_per_class=3,
        class_sep=class_sep,
        flip_y=0.0,
        random_state=seed,
    )
    x = x.astype(np.float32)
    x_val, y_val, x, y = x[:val_rows], y[:val_rows], x[val_rows:], y[val_rows:]
    scale = x.std(axis=0)
    near = rng.integers(0, len(x), unique_rows // 2)  # 25% of the final rows
    exact = rng.integers(0, len(x), unique_rows // 10)  # 5%
    # Easy clusters: the rows a quick linear model is surest of (far from every boundary), each repeated
    # with small jitter: 20% of the final rows around 30 such anchors.
    margin = _linear_margin(x, y)
    anchors = rng.choice(np.argsort(-margin)[: len(x) // 10], 30, replace=False)
    easy = rng.choice(anchors, 2 * unique_rows // 5)
    parts_x = [
        x,
        x[near] + rng.normal(0, 0.02, (len(near), x.shape[1])).astype(np.float32) * scale,
        x[exact],
        x[easy] + rng.normal(0, 0.05, (len(easy), x.shape[1])).astype(np.float32) * scale,
    ]
    x_train = np.concatenate(parts_x).astype(np.float32)
    y_train = np.concatenate([y, y[near], y[exact], y[easy]]).astype(np.int64)
    noisy = rng.random(len(y_train)) < noise
    y_train[noisy] = (y_train[noisy] + rng.integers(1, SYNTH_CLASSES, noisy.sum())) % SYNTH_CLASSES
    order = rng.permutation(len(x_train))
    return Dataset(
        "tabular",
        x_train[order],
        y_train[order],
        x_val,
        y_val.astype(np.int64),
        SYNTH_CLASSES,
        noisy=noisy[order],
    )


def digits(seed: int) -> Dataset:
    """scikit-learn's digits, a stratified 70/30 split drawn by ``seed``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x, y = bunch.data.astype(np.float32), bunch.target.astype(np.int64)
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.3, stratify=y, random_state=seed)
    return Dataset("digits", x_train, y_train, x_val, y_val, 10, batch_size=64, epochs=8)


def _linear_margin(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """How far each row is inside its class, by a least-squares one-vs-rest linear model."""
    design = np.c_[x, np.ones(len(x))]
    targets = np.eye(int(y.max()) + 1)[y]
    scores = design @ np.linalg.lstsq(design, targets, rcond=None)[0]
    own = scores[np.arange(len(y)), y]
    scores[np.arange(len(y)), y] = -np.inf
    return own - scores.max(axis=1)


@functools.cache
def load(name: str, seed: int, quick: bool = False) -> Dataset:
    """A dataset by name, drawn by ``seed`` (``quick``: a smaller tabular set)."""
    if name == "digits":
        return digits(seed)
    return tabular(seed, unique_rows=1500, val_rows=1000) if quick else tabular(seed)
