"""The amax searches of the histogram calibrator: entropy (TensorRT's KL divergence), MSE, percentile.

Each takes a histogram of ``|x|`` — ``counts`` ``(N,)`` or ``(C, N)`` with bins
``[j * width, (j + 1) * width)`` — and returns amax for every row at once.
They implement the reference toolkit's algorithms on the grid they are given
(candidates, objective and tie-breaking alike); only the evaluation is
different: all candidates together with tensor ops, in cache-sized chunks, on
the histogram's device, instead of one Python iteration per candidate.

* entropy tries ``amax = edges[i]`` for ``i in range(start_bin, n + 1, stride)``
  and takes the LAST minimum of the KL divergence;
* mse tries ``amax = centers[i]`` for ``i in range(start_bin, n, stride)`` and
  takes the FIRST minimum of the count-weighted squared fake-quantization error;
* percentile takes ``edges[i]`` for the first bin ``i`` where the CDF reaches
  ``percentile`` % (the left edge of that bin, as the reference does).

``n`` is the row's number of bins in use: ``nbins[c]`` when given (rows of a
per-channel histogram may use fewer bins than the tensor holds; the rest are
empty), else ``N``.
"""

from __future__ import annotations

import math

import torch

from lq import _reference

__all__ = ["compute_amax_entropy", "compute_amax_mse", "compute_amax_percentile", "serial_cpu"]

_ENTROPY_CHUNK = 1 << 15  # (candidate, group) cells per chunk: float64 working set stays in cache
_MSE_CHUNK = 1 << 16  # (candidate, center) cells per chunk


class serial_cpu:
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


def _rows(counts, width, nbins):
    """``(counts (C, N) float64, width (C,) float64, nbins (C,) int64, squeeze)``."""
    counts = torch.as_tensor(counts)
    squeeze = counts.dim() == 1
    b = counts.double()
    if squeeze:
        b = b.unsqueeze(0)
    C, N = b.shape
    w = torch.as_tensor(width, dtype=torch.float64, device=b.device).reshape(-1)
    if w.numel() == 1 and C != 1:
        w = w.expand(C)
    if nbins is None:
        n = torch.full((C,), N, dtype=torch.int64, device=b.device)
    else:
        n = torch.as_tensor(nbins, dtype=torch.int64, device=b.device).reshape(-1).clamp(max=N)
        if n.numel() == 1 and C != 1:
            n = n.expand(C)
    return b, w, n, squeeze


def _finish(amax, b, squeeze):
    amax = torch.where(b.sum(1) > 0, amax, torch.zeros_like(amax))  # no data: 0
    return amax[0] if squeeze else amax


