"""Fake quantization in ops that ``torch.onnx.export`` translates by itself (``lq.enable_onnx_export()``).

Inside ``lq.enable_onnx_export()`` (``TensorQuantizer.use_fb_fake_quant``)
quantizers leave lq's custom ops and compute with stock PyTorch ops, so a
plain ``torch.onnx.export(model, ...)`` works with either exporter and no
custom translation table:

* integers: ``torch.fake_quantize_per_tensor_affine`` / ``..._per_channel_affine``
  (scale ``amax / maxbound``, zero point 0), which both exporters turn into
  QuantizeLinear/DequantizeLinear. ONNX has no narrow-range Q/DQ, so narrow
  range is exact as a clip of the input to ``[-amax, amax]`` before a full-range
  Q/DQ (no input lands on ``-maxbound - 1`` then). float16/bfloat16 inputs are
  quantized in float32 and cast back, as lq's kernels do.
* FP8 E4M3: written out with elementwise float ops (:func:`round_to_e4m3`), valid
  at every opset (float8 types need opset 19; ``lq.export.export_onnx`` writes
  real FP8 Q/DQ there).

Every function is free of data-dependent Python branches (``torch.export``
traces it). lq's own export (:func:`lq.export.export_onnx`) does not use this
path: it lowers lq's ops itself.
"""

from __future__ import annotations

import torch

from lq import _reference

__all__ = ["fake_int_quant", "scaled_e4m3", "round_to_e4m3"]


def fake_int_quant(x: torch.Tensor, amax: torch.Tensor, num_bits: int, unsigned: bool, narrow_range: bool,
                   axis: int | None) -> torch.Tensor:
    """Integer fake quantization with PyTorch's fake-quantize ops; ``axis`` is the channel axis of a per-channel
    ``amax`` (None: per tensor). Returns ``x``'s dtype."""
    min_bound, max_bound = _reference.int_bounds(num_bits, unsigned, narrow_range=False)
    amax = amax.detach().float()
    xf = x.float()
    if narrow_range and not unsigned:
        # The narrow grid as a clip: |x| <= amax quantizes to at most maxbound in magnitude.
        xf = torch.clamp(xf, -amax, amax)
    scale = torch.clamp(amax, min=_reference.AMAX_EPSILON) / max_bound
    if axis is None:
        zero = torch.zeros((), dtype=torch.int32, device=x.device)
        out = torch.fake_quantize_per_tensor_affine(xf, scale.reshape(()), zero, int(min_bound), int(max_bound))
    else:
        zero = torch.zeros(scale.numel(), dtype=torch.int32, device=x.device)
        out = torch.fake_quantize_per_channel_affine(xf, scale.reshape(-1), zero, axis, int(min_bound),
                                                     int(max_bound))
    return out.to(x.dtype)


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """:func:`lq._reference.round_to_e4m3` (nearest E4M3 value, half to even, saturating at ±448) bit for bit,
    in ops every ONNX opset has: the step of ``v``'s binade is a power of two, so ``round(v / step) * step`` is the
    rounding, exact in float32."""
    v = torch.clamp(v.float(), -_reference.E4M3_MAX, _reference.E4M3_MAX)
    a = v.abs()
    e = torch.floor(torch.log2(a))
    p = torch.exp2(e)
    # log2 may be off by one next to a power of two: correct it against the exact power.
    e = e - (p > a).float() + (2.0 * p <= a).float()
    # 3 mantissa bits; below 2^-6 (subnormals, and 0) the step stays 2^-9.
    step = torch.exp2(torch.clamp(e, min=-6.0) - 3.0)
    return torch.round(v / step) * step


def scaled_e4m3(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """:func:`lq._reference.scaled_e4m3` with :func:`round_to_e4m3` of this module (same numerics, exportable)."""
    amax = amax.detach().float()
    scale = _reference.E4M3_MAX / amax
    tiny = amax <= _reference.AMAX_EPSILON
    scale = torch.where(tiny, torch.zeros_like(scale), scale)
    y = round_to_e4m3(x.float() * scale)
    out = torch.where(scale == 0, torch.zeros_like(y), y / scale)
    return out.to(x.dtype)
