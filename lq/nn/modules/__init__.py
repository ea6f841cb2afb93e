"""Quantizer and quantized modules (``pytorch_quantization.nn.modules`` layout)."""

from lq.nn.modules import (  # noqa: F401
    quant_attention,
    quant_conv,
    quant_elementwise,
    quant_instancenorm,
    quant_linear,
    quant_pooling,
    quant_rnn,
    tensor_quantizer,
)
from lq.nn.modules._utils import QuantInputMixin, QuantMixin  # noqa: F401
