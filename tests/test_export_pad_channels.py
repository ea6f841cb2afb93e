"""Zero input channels for small integer convs (:mod:`lq.export.passes._pad_channels`).

The padding must leave every number as it was: the rewritten graph gives onnxruntime's very outputs of the
original (bit for bit, optimizations on and off), and onnxruntime then runs the conv as QLinearConv on the
padded filter. Convs the rule leaves alone (enough channels already, too few or odd output channels, a large
kernel, a 1-D or depthwise conv, a conv with no quantizer after it, asymmetric weights) are not touched. An
exported ResNet-style stem, written as modules and as functions, is padded the same way and still equals
PyTorch's fake-quant model.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export.passes._int16 import ACTIVATION_CODE_MAX, INT16_MAX, worst_pair_per_channel
from lq.export.passes._pad_channels import pad_conv_input_channels

from _export_checks import LEVELS, assert_file_matches_pytorch, quantize_calibrate_export, rewritten, run_graph

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)


def _graph(cin=3, cout=16, kernel=(3, 3), group=1, quantize_output=True, weight_zp=None, seed=0) -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv (int8 per-channel weights, int32 bias) -> Relu [-> Q -> DQ] -> y, float NCHW.

    The weights are 7-bit, as :func:`lq.export.passes._int16.encode_int16_safe` leaves every int8 weight it does
    not re-encode (no pair of products leaves int16): with full-range weights a CPU without VNNI saturates the
    unpadded reference itself, so the two graphs would differ there for a reason that is not the padding."""
    rng = np.random.default_rng(seed)
    spatial = [9] * len(kernel)
    w = rng.integers(-63, 64, size=(cout, cin // group, *kernel)).astype(np.int8)
    assert (worst_pair_per_channel(w, 0) * ACTIVATION_CODE_MAX <= INT16_MAX).all()
    w_scale = rng.uniform(0.002, 0.01, cout).astype(np.float32)
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "xs"), numpy_helper.from_array(np.array(131, np.uint8), "xz"),
             numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_scale, "ws"),
             numpy_helper.from_array(rng.integers(-500, 500, cout).astype(np.int32), "b"),
             numpy_helper.from_array((w_scale * 0.02).astype(np.float32), "bs"),
             numpy_helper.from_array(np.array(0.05, np.float32), "ys"), numpy_helper.from_array(np.array(0, np.uint8), "yz")]
    w_dq = ["w", "ws"]
    if weight_zp is not None:
        inits.append(numpy_helper.from_array(np.full(cout, weight_zp, np.int8), "wz"))
        w_dq.append("wz")
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", w_dq, ["wd"], axis=0),
             helper.make_node("DequantizeLinear", ["b", "bs"], ["bd"], axis=0),
             helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], name="stem", group=group,
                              pads=[k // 2 for k in kernel] * 2),
             helper.make_node("Relu", ["c"], ["r" if quantize_output else "y"])]
    if quantize_output:
        nodes += [helper.make_node("QuantizeLinear", ["r", "ys", "yz"], ["yq"]),
                  helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, cin, *spatial])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _optimized_conv_weight(model: onnx.ModelProto, tmp_path) -> tuple[str, tuple]:
    """The op onnxruntime runs for the conv, and the shape of the weight it reads, from its optimized graph."""
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(so.optimized_model_filepath)
    dims = {i.name: tuple(i.dims) for i in opt.graph.initializer}
    conv = next(n for n in opt.graph.node if n.op_type in ("QLinearConv", "Conv", "FusedConv"))
    return conv.op_type, dims.get(conv.input[3] if conv.op_type == "QLinearConv" else conv.input[1])


