"""Quantized modules (the API of ``pytorch_quantization.nn``).

``import lq.nn as quant_nn`` gives ``quant_nn.TensorQuantizer``,
``quant_nn.QuantConv2d`` and the short aliases of the reference toolkit
(``quant_nn.Conv2d is quant_nn.QuantConv2d``, ``quant_nn.Linear``, ...).
Every quantized module subclasses its ``torch.nn`` class (``isinstance(m,
torch.nn.Conv2d)`` holds, state_dict keys of the float parameters are
unchanged), takes the same constructor arguments plus keyword-only
``quant_desc_input`` / ``quant_desc_weight``, and has ``from_float(module)``
(same Parameter objects) and ``to_float()``.
"""

from lq.nn.modules._utils import DescriptorTypeError, QuantInputMixin, QuantMixin
from lq.nn.modules.quant_attention import MultiheadAttention, QuantMultiheadAttention
from lq.nn.modules.quant_conv import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantConvTranspose1d,
    QuantConvTranspose2d,
    QuantConvTranspose3d,
)
from lq.nn.modules.quant_elementwise import FloatAdd, FloatCat, QuantAdd, QuantCat
from lq.nn.modules.quant_instancenorm import (
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    QuantInstanceNorm1d,
    QuantInstanceNorm2d,
    QuantInstanceNorm3d,
)
from lq.nn.modules.quant_linear import Linear, QuantLinear
from lq.nn.modules.quant_pooling import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveAvgPool3d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
    QuantAdaptiveAvgPool1d,
    QuantAdaptiveAvgPool2d,
    QuantAdaptiveAvgPool3d,
    QuantAvgPool1d,
    QuantAvgPool2d,
    QuantAvgPool3d,
    QuantMaxPool1d,
    QuantMaxPool2d,
    QuantMaxPool3d,
)
from lq.nn.modules.quant_rnn import LSTM, LSTMCell, QuantLSTM, QuantLSTMCell
from lq.nn.modules.clip import Clip
from lq.nn.modules.quant_activation import QuantHardswish, QuantSiLU
from lq.nn.modules.tensor_quantizer import (
    AmaxShapeError,
    TensorQuantizer,
    iter_quantizers,
    name_quantizers,
    quantizers_without_data,
    uncalibrated_quantizers,
)

Add = QuantAdd
Cat = QuantCat

#: every quantized module class, keyed by the float class it replaces
QUANT_MODULE_CLASSES = {
    cls._float_module: cls
    for cls in (
        QuantLinear,
        QuantConv1d,
        QuantConv2d,
        QuantConv3d,
        QuantConvTranspose1d,
        QuantConvTranspose2d,
        QuantConvTranspose3d,
        QuantMaxPool1d,
        QuantMaxPool2d,
        QuantMaxPool3d,
        QuantAvgPool1d,
        QuantAvgPool2d,
        QuantAvgPool3d,
        QuantAdaptiveAvgPool1d,
        QuantAdaptiveAvgPool2d,
        QuantAdaptiveAvgPool3d,
        QuantInstanceNorm1d,
        QuantInstanceNorm2d,
        QuantInstanceNorm3d,
        QuantLSTM,
        QuantLSTMCell,
        QuantMultiheadAttention,
        QuantAdd,
        QuantCat,
    )
}

__all__ = [
    "TensorQuantizer",
    "AmaxShapeError",
    "Clip",
    "iter_quantizers",
    "name_quantizers",
    "uncalibrated_quantizers",
    "quantizers_without_data",
    "QuantMixin",
    "QuantInputMixin",
    "DescriptorTypeError",
    "QUANT_MODULE_CLASSES",
    "QuantLinear", "Linear",
    "QuantConv1d", "QuantConv2d", "QuantConv3d", "Conv1d", "Conv2d", "Conv3d",
    "QuantConvTranspose1d", "QuantConvTranspose2d", "QuantConvTranspose3d",
    "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "QuantMaxPool1d", "QuantMaxPool2d", "QuantMaxPool3d", "MaxPool1d", "MaxPool2d", "MaxPool3d",
    "QuantAvgPool1d", "QuantAvgPool2d", "QuantAvgPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "QuantAdaptiveAvgPool1d", "QuantAdaptiveAvgPool2d", "QuantAdaptiveAvgPool3d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "QuantInstanceNorm1d", "QuantInstanceNorm2d", "QuantInstanceNorm3d",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
    "QuantLSTM", "QuantLSTMCell", "LSTM", "LSTMCell",
    "QuantMultiheadAttention", "MultiheadAttention",
    "FloatAdd", "FloatCat", "QuantAdd", "QuantCat", "Add", "Cat",
    "QuantSiLU", "QuantHardswish",  # swapped only by recipes with QuantConfig.activations (not in the type map)
]  # fmt: skip
