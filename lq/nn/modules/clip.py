"""Clip module with optionally learnable bounds (``pytorch_quantization.nn.Clip``).

``Clip(clip_value_min, clip_value_max, learn_min=False, learn_max=False)``
clamps its input to ``[min, max]``. A learnable bound is an ``nn.Parameter``
that receives the PACT gradient: the sum of the incoming gradient over the
elements clipped at that bound (elements inside the range pass their gradient
to the input, the straight-through part).
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from lq.nn.functional import clip

__all__ = ["Clip", "clip"]


def _scalar(value, what: str) -> float:
    """A learnable bound starts from a plain number (as in the reference toolkit: a tensor is refused)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, torch.Tensor)):
        return float(value)
    raise ValueError(f"{what} must be scalar (a Python number) to initialize a learnable bound, "
                     f"got {type(value).__name__}")


class Clip(nn.Module):
    """Clip a tensor to ``[clip_value_min, clip_value_max]``.

    Args:
        clip_value_min: a number or tensor, the lower bound.
        clip_value_max: a number or tensor, the upper bound.
        learn_min: learn the lower bound (initialized from ``clip_value_min``, must be a scalar).
        learn_max: learn the upper bound.
    """

    def __init__(self, clip_value_min, clip_value_max, learn_min=False, learn_max=False):
        super().__init__()
        if learn_min:
            self.clip_value_min = nn.Parameter(torch.tensor(_scalar(clip_value_min, "clip_value_min")))
        else:
            self.clip_value_min = clip_value_min
        if learn_max:
            self.clip_value_max = nn.Parameter(torch.tensor(_scalar(clip_value_max, "clip_value_max")))
        else:
            self.clip_value_max = clip_value_max
        lo, hi = self.clip_value_min, self.clip_value_max
        lo = lo.detach() if isinstance(lo, torch.Tensor) else lo
        hi = hi.detach() if isinstance(hi, torch.Tensor) else hi
        if isinstance(lo, (numbers.Real, torch.Tensor)) and isinstance(hi, (numbers.Real, torch.Tensor)):
            if torch.as_tensor(lo).numel() == 1 and torch.as_tensor(hi).numel() == 1 and float(lo) > float(hi):
                raise ValueError(f"clip_value_min={float(lo)} must be <= clip_value_max={float(hi)}")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return clip(inputs, self.clip_value_min, self.clip_value_max)

    def extra_repr(self) -> str:
        def fmt(v):
            v = v.detach() if isinstance(v, torch.Tensor) else v
            return f"{float(v):.4f}" if torch.as_tensor(v).numel() == 1 else f"tensor{tuple(torch.as_tensor(v).shape)}"

        learned = [n for n, p in (("min", self.clip_value_min), ("max", self.clip_value_max))
                   if isinstance(p, nn.Parameter)]
        s = f"min={fmt(self.clip_value_min)}, max={fmt(self.clip_value_max)}"
        return s + (f", learned={'+'.join(learned)}" if learned else "")
