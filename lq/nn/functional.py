"""Functional helpers of the quantized layers (``pytorch_quantization.nn.functional``): ``clip``.

``torch.clamp`` takes tensor bounds that broadcast, but gives a bound no useful gradient where the input
sits exactly on it and knows nothing of learned ranges. ``clip`` is the PACT-style clip that learned
ranges need: the input's gradient passes strictly inside ``(min, max)``; a bound that requires grad gets
the sum of the incoming gradient over the elements clipped at it. A learned bound is one number (per
tensor): bounds of any other shape raise in backward, as the reference toolkit does.
"""

from __future__ import annotations

import torch

__all__ = ["ClipFunction", "clip"]


def _bound(value, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), dtype=like.dtype, device=like.device)


class ClipFunction(torch.autograd.Function):
    """``min(max(x, lo), hi)`` with broadcasting bounds and PACT gradients for learnable scalar bounds."""

    @staticmethod
    def forward(ctx, inputs, clip_value_min, clip_value_max):
        lo, hi = _bound(clip_value_min, inputs), _bound(clip_value_max, inputs)
        ctx.save_for_backward(inputs, lo, hi)
        return torch.maximum(torch.minimum(inputs, hi.to(inputs.dtype)), lo.to(inputs.dtype))

    @staticmethod
    def backward(ctx, grad):
        inputs, lo, hi = ctx.saved_tensors
        above_lo = inputs > lo
        below_hi = inputs < hi
        grad_in = grad * (above_lo & below_hi).to(grad.dtype)
        need_lo, need_hi = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if (need_lo or need_hi) and (lo.numel() != 1 or hi.numel() != 1):
            raise ValueError(f"learnable clip bounds can only be scalar, got shapes {tuple(lo.shape)} and "
                             f"{tuple(hi.shape)}")
        grad_lo = (grad * (~above_lo).to(grad.dtype)).sum().to(lo.dtype).reshape(lo.shape) if need_lo else None
        grad_hi = (grad * (~below_hi).to(grad.dtype)).sum().to(hi.dtype).reshape(hi.shape) if need_hi else None
        return grad_in, grad_lo, grad_hi


def clip(inputs: torch.Tensor, clip_value_min, clip_value_max) -> torch.Tensor:
    """Clip ``inputs`` to ``[clip_value_min, clip_value_max]`` (numbers or broadcasting tensors)."""
    return ClipFunction.apply(inputs, clip_value_min, clip_value_max)
