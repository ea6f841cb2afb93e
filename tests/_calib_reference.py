"""The reference toolkit's histogram calibration written out plainly, for tests to compare lq against.

Independent of lq: numpy, float64, one candidate at a time, straight from the
algorithms' definitions (TensorRT's KL calibration, the MSE and percentile
searches of pytorch-quantization's HistogramCalibrator, and its growing grid).
"""

from __future__ import annotations

import numpy as np


class RefHistogram:
    """The reference grid: the first batch's ``|x|`` on ``[0, max]`` in ``num_bins`` bins; a later batch
    reaching past the top appends bins of the same width; bins ``[j w, (j + 1) w)``, the top edge closed.

    ``start`` fixes the starting range instead of the first batch's max (one histogram of everything on
    ``[0, start]`` when ``start`` is the global max).
    """

    def __init__(self, num_bins=2048, start=None, skip_zeros=False):
        self.num_bins, self.skip_zeros = num_bins, skip_zeros
        self.width = None if start is None else float(start) / num_bins
        self.hist = None if start is None else np.zeros(num_bins, dtype=np.int64)

    def collect(self, x):
        a = np.abs(np.asarray(x, dtype=np.float32).ravel()).astype(np.float64)
        a = a[np.isfinite(a)]
        if self.skip_zeros:
            a = a[a != 0]
        if a.size == 0:
            return self
        m = a.max()
        if self.hist is None:
            self.width, self.hist = m / self.num_bins, np.zeros(self.num_bins, dtype=np.int64)
        n = len(self.hist)
        if m > n * self.width:
            n = int(np.ceil(m / self.width))
            self.hist = np.concatenate([self.hist, np.zeros(n - len(self.hist), dtype=np.int64)])
        idx = np.minimum(np.floor(a / self.width), n - 1).astype(np.int64)
        self.hist += np.bincount(idx, minlength=n)
        return self

    @property
    def edges(self):
        return np.arange(len(self.hist) + 1) * self.width


def kl_at(hist, i, num_bits=8, unsigned=False):
    """TensorRT's KL divergence of candidate ``i`` (amax = edges[i]) on ``hist``."""
    bins = np.asarray(hist, dtype=np.float64).copy()
    bins[0] = bins[1]
    nq = 1 << (num_bits - 1 + int(unsigned))
    groups = (np.arange(i) * nq) // i  # quantized bin of each histogram bin
    nonempty = bins[:i] > 0
    sums = np.bincount(groups[nonempty], weights=bins[:i][nonempty], minlength=nq)
    cnts = np.bincount(groups[nonempty], minlength=nq)
    q = np.where(nonempty, sums[groups] / np.maximum(cnts[groups], 1), 0.0)
    p = bins[:i].copy()
    p[-1] += bins[i:].sum()
    if q.sum() <= 0 or p.sum() <= 0:
        return np.inf
    p, q = p / p.sum(), q / q.sum()
    m = p > 0
    if np.any(q[m] == 0):
        return np.inf
    return float(np.sum(p[m] * np.log(p[m] / q[m])))


def entropy_amax(hist, edges, num_bits=8, unsigned=False, stride=1, start_bin=128):
    """``(amax, KL at amax)``: the last candidate of least divergence."""
    best_i, best_kl = None, np.inf
    for i in range(start_bin, len(hist) + 1, stride):
        kl = kl_at(hist, i, num_bits, unsigned)
        if kl <= best_kl or best_i is None:
            best_i, best_kl = i, kl
    return float(edges[best_i]), best_kl


def mse_at(hist, edges, amax, num_bits=8, unsigned=False):
    """Count-weighted squared error of the bin centers fake-quantized (float32) with ``amax``."""
    centers = ((np.asarray(edges[1:], np.float64) + edges[:-1]) / 2).astype(np.float32)
    maxb = np.float32(2 ** (num_bits - 1 + int(unsigned)) - 1)
    scale = maxb / np.float32(amax)
    q = np.clip(np.round(centers * scale), -maxb, maxb) / scale
    return float(np.sum((q.astype(np.float64) - centers) ** 2 * np.asarray(hist, dtype=np.float64)))


def mse_amax(hist, edges, num_bits=8, unsigned=False, stride=1, start_bin=128):
    """``(amax, error at amax)``: the first center of least error."""
    centers = ((np.asarray(edges[1:], np.float64) + edges[:-1]) / 2).astype(np.float32)
    best, best_err = None, np.inf
    for i in range(start_bin, len(centers), stride):
        err = mse_at(hist, edges, centers[i], num_bits, unsigned)
        if err < best_err:
            best, best_err = float(centers[i]), err
    return best, best_err


def percentile_amax(hist, edges, percentile):
    """Left edge of the first bin where the cumulative count reaches ``percentile`` % of the total."""
    total = float(np.sum(hist))
    run = 0.0
    for j, c in enumerate(hist):
        run += float(c)
        if run / total >= percentile / 100.0:
            return float(edges[j])
    return float(edges[len(hist)])
