"""Histogram calibrator: entropy (TensorRT KL divergence), MSE and percentile amax.

Collection
----------
Each batch is binned by ``torch.ops.lq.abs_histogram`` (one pass: counts,
finite absmax and the number of NaN/Inf, per tensor or per channel). The
histogram covers ``[0, range)`` with ``num_bins`` bins, and ``range`` is always
``num_bins * 2^k``: the smallest such value strictly above the absmax seen so
far. When a batch exceeds the range, the range grows to the next such value
and the existing counts are re-binned by merging ``2^j`` adjacent bins, which
is exact (bin edges of the two grids coincide, and scaling by a power of two
is exact in floating point). Consequences:

* memory is bounded (``num_bins`` bins, whatever the outliers);
* the histogram depends only on the data, not on the batch order: collecting
  A then B, or A and B in two calibrators then :meth:`merge`, or A and B on two
  ranks then :meth:`sync`, give bit-identical counts.

(The reference toolkit instead keeps the first batch's bin width and appends
bins; that grid depends on which batch came first and cannot be merged exactly.)

amax methods
------------
:meth:`HistogramCalibrator.compute_amax` (and the module-level functions
:func:`compute_amax_entropy`, :func:`compute_amax_mse`,
:func:`compute_amax_percentile`) evaluate all candidate bins at once with
tensor ops (chunked to bound memory), on the histogram's device, per tensor or
per channel. Candidates and tie-breaking follow the reference toolkit:
entropy tries ``amax = edges[i]`` for ``i in range(start_bin, num_bins + 1, stride)``
and takes the last minimum; MSE tries ``amax = centers[i]`` for
``i in range(start_bin, num_bins, stride)`` and takes the first minimum;
percentile takes the right edge of the bin where the CDF reaches ``percentile``.
"""

from __future__ import annotations

import math
import warnings

import torch

from lq import _checks, _reference
from lq.calib.calibrator import _Calibrator, _comm_device, _gather_objects

__all__ = [
    "HistogramCalibrator",
    "calibrate_weights",
    "compute_amax_entropy",
    "compute_amax_mse",
    "compute_amax_percentile",
    "pow2_range",
]

HIST_METHODS = ("entropy", "mse", "percentile", "max")
_ENTROPY_CHUNK = 1 << 15  # (candidate, group) cells per chunk: float64 working set stays in cache
_MSE_CHUNK = 1 << 15  # (candidate, center) cells per chunk; <= GRAIN_SIZE keeps each op serial


