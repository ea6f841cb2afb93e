"""lq's own entry points quantize with the recipe for where the model runs (issue 27, item 2).

``QuantCallback()``, ``quantize_model(model)``, ``lq-train`` and ``lq-cli`` with no recipe use ``int8_onnxruntime``
(their export target, onnxruntime, by default) and pytorch-quantization's symmetric INT8 for tensorrt; the
pytorch-quantization API (descriptors, ``lq.nn`` modules built by hand) keeps its numerics.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lq
from lq.callbacks import QuantSwap
from lq.config import (ExportConfig, Int8OnnxruntimeConfig, Int8OpenvinoConfig, Int8PerChannelConfig,
                       Int8ReduceRangeConfig, QuantConfig)
from lq.nn import QuantConv2d, QuantLinear, QuantSiLU
from lq.recipe import TARGET_RECIPES, default_recipe
from lq.tensor_quant import QuantDescriptor

torch.set_flush_denormal(True)


def _net() -> nn.Module:
    """4 input channels: not a stem that onnxruntime runs in float (whose SiLU would stay float)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 8, 3),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()


def _quantizer_state(model: nn.Module) -> dict:
    return {k: v for k, v in model.state_dict().items() if "quantizer" in k}


def test_the_callback_picks_the_recipe_of_its_export_target():
    assert TARGET_RECIPES == {"onnxruntime": "int8_onnxruntime", "tensorrt": "int8_per_channel",
                              "openvino": "int8_openvino"}
    assert type(lq.QuantCallback().quant) is Int8OnnxruntimeConfig
    assert type(lq.QuantCallback(export=ExportConfig(target="tensorrt")).quant) is Int8PerChannelConfig
    assert type(lq.QuantCallback(export={"target": "tensorrt"}).quant) is Int8PerChannelConfig
    assert type(lq.QuantCallback(export={"target": "openvino"}).quant) is Int8OpenvinoConfig
    # a recipe the user gives wins, whatever the target; a plain QuantConfig() is pytorch-quantization's
    assert type(lq.QuantCallback(quant=Int8ReduceRangeConfig()).quant) is Int8ReduceRangeConfig
    assert type(lq.QuantCallback(quant=QuantConfig(), export={"target": "onnxruntime"}).quant) is QuantConfig
    assert type(QuantSwap().quant) is Int8OnnxruntimeConfig
    # learned ranges are symmetric (PACT): onnxruntime's fastest symmetric recipe, not a refusal
    assert type(lq.QuantCallback(qat={"learn_amax": True}).quant) is Int8ReduceRangeConfig
    assert type(lq.QuantCallback(qat={"learn_amax": True}, export={"target": "tensorrt"}).quant) is \
        Int8PerChannelConfig
    with pytest.raises(ValueError, match="target='cuda' is not allowed"):
        default_recipe("cuda")


def test_quantize_model_with_nothing_is_the_onnxruntime_recipe_as_the_callback_applies_it():
    a, b = _net(), _net()
    lq.quantize_model(a)
    QuantSwap(Int8OnnxruntimeConfig()).swap(b)
    assert isinstance(a[0], QuantConv2d) and isinstance(a[2], QuantSiLU) and isinstance(a[7], QuantLinear)
    assert a[0]._input_quantizer.asymmetric and not a[0]._input_quantizer.narrow_range
    assert a[0]._weight_quantizer.num_bits == 7 and a[0]._weight_quantizer.axis == 0
    x = torch.randn(16, 4, 10, 10)
    with torch.no_grad():
        lq.calibrate_model(a, [x], method="max")
        lq.calibrate_model(b, [x], method="max")
        assert torch.equal(a(x), b(x))  # one recipe, one result, whichever entry point applied it
    sa, sb = _quantizer_state(a), _quantizer_state(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tensorrt_and_named_recipes_and_arguments_that_change_the_recipe():
    m = _net()
    lq.quantize_model(m, target="tensorrt")
    q = m[0]._input_quantizer
    assert not q.asymmetric and q.narrow_range and q.num_bits == 8 and m[0]._weight_quantizer.num_bits == 8
    assert isinstance(m[2], nn.SiLU)  # int8_per_channel quantizes no activations
    m = _net()
    lq.quantize_model(m, recipe="int8_reduce_range", exclude=["7"])
    assert m[0]._weight_quantizer.num_bits == 7 and not m[0]._input_quantizer.asymmetric
    assert isinstance(m[7], nn.Linear) and not isinstance(m[7], QuantLinear)
    m = _net()
    lq.quantize_model(m, activations=False)  # the onnxruntime recipe without its activation swaps
    assert isinstance(m[2], nn.SiLU) and m[0]._input_quantizer.asymmetric


def test_descriptors_keep_pytorch_quantizations_numbers():
    """The reference: the same layers built by hand from lq.nn with the same descriptor."""
    desc = QuantDescriptor(num_bits=8, calib_method="max")
    m = _net()
    lq.quantize_model(m, quant_desc_input=desc)
    hand = QuantConv2d(4, 8, 3, padding=1, quant_desc_input=desc)
    for role in ("_input_quantizer", "_weight_quantizer"):
        got, want = getattr(m[0], role), getattr(hand, role)
        assert (got.num_bits, got.narrow_range, got.axis, got.asymmetric, got.unsigned) == \
            (want.num_bits, want.narrow_range, want.axis, want.asymmetric, want.unsigned), role
    assert isinstance(m[2], nn.SiLU)


def test_a_recipe_and_descriptors_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        lq.quantize_model(_net(), recipe="int8_onnxruntime", quant_desc_input=QuantDescriptor())
    with pytest.raises(ValueError, match="not both"):
        lq.quantize_model(_net(), target="tensorrt", quant_desc_weight=QuantDescriptor(axis=0))
    with pytest.raises(ValueError, match="not both"):
        lq.quantize_model(_net(), recipe="int8_onnxruntime", target="tensorrt")
    with pytest.raises(ValueError, match=r"recipe='int9' is not a recipe: choose one of \["):
        lq.quantize_model(_net(), recipe="int9")
