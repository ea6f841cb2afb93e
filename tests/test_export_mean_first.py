"""A spatial mean moved in front of the 1x1 conv whose output it averages (:mod:`lq.export.passes._mean_first`).

The move is exact in arithmetic (a 1x1 conv is the same linear map at every pixel) and leaves only float
summation order: these tests check the rewritten graph against onnxruntime on the original one (optimizations
on and off), that a conv that is not pointwise, a strided one, a mean over other axes and a conv output read
twice stay as written (and that moving the mean above the strided one would have changed the numbers), and
that an exported fully convolutional classifier reports its head as float by choice and equals PyTorch's
fake-quant model.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export.report._kernel_report import ON_THE_MEAN
from lq.export.passes._mean_first import MEAN_FIRST, mean_before_pointwise_convs
from lq.export.verify._verify import make_session
from _export_checks import LEVELS, assert_file_matches_pytorch, quantize_calibrate_export, rewritten, run_graph

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)

C_IN, C_OUT, HW = 6, 9, 7


def _graph(kernel=1, strides=(1, 1), pads=(0, 0, 0, 0), mean="ReduceMean", axes=(2, 3), keepdims=0,
           group=1, also_output=False, quantized_weight=True) -> onnx.ModelProto:
    """x -> Conv(W, b) -> mean -> y (float NCHW (2, 6, 7, 7)); W as DQ(int8, per channel) or a float constant."""
    rng = np.random.default_rng(0)
    w_shape = (C_OUT, C_IN // group, kernel, kernel)
    inits = [numpy_helper.from_array(rng.standard_normal(C_OUT).astype(np.float32), "b")]
    nodes = []
    if quantized_weight:
        inits += [numpy_helper.from_array(rng.integers(-127, 128, w_shape).astype(np.int8), "wq"),
                  numpy_helper.from_array((0.01 + 0.02 * rng.random(C_OUT)).astype(np.float32), "ws")]
        nodes.append(helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=0))
    else:
        inits.append(numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "w"))
    nodes.append(helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[kernel, kernel], strides=list(strides),
                                  pads=list(pads), group=group))
    if mean == "ReduceMean":
        nodes.append(helper.make_node("ReduceMean", ["c"], ["y"], axes=list(axes), keepdims=keepdims))
    else:
        nodes.append(helper.make_node("GlobalAveragePool", ["c"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if also_output:
        outputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, C_IN, HW, HW])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray, level: str):
    return run_graph(model, x, level)[0]


def _rewrite(model: onnx.ModelProto) -> tuple[int, onnx.ModelProto]:
    return rewritten(model, mean_before_pointwise_convs)


X = 3 * np.random.default_rng(1).standard_normal((2, C_IN, HW, HW)).astype(np.float32)


@pytest.mark.parametrize("kw", [
    dict(), dict(keepdims=1), dict(axes=(-1, -2)), dict(mean="GlobalAveragePool"), dict(group=3),
    dict(quantized_weight=False), dict(keepdims=1, quantized_weight=False),
], ids=["reducemean", "keepdims", "negative-axes", "globalaveragepool", "grouped", "float-weight",
        "keepdims-float-weight"])
def test_mean_moves_above_a_pointwise_conv_with_the_same_numbers(kw):
    model = _graph(**kw)
    moved, new = _rewrite(model)
    assert moved == 1
    ops = [n.op_type for n in new.graph.node if n.op_type != "DequantizeLinear"]
    keeps_dims = kw.get("mean") == "GlobalAveragePool" or kw.get("keepdims")
    assert ops == ["GlobalAveragePool", "Conv"] + ([] if keeps_dims else ["Flatten"]), ops
    assert MEAN_FIRST in new.graph.node[[n.op_type for n in new.graph.node].index("GlobalAveragePool")].name
    for level in LEVELS:
        want, got = _run(model, X, level), _run(new, X, level)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [
    dict(kernel=3), dict(strides=(2, 2)), dict(pads=(1, 1, 1, 1)), dict(axes=(1, 2, 3)), dict(axes=(3,)),
    dict(also_output=True),
], ids=["3x3", "strided", "padded", "channels-too", "one-axis", "conv-output-read-twice"])
def test_mean_stays_where_the_move_would_not_be_exact(kw):
    model = _graph(**kw)
    moved, new = _rewrite(model)
    assert moved == 0 and [n.op_type for n in new.graph.node] == [n.op_type for n in model.graph.node]
    if "strides" in kw:  # and moving it would have changed the result: the strided conv skips pixels
        moved_anyway = _graph(**kw, mean="GlobalAveragePool")
        conv, pool = moved_anyway.graph.node[-2], moved_anyway.graph.node[-1]
        pool.input[0], pool.output[0], conv.input[0], conv.output[0] = "x", "p", "p", "y"
        nodes = list(moved_anyway.graph.node)
        del moved_anyway.graph.node[:]
        moved_anyway.graph.node.extend(nodes[:-2] + [pool, conv])
        want = _run(model, X, "ORT_DISABLE_ALL").reshape(2, C_OUT)
        assert np.abs(_run(moved_anyway, X, "ORT_DISABLE_ALL").reshape(2, C_OUT) - want).max() > 0.01


class FullyConvolutional(nn.Module):
    """conv -> ReLU -> conv -> ReLU -> 1x1 conv head -> mean over the map: the U-Net / P-Net head."""

    def __init__(self, keepdim: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU())
        self.head = nn.Conv2d(16, 10, 1)
        self.keepdim = keepdim

    def forward(self, x):
        return self.head(self.body(x)).mean((2, 3), keepdim=self.keepdim)


@pytest.mark.parametrize("keepdim", [False, True])
def test_exported_head_runs_on_the_mean_and_equals_pytorch(tmp_path, keepdim):
    torch.manual_seed(0)
    model = FullyConvolutional(keepdim)
    calib = [torch.randn(8, 4, 16, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    res, ops = quantize_calibrate_export(model, calib, str(tmp_path / "fc.onnx"), speed_check=False)
    kernels = {k.layer: k for k in res.layer_kernels}
    assert kernels["head"].reason == ON_THE_MEAN and kernels["head"].by_choice, kernels["head"]
    assert kernels["body.0"].kernel == "QLinearConv" and kernels["body.2"].kernel == "QLinearConv", kernels
    assert not any(MEAN_FIRST in k.layer for k in res.layer_kernels)  # the moved mean is not reported as a layer
    assert "ReduceMean" not in ops and ops.index("GlobalAveragePool") < len(ops) - 1 - ops[::-1].index("Conv")
    assert not [w for w in res.warnings if w.startswith("onnxruntime runs")], res.warnings  # nothing unfused
    x = torch.randn(8, 4, 16, 16, generator=torch.Generator().manual_seed(5))
    assert_file_matches_pytorch(model, res, x)
    sess = make_session(res.path, ["CPUExecutionProvider"])
    assert sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0].shape == ((8, 10, 1, 1) if keepdim else (8, 10))
