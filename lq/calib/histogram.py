"""Histogram calibrator: amax by entropy (TensorRT's KL divergence), MSE or percentile.

Collection
----------
Each batch is binned by ``torch.ops.lq.abs_histogram`` (one pass: counts,
finite absmax and the number of NaN/Inf, per tensor or per channel) onto the
reference toolkit's grid (details in :mod:`lq.calib._grid`): ``num_bins`` bins
on ``[0, R]``, extended by bins of the same width when later data reaches past
``R``. ``R`` is either

* known in advance, given with :meth:`HistogramCalibrator.set_range` —
  :mod:`lq.calibration` runs a range pass (max) first and sets the global
  absmax, as TensorRT's own calibrator does. The histogram is then the one the
  reference algorithms are written for (all the data on ``[0, absmax]``), it
  does not depend on the batch order, and histograms collected with the same
  range (other calibrators, other ranks) merge exactly; or
* the absmax of the first batch, when ``collect`` is called by user code with
  no range: then the grid follows the reference's own growing grid.

Growth is bounded (``max_bins``, 4 x ``num_bins`` by default): beyond it pairs
of bins merge, exactly. Memory stays ``O(max_bins)`` whatever the outliers.

amax methods
------------
:meth:`HistogramCalibrator.compute_amax` runs the reference algorithms on the
collected grid, all candidates at once (:mod:`lq.calib._search`).
"""

from __future__ import annotations

import math
import warnings

import torch

from lq import _checks
from lq.calib._grid import bins_needed, coarsen, holds, kernel_bins, onto, pad, rebin, regrid, start_width
from lq.calib._search import compute_amax_entropy, compute_amax_mse, compute_amax_percentile, serial_cpu
from lq.calib.calibrator import _Calibrator, _comm_device, _gather_objects, finite_minmax

__all__ = [
    "HistogramCalibrator",
    "calibrate_weights",
    "compute_amax_entropy",
    "compute_amax_mse",
    "compute_amax_percentile",
]

HIST_METHODS = ("entropy", "mse", "percentile", "max", "sample_mean")
#: default growth bound: ``max_bins = GROWTH_LIMIT * num_bins``
GROWTH_LIMIT = 4