@pytest.mark.parametrize("cin,cout,padded", [(1, 16, 4), (2, 32, 4), (3, 16, 4), (3, 24, 4), (5, 16, 8), (6, 32, 8), (10, 16, 12)])
def test_padding_keeps_every_number_and_gives_the_integer_conv_aligned_channels(cin, cout, padded, tmp_path):
    model = _graph(cin, cout)
    done, new = rewritten(model, pad_conv_input_channels)
    assert done == ["stem"]
    weight = next(numpy_helper.to_array(i) for i in new.graph.initializer if i.name.startswith("w_padded"))
    assert weight.shape == (cout, padded, 3, 3)
    assert not weight[:, cin:].any()  # the added channels weigh nothing
    np.testing.assert_array_equal(weight[:, :cin], next(numpy_helper.to_array(i) for i in model.graph.initializer
                                                        if i.name == "w"))
    pad = next(n for n in new.graph.node if n.op_type == "Pad")
    assert pad.input[0] == "xq"  # on the uint8 codes, so DQ -> Conv -> Q still fuses
    x = np.random.default_rng(1).normal(0, 1.5, (2, cin, 9, 9)).astype(np.float32)
    for level in LEVELS:
        np.testing.assert_array_equal(run_graph(new, x, level)[0], run_graph(model, x, level)[0])
    op, shape = _optimized_conv_weight(new, tmp_path)
    assert op == "QLinearConv" and shape is not None and shape[1] == padded


@pytest.mark.parametrize("kw", [
    dict(cin=4),  # aligned already
    dict(cin=8),
    dict(cout=8),  # fewer output channels than the symmetric kernel packs
    dict(cout=20),  # not a multiple of 8
    dict(kernel=(7, 7)),  # its im2col path is faster than the padded symmetric one
    dict(cin=2, kernel=(7, 7)),  # a 7x7 kernel, even under 128 products
    dict(cin=30, cout=32),  # 270 products: the im2col path wins again
    dict(kernel=(1, 1)),  # pointwise: no im2col to avoid
    dict(kernel=(9,)),  # 1-D: padding measured slower
    dict(cin=16, group=16, cout=16),  # depthwise
    dict(quantize_output=False),  # no quantizer after it: onnxruntime runs it in float
    dict(weight_zp=3),  # asymmetric weights: not the symmetric kernel
])
def test_convs_the_rule_leaves_alone_are_untouched(kw):
    model = _graph(**kw)
    done, new = rewritten(model, pad_conv_input_channels)
    assert done == []
    assert [n.op_type for n in new.graph.node] == [n.op_type for n in model.graph.node]


class StemModules(nn.Module):
    """A ResNet-style stem (RGB 3x3 conv, BN, ReLU, max pool) and one residual block, as modules."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16))
        self.act = nn.ReLU()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x):
        x = self.stem(x)
        return self.head(self.act(self.body(x) + x))


class StemFunctions(StemModules):
    """The same layers, the stem's activation and pool written as functions in the forward."""

    def forward(self, x):
        conv, bn = self.stem[0], self.stem[1]
        x = F.max_pool2d(F.relu(bn(conv(x))), 2)
        return self.head(self.act(self.body(x) + x))


def _trained_stem(cls) -> nn.Module:
    torch.manual_seed(0)
    model = cls()
    for m in model.modules():  # BatchNorm statistics of a trained net, not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("cls", [StemModules, StemFunctions])
def test_exported_resnet_stem_is_padded_and_matches_pytorch(cls, tmp_path):
    model = _trained_stem(cls)
    calib = [torch.rand(8, 3, 16, 16) for _ in range(2)]
    res, ops = quantize_calibrate_export(model, calib, str(tmp_path / "m.onnx"), speed_check=False, fallback_seconds=0)
    proto = onnx.load(res.path)
    pads = [n for n in proto.graph.node if n.op_type == "Pad"]
    assert len(pads) == 1
    weights = {i.name: tuple(i.dims) for i in proto.graph.initializer}
    assert (16, 4, 3, 3) in weights.values()
    assert_file_matches_pytorch(model, res, torch.rand(8, 3, 16, 16))
    stem = next(k for k in res.layer_kernels if k.layer.startswith("stem"))
    assert stem.kernel == "QLinearConv" and stem.reason is None


def test_both_styles_give_the_same_file(tmp_path):
    files = []
    for cls in (StemModules, StemFunctions):
        model = _trained_stem(cls)
        calib = [torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        res, ops = quantize_calibrate_export(model, calib, str(tmp_path / f"{cls.__name__}.onnx"), speed_check=False,
                                             fallback_seconds=0)
        files.append(ops)
    assert files[0] == files[1]
