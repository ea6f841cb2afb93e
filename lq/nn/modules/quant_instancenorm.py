"""Quantized instance normalization: the input is quantized, the normalization is float."""

from __future__ import annotations

from torch import nn

from lq.nn.modules._utils import input_quant_class

__all__ = [
    "QuantInstanceNorm1d", "QuantInstanceNorm2d", "QuantInstanceNorm3d",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
]  # fmt: skip


def _norm(float_cls):
    return input_quant_class(float_cls, __name__)


QuantInstanceNorm1d = _norm(nn.InstanceNorm1d)
QuantInstanceNorm2d = _norm(nn.InstanceNorm2d)
QuantInstanceNorm3d = _norm(nn.InstanceNorm3d)

InstanceNorm1d = QuantInstanceNorm1d
InstanceNorm2d = QuantInstanceNorm2d
InstanceNorm3d = QuantInstanceNorm3d