# ====================================================================== grid
def pow2_range(absmax: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Smallest ``num_bins * 2^k`` strictly greater than ``absmax`` (float32; 0 where absmax is 0)."""
    a = absmax.double()
    safe = torch.where(a > 0, a, torch.ones_like(a))
    w = torch.exp2(torch.floor(torch.log2(safe / num_bins)))
    w = torch.where(num_bins * w > safe, w, w * 2)
    w = torch.where(num_bins * (w / 2) > safe, w / 2, w)
    r = (num_bins * w).float()
    return torch.where(a > 0, r, torch.zeros_like(r))


def _rebin(counts: torch.Tensor, old_range: torch.Tensor, new_range: torch.Tensor) -> torch.Tensor:
    """Counts ``(C, N)`` on ranges ``old_range`` re-binned exactly onto ``new_range`` (both ``N * 2^k`` or 0)."""
    C, N = counts.shape
    old = old_range.double().reshape(C, 1)
    new = new_range.double().reshape(C, 1)
    ratio = torch.where(new > 0, old / torch.where(new > 0, new, torch.ones_like(new)), torch.ones_like(new))
    j = torch.arange(N, device=counts.device, dtype=torch.float64).reshape(1, N)
    idx = torch.floor(j * ratio).long().clamp_(0, N - 1)
    out = torch.zeros_like(counts)
    out.scatter_add_(1, idx, counts)
    return out


# ====================================================================== amax methods (vectorized)
class _serial_cpu:
    """Run the amax searches with one intra-op thread on CPU.

    Their work is split into cache-sized chunks of small ops; thread fan-out
    buys nothing there and, on a busy machine, the OpenMP hand-offs of every
    small op cost far more than the arithmetic (measured 10-30x slower).
    """

    def __init__(self, device):
        self._on = torch.device(device).type == "cpu"

    def __enter__(self):
        if self._on:
            self._n = torch.get_num_threads()
            if self._n != 1:
                torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        if self._on and self._n != 1:
            torch.set_num_threads(self._n)
        return False


def _as_2d(counts: torch.Tensor, width) -> tuple[torch.Tensor, torch.Tensor]:
    counts = counts.double()
    if counts.dim() == 1:
        counts = counts.unsqueeze(0)
    width = torch.as_tensor(width, dtype=torch.float64, device=counts.device).reshape(-1)
    if width.numel() == 1 and counts.shape[0] != 1:
        width = width.expand(counts.shape[0])
    return counts, width


def _compute_amax_entropy_impl(counts, width, num_bits=8, unsigned=False, stride=1, start_bin=128) -> torch.Tensor:
    """amax minimizing TensorRT's KL divergence, for every row of ``counts`` at once.

    Args:
        counts: ``(N,)`` or ``(C, N)`` histogram of ``|x|`` with bins ``[j * width, (j + 1) * width)``.
        width: bin width, a scalar or ``(C,)``.

    For candidate ``i`` the reference distribution is ``counts[:i]`` with the
    tail ``counts[i:]`` added to bin ``i - 1``; the candidate distribution
    merges bin ``j`` into quantized bin ``floor(j * nbins / i)``
    (``nbins = 2^(num_bits - 1 + unsigned)``) and spreads each group's count
    evenly over its non-empty bins. Both use ``counts[0] := counts[1]``. All
    candidates are evaluated together from prefix sums:
    ``KL = sum P log P - sum P log Q`` with group sums from cumulative counts
    (float64, in cache-sized chunks of candidates).
    Returns float64 amax, ``(C,)`` (or a scalar for 1-D ``counts``).
    """
    squeeze = torch.as_tensor(counts).dim() == 1
    b, w = _as_2d(torch.as_tensor(counts), width)
    C, N = b.shape
    dev = b.device
    b = b.clone()
    if N > 1:
        b[:, 0] = b[:, 1]
    shift = num_bits - 1 + int(unsigned)
    nb = 1 << shift
    cand = torch.arange(start_bin, N + 1, stride, device=dev)
    if cand.numel() == 0:
        raise ValueError(f"no entropy candidates: start_bin={start_bin} must be <= num_bins={N}")
    T = b.sum(1, keepdim=True)
    Tsafe = torch.where(T > 0, T, torch.ones_like(T))
    logT = torch.log(Tsafe)
    zero = torch.zeros(C, 1, dtype=torch.float64, device=dev)
    cs = torch.cat([zero, b.cumsum(1)], 1)  # cs[:, i] = sum(b[:, :i])
    cn = torch.cat([zero, (b > 0).double().cumsum(1)], 1)  # non-empty bins before i
    cbl = torch.cat([zero, torch.xlogy(b, b).cumsum(1)], 1)  # sum b log b before i
    # per candidate (cheap, K elements)
    last = cand - 1
    Bi = cs[:, cand]  # (C, K) counts below the candidate
    tail = T - Bi
    b_last = b[:, last]
    p_last = (b_last + tail) / Tsafe
    sum_plogp = (cbl[:, last] - cs[:, last] * logT) / Tsafe + torch.xlogy(p_last, p_last)
    g_last = (last * nb) // cand  # group of bin i - 1
    # per (candidate, group): group sums from prefix sums, in chunks of candidates
    g = torch.arange(nb + 1, device=dev)
    A = torch.empty(C, cand.numel(), dtype=torch.float64, device=dev)
    log_ql = torch.empty_like(A)
    step = max(1, _ENTROPY_CHUNK // (C * (nb + 1)))
    for k0 in range(0, cand.numel(), step):
        ci = cand[k0:k0 + step]
        E = ((g.reshape(1, -1) * ci.reshape(-1, 1) + (nb - 1)) >> shift).reshape(-1)  # group starts, (k*(nb+1),)
        S = cs.index_select(1, E).reshape(C, -1, nb + 1).diff(dim=2)  # (C, k, nb) group sums
        M = cn.index_select(1, E).reshape(C, -1, nb + 1).diff(dim=2)  # non-empty bins per group
        A[:, k0:k0 + step] = (torch.xlogy(S, S) - torch.xlogy(S, M)).sum(2)  # sum_g S log(S / M)
        gl = g_last[k0:k0 + step].reshape(1, -1, 1).expand(C, -1, 1)
        S_l, M_l = S.gather(2, gl).squeeze(2), M.gather(2, gl).squeeze(2)
        log_ql[:, k0:k0 + step] = torch.log(torch.where(S_l > 0, S_l, 1.0)) - torch.log(torch.where(M_l > 0, M_l, 1.0))
    Bsafe = torch.where(Bi > 0, Bi, torch.ones_like(Bi))
    logBi = torch.log(Bsafe)
    sum_plogq = (A - Bi * logBi) / Tsafe + torch.where(tail > 0, tail / Tsafe * (log_ql - logBi), 0.0)
    kl = sum_plogp - sum_plogq
    bad = (Bi <= 0) | ((tail > 0) & (b_last <= 0))  # Q = 0 where P > 0: infinite divergence
    kl = torch.where(bad, torch.full_like(kl, math.inf), kl)
    K = kl.shape[1]
    best = K - 1 - torch.argmin(kl.flip(1), dim=1)  # last minimum, like the reference toolkit
    amax = cand[best].double() * w
    amax = torch.where(T.squeeze(1) > 0, amax, torch.zeros_like(amax))
    return amax[0] if squeeze else amax


def _fake_quant_candidates(c: torch.Tensor, amax: torch.Tensor, num_bits, unsigned: bool) -> torch.Tensor:
    """``fake_tensor_quant(c, amax) - c`` for every candidate: ``c (..., 1, M)``, ``amax (..., K, 1)`` (> 0).

    The same float32 operations as ``lq._reference.fake_quant`` (``scaled_e4m3`` for FP8), in place.
    """
    if num_bits == (4, 3):
        return _reference.scaled_e4m3(c, amax) - c
    _, max_bound = _reference.int_bounds(num_bits, unsigned, True)
    scale = max_bound / amax
    q = (c * scale).round_().clamp_(-max_bound, max_bound)
    return q.div_(scale).sub_(c)


def _compute_amax_mse_impl(counts, width, num_bits=8, unsigned=False, stride=1, start_bin=128) -> torch.Tensor:
    """amax minimizing the histogram-weighted squared fake-quantization error of the bin centers.

    Candidates ``amax = centers[i]``, ``i in range(start_bin, N, stride)``;
    error of every (non-empty) center under every candidate at once, in
    cache-sized chunks, with the float32 arithmetic of ``fake_tensor_quant``
    (``scaled_e4m3`` for ``num_bits=(4, 3)``); weighted sums in float64.
    First minimum wins. Returns float64 amax, ``(C,)`` (or a scalar).
    """
    squeeze = torch.as_tensor(counts).dim() == 1
    b, w = _as_2d(torch.as_tensor(counts), width)
    C, N = b.shape
    dev = b.device
    cand = torch.arange(start_bin, N, stride, device=dev)
    if cand.numel() == 0:
        raise ValueError(f"no mse candidates: start_bin={start_bin} must be < num_bins={N}")
    K = cand.numel()
    # centers (2j + 1) * w / 2: exact in float32, equal to (edges[1:] + edges[:-1]) / 2
    empty_row = w <= 0
    half_w = torch.where(empty_row, torch.ones_like(w), w / 2).float().reshape(C, 1)
    # keep only bins that hold data (padded per row with weight 0)
    nz = b > 0
    M = max(1, int(nz.sum(1).max()))
    order = torch.argsort((~nz).to(torch.int8), dim=1, stable=True)[:, :M]
    weights = b.gather(1, order)  # (C, M) float64
    centers = (2 * order + 1).float() * half_w  # (C, M) float32
    amax_c = (2 * cand + 1).float().reshape(1, -1) * half_w  # (C, K) float32
    out = torch.empty(C, K, dtype=torch.float64, device=dev)
    kstep = max(1, _MSE_CHUNK // M)
    for c in range(C):
        cc = centers[c].reshape(1, M)
        wc = weights[c]
        for k0 in range(0, K, kstep):
            err = _fake_quant_candidates(cc, amax_c[c, k0:k0 + kstep].reshape(-1, 1), num_bits, unsigned)
            out[c, k0:k0 + kstep] = err.double().square_() @ wc
    best = torch.argmin(out, dim=1)  # first minimum
    amax = amax_c.double().gather(1, best.reshape(-1, 1)).squeeze(1)
    amax = torch.where(empty_row | (b.sum(1) <= 0), torch.zeros_like(amax), amax)
    return amax[0] if squeeze else amax


def _compute_amax_percentile_impl(counts, width, percentile=99.99) -> torch.Tensor:
    """Right edge of the first bin where the CDF of ``counts`` reaches ``percentile`` %."""
    squeeze = torch.as_tensor(counts).dim() == 1
    b, w = _as_2d(torch.as_tensor(counts), width)
    C, N = b.shape
    total = b.sum(1, keepdim=True)
    cdf = b.cumsum(1) / torch.where(total > 0, total, torch.ones_like(total))
    target = torch.full((C, 1), percentile / 100.0, dtype=torch.float64, device=b.device)
    idx = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=N - 1)
    amax = (idx + 1).double() * w
    amax = torch.where(total.squeeze(1) > 0, amax, torch.zeros_like(amax))
    return amax[0] if squeeze else amax


def compute_amax_entropy(counts, width, num_bits=8, unsigned=False, stride=1, start_bin=128) -> torch.Tensor:
    with _serial_cpu(torch.as_tensor(counts).device):
        return _compute_amax_entropy_impl(counts, width, num_bits, unsigned, stride, start_bin)


def compute_amax_mse(counts, width, num_bits=8, unsigned=False, stride=1, start_bin=128) -> torch.Tensor:
    with _serial_cpu(torch.as_tensor(counts).device):
        return _compute_amax_mse_impl(counts, width, num_bits, unsigned, stride, start_bin)


def compute_amax_percentile(counts, width, percentile=99.99) -> torch.Tensor:
    with _serial_cpu(torch.as_tensor(counts).device):
        return _compute_amax_percentile_impl(counts, width, percentile)


compute_amax_entropy.__doc__ = _compute_amax_entropy_impl.__doc__
compute_amax_mse.__doc__ = _compute_amax_mse_impl.__doc__
compute_amax_percentile.__doc__ = _compute_amax_percentile_impl.__doc__


# ====================================================================== calibrator
class HistogramCalibrator(_Calibrator):
    """Histogram calibrator (entropy, mse, percentile; "max" gives the exact absmax).

    Args:
        num_bits: bits of the quantization (an int or ``(4, 3)``; entropy needs an int).
        axis: None (per tensor) or the axis / axes that keep their own amax (one histogram per channel).
        unsigned: unsigned quantization.
        num_bins: bins of the histogram. Default 2048.
        grow_method: deprecated in the reference toolkit and ignored here (the grid is described in the module doc).
        skip_zeros: leave exact zeros out of the histogram.
        torch_hist: accepted for compatibility; collection always runs ``torch.ops.lq.abs_histogram``
            on the input's device.
    """

    def __init__(self, num_bits=8, axis=None, unsigned=False, num_bins=2048, grow_method=None, skip_zeros=False,
                 torch_hist=True):
        super().__init__(num_bits, axis, unsigned)
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 2:
            raise ValueError(f"num_bins must be an int >= 2, got {num_bins!r}")
        if grow_method is not None:
            warnings.warn(f"grow_method={grow_method!r} is deprecated and ignored", DeprecationWarning, stacklevel=2)
        self._num_bins = num_bins
        self._skip_zeros = bool(skip_zeros)
        self._torch_hist = bool(torch_hist)
        self.add_state("_counts", None, "custom")  # int64 (C, N); C = 1 per tensor
        self.add_state("_range", None, "custom")  # float32 (C,)
        self.add_state("_absmax", None, "custom")  # float32 (C,), finite absmax
        self.add_state("_amax_shape", None, "custom")  # broadcast shape of the amax

    def _config(self) -> dict:
        cfg = super()._config()
        cfg.update(num_bins=self._num_bins, skip_zeros=self._skip_zeros)
        return cfg

    @property
    def has_data(self) -> bool:
        return self._counts is not None

    @property
    def num_bins(self) -> int:
        return self._num_bins

    # --- the reference toolkit's attribute names
    @property
    def _calib_hist(self):
        """Counts: ``(num_bins,)`` per tensor, ``(C, num_bins)`` per channel (None before data)."""
        if self._counts is None:
            return None
        return self._counts[0] if self._axis is None else self._counts

    @property
    def _calib_bin_edges(self):
        """Bin edges: ``(num_bins + 1,)`` per tensor, ``(C, num_bins + 1)`` per channel (None before data)."""
        if self._counts is None:
            return None
        j = torch.arange(self._num_bins + 1, device=self._range.device, dtype=torch.float32)
        edges = j.reshape(1, -1) * (self._range / self._num_bins).reshape(-1, 1)
        return edges[0] if self._axis is None else edges

    @property
    def bin_width(self) -> torch.Tensor | None:
        """Bin width (float32, ``()`` per tensor or ``(C,)``)."""
        if self._range is None:
            return None
        wdt = self._range / self._num_bins
        return wdt[0] if self._axis is None else wdt

    def _channel_view(self, x: torch.Tensor):
        """``(tensor, axis for abs_histogram, amax broadcast shape)``."""
        if self._axis is None:
            return x, None, []
        axes = self._axis if isinstance(self._axis, tuple) else (self._axis,)
        keep = sorted({_checks.normalize_axis(a, x.dim()) for a in axes})
        shape = [x.shape[d] if d in keep else 1 for d in range(x.dim())]
        if len(keep) == 1:
            return x, keep[0], shape
        rest = [d for d in range(x.dim()) if d not in keep]
        xc = x.permute(keep + rest).reshape(math.prod(x.shape[d] for d in keep), -1)
        return xc, 0, shape

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Add ``|x|`` to the histogram (one ``abs_histogram`` pass; a second one only when the range grows)."""
        self._check_input(x)
        x = x.detach()
        if x.numel() == 0:
            return
        xc, axis, shape = self._channel_view(x)
        C = 1 if axis is None else xc.shape[axis]
        if self._counts is None:
            self._counts = torch.zeros(C, self._num_bins, dtype=torch.int64, device=x.device)
            self._range = torch.zeros(C, dtype=torch.float32, device=x.device)
            self._absmax = torch.zeros(C, dtype=torch.float32, device=x.device)
            self._amax_shape = shape
        elif self._counts.shape[0] != C or list(shape) != list(self._amax_shape):
            raise RuntimeError(
                f"HistogramCalibrator: amax shape changed from {tuple(self._amax_shape)} to {tuple(shape)} "
                f"(axis={self._axis}); per-channel calibration needs the same channel count in every batch"
            )
        rng = self._range.to(x.device)
        counts, absmax, nonfinite = self._hist(xc, rng, axis)
        grow = (absmax >= rng) & (absmax > 0)
        if bool(grow.any()):
            new_rng = torch.where(grow, pow2_range(absmax, self._num_bins), rng)
            self._counts = _rebin(self._counts, self._range, new_rng.to(self._counts.device))
            self._range = new_rng.to(self._range.device)
            counts, absmax, nonfinite = self._hist(xc, new_rng, axis)
        if self._skip_zeros:
            zeros = (xc == 0)
            nzero = zeros.sum() if axis is None else zeros.sum(dim=[d for d in range(xc.dim()) if d != axis])
            counts[:, 0] -= nzero.reshape(-1).to(counts.device)
        self._counts += counts.to(self._counts.device)
        self._absmax = torch.maximum(self._absmax, absmax.to(self._absmax.device))
        self._note_nonfinite(int(nonfinite.sum()))

    def _hist(self, xc, rng, axis):
        r = rng[0] if axis is None else rng
        counts, absmax, nonfinite = torch.ops.lq.abs_histogram(xc, r, self._num_bins, axis)
        return counts.reshape(-1, self._num_bins), absmax.reshape(-1), nonfinite.reshape(-1)

    def reset(self) -> None:
        super().reset()

    # ------------------------------------------------------------------ amax
    def compute_amax(self, method=None, *, stride=1, start_bin=128, percentile=99.99):
        """amax by ``method`` ("entropy", "mse", "percentile", or "max" for the exact absmax).

        Returns a float32 tensor with the quantization's broadcast shape
        (``()`` per tensor), or None when no data was collected.
        """
        if method is None:
            raise ValueError(f"HistogramCalibrator.compute_amax needs a method: one of {HIST_METHODS}")
        if method not in HIST_METHODS:
            raise ValueError(f"calibration method {method!r} is not supported: one of {HIST_METHODS}")
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be a positive int, got {stride!r}")
        if method in ("entropy", "mse"):
            hi = self._num_bins if method == "entropy" else self._num_bins - 1
            if isinstance(start_bin, bool) or not isinstance(start_bin, int) or not 0 <= start_bin <= hi:
                raise ValueError(f"start_bin must be an int in [0, {hi}] for {method} with num_bins="
                                 f"{self._num_bins}, got {start_bin!r}")
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
        if self._counts is None:
            return None
        with _serial_cpu(self._counts.device):
            return self._compute_amax(method, stride, start_bin, percentile)

    def _compute_amax(self, method, stride, start_bin, percentile):
        width = self._range.double() / self._num_bins
        if method == "max":
            amax = self._absmax.double()
        elif method == "entropy":
            if self._num_bits == (4, 3):
                raise ValueError("entropy calibration needs integer num_bits; use 'mse' or 'percentile' for FP8")
            amax = compute_amax_entropy(self._counts, width, self._num_bits, self._unsigned, stride, start_bin)
        elif method == "mse":
            amax = compute_amax_mse(self._counts, width, self._num_bits, self._unsigned, stride, start_bin)
        else:
            amax = compute_amax_percentile(self._counts, width, percentile)
        if method != "max":
            # The grid reaches up to 2x past the data (power-of-two bin width): a candidate above the
            # largest |x| seen only loses resolution, so amax never exceeds it (as with the reference
            # toolkit, whose histogram ends at the max).
            amax = torch.minimum(amax, self._absmax.double().reshape(amax.shape))
        amax = amax.float()
        return amax.reshape(self._amax_shape) if self._axis is not None else amax.reshape(())

    # ------------------------------------------------------------------ merge / sync
    def _merge_custom(self, other: "HistogramCalibrator") -> None:
        if other._counts is None:
            return
        if self._counts is None:
            self._counts = other._counts.clone()
            self._range = other._range.clone()
            self._absmax = other._absmax.clone()
            self._amax_shape = list(other._amax_shape)
            return
        if self._counts.shape != other._counts.shape or list(self._amax_shape) != list(other._amax_shape):
            raise ValueError(f"cannot merge histograms of shapes {tuple(self._counts.shape)} and "
                             f"{tuple(other._counts.shape)} (amax shapes {self._amax_shape} / {other._amax_shape})")
        dev = self._counts.device
        o_rng = other._range.to(dev)
        rng = torch.maximum(self._range, o_rng)
        self._counts = _rebin(self._counts, self._range, rng) + _rebin(other._counts.to(dev), o_rng, rng)
        self._range = rng
        self._absmax = torch.maximum(self._absmax, other._absmax.to(dev))

    def _sync_custom(self, process_group) -> None:
        dist = torch.distributed
        meta = None if self._counts is None else (tuple(self._counts.shape), tuple(self._amax_shape))
        metas = [m for m in _gather_objects(meta, process_group) if m is not None]
        if not metas:
            return
        if len(set(metas)) != 1:
            raise ValueError(f"cannot sync histograms across ranks: shapes differ {metas}")
        (C, N), amax_shape = metas[0]
        dev = _comm_device(self._counts, process_group)
        home = self._counts.device if self._counts is not None else torch.device("cpu")
        if self._counts is None:
            counts = torch.zeros(C, N, dtype=torch.int64, device=dev)
            rng = torch.zeros(C, dtype=torch.float32, device=dev)
            absmax = torch.zeros(C, dtype=torch.float32, device=dev)
        else:
            counts, rng, absmax = self._counts.to(dev), self._range.to(dev), self._absmax.to(dev)
        # 1. agree on the range (identical bin edges everywhere), 2. re-bin exactly, 3. sum the counts
        new_rng = rng.clone()
        dist.all_reduce(new_rng, op=dist.ReduceOp.MAX, group=process_group)
        counts = _rebin(counts, rng, new_rng)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=process_group)
        absmax = absmax.clone()
        dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=process_group)
        self._counts, self._range, self._absmax = counts.to(home), new_rng.to(home), absmax.to(home)
        self._amax_shape = list(amax_shape)

    def __repr__(self) -> str:
        s = super().__repr__()[:-1]
        if self._range is not None:
            s += f", range={_fmt(self._range)}"
        return s + ")"


