"""``reduce_amax``: the largest magnitude of a tensor over some of its dims (``pytorch_quantization.utils``)."""

from __future__ import annotations

import torch

__all__ = ["reduce_amax"]


@torch.no_grad()
def reduce_amax(input: torch.Tensor, axis=None, keepdims: bool = True) -> torch.Tensor:
    """Largest ``|input|`` over the dims ``axis`` (an int, a tuple of ints, or None for all of them).

    ``keepdims`` keeps the reduced dims with size 1. As in the reference
    toolkit, a tuple ``axis`` whose result has one element is squeezed to a
    0-dim tensor even with ``keepdims``. No gradient is tracked.
    """
    a = input.abs()
    if axis is None:
        return a.amax()
    if isinstance(axis, int):
        return a.amax(dim=axis, keepdim=keepdims)
    dims = tuple(axis)
    if len(dims) > input.dim():
        raise ValueError(f"reduce_amax: cannot reduce {len(dims)} axes {dims} of a {input.dim()}-D tensor")
    dims = sorted({d % input.dim() for d in dims}) if input.dim() else []
    out = a.amax(dim=dims, keepdim=True) if dims else a
    return out.squeeze() if not keepdims or out.numel() == 1 else out
