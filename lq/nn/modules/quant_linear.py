"""Quantized Linear."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from lq import tensor_quant
from lq.nn.modules import _bias_shift
from lq.nn.modules._utils import QuantMixin, quant_class

__all__ = ["QuantLinear", "Linear"]


@quant_class
class QuantLinear(nn.Linear, QuantMixin):
    """``nn.Linear`` that fake-quantizes its input (per tensor by default) and its weight
    (per output row by default): ``F.linear(q_in(x), q_w(weight), bias)``."""

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW

    def forward(self, input):
        return F.linear(self._input_quantizer(input), self._weight_quantizer(self.weight), _bias_shift.quant_bias(self))


Linear = QuantLinear
