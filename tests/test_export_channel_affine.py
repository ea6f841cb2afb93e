"""A per-channel ``Mul -> Add`` (GroupNorm's affine) written as one BatchNormalization
(:mod:`lq.export.passes._channel_affine`).

The rewritten graph must give onnxruntime's numbers of the original (same two roundings: checked to float
rounding, optimizations on and off); an affine along another axis, one that grows the tensor by broadcasting,
or a Mul read elsewhere stays as it is; an exported GroupNorm/SiLU model carries one BatchNormalization per
GroupNorm for onnxruntime (none for TensorRT) and still equals PyTorch's fake-quant model.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export.passes._channel_affine import affines_as_batchnorm
from lq.export._ir import value_shapes

from _export_checks import LEVELS, assert_file_matches_pytorch, quantize_calibrate_export, rewritten, run_graph

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)



def _affine(x_shape, gamma: np.ndarray, beta: np.ndarray, mul_read_twice: bool = False) -> onnx.ModelProto:
    """y = x * gamma + beta (and, with ``mul_read_twice``, a second output reading the product)."""
    inits = [numpy_helper.from_array(gamma.astype(np.float32), "gamma"),
             numpy_helper.from_array(beta.astype(np.float32), "beta")]
    nodes = [helper.make_node("Mul", ["x", "gamma"], ["m"]), helper.make_node("Add", ["m", "beta"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if mul_read_twice:
        nodes.append(helper.make_node("Relu", ["m"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)], outputs,
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _rewrite(model: onnx.ModelProto) -> tuple[int, onnx.ModelProto]:
    return rewritten(model, affines_as_batchnorm, value_shapes(model))


def _run(model: onnx.ModelProto, x: np.ndarray, level: str):
    return run_graph(model, x, level)


RNG = np.random.default_rng(0)


@pytest.mark.parametrize("x_shape,const_shape", [
    ([2, 8, 5, 5], (8, 1, 1)),  # GroupNorm's affine as PyTorch's exporters write it
    ([2, 8, 5, 5], (1, 8, 1, 1)),
    ([2, 8, 5], (8, 1)),  # GroupNorm on (N, C, L)
    ([2, 8, 3, 4, 5], (8, 1, 1, 1)),
])
def test_channel_affine_becomes_batchnorm_with_the_same_numbers(x_shape, const_shape):
    gamma = RNG.standard_normal(const_shape)
    model = _affine(x_shape, gamma, RNG.standard_normal(const_shape))
    done, new = _rewrite(model)
    assert done == 1
    assert [n.op_type for n in new.graph.node] == ["BatchNormalization"]
    x = (10 * RNG.standard_normal(x_shape)).astype(np.float32)
    for level in LEVELS:
        (got,), (ref,) = _run(new, x, level), _run(model, x, level)
        assert got.shape == ref.shape == tuple(x_shape)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("x_shape,const_shape,twice", [
    ([2, 5, 8], (8,), False),  # a LayerNorm affine: along the last axis
    ([2, 1, 5, 5], (8, 1, 1), False),  # one channel broadcast to eight: the tensor grows
    ([2, 8, 5, 5], (8, 5, 1), False),  # varies along a spatial axis
    ([2, 8, 5, 5], (8, 1, 1), True),  # the product is read by another op too
    ([2, 8], (8,), False),  # no spatial axes: nothing to gain
])
def test_other_affines_stay(x_shape, const_shape, twice):
    model = _affine(x_shape, RNG.standard_normal(const_shape), RNG.standard_normal(const_shape), twice)
    done, new = _rewrite(model)
    assert done == 0
    assert [n.op_type for n in new.graph.node][:2] == ["Mul", "Add"]


def test_affine_right_after_a_conv_stays():
    """onnxruntime folds Mul/Add, and a BatchNormalization, after a conv into its weights by itself; a
    BatchNormalization there would let it fold a scalar gamma too and round the weights it then quantizes."""
    model = _affine([2, 8, 5, 5], RNG.standard_normal((1, 1, 1)), RNG.standard_normal((8, 1, 1)))
    g = model.graph
    g.initializer.append(numpy_helper.from_array(RNG.standard_normal((8, 8, 1, 1)).astype(np.float32), "w"))
    g.node.insert(0, helper.make_node("Conv", ["x", "w"], ["cx"]))
    g.node[1].input[0] = "cx"
    done, new = _rewrite(model)
    assert done == 0 and [n.op_type for n in new.graph.node] == ["Conv", "Mul", "Add"]


class GNBlock(nn.Module):
    """conv -> GroupNorm -> SiLU -> conv, a plain + residual: the block of bench.ordinary's depthwise ResNet."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c), nn.Conv2d(c, c, 1)
        with torch.no_grad():  # an affine that is not the identity
            self.norm.weight.copy_(0.5 + torch.rand(c, generator=torch.Generator().manual_seed(1)))
            self.norm.bias.copy_(torch.randn(c, generator=torch.Generator().manual_seed(2)))

    def forward(self, x):
        return x + self.conv2(F.silu(self.norm(self.conv1(x))))


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_exported_groupnorm_affine_is_one_batchnorm_for_onnxruntime(tmp_path, target):
    torch.manual_seed(0)
    model = GNBlock()
    calib = [torch.randn(4, 16, 12, 12, generator=torch.Generator().manual_seed(s)) for s in (3, 4)]
    res, ops = quantize_calibrate_export(model, calib, str(tmp_path / "gn.onnx"), target=target)
    assert ops.count("InstanceNormalization") == 1
    if target == "onnxruntime":
        assert ops.count("BatchNormalization") == 1 and ops.count("QuickGelu") == 1, ops  # the SiLU, fused
        assert "Mul" not in ops and "Sigmoid" not in ops, ops
    else:
        assert "BatchNormalization" not in ops and ops.count("Mul") == 2, ops
    assert_file_matches_pytorch(model, res, torch.randn(4, 16, 12, 12, generator=torch.Generator().manual_seed(5)),
                                target)
