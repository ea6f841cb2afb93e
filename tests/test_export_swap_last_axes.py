"""``Reshape -> Transpose([0, 2, 1]) -> Reshape`` that swaps the last two axes, as one Transpose
(:mod:`lq.export.passes._swap_last_axes`).

The rewrite moves the same elements (onnxruntime's output is bit for bit the same, optimizations off and on),
leaves look-alikes alone (a second Reshape that does not swap back, a shape read from another tensor), and in an
exported attention block (``scaled_dot_product_attention``, PyTorch's current exporter) onnxruntime runs as many
Transposes as in the legacy exporter's file, the file still equal to the fake-quant model. A deliberately wrong
permutation is caught by the export's verification.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export._ir import ExportError
from lq.export.passes import _swap_last_axes
from lq.export.passes._swap_last_axes import swap_last_axes

from _export_checks import LEVELS, assert_file_matches_pytorch, run_graph, rewritten

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)
BIG = np.iinfo(np.int64).max


def _chain(second=("first", "last", "second_last"), shape_of: str = "x") -> onnx.ModelProto:
    """y = Reshape(Transpose(Reshape(x, [-1, d2, d3]), [0, 2, 1]), Concat(<second>)) with d = Shape(shape_of), the
    way onnxscript writes ``x.transpose(-1, -2)`` (``second``: the pieces of the second shape, in order)."""
    c = {"m1": [-1], "m2": [-2], "z": [0], "big": [BIG]}
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in c.items()]
    pieces = {"first": ("z", "m2"), "second_last": ("m2", "m1"), "last": ("m1", "big")}
    nodes = [helper.make_node("Shape", [shape_of], ["shp"])]
    for name, (a, b) in pieces.items():
        nodes.append(helper.make_node("Slice", ["shp", a, b], [name]))
    nodes += [helper.make_node("Concat", ["m1", "second_last", "last"], ["s1"], axis=0),
              helper.make_node("Reshape", ["x", "s1"], ["r1"]),
              helper.make_node("Transpose", ["r1"], ["t"], perm=[0, 2, 1]),
              helper.make_node("Concat", list(second), ["s2"], axis=0),
              helper.make_node("Reshape", ["t", "s2"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3, "s", 8])]
    if shape_of != "x":
        inputs.append(helper.make_tensor_value_info(shape_of, TensorProto.FLOAT, ["b", 3, "s", 8]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    inferred = onnx.shape_inference.infer_shapes(model)
    return {v.name: tuple(d.dim_value or None for d in v.type.tensor_type.shape.dim)
            for v in list(inferred.graph.input) + list(inferred.graph.value_info) if v.type.tensor_type.HasField("shape")}


def _rewrite(model):
    return rewritten(model, swap_last_axes, _shapes(model))


@pytest.mark.parametrize("shape", [(2, 3, 5, 8), (1, 3, 1, 8), (4, 3, 17, 8)])
def test_one_transpose_with_the_same_numbers(shape):
    model = _chain()
    done, new = _rewrite(model)
    assert done == 1
    assert [(n.op_type, list(n.attribute[0].ints)) for n in new.graph.node] == [("Transpose", [0, 1, 3, 2])]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for level in LEVELS:
        (want,) = run_graph(model, x, level)
        (got,) = run_graph(new, x, level)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, x.transpose(0, 1, 3, 2))  # the independent reference: numpy


def test_the_transpose_before_merges_into_it():
    model = _chain()
    x = helper.make_tensor_value_info("x_in", TensorProto.FLOAT, ["b", "s", 3, 8])
    model.graph.node.insert(0, helper.make_node("Transpose", ["x_in"], ["x"], perm=[0, 2, 1, 3]))
    del model.graph.input[:]
    model.graph.input.append(x)
    done, new = _rewrite(model)
    assert done == 1
    assert [(n.op_type, list(n.attribute[0].ints)) for n in new.graph.node] == [("Transpose", [0, 2, 3, 1])]
    a = np.random.default_rng(1).standard_normal((2, 5, 3, 8)).astype(np.float32)
    (got,) = run_graph(new, {"x_in": a}, "ORT_DISABLE_ALL")
    np.testing.assert_array_equal(got, a.transpose(0, 2, 1, 3).transpose(0, 1, 3, 2))


@pytest.mark.parametrize("model", [
    _chain(second=("first", "second_last", "last")),  # the second Reshape does not swap back: not a transpose
    _chain(shape_of="other"),  # the dimensions of another tensor: not provably x's
], ids=["no_swap", "other_shape"])
def test_look_alikes_stay(model):
    done, new = _rewrite(model)
    assert done == 0
    assert [n.op_type for n in new.graph.node] == [n.op_type for n in model.graph.node]


def test_a_wrong_permutation_gives_other_numbers(monkeypatch):
    """The independent reference above (numpy's transpose) tells a wrong rewrite from the right one."""
    monkeypatch.setattr(_swap_last_axes, "swapped_perm", lambda rank: list(range(rank)))
    _, new = _rewrite(_chain())
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)  # square: the same shape
    (got,) = run_graph(new, x, "ORT_DISABLE_ALL")
    assert got.shape == x.shape and not np.array_equal(got, x.transpose(0, 1, 3, 2))


class Attention(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (m(x).view(b, t, -1, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        mask = torch.zeros(b, 1, 1, t, dtype=x.dtype, device=x.device)  # as transformers' padding mask
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5)
        return self.o(a.transpose(1, 2).reshape(b, t, d))


def _calibrated(quant: str):
    from lq.calibration import calibrate_model
    from lq.callbacks.swap import QuantSwap

    torch.manual_seed(0)
    m = Attention().eval()
    QuantSwap(quant).swap(m)
    calibrate_model(m, [torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(s)) for s in (1, 2)])
    return m


def _optimized_transposes(path: str, tmp_path) -> int:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return sum(n.op_type == "Transpose" for n in onnx.load(so.optimized_model_filepath).graph.node)


@pytest.mark.parametrize("quant", ["int4_block_weight", "int8_onnxruntime"])
def test_exported_attention_runs_the_legacy_files_transposes_and_equals_pytorch(tmp_path, quant):
    from lq.export import export_onnx

    m = _calibrated(quant)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(3))
    counts = {}
    for dynamo in (True, False):
        res = export_onnx(m, x, str(tmp_path / f"attn_{dynamo}.onnx"), opset=21, dynamo=dynamo, dynamic_dims=(1,),
                          check_fusion=False)
        assert_file_matches_pytorch(m, res, torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(4)))
        perms = [list(n.attribute[0].ints) for n in onnx.load(res.path).graph.node if n.op_type == "Transpose"]
        assert [0, 2, 1] not in perms, perms
        counts[dynamo] = _optimized_transposes(res.path, tmp_path)
    assert counts[True] <= counts[False] == 4, counts  # Q, K (with K's transpose for q @ k^T), V, the output


def test_a_wrong_permutation_fails_the_export_verification(tmp_path, monkeypatch):
    from lq.export import export_onnx

    """Key left unswapped: the export's own checks stop it (here onnxruntime cannot run q @ k on the second input
    shape they try; at 16 tokens of 16 channels per head it runs, with other numbers)."""
    monkeypatch.setattr(_swap_last_axes, "swapped_perm", lambda rank: list(range(rank)))
    m = _calibrated("int4_block_weight")
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ExportError):
        res = export_onnx(m, x, str(tmp_path / "wrong.onnx"), opset=21, dynamo=True, dynamic_dims=(1,),
                          check_fusion=False)
        assert res.verified  # (an export that reports instead of raising)
