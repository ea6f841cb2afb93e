"""Quantized convolutions and transposed convolutions (1d, 2d, 3d)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from lq import tensor_quant
from lq.nn.modules import _bias_shift
from lq.nn.modules._utils import QuantMixin, quant_class

__all__ = [
    "QuantConv1d", "QuantConv2d", "QuantConv3d",
    "QuantConvTranspose1d", "QuantConvTranspose2d", "QuantConvTranspose3d",
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
]  # fmt: skip


class _QuantConvMixin(QuantMixin):
    """Convolution: quantize the input (per tensor) and the weight (per output channel, axis 0)."""

    def forward(self, input):
        # _conv_forward handles padding_mode (reflect/replicate/circular) like the float module
        return self._conv_forward(self._input_quantizer(input), self._weight_quantizer(self.weight),
                                  _bias_shift.quant_bias(self))


class _QuantConvTransposeMixin(QuantMixin):
    """Transposed convolution: weights are (in, out // groups, k...), so per-channel is axis 1."""

    _conv_transpose_fn = None
    _spatial_dims = 0

    def forward(self, input, output_size=None):
        if self.padding_mode != "zeros":
            raise ValueError(f"Only `zeros` padding mode is supported for {type(self).__name__}")
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, self._spatial_dims, self.dilation
        )
        fn = type(self)._conv_transpose_fn
        return fn(
            self._input_quantizer(input),
            self._weight_quantizer(self.weight),
            _bias_shift.quant_bias(self),
            self.stride,
            self.padding,
            output_padding,
            self.groups,
            self.dilation,
        )


@quant_class
class QuantConv1d(nn.Conv1d, _QuantConvMixin):
    """``nn.Conv1d`` with quantized input and weight."""

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL
    forward = _QuantConvMixin.forward


@quant_class
class QuantConv2d(nn.Conv2d, _QuantConvMixin):
    """``nn.Conv2d`` with quantized input and weight."""

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL
    forward = _QuantConvMixin.forward


@quant_class
class QuantConv3d(nn.Conv3d, _QuantConvMixin):
    """``nn.Conv3d`` with quantized input and weight."""

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL
    forward = _QuantConvMixin.forward


@quant_class
class QuantConvTranspose1d(nn.ConvTranspose1d, _QuantConvTransposeMixin):
    """``nn.ConvTranspose1d`` with quantized input and weight (per channel on axis 1)."""

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL
    _conv_transpose_fn = staticmethod(F.conv_transpose1d)
    _spatial_dims = 1
    forward = _QuantConvTransposeMixin.forward


@quant_class
class QuantConvTranspose2d(nn.ConvTranspose2d, _QuantConvTransposeMixin):
    """``nn.ConvTranspose2d`` with quantized input and weight (per channel on axis 1)."""

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL
    _conv_transpose_fn = staticmethod(F.conv_transpose2d)
    _spatial_dims = 2
    forward = _QuantConvTransposeMixin.forward


@quant_class
class QuantConvTranspose3d(nn.ConvTranspose3d, _QuantConvTransposeMixin):
    """``nn.ConvTranspose3d`` with quantized input and weight (per channel on axis 1)."""

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL
    _conv_transpose_fn = staticmethod(F.conv_transpose3d)
    _spatial_dims = 3
    forward = _QuantConvTransposeMixin.forward


Conv1d = QuantConv1d
Conv2d = QuantConv2d
Conv3d = QuantConv3d
ConvTranspose1d = QuantConvTranspose1d
ConvTranspose2d = QuantConvTranspose2d
ConvTranspose3d = QuantConvTranspose3d
