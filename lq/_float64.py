"""float64 inputs: the ops' reference arithmetic in float64, with the ops' gradients.

The compiled kernels take float32, float16 and bfloat16. The reference toolkit quantizes float64 too (its
kernels dispatch on double), so lq's public functions send float64 tensors here. This module has the
functions of ``torch.ops.lq`` that the public API calls, under the same names and arguments, so a caller
picks its operator set with :func:`ops_for` and writes one call for every dtype. Each function runs
:mod:`lq._reference` (which computes in float64 for float64 inputs) inside an ``autograd.Function`` that
gives the op's gradients (clipped STE for the input, the PACT gradient for a learned amax). The ops' value
checks (amax finite and >= 0, no negative input with ``unsigned``) run in eager mode only, so
``torch.compile`` and ``torch.export`` trace plain tensor arithmetic without a data-dependent branch.
"""

from __future__ import annotations

import sys

import torch

from lq import _checks, _ops, _reference


def ops_for(x: torch.Tensor):
    """``torch.ops.lq`` for the kernels' dtypes; this module (same function names and arguments) for float64.

    The choice depends on the dtype only, which tracing knows, so it is no data-dependent branch.
    """
    return sys.modules[__name__] if x.dtype == torch.float64 else torch.ops.lq


def _check_values(x: torch.Tensor, amax, unsigned: bool) -> None:
    if _checks.eager(x):
        if amax is not None:
            _checks.check_amax_values(amax)
        _checks.check_unsigned_input(x, unsigned)


class _Scaled(torch.autograd.Function):
    """fake_quant, quant and scaled_e4m3: the reference's values, the ops' gradients."""

    @staticmethod
    def forward(ctx, x, amax, kind, num_bits, unsigned, narrow_range):
        _check_values(x, amax, unsigned)
        ctx.save_for_backward(x, amax)
        if kind == "e4m3":
            return _reference.scaled_e4m3(x, amax)
        if kind == "fake":
            return _reference.fake_quant(x, amax, num_bits, unsigned, narrow_range)
        outputs, scale = _reference.quant(x, amax, num_bits, unsigned, narrow_range)
        ctx.mark_non_differentiable(scale)
        return outputs, scale

    @staticmethod
    def backward(ctx, grad, *unused):
        x, amax = ctx.saved_tensors
        grad_x = _reference.fake_quant_backward(grad, x, amax) if ctx.needs_input_grad[0] else None
        grad_amax = _ops.clip_amax_grad(grad, x, amax) if ctx.needs_input_grad[1] else None
        return grad_x, grad_amax, None, None, None, None


class _Affine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, min_range, max_range, num_bits):
        ctx.save_for_backward(x, min_range, max_range)
        return _reference.fake_affine_quant(x, min_range, max_range, num_bits)

    @staticmethod
    def backward(ctx, grad):
        x, lo, hi = ctx.saved_tensors
        return _reference.fake_affine_quant_backward(grad, x, lo, hi), None, None, None


class _DynamicBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, block_size, num_bits, unsigned, narrow_range):
        _check_values(x, None, unsigned)
        return _reference.fake_dynamic_block_quant(x, axis, block_size, num_bits, unsigned, narrow_range)

    @staticmethod
    def backward(ctx, grad):
        # A dynamic amax bounds every value of its block, so the clipped STE passes everything (as the op).
        return grad, None, None, None, None, None


def fake_quant(x, amax, num_bits, unsigned, narrow_range):
    return _Scaled.apply(x, amax, "fake", num_bits, unsigned, narrow_range)


def quant(x, amax, num_bits, unsigned, narrow_range):
    return _Scaled.apply(x, amax, "quant", num_bits, unsigned, narrow_range)


def scaled_e4m3(x, amax):
    return _Scaled.apply(x, amax, "e4m3", 8, False, True)


def fake_quant_out(x, amax, num_bits, unsigned, narrow_range, out):
    with torch.no_grad():
        out.copy_(fake_quant(x, amax, num_bits, unsigned, narrow_range))


def fake_affine_quant(x, min_range, max_range, num_bits):
    return _Affine.apply(x, min_range, max_range, num_bits)


def fake_dynamic_block_quant(x, axis, block_size, num_bits, unsigned, narrow_range):
    return _DynamicBlock.apply(x, axis, block_size, num_bits, unsigned, narrow_range)


fake_quant_backward = _reference.fake_quant_backward
fake_affine_quant_backward = _reference.fake_affine_quant_backward
