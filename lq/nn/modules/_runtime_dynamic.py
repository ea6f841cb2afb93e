"""onnxruntime's dynamic uint8 quantization of an activation, as a fake-quant op.

Why: onnxruntime's fused quantized LSTM (``com.microsoft.DynamicQuantizeLSTM``) quantizes the activations
of every GEMM it runs itself, from that GEMM's own input: the input sequence once per layer and direction,
the hidden state at every step. A ``QuantLSTM`` exported to that op (``runtime_dynamic``) must compute the
same numbers in PyTorch, so calibration, QAT and verification see what the file runs. The rule is the
one of ONNX ``DynamicQuantizeLinear`` (onnxruntime uses one routine for both): the range is widened to
hold 0, ``scale = (max - min) / 255`` (1 for an all-zero tensor), ``zero_point = round(-min / scale)``
clamped to [0, 255], ``q = clamp(round(x / scale) + zero_point, 0, 255)``, rounding half to even.

The gradient is the identity (straight-through): the range covers every element, so nothing is clipped.
"""

from __future__ import annotations

import torch

__all__ = ["runtime_dynamic_fake_quant", "runtime_dynamic_params"]


def runtime_dynamic_params(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` onnxruntime computes for ``x`` (float32 scalars; no data-dependent branch)."""
    xf = x.detach().float()
    lo = torch.clamp(xf.min(), max=0.0)
    hi = torch.clamp(xf.max(), min=0.0)
    scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 255.0)
    zero_point = torch.round(torch.clamp(-lo / scale, 0.0, 255.0))
    return scale, zero_point


class _RuntimeDynamicFakeQuant(torch.autograd.Function):
    """Forward: the dequantized uint8 values exactly; backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, x):
        scale, zero_point = runtime_dynamic_params(x)
        q = torch.clamp(torch.round(x.float() / scale) + zero_point, 0.0, 255.0)
        return ((q - zero_point) * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


def runtime_dynamic_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to uint8 and back with the scale and zero point onnxruntime derives from ``x`` itself."""
    return _RuntimeDynamicFakeQuant.apply(x)