def _entropy(counts, width, num_bits=8, unsigned=False, stride=1, start_bin=128, nbins=None):
    """amax minimizing TensorRT's KL divergence, for every row of ``counts`` at once.

    For candidate ``i`` the reference distribution P is ``counts[:i]`` with the
    tail ``counts[i:]`` added to bin ``i - 1``; the candidate distribution Q
    merges bin ``j`` into quantized bin ``floor(j * nq / i)``
    (``nq = 2^(num_bits - 1 + unsigned)``) and spreads each group's count
    evenly over its non-empty bins (empty bins stay empty). Both use
    ``counts[0] := counts[1]``. All candidates are evaluated together from
    prefix sums: ``KL = sum P log P - sum P log Q`` with group sums from
    cumulative counts (float64, in chunks of candidates). A candidate where Q
    is 0 and P is not has infinite divergence. Returns float64 amax ``(C,)``
    (a scalar for 1-D ``counts``).
    """
    b, w, n_used, squeeze = _rows(counts, width, nbins)
    C, N = b.shape
    dev = b.device
    b = b.clone()
    if N > 1:
        b[:, 0] = b[:, 1]
    shift = num_bits - 1 + int(unsigned)
    nq = 1 << shift
    cand = torch.arange(start_bin, N + 1, stride, device=dev)
    if cand.numel() == 0:
        raise ValueError(f"no entropy candidates: start_bin={start_bin} must be <= the number of bins ({N})")
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
    g_last = (last * nq) // cand  # group of bin i - 1
    # per (candidate, group): group sums from prefix sums, in chunks of candidates
    g = torch.arange(nq + 1, device=dev)
    A = torch.empty(C, cand.numel(), dtype=torch.float64, device=dev)
    log_ql = torch.empty_like(A)
    step = max(1, _ENTROPY_CHUNK // (C * (nq + 1)))
    for k0 in range(0, cand.numel(), step):
        ci = cand[k0:k0 + step]
        E = ((g.reshape(1, -1) * ci.reshape(-1, 1) + (nq - 1)) >> shift).reshape(-1)  # group starts
        S = cs.index_select(1, E).reshape(C, -1, nq + 1).diff(dim=2)  # (C, k, nq) group sums
        M = cn.index_select(1, E).reshape(C, -1, nq + 1).diff(dim=2)  # non-empty bins per group
        A[:, k0:k0 + step] = (torch.xlogy(S, S) - torch.xlogy(S, M)).sum(2)  # sum_g S log(S / M)
        gl = g_last[k0:k0 + step].reshape(1, -1, 1).expand(C, -1, 1)
        S_l, M_l = S.gather(2, gl).squeeze(2), M.gather(2, gl).squeeze(2)
        log_ql[:, k0:k0 + step] = torch.log(torch.where(S_l > 0, S_l, 1.0)) - torch.log(torch.where(M_l > 0, M_l, 1.0))
    Bsafe = torch.where(Bi > 0, Bi, torch.ones_like(Bi))
    logBi = torch.log(Bsafe)
    sum_plogq = (A - Bi * logBi) / Tsafe + torch.where(tail > 0, tail / Tsafe * (log_ql - logBi), 0.0)
    kl = sum_plogp - sum_plogq
    bad = (Bi <= 0) | ((tail > 0) & (b_last <= 0))  # Q = 0 where P > 0: infinite divergence
    bad |= cand.reshape(1, -1) > n_used.reshape(-1, 1)  # past the row's last bin
    kl = torch.where(bad, torch.full_like(kl, math.inf), kl)
    K = kl.shape[1]
    best = K - 1 - torch.argmin(kl.flip(1), dim=1)  # last minimum, like the reference toolkit
    return _finish(cand[best].double() * w, b, squeeze)


def _fake_quant_candidates(c: torch.Tensor, amax: torch.Tensor, num_bits, unsigned: bool) -> torch.Tensor:
    """``fake_tensor_quant(c, amax) - c`` for every candidate: ``c (..., 1, M)``, ``amax (..., K, 1)`` (> 0).

    The same float32 operations as ``lq._reference.fake_quant`` (``scaled_e4m3`` for FP8), in place.
    """
    if num_bits == (4, 3):
        return _reference.scaled_e4m3(c, amax) - c
    _, max_bound = _reference.int_bounds(num_bits, unsigned, True)
    scale = _reference.int_scale(amax, max_bound)
    q = (c * scale).round_().clamp_(-max_bound, max_bound)
    return q.div_(scale).sub_(c)


def _clipped_value(amax: torch.Tensor, num_bits, unsigned: bool) -> torch.Tensor:
    """What ``fake_tensor_quant`` makes of any value above ``amax`` (float32): the top level, dequantized."""
    if num_bits == (4, 3):
        return _reference.scaled_e4m3(amax * 2, amax)
    _, max_bound = _reference.int_bounds(num_bits, unsigned, True)
    return torch.full_like(amax, max_bound) / _reference.int_scale(amax, max_bound)


def _mse(counts, width, num_bits=8, unsigned=False, stride=1, start_bin=128, nbins=None):
    """amax minimizing the count-weighted squared fake-quantization error of the bin centers.

    Candidates ``amax = centers[i]``, ``i in range(start_bin, n, stride)``;
    the error of every (non-empty) center under every candidate, with the
    float32 arithmetic of ``fake_tensor_quant`` (``scaled_e4m3`` for
    ``num_bits=(4, 3)``); weighted sums in float64. First minimum wins.
    Candidates go in ascending chunks: centers below the chunk's largest amax
    are fake-quantized one by one, the centers above it are all clipped to the
    same top level ``t``, so their error ``sum w (t - c)^2`` comes from prefix
    sums of ``w``, ``w c``, ``w c^2``. Returns float64 amax ``(C,)`` (a scalar for 1-D ``counts``).
    """
    b, w, n_used, squeeze = _rows(counts, width, nbins)
    C, N = b.shape
    dev = b.device
    cand = torch.arange(start_bin, N, stride, device=dev)
    if cand.numel() == 0:
        raise ValueError(f"no mse candidates: start_bin={start_bin} must be < the number of bins ({N})")
    K = cand.numel()
    # centers (2j + 1) * w / 2: exact in float32, equal to (edges[1:] + edges[:-1]) / 2
    empty_row = w <= 0
    half_w = torch.where(empty_row, torch.ones_like(w), w / 2).float().reshape(C, 1)
    amax_c = (2 * cand + 1).float().reshape(1, -1) * half_w  # (C, K) float32, ascending
    top = _clipped_value(amax_c, num_bits, unsigned).double()
    out = torch.full((C, K), math.inf, dtype=torch.float64, device=dev)
    k_used = torch.searchsorted(cand, n_used).tolist()  # candidates below each row's bin count
    zero = torch.zeros(1, dtype=torch.float64, device=dev)
    for c in range(C):
        idx = torch.nonzero(b[c] > 0).flatten()  # bins that hold data, ascending
        wc = b[c, idx]
        cen = (2 * idx + 1).float() * half_w[c]
        c64 = cen.double()
        P = [torch.cat([zero, v.cumsum(0)]) for v in (wc, wc * c64, wc * c64 * c64)]
        M, K_c = idx.numel(), k_used[c]
        below = torch.searchsorted(cen, amax_c[c, :K_c], right=True).tolist()  # centers <= amax
        split = [0] * K_c  # per candidate: centers [0, split) one by one, the rest clipped
        k0 = 0
        while k0 < K_c:
            k1 = min(K_c, k0 + max(1, _MSE_CHUNK // max(1, below[k0])))
            m = below[k1 - 1]  # the centers any candidate of the chunk may leave unclipped
            err = _fake_quant_candidates(cen[:m].reshape(1, m), amax_c[c, k0:k1].reshape(-1, 1), num_bits, unsigned)
            out[c, k0:k1] = err.double().square_() @ wc[:m]
            split[k0:k1] = [m] * (k1 - k0)
            k0 = k1
        s_ = torch.tensor(split, dtype=torch.int64, device=dev)
        t = top[c, :K_c]
        tail = [v[M] - v.index_select(0, s_) for v in P]
        out[c, :K_c] += tail[2] - 2 * t * tail[1] + t * t * tail[0]
    best = torch.argmin(out, dim=1)  # first minimum
    amax = amax_c.double().gather(1, best.reshape(-1, 1)).squeeze(1)
    return _finish(torch.where(empty_row, torch.zeros_like(amax), amax), b, squeeze)


def _percentile(counts, width, percentile=99.99, nbins=None):
    """Left edge of the first bin where the CDF of ``counts`` reaches ``percentile`` %."""
    b, w, n_used, squeeze = _rows(counts, width, nbins)
    total = b.sum(1, keepdim=True)
    cdf = b.cumsum(1) / torch.where(total > 0, total, torch.ones_like(total))  # exact integer sums, one division
    target = torch.full((b.shape[0], 1), percentile / 100.0, dtype=torch.float64, device=b.device)
    idx = torch.minimum(torch.searchsorted(cdf, target).squeeze(1), n_used)
    return _finish(idx.double() * w, b, squeeze)


def compute_amax_entropy(counts, width, num_bits=8, unsigned=False, stride=1, start_bin=128, nbins=None):
    with serial_cpu(torch.as_tensor(counts).device):
        return _entropy(counts, width, num_bits, unsigned, stride, start_bin, nbins)


def compute_amax_mse(counts, width, num_bits=8, unsigned=False, stride=1, start_bin=128, nbins=None):
    with serial_cpu(torch.as_tensor(counts).device):
        return _mse(counts, width, num_bits, unsigned, stride, start_bin, nbins)


def compute_amax_percentile(counts, width, percentile=99.99, nbins=None):
    with serial_cpu(torch.as_tensor(counts).device):
        return _percentile(counts, width, percentile, nbins)


compute_amax_entropy.__doc__ = _entropy.__doc__
compute_amax_mse.__doc__ = _mse.__doc__
compute_amax_percentile.__doc__ = _percentile.__doc__
