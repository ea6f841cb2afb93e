"""Quantized instance normalization: the input is quantized, the normalization is float."""

from __future__ import annotations

from torch import nn

from lq.nn.modules._utils import QuantInputMixin, quant_class

__all__ = [
    "QuantInstanceNorm1d", "QuantInstanceNorm2d", "QuantInstanceNorm3d",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
]  # fmt: skip


def _forward(self, input):
    return self._float_module.forward(self, self._input_quantizer(input))


def _norm(float_cls):
    name = "Quant" + float_cls.__name__
    cls = type(
        name,
        (float_cls, QuantInputMixin),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"``nn.{float_cls.__name__}`` applied to its quantized input (per tensor by default).",
            "forward": _forward,
        },
    )
    return quant_class(cls)


QuantInstanceNorm1d = _norm(nn.InstanceNorm1d)
QuantInstanceNorm2d = _norm(nn.InstanceNorm2d)
QuantInstanceNorm3d = _norm(nn.InstanceNorm3d)

InstanceNorm1d = QuantInstanceNorm1d
InstanceNorm2d = QuantInstanceNorm2d
InstanceNorm3d = QuantInstanceNorm3d