def _fmt(t: torch.Tensor) -> str:
    return f"{float(t):.4g}" if t.numel() == 1 else f"[{float(t.min()):.4g}, {float(t.max()):.4g}]"


# ====================================================================== calibrate_weights
def calibrate_weights(model, method="percentile", perchannel=True, percentile=99.99, num_bins=2048):
    """Calibrate the weight quantizers of ``model`` from the weights themselves.

    Every quantized module reports its ``(weight quantizer, weight)`` pairs
    (``weight_quantizer_pairs()``: one for Conv/Linear, several for LSTM and
    attention); a quantizer that serves several weights sees all of them. Each
    gets the amax of its weights per output channel (axis 0, axis 1 for
    transposed convolutions, or the quantizer's own axis) when ``perchannel``,
    else per tensor. ``method``: "max", "entropy", "mse" or "percentile".
    Returns ``{name: amax}``.
    """
    from torch import nn

    from lq.calib.max import MaxCalibrator

    if method not in HIST_METHODS:
        raise ValueError(f"calibrate_weights: method {method!r} is not supported: one of {HIST_METHODS}")
    names = {id(m): n for n, m in model.named_modules()}
    groups: dict = {}  # id(quantizer) -> (quantizer, parent module, [weights])
    for _, module in model.named_modules():
        pairs = getattr(module, "weight_quantizer_pairs", None)
        if callable(pairs):
            found = list(pairs())
        else:  # a quantizer attached by hand to a float module (reference-toolkit style)
            q = module._modules.get("_weight_quantizer")
            found = [(q, getattr(module, "weight", None))] if q is not None else []
        for q, w in found:
            if isinstance(w, torch.Tensor) and q.is_enabled and not q.dynamic:
                groups.setdefault(id(q), (q, module, []))[2].append(w.detach())
    out = {}
    for q, parent, weights in groups.values():
        name = names.get(id(q), q.name)
        if perchannel and not q.learn_amax and q.block_sizes is None:
            if q.axis is not None:
                axis = q.axis
            else:
                axis = 1 if isinstance(parent, nn.modules.conv._ConvTransposeNd) else 0
        else:
            axis = None
        if method == "max":
            cal = MaxCalibrator(q.num_bits, axis, q.unsigned)
        else:
            cal = HistogramCalibrator(q.num_bits, axis, q.unsigned, num_bins=num_bins)
        for w in weights:
            cal.collect(w)
        amax = cal.compute_amax() if method == "max" else cal.compute_amax(method, percentile=percentile)
        if amax is None:
            continue
        q.name = q._name or name
        if q.amax is not None and tuple(q.amax.shape) != tuple(amax.shape) and not q.learn_amax:
            q.amax = None
        q._set_amax(amax, allow_reshape=True)
        q._axis = axis if axis is not None else (q.axis if amax.numel() > 1 else None)
        out[name] = q.amax
    return out