# ====================================================================== calibrator
class HistogramCalibrator(_Calibrator):
    """Histogram calibrator (entropy, mse, percentile; "max" gives the exact absmax).

    Args:
        num_bits: bits of the quantization (an int or ``(4, 3)``; entropy needs an int).
        axis: None (per tensor) or the axis / axes that keep their own amax (one histogram per channel).
        unsigned: unsigned quantization.
        num_bins: bins of the histogram on its starting range. Default 2048.
        grow_method: deprecated in the reference toolkit and ignored here (see the module doc for growth).
        skip_zeros: leave exact zeros out of the histogram.
        torch_hist: accepted for compatibility; collection always runs ``torch.ops.lq.abs_histogram``
            on the input's device.
        max_bins: most bins the grid may grow to before pairs of bins merge (default ``4 * num_bins``).
        signed_range: per tensor, also keep the signed min and max (:meth:`compute_range`) for an asymmetric
            quantizer; one more reduction pass per batch, so only where one asks for it.

    Integer and bool tensors are calibrated as float32.
    """

    def __init__(self, num_bits=8, axis=None, unsigned=False, num_bins=2048, grow_method=None, skip_zeros=False,
                 torch_hist=True, *, max_bins=None, signed_range=False):
        super().__init__(num_bits, axis, unsigned)
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or not 2 <= num_bins <= 1 << 22:
            raise ValueError(f"num_bins must be an int in [2, 2^22], got {num_bins!r}")
        if max_bins is None:
            max_bins = GROWTH_LIMIT * num_bins
        if isinstance(max_bins, bool) or not isinstance(max_bins, int) or not num_bins <= max_bins <= 1 << 24:
            raise ValueError(f"max_bins must be an int in [num_bins, 2^24] (num_bins={num_bins}), got {max_bins!r}")
        if grow_method is not None:
            warnings.warn(f"grow_method={grow_method!r} is deprecated and ignored", DeprecationWarning, stacklevel=2)
        self._num_bins = num_bins
        self._max_bins = max_bins
        self._skip_zeros = bool(skip_zeros)
        self._torch_hist = bool(torch_hist)
        self.add_state("_counts", None, "custom")  # int64 (C, max(nbins)); C = 1 per tensor
        self.add_state("_width", None, "custom")  # float32 (C,): bin width, 0 while only zeros were seen
        self.add_state("_nbins", None, "custom")  # int64 (C,): bins in use per row
        self.add_state("_absmax", None, "custom")  # float32 (C,), finite absmax
        self.add_state("_amax_shape", None, "custom")  # broadcast shape of the amax
        self._signed_range = bool(signed_range) and self._axis is None
        if self._signed_range:
            self._track_range()  # the signed range an asymmetric quantizer clips with the method's amax

    def _config(self) -> dict:
        cfg = super()._config()
        cfg.update(num_bins=self._num_bins, skip_zeros=self._skip_zeros)
        if self._signed_range:
            cfg["signed_range"] = True
        if self._max_bins != GROWTH_LIMIT * self._num_bins:
            cfg["max_bins"] = self._max_bins
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
        """Counts: ``(n,)`` per tensor, ``(C, max n)`` per channel (None before data)."""
        if self._counts is None:
            return None
        return self._counts[0] if self._axis is None else self._counts

    @property
    def _calib_bin_edges(self):
        """Bin edges: ``(n + 1,)`` per tensor, ``(C, max n + 1)`` per channel (None before data)."""
        if self._counts is None:
            return None
        j = torch.arange(self._counts.shape[1] + 1, device=self._width.device, dtype=torch.float32)
        edges = j.reshape(1, -1) * self._width.reshape(-1, 1)
        return edges[0] if self._axis is None else edges

    @property
    def bin_width(self) -> torch.Tensor | None:
        """Bin width (float32, ``()`` per tensor or ``(C,)``); None before a range or data."""
        if self._width is None:
            return None
        return self._width[0] if self._axis is None else self._width

    # ------------------------------------------------------------------ range
    def set_range(self, amax) -> "HistogramCalibrator":
        """Start the grid on ``[0, amax]`` (``num_bins`` bins) instead of on the first batch's absmax.

        ``amax``: a number or tensor, one value per tensor or one per channel
        (e.g. a :class:`MaxCalibrator`'s amax over the same data). Call it
        before collecting (or after :meth:`reset`). Calibrators given the same
        range merge and sync exactly. Returns self.
        """
        if self._counts is not None:
            raise RuntimeError("HistogramCalibrator.set_range must come before collect() (or after reset())")
        a = torch.as_tensor(amax).detach().reshape(-1).double()
        if a.numel() == 0 or not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
            raise ValueError(f"set_range needs finite amax >= 0, got {amax!r}")
        if self._axis is None and a.numel() != 1:
            raise ValueError(f"set_range of a per-tensor histogram takes one value, got {a.numel()}")
        self._width = start_width(a, self._num_bins)
        self._nbins = torch.full_like(self._width, self._num_bins, dtype=torch.int64)
        return self

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

    def _start(self, C: int, shape, device) -> None:
        """Empty state for ``C`` rows on ``device`` (the range, when set, must have ``C`` values)."""
        if self._width is None:
            self._width = torch.zeros(C, dtype=torch.float32)
            self._nbins = torch.full((C,), self._num_bins, dtype=torch.int64)
        elif self._width.numel() != C:
            raise RuntimeError(f"HistogramCalibrator: set_range gave {self._width.numel()} value(s), the data has "
                               f"{C} channel(s) for axis={self._axis}")
        self._width, self._nbins = self._width.to(device), self._nbins.to(device)
        self._counts = torch.zeros(C, int(self._nbins.max()), dtype=torch.int64, device=device)
        self._absmax = torch.zeros(C, dtype=torch.float32, device=device)
        self._amax_shape = shape

    def _fit(self, w, n, m):
        """The grid ``(w, n)`` after seeing absmax ``m``: started where it had no width, grown, coarsened."""
        start = (w <= 0) & (m > 0)
        w = torch.where(start, start_width(m, self._num_bins), w)
        n = torch.where(start, torch.full_like(n, self._num_bins), n)
        n = torch.maximum(n, bins_needed(m, w))
        return coarsen(w, n, self._max_bins)

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Add ``|x|`` to the histogram (one ``abs_histogram`` pass; a second one only when the range grows)."""
        x = self._input(x)
        if x.numel() == 0:
            return
        if self._signed_range:
            lo, hi, _ = finite_minmax(x, tuple(range(x.dim())), [])
            self._note_range(lo, hi)
        if self._tracks_samples:
            self._note_samples(x)
        xc, axis, shape = self._channel_view(x)
        C = 1 if axis is None else xc.shape[axis]
        if self._counts is None:
            self._start(C, shape, x.device)
        elif self._counts.shape[0] != C or list(shape) != list(self._amax_shape):
            raise RuntimeError(
                f"HistogramCalibrator: amax shape changed from {tuple(self._amax_shape)} to {tuple(shape)} "
                f"(axis={self._axis}); per-channel calibration needs the same channel count in every batch"
            )
        dev = x.device
        w, n = self._width.to(dev), self._nbins.to(dev)
        counts, absmax, reach, nonfinite = self._hist(xc, w, self._counts.shape[1], axis)
        if holds(absmax, w, n):  # the usual case: the grid already holds the batch
            w_new, n_new = w, n
        else:
            w_new, n_new = self._fit(w, n, torch.maximum(self._absmax.to(dev), absmax))
            if not bool((absmax <= reach).all()):  # values past the pass's reach: bin again on the new grid
                counts, _, _, _ = self._hist(xc, w_new, int(n_new.max()), axis)
                w = w_new
            home = self._counts.device
            self._counts = rebin(self._counts, self._width, w_new.to(home), n_new.to(home))
        counts = onto(counts, w, w_new, n_new, self._counts.shape[1])
        if self._skip_zeros:
            zeros = xc == 0
            nzero = zeros.sum() if axis is None else zeros.sum(dim=[d for d in range(xc.dim()) if d != axis])
            counts[:, 0] -= nzero.reshape(-1)
        home = self._counts.device
        self._counts += counts.to(home)
        self._width, self._nbins = w_new.to(home), n_new.to(home)
        self._absmax = torch.maximum(self._absmax, absmax.to(home))
        self._note_nonfinite(int(nonfinite.sum()))

    def track_samples(self) -> "HistogramCalibrator":
        """Also keep, per tensor, the sum of each sample's largest ``|x|`` and the sample count, which
        ``sample_mean`` needs (one more reduction per batch, about 40% of a collection's cost: only where that
        method is asked for; :func:`lq.calibration.collect` asks). Returns self."""
        self._refuse_per_channel()
        if not self._tracks_samples:
            self.add_state("_sample_absmax_sum", None, "sum")  # float64 ()
            self.add_state("_sample_count", None, "sum")  # float64 ()
        return self

    @property
    def _tracks_samples(self) -> bool:
        return "_sample_count" in self._state_specs

    @property
    def holds_sample_maxima(self) -> bool:
        """Whether ``compute_amax("sample_mean")`` can answer: the per-sample maxima were tracked and collected."""
        return self._tracks_samples and self._sample_count is not None

    def _refuse_per_channel(self) -> None:
        if self._axis is not None:
            raise ValueError("calibration method 'sample_mean' is per tensor: this calibrator keeps one amax per "
                             f"channel (axis={self._axis}); use max, entropy, mse or percentile")

    def _note_samples(self, x: torch.Tensor) -> None:
        """Per tensor: add each sample's largest finite ``|x|`` (a sample = an index of the first dimension; a
        0-d tensor is one sample) to the running sum behind ``sample_mean``."""
        rows = x.reshape(x.shape[0] if x.dim() else 1, -1)
        if rows.shape[1] == 0:
            return
        # amax and amin apart: several times faster on CPU than aminmax or |x|'s amax (every input runs this)
        top = torch.maximum(rows.amax(1), -rows.amin(1))
        if not bool(torch.isfinite(top).all()):  # a sample holding NaN/Inf: its finite values only
            top = torch.where(torch.isfinite(rows), rows.abs(), torch.zeros((), dtype=rows.dtype,
                                                                            device=rows.device)).amax(1)
        s = top.double().sum().reshape(())
        n = torch.tensor(float(rows.shape[0]), dtype=torch.float64, device=s.device)
        if self._sample_absmax_sum is None:
            self._sample_absmax_sum, self._sample_count = s, n
        else:
            dev = self._sample_absmax_sum.device
            self._sample_absmax_sum = self._sample_absmax_sum + s.to(dev)
            self._sample_count = self._sample_count + n.to(dev)

    def _hist(self, xc, w, cols: int, axis):
        """One ``abs_histogram`` pass on width ``w``: ``(counts (C, K), absmax, reach, nonfinite)``.

        ``K`` is a power of two >= ``cols`` and the range ``K * w`` (exact), so the
        kernel's ``fl(1 / range) * K`` is ``fl(1 / w)`` whatever ``K`` is: a value's bin
        depends on the width only. ``reach`` is that range: values above it were not counted.
        """
        K = kernel_bins(cols)
        rng = w.float() * K
        r = rng[0] if axis is None else rng
        counts, absmax, nonfinite = torch.ops.lq.abs_histogram(xc, r, K, axis)
        return counts.reshape(-1, K), absmax.reshape(-1), rng, nonfinite.reshape(-1)

    # ------------------------------------------------------------------ amax
    def compute_amax(self, method=None, *, stride=1, start_bin=128, percentile=99.99):
        """amax by ``method`` ("entropy", "mse", "percentile", "max" for the exact absmax, or "sample_mean": the
        mean over samples of each sample's largest ``|x|``, NNCF's default activation range, per tensor only).

        Returns a float32 tensor with the quantization's broadcast shape
        (``()`` per tensor), or None when no data was collected. amax never
        exceeds the largest finite ``|x|`` collected.
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
            raise ValueError(f"percentile {percentile!r} is out of range: it must be in (0, 100]")
        if method == "sample_mean":
            self._refuse_per_channel()
            if self._counts is not None and (not self._tracks_samples or self._sample_count is None):
                raise ValueError("calibration method 'sample_mean' needs the per-sample maxima, which this "
                                 "calibrator did not collect: call track_samples() before collecting (calibrate_model "
                                 "does it for that method)")
        if self._counts is None:
            return None
        key = (method, stride, start_bin, float(percentile))
        memo = self._amax_memo()
        if memo is None or key not in memo:  # ``auto`` asks every method of every quantizer several times
            with serial_cpu(self._counts.device):
                amax = self._compute_amax(method, stride, start_bin, percentile)
            if memo is None:
                return amax
            memo[key] = amax
        return memo[key].clone()

    def _amax_memo(self) -> dict | None:
        """The amaxes computed on the histogram as it is now: emptied when the state changes (a new tensor, or an
        in-place change, which bumps a tensor's version). The memo holds the tensors themselves, so an identity
        it compares cannot be reused by another tensor. None (no memo) for a histogram collected under
        ``torch.inference_mode`` (Lightning's validate): inference tensors keep no version."""
        tensors = (self._counts, self._width, self._nbins, self._absmax)
        if self._tracks_samples and self._sample_absmax_sum is not None:
            tensors += (self._sample_absmax_sum,)
        if any(t.is_inference() for t in tensors):
            return None
        state = tuple((t, t._version) for t in tensors)
        held = getattr(self, "_memo_state", None)
        if held is None or len(held) != len(state) or any(a is not b or va != vb
                                                           for (a, va), (b, vb) in zip(held, state)):
            self._memo_state, self._memo = state, {}
        return self._memo

    def _compute_amax(self, method, stride, start_bin, percentile):
        width, n = self._width.double(), self._nbins
        if method == "max":
            amax = self._absmax.double()
        elif method == "sample_mean":
            amax = (self._sample_absmax_sum / self._sample_count.clamp_min(1)).reshape(1)
        elif method == "entropy":
            if self._num_bits == (4, 3):
                raise ValueError("entropy calibration needs integer num_bits; use 'mse' or 'percentile' for FP8")
            amax = compute_amax_entropy(self._counts, width, self._num_bits, self._unsigned, stride, start_bin, n)
        elif method == "mse":
            amax = compute_amax_mse(self._counts, width, self._num_bits, self._unsigned, stride, start_bin, n)
        else:
            amax = compute_amax_percentile(self._counts, width, percentile, n)
        if method != "max":
            # the grid's top edge can lie past the data (grown or coarsened bins): above the largest |x| seen
            # a candidate only loses resolution
            amax = torch.minimum(amax, self._absmax.double().reshape(amax.shape))
        amax = amax.float()
        return amax.reshape(self._amax_shape) if self._axis is not None else amax.reshape(())

    # ------------------------------------------------------------------ merge / sync
    def _merge_custom(self, other: "HistogramCalibrator") -> None:
        if other._counts is None:
            return
        if self._counts is None:
            for name in ("_counts", "_width", "_nbins", "_absmax"):
                setattr(self, name, getattr(other, name).clone())
            self._amax_shape = list(other._amax_shape)
            return
        if self._counts.shape[0] != other._counts.shape[0] or list(self._amax_shape) != list(other._amax_shape):
            raise ValueError(f"cannot merge histograms of {self._counts.shape[0]} and {other._counts.shape[0]} "
                             f"row(s) (amax shapes {self._amax_shape} / {other._amax_shape})")
        dev = self._counts.device
        w = torch.maximum(self._width, other._width.to(dev))  # the coarser grid: exact when the widths nest
        a, na = regrid(self._counts, self._width, self._nbins, w)
        b, nb = regrid(other._counts.to(dev), other._width.to(dev), other._nbins.to(dev), w)
        n = torch.maximum(na, nb)
        cols = int(n.max())
        self._counts = pad(a, cols) + pad(b, cols)
        self._width, self._nbins = w, n
        self._absmax = torch.maximum(self._absmax, other._absmax.to(dev))

    def _sync_custom(self, process_group) -> None:
        dist = torch.distributed
        meta = None if self._counts is None else (self._counts.shape[0], tuple(self._amax_shape))
        metas = [m for m in _gather_objects(meta, process_group) if m is not None]
        if not metas:
            return
        if len(set(metas)) != 1:
            raise ValueError(f"cannot sync histograms across ranks: shapes differ {metas}")
        C, amax_shape = metas[0]
        dev = _comm_device(self._counts, process_group)
        home = self._counts.device if self._counts is not None else torch.device("cpu")
        if self._counts is None:  # a rank that saw nothing contributes nothing
            counts = torch.zeros(C, 1, dtype=torch.int64, device=dev)
            w = torch.zeros(C, dtype=torch.float32, device=dev)
            n = torch.zeros(C, dtype=torch.int64, device=dev)
            absmax = torch.zeros(C, dtype=torch.float32, device=dev)
        else:
            counts, w, n, absmax = (t.to(dev) for t in (self._counts, self._width, self._nbins, self._absmax))
        # 1. agree on the grid (the coarsest width), 2. re-bin onto it, 3. sum the counts
        w_all = w.clone()
        dist.all_reduce(w_all, op=dist.ReduceOp.MAX, group=process_group)
        counts, n = regrid(counts, w, n, w_all)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=process_group)
        counts = pad(counts, int(n.max())).contiguous()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=process_group)
        absmax = absmax.clone()
        dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=process_group)
        self._counts, self._width, self._nbins, self._absmax = (t.to(home) for t in (counts, w_all, n, absmax))
        self._amax_shape = list(amax_shape)

    def __repr__(self) -> str:
        s = super().__repr__()[:-1]
        if self._counts is not None:
            top = self._width.double() * self._nbins
            s += f", bins={_fmt(self._nbins)}, range={_fmt(top)}"
        return s + ")"


def _fmt(t: torch.Tensor) -> str:
    if t.numel() == 1:
        return f"{float(t):.4g}"
    return f"[{float(t.min()):.4g}, {float(t.max()):.4g}]"


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
        rng = MaxCalibrator(q.num_bits, axis, q.unsigned)
        for w in weights:
            rng.collect(w)
        if method == "max" or rng.compute_amax() is None:
            amax = rng.compute_amax()
        else:  # the range is known: one histogram of all the weights on [0, absmax], as the reference bins them
            cal = HistogramCalibrator(q.num_bits, axis, q.unsigned, num_bins=num_bins).set_range(rng.compute_amax())
            for w in weights:
                cal.collect(w)
            amax = cal.compute_amax(method, percentile=percentile)
        if amax is None:
            continue
        q.name = q._name or name
        if q.amax is not None and tuple(q.amax.shape) != tuple(amax.shape) and not q.learn_amax:
            q.amax = None
        q._set_amax(amax, allow_reshape=True)
        q._axis = axis if axis is not None else (q.axis if amax.numel() > 1 else None)
        out[name] = q.amax
    return out
