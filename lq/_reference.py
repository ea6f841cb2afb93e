"""Pure-PyTorch reference implementation of every ``torch.ops.lq`` op.

This module is the single definition of lq's numerics. The C++ and CUDA
kernels are tested bit for bit against these functions, and these functions
are what the ops run where the extension cannot be built (or where
``LQ_DISABLE_EXT=1``).

Every function here computes exactly what its kernel computes, in the same
order of floating point operations (all arithmetic in float32, the result
cast back to the input dtype), so that "bit for bit" is a meaningful test.
float64 inputs, which the compiled kernels do not take, are computed here in
float64 (``compute_dtype``), as the reference toolkit does.

Argument checks live in :mod:`lq._checks` and are called by the op layer,
not here, so the reference stays a plain description of the arithmetic.
"""

from __future__ import annotations

import torch

#: amax at or below this value quantizes everything to zero (smallest fp16
#: subnormal is 2^-24; a calibrated all-zero channel ends up here).
AMAX_EPSILON = 2.0**-24

#: Largest finite FP8 E4M3 (``e4m3fn``) value.
E4M3_MAX = 448.0


def int_bounds(num_bits: int, unsigned: bool, narrow_range: bool) -> tuple[float, float]:
    """Return ``(min_bound, max_bound)`` of the integer grid.

    ``max_bound = 2^(num_bits - 1 + unsigned) - 1``; the signed range is
    ``[-max_bound, max_bound]`` with ``narrow_range`` and
    ``[-max_bound - 1, max_bound]`` without; unsigned is ``[0, max_bound]``.
    """
    max_bound = float(2 ** (num_bits - 1 + int(unsigned)) - 1)
    if unsigned:
        min_bound = 0.0
    elif narrow_range:
        min_bound = -max_bound
    else:
        min_bound = -max_bound - 1.0
    return min_bound, max_bound


