"""Quantized pooling: the input is quantized, the pooling itself is the float module's.

Max/average pooling of quantized values stays on the quantization grid (max
exactly, average up to the divide), so an inference engine can run the pool
in INT8 right after the input's QuantizeLinear.
"""

from __future__ import annotations

from torch import nn

from lq.nn.modules._utils import input_quant_class

__all__ = [
    "QuantMaxPool1d", "QuantMaxPool2d", "QuantMaxPool3d",
    "QuantAvgPool1d", "QuantAvgPool2d", "QuantAvgPool3d",
    "QuantAdaptiveAvgPool1d", "QuantAdaptiveAvgPool2d", "QuantAdaptiveAvgPool3d",
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
]  # fmt: skip


def _pool(float_cls):
    return input_quant_class(float_cls, __name__)


QuantMaxPool1d = _pool(nn.MaxPool1d)
QuantMaxPool2d = _pool(nn.MaxPool2d)
QuantMaxPool3d = _pool(nn.MaxPool3d)
QuantAvgPool1d = _pool(nn.AvgPool1d)
QuantAvgPool2d = _pool(nn.AvgPool2d)
QuantAvgPool3d = _pool(nn.AvgPool3d)
QuantAdaptiveAvgPool1d = _pool(nn.AdaptiveAvgPool1d)
QuantAdaptiveAvgPool2d = _pool(nn.AdaptiveAvgPool2d)
QuantAdaptiveAvgPool3d = _pool(nn.AdaptiveAvgPool3d)

MaxPool1d = QuantMaxPool1d
MaxPool2d = QuantMaxPool2d
MaxPool3d = QuantMaxPool3d
AvgPool1d = QuantAvgPool1d
AvgPool2d = QuantAvgPool2d
AvgPool3d = QuantAvgPool3d
AdaptiveAvgPool1d = QuantAdaptiveAvgPool1d
AdaptiveAvgPool2d = QuantAdaptiveAvgPool2d
AdaptiveAvgPool3d = QuantAdaptiveAvgPool3d
