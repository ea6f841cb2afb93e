"""Quantized gated activations: SiLU = ``x * sigmoid(x)`` and HardSwish = ``x * hardsigmoid(x)``.

Both quantize ``x`` (their input) and the gate, so the product reads two quantized tensors: onnxruntime then
runs ``DQ -> Sigmoid -> Q`` as ``QLinearSigmoid`` (HardSigmoid runs float between its Q/DQ) and the product
as ``QLinearMul``, the way its own ``quantize_static`` files do, instead of a float SiLU/HardSwish between a
DequantizeLinear and a QuantizeLinear. The gate lies in ``[0, 1]``: its quantizer is the input's descriptor
made unsigned (asymmetric descriptors calibrate ``[0, max]`` themselves). The product is quantized by
whatever reads it (the next layer's input quantizer). Used where the recipe asks for it
(:attr:`lq.config.QuantConfig.activations`); not part of the reference toolkit's module set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lq.nn.modules._utils import QuantInputMixin, _tensor_quantizer_cls, quant_class

__all__ = ["QuantSiLU", "QuantHardswish", "ACTIVATION_MODULE_CLASSES"]


def gate_descriptor(desc):
    """The gate's grid: the input's, on ``[0, 1]`` (unsigned, or the input's own affine calibration)."""
    if desc.asymmetric or desc.unsigned or desc.is_fp8 or desc.axis is not None or desc.block_sizes is not None:
        return desc
    return type(desc)(**{**desc.dict(), "unsigned": True, "narrow_range": False})


class _GatedMixin(QuantInputMixin):
    _quantizer_names = ("_input_quantizer", "_gate_quantizer")

    def init_quantizer(self, quant_desc_input, quant_desc_weight=None, num_layers=None):
        super().init_quantizer(quant_desc_input, quant_desc_weight, num_layers)
        self._gate_quantizer = _tensor_quantizer_cls()(gate_descriptor(self._input_quantizer.quant_desc))

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input):
        x = self._input_quantizer(input)
        return x * self._gate_quantizer(self._gate(x))


@quant_class
class QuantSiLU(nn.SiLU, _GatedMixin):
    """``x * sigmoid(x)`` with ``x`` and ``sigmoid(x)`` quantized (QLinearSigmoid + QLinearMul)."""

    def _gate(self, x):
        return torch.sigmoid(x)

    forward = _GatedMixin.forward


@quant_class
class QuantHardswish(nn.Hardswish, _GatedMixin):
    """``x * hardsigmoid(x)`` with ``x`` and the gate quantized (HardSigmoid between Q/DQ + QLinearMul)."""

    def _gate(self, x):
        return F.hardsigmoid(x)

    forward = _GatedMixin.forward


#: the gated activations a recipe with ``activations=True`` swaps, keyed by the float class
ACTIVATION_MODULE_CLASSES = {cls._float_module: cls for cls in (QuantSiLU, QuantHardswish)}