def _fit(amax: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A one-element amax with more dims than ``x`` acts as a scalar (the output keeps x's shape)."""
    return amax.reshape(()) if amax.dim() > x.dim() and amax.numel() == 1 else amax


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything else (float16 and bfloat16 never overflow there)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def int_scale(amax: torch.Tensor, max_bound: float) -> torch.Tensor:
    """``max_bound / amax`` as one IEEE division in amax's dtype, as pytorch-quantization's kernels and its
    tensor-by-tensor formula compute it.

    Not ``max_bound / amax`` with a Python number on the left: torch evaluates that as
    ``amax.reciprocal() * max_bound`` (two roundings), which differs in the last bit for some amax and so
    moves dequantized values by one ulp.
    """
    return torch.full_like(amax, max_bound) / amax


def quant_scale(amax: torch.Tensor, num_bits: int, unsigned: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`int_scale` in float32 (float64 for float64 inputs), and 0 where ``amax <= AMAX_EPSILON``."""
    amax = amax.to(dtype)
    _, max_bound = int_bounds(num_bits, unsigned, True)
    scale = int_scale(amax, max_bound)
    return torch.where(amax <= AMAX_EPSILON, torch.zeros_like(scale), scale)


def _quantize(x: torch.Tensor, scale: torch.Tensor, num_bits: int, unsigned: bool, narrow_range: bool):
    min_bound, max_bound = int_bounds(num_bits, unsigned, narrow_range)
    # torch.round is round-half-to-even; clamp keeps NaN as NaN.
    return torch.clamp(torch.round(x.to(scale.dtype) * scale), min_bound, max_bound)


def fake_quant(x, amax, num_bits: int = 8, unsigned: bool = False, narrow_range: bool = True):
    """Quantize to the integer grid and dequantize: ``round(x * s) / s``, ``s = max_bound / amax``.

    ``amax`` broadcasts against ``x`` (a scalar for per-tensor, size-1 dims
    elsewhere for per-channel). Where ``amax <= 2^-24`` the output is 0.
    """
    scale = quant_scale(_fit(amax, x), num_bits, unsigned, compute_dtype(x))
    q = _quantize(x, scale, num_bits, unsigned, narrow_range)
    out = torch.where(scale == 0, torch.zeros_like(q), q / scale)
    return out.to(x.dtype)


def fake_quant_backward(grad, x, amax):
    """Straight-through estimator with clipping: ``grad`` where ``|x| <= amax`` (inclusive), else 0."""
    cd = compute_dtype(x)
    inside = x.to(cd).abs() <= _fit(amax, x).to(cd)
    return torch.where(inside, grad, torch.zeros_like(grad))


def quant(x, amax, num_bits: int = 8, unsigned: bool = False, narrow_range: bool = True):
    """Real quantization: integer values (stored in ``x.dtype``) and the float32 scale.

    ``outputs / scale`` dequantizes. Where ``amax <= 2^-24`` the outputs are 0
    and the returned scale is 1 (any scale dequantizes 0 to 0).
    """
    scale = quant_scale(amax, num_bits, unsigned, compute_dtype(x))
    q = _quantize(x, _fit(scale, x), num_bits, unsigned, narrow_range)
    scale_out = torch.where(scale == 0, torch.ones_like(scale), scale)
    return q.to(x.dtype), scale_out.float()


def affine_params(min_range, max_range, num_bits: int, dtype: torch.dtype = torch.float32):
    """``(step_size, zero_point, min_bound, max_bound)`` of gemmlowp-style affine quantization, in ``dtype``."""
    min_range = min_range.to(dtype)
    max_range = max_range.to(dtype)
    step = (max_range - min_range) / float(2**num_bits - 1)
    min_bound = -float(2 ** (num_bits - 1))
    max_bound = float(2 ** (num_bits - 1) - 1)
    zero_point = torch.round(min_range / step) - min_bound
    return step, zero_point, min_bound, max_bound


def fake_affine_quant(x, min_range, max_range, num_bits: int = 8):
    """Affine fake quantization: ``(clamp(round(x / step) - zp) + zp) * step``."""
    cd = compute_dtype(x)
    step, zp, min_bound, max_bound = affine_params(_fit(min_range, x), _fit(max_range, x), num_bits, cd)
    q = torch.clamp(torch.round(x.to(cd) / step) - zp, min_bound, max_bound)
    return ((q + zp) * step).to(x.dtype)


def fake_affine_quant_backward(grad, x, min_range, max_range):
    """STE with clipping to ``[min_range, max_range]`` (inclusive)."""
    cd = compute_dtype(x)
    xf = x.to(cd)
    inside = (xf >= _fit(min_range, x).to(cd)) & (xf <= _fit(max_range, x).to(cd))
    return torch.where(inside, grad, torch.zeros_like(grad))


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float32 ``v`` to the nearest FP8 E4M3 value (half to even), saturating at ±448."""
    v = torch.clamp(v, -E4M3_MAX, E4M3_MAX)
    return v.to(torch.float8_e4m3fn).float()


def scaled_e4m3(x, amax):
    """FP8 E4M3 fake quantization: scale by ``448 / amax``, round to E4M3, scale back.

    The scale is ``448.0 / amax`` as torch evaluates a Python number over a tensor (reciprocal, then
    multiply), which is what pytorch-quantization's ``scaled_e4m3`` computes. Where ``amax <= 2^-24`` the
    output is 0. float64 inputs are scaled in float64 and rounded to E4M3 through float32, as the reference
    toolkit's kernel does.
    """
    cd = compute_dtype(x)
    amax = _fit(amax, x).to(cd)
    scale = E4M3_MAX / amax
    scale = torch.where(amax <= AMAX_EPSILON, torch.zeros_like(scale), scale)
    y = round_to_e4m3((x.to(cd) * scale).float()).to(cd)
    out = torch.where(scale == 0, torch.zeros_like(y), y / scale)
    return out.to(x.dtype)


def _block_view(x: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """View ``x`` as ``(outer, n // block, block, inner)`` with the blocks along ``axis``."""
    axis = axis % x.dim() if x.dim() else 0
    shape = x.shape
    outer = 1
    for s in shape[:axis]:
        outer *= s
    inner = 1
    for s in shape[axis + 1 :]:
        inner *= s
    n = shape[axis]
    return x.reshape(outer, n // block_size, block_size, inner)


def block_amax(x, axis: int, block_size: int) -> torch.Tensor:
    """Per-block ``abs().amax()`` as float32 (float64 for float64 inputs), shaped ``(outer, n // block, 1, inner)``."""
    xb = _block_view(x, axis, block_size)
    cd = compute_dtype(x)
    if xb.numel() == 0:
        return torch.zeros(xb.shape[0], xb.shape[1], 1, xb.shape[3], dtype=cd, device=x.device)
    return xb.to(cd).abs().amax(dim=2, keepdim=True)


def fake_dynamic_block_quant(x, axis: int, block_size: int, num_bits: int = 8, unsigned: bool = False,
                             narrow_range: bool = True):
    """Block quantization with the amax of each block computed from the block itself."""
    xb = _block_view(x, axis, block_size)
    amax = block_amax(x, axis, block_size)
    out = fake_quant(xb, amax, num_bits, unsigned, narrow_range).reshape(x.shape)
    return torch.empty_like(x).copy_(out)  # the layout of empty_like(x), as the fake impl promises


def abs_histogram(x, range_max, num_bins: int, axis: int | None = None):
    """Histogram of ``|x|`` over ``num_bins`` equal bins on ``[0, range_max]``, in one pass.

    Returns ``(counts, absmax, nonfinite)``:

    * ``counts`` (int64): ``(num_bins,)`` per tensor, ``(C, num_bins)`` with
      ``axis`` (``C = x.shape[axis]``, ``range_max`` of shape ``(C,)``, each
      channel binned on its own range);
    * ``absmax`` (float32, ``()`` or ``(C,)``): the largest finite ``|x|``
      (0 when there is none), so a caller can grow its range;
    * ``nonfinite`` (int64, ``()`` or ``(C,)``): how many NaN/Inf were skipped.

    Bin of ``a = |x|``: ``min(floor(a * (num_bins / range_max)), num_bins - 1)``
    with ``num_bins / range_max`` computed once in float32; values with
    ``a > range_max`` (or non-finite) are not counted. ``range_max <= 0``
    counts only zeros, into bin 0.
    """
    xf = x.float()
    if axis is None:
        xc = xf.reshape(1, -1)
        rng = range_max.float().reshape(1)
    else:
        xc = xf.movedim(axis, 0).reshape(x.shape[axis], -1)
        rng = range_max.float().reshape(-1)
    a = xc.abs()
    finite = torch.isfinite(a)
    nonfinite = (~finite).sum(dim=1)
    a = torch.where(finite, a, torch.zeros_like(a))
    absmax = a.amax(dim=1) if a.shape[1] else torch.zeros(a.shape[0], device=x.device)
    inv = torch.where(rng > 0, num_bins / rng, torch.zeros_like(rng)).unsqueeze(1)
    idx = torch.clamp(torch.floor(a * inv), max=num_bins - 1).long()
    keep = finite & (a <= rng.unsqueeze(1)) & ((rng.unsqueeze(1) > 0) | (a == 0))
    counts = torch.zeros(a.shape[0], num_bins, dtype=torch.int64, device=x.device)
    counts.scatter_add_(1, torch.where(keep, idx, torch.zeros_like(idx)), keep.long())
    if axis is None:
        return counts[0], absmax[0], nonfinite[0]
    return counts, absmax, nonfinite
