"""Quantized smooth activations: SiLU (``x * sigmoid(x)``) and HardSwish (``x * hardsigmoid(x)``) with their input
quantized, and SiLU's gate too where the placement asks for it.

With the input quantized only, the activation runs in float on the dequantized input and its output is quantized
by whatever reads it (the next layer's input quantizer). So the conv before it has an output grid (the
activation's input quantizer) and runs as ``QLinearConv``, and the activation is one fused float kernel between a
DequantizeLinear and a QuantizeLinear: onnxruntime's ``QuickGelu`` (the export writes SiLU as it,
:mod:`lq.export.passes._silu`) and ``HardSwish`` (which it runs as HardSigmoid and a float Mul).

A SiLU reading a large activation map (:func:`lq.rules.onnxruntime.ort_gates_silu`) also quantizes its gate:
``x * q(sigmoid(x))``, which onnxruntime runs as ``QLinearSigmoid`` + ``QLinearMul`` on the integers, as its own
``quantize_static`` files do. There the float sandwich's DequantizeLinear, QuickGelu and QuantizeLinear each
pass over a float tensor four times the size of the codes (EfficientNet-style net at 224x224, measured in
:data:`lq.rules.onnxruntime.ORT_INT8_SILU_GATE_MIN_ELEMENTS`). The gate's quantizer is calibrated like any other
(its data lies in ``[0, 1]``: an unsigned grid where the input's descriptor is symmetric).
Used where the recipe asks for it (:attr:`lq.config.QuantConfig.activations`); not part of the reference
toolkit's module set.
"""

from __future__ import annotations

import torch
from torch import nn

from lq.nn.modules._utils import QuantInputMixin, _tensor_quantizer_cls, input_quant_class, quant_class

__all__ = ["QuantSiLU", "QuantHardswish", "ACTIVATION_MODULE_CLASSES", "gate_descriptor", "gated_silu"]

GATE = "_gate_quantizer"


def gate_descriptor(desc):
    """The gate's grid: the input's, unsigned where the input's is a symmetric signed integer grid (the gate lies
    in ``[0, 1]``; affine descriptors calibrate ``[0, max]`` themselves)."""
    if desc.asymmetric or desc.unsigned or desc.is_fp8 or desc.axis is not None or desc.block_sizes is not None:
        return desc
    return type(desc)(**{**desc.dict(), "unsigned": True, "narrow_range": False})


def gated_silu(x: torch.Tensor, gate_quantizer: nn.Module) -> torch.Tensor:
    """``x * gate_quantizer(sigmoid(x))``: SiLU with its gate on a grid (``x`` already quantized). The one
    definition of the gated form, shared by :class:`QuantSiLU` and the functional ``F.silu`` glue sites."""
    return x * gate_quantizer(torch.sigmoid(x))


@quant_class
class QuantSiLU(nn.SiLU, QuantInputMixin):
    """``nn.SiLU`` applied to its quantized input; with :meth:`quantize_gate`, ``x * q(sigmoid(x))``."""

    _quantizer_names = ("_input_quantizer", GATE)

    @property
    def gated(self) -> bool:
        return GATE in self._modules

    def quantize_gate(self, desc=None) -> None:
        """Quantize the gate too, on ``desc`` (default: :func:`gate_descriptor` of the input's descriptor)."""
        if not self.gated:
            q = _tensor_quantizer_cls()(desc if desc is not None else gate_descriptor(self._input_quantizer.quant_desc))
            device = next((t.device for t in self._input_quantizer.buffers()), None)
            self._modules[GATE] = q.to(device) if device is not None else q
            q.train(self.training)

    def forward(self, input):
        x = self._input_quantizer(input)
        if self.gated:
            return gated_silu(x, self._modules[GATE])
        return nn.SiLU.forward(self, x)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        """A checkpoint whose SiLU quantized its gate gets its gate quantizer back (made here when the module was
        placed without one), so the model computes what was trained."""
        if not self.gated and any(k.startswith(prefix + GATE + ".") for k in state_dict):
            self.quantize_gate()
        super()._load_from_state_dict(state_dict, prefix, *args)


def _load_without_gate(self, state_dict, prefix, *args):
    """Loads a checkpoint of an earlier lq that also quantized HardSwish's gate: its ``_gate_quantizer`` entries
    (a calibrated range with nothing left to restore it into) are dropped."""
    for k in [k for k in state_dict if k.startswith(prefix + GATE + ".")]:
        del state_dict[k]
    nn.Module._load_from_state_dict(self, state_dict, prefix, *args)


QuantHardswish = input_quant_class(nn.Hardswish, __name__)
QuantHardswish._load_from_state_dict = _load_without_gate

#: the activations a recipe with ``activations=True`` swaps, keyed by the float class
ACTIVATION_MODULE_CLASSES = {cls._float_module: cls for cls in (QuantSiLU, QuantHardswish)}
