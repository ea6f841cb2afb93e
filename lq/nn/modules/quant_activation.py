"""Quantized smooth activations: SiLU (``x * sigmoid(x)``) and HardSwish (``x * hardsigmoid(x)``) with their input
quantized.

The activation itself runs in float on the dequantized input, and its output is quantized by whatever reads it
(the next layer's input quantizer). So the conv before it has an output grid (the activation's input quantizer)
and runs as ``QLinearConv``, and the activation is one fused float kernel between a DequantizeLinear and a
QuantizeLinear: onnxruntime's ``QuickGelu`` (the export writes SiLU as it, :mod:`lq.export.passes._silu`) and
``HardSwish`` (which it runs as HardSigmoid and a float Mul). Quantizing the gate as well (``QLinearSigmoid`` + ``QLinearMul``, what onnxruntime's own
``quantize_static`` files run) measured slower: an EfficientNet-style net at batch 8 (AVX-512 VNNI) ran 1.91 ms
that way, 1.72 ms with QuickGelu (FP32 1.62 ms); a MobileNetV3-style net at batch 32 3.21 ms with its
HardSwish gates quantized, 3.09 ms without. And the activations are one rounding closer to the float model.
Used where the recipe asks for it (:attr:`lq.config.QuantConfig.activations`); not part of the reference
toolkit's module set.
"""

from __future__ import annotations

from torch import nn

from lq.nn.modules._utils import input_quant_class

__all__ = ["QuantSiLU", "QuantHardswish", "ACTIVATION_MODULE_CLASSES"]


def _load_without_gate(self, state_dict, prefix, *args):
    """Loads a checkpoint of an earlier lq that also quantized the gate: its ``_gate_quantizer`` entries (a
    calibrated range with nothing left to restore it into) are dropped."""
    for k in [k for k in state_dict if k.startswith(prefix + "_gate_quantizer.")]:
        del state_dict[k]
    nn.Module._load_from_state_dict(self, state_dict, prefix, *args)


QuantSiLU = input_quant_class(nn.SiLU, __name__)
QuantHardswish = input_quant_class(nn.Hardswish, __name__)
for _cls in (QuantSiLU, QuantHardswish):
    _cls._load_from_state_dict = _load_without_gate

#: the activations a recipe with ``activations=True`` swaps, keyed by the float class
ACTIVATION_MODULE_CLASSES = {cls._float_module: cls for cls in (QuantSiLU, QuantHardswish)}
