"""GELU in the operand order onnxruntime fuses (:mod:`lq.export.passes._gelu_order`).

The rewrite must leave onnxruntime's numbers unchanged (bit for bit with its optimizations off), must make
onnxruntime run one Gelu/BiasGelu kernel, must leave look-alikes with other constants or shared intermediate
values alone, and an exported Linear-GELU-Linear model must fuse its GELU and still equal PyTorch.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export.passes._gelu_order import reorder_gelus

from _export_checks import assert_file_matches_pytorch, quantize_calibrate_export, rewritten

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)


def _dynamo_gelu(root: float = math.sqrt(2.0), half: float = 0.5, share_half: bool = False) -> onnx.ModelProto:
    """y = x * (half * (1 + erf(x / root))), the order torch.onnx's current exporter writes F.gelu in."""
    consts = {"root": root, "one": 1.0, "half": half}
    inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in consts.items()]
    nodes = [helper.make_node("Div", ["x", "root"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["a", "half"], ["h"]),
             helper.make_node("Mul", ["x", "h"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if share_half:
        outputs.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])], outputs,
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _rewrite(model: onnx.ModelProto) -> tuple[int, onnx.ModelProto]:
    return rewritten(model, reorder_gelus)


def _session(model, level: str, optimized: str | None = None):
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if optimized:
        so.optimized_model_filepath = optimized
    data = model if isinstance(model, (bytes, str)) else model.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _optimized_ops(model, tmp_path) -> list[str]:
    path = str(tmp_path / "optimized.onnx")
    _session(model, "ORT_ENABLE_EXTENDED", path)
    return [n.op_type for n in onnx.load(path).graph.node]


def test_gelu_reordered_with_the_same_numbers_and_fused(tmp_path):
    model = _dynamo_gelu()
    done, new = _rewrite(model)
    assert done == 1
    x = (4 * np.random.default_rng(0).standard_normal((4, 64))).astype(np.float32)
    (want,) = _session(model, "ORT_DISABLE_ALL").run(None, {"x": x})
    (got,) = _session(new, "ORT_DISABLE_ALL").run(None, {"x": x})
    np.testing.assert_array_equal(got, want)  # multiplying by 0.5 first or last: the same floats
    (fused,) = _session(new, "ORT_ENABLE_ALL").run(None, {"x": x})
    np.testing.assert_allclose(fused, F.gelu(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)
    ops = _optimized_ops(new, tmp_path)
    assert "Gelu" in ops and "Erf" not in ops, ops


@pytest.mark.parametrize("kw", [{"root": 2.0}, {"half": 0.25}, {"share_half": True}])
def test_look_alikes_stay(kw):
    done, new = _rewrite(_dynamo_gelu(**kw))
    assert done == 0
    assert [list(n.input) for n in new.graph.node][-1] == ["x", "h"]


class MLP(nn.Module):
    def __init__(self, functional: bool):
        super().__init__()
        self.up, self.down, self.functional = nn.Linear(32, 64), nn.Linear(64, 16), functional
        self.act = nn.GELU()

    def forward(self, x):
        h = self.up(x)
        return self.down(F.gelu(h) if self.functional else self.act(h))


@pytest.mark.parametrize("functional", [False, True])
def test_exported_gelu_is_fused_by_onnxruntime(tmp_path, functional):
    torch.manual_seed(0)
    model = MLP(functional)
    calib = [torch.randn(4, 10, 32, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    res, _ = quantize_calibrate_export(model, calib, str(tmp_path / "mlp.onnx"))
    assert_file_matches_pytorch(model, res, torch.randn(4, 10, 32, generator=torch.Generator().manual_seed(3)))
    ops = _optimized_ops(res.path, tmp_path)
    assert any(op in ("Gelu", "BiasGelu") for op in ops) and "Erf" not in ops, ops
