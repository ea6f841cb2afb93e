"""Residual add and concatenation with ONE shared input quantizer.

TensorRT keeps an elementwise add (or a concat) in INT8 only when all of its
inputs carry the same scale; ``QuantAdd`` and ``QuantCat`` quantize every
input with the same ``_input_quantizer`` (one amax, calibrated over all of
them), which is exactly that.

``FloatAdd`` / ``FloatCat`` are the float modules to write in a model
(``self.add = FloatAdd()`` ... ``self.add(x, residual)``); conversion
(:func:`lq.convert.quantize_model`) turns them into ``QuantAdd`` / ``QuantCat``.
"""

from __future__ import annotations

import torch
from torch import nn

from lq.nn.modules._utils import QuantInputMixin, quant_class

__all__ = ["FloatAdd", "FloatCat", "QuantAdd", "QuantCat"]


class FloatAdd(nn.Module):
    """``input + other`` as a module (a placeholder that conversion quantizes)."""

    def forward(self, input, other):
        return input + other


class FloatCat(nn.Module):
    """``torch.cat(tensors, dim)`` as a module (a placeholder that conversion quantizes)."""

    def __init__(self, dim: int = 0):
        super().__init__()
        self.dim = dim

    def extra_repr(self) -> str:
        return f"dim={self.dim}"

    def forward(self, tensors):
        return torch.cat(tuple(tensors), dim=self.dim)


@quant_class
class QuantAdd(FloatAdd, QuantInputMixin):
    """``q(input) + q(other)`` with one quantizer (one amax) for both operands."""

    def forward(self, input, other):
        q = self._input_quantizer
        return q(input) + q(other)


@quant_class
class QuantCat(FloatCat, QuantInputMixin):
    """``torch.cat([q(t) for t in tensors], dim)`` with one quantizer (one amax) for all inputs."""

    def forward(self, tensors):
        q = self._input_quantizer
        return torch.cat([q(t) for t in tensors], dim=self.dim)
