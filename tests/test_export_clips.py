"""ReLU6, Hardtanh and clamp (ONNX ``Clip``) between a conv and its reader's quantizer
(:func:`lq.export.passes._placement.hoist_quantizers`, :func:`lq.export.passes._placement.clips_on_integers`).

A rounding that keeps order distributes over min and max, so ``Q(clip(x, lo, hi)) == clamp(Q(x), Q(lo), Q(hi))``
for any constant bounds: the quantizer after a Clip may be copied to its input (the conv then fuses into
QLinearConv), and ``DQ -> Clip -> Q`` on one grid is the clip on the integers, or nothing. The references here
are onnxruntime's own float Clip and QuantizeLinear on the graph before the rewrite (optimizations off, so
onnxruntime's ClipQuantFusion does not do the work), over every code and on off-grid, on-grid and inactive
bounds; and an exported MobileNetV2-style model with ReLU6 on the default (signed) recipe, whose convs ran in
float before (0.32x FP32 in ``bench.ordinary``'s model).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export._ir import Graph
from lq.export.passes._placement import clips_on_integers, hoist_quantizers
from lq.export.verify._verify import make_session

from bench.ordinary import InvertedResidual

from _export_checks import assert_file_matches_pytorch, quantize_calibrate_export

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)

INT8, UINT8 = TensorProto.INT8, TensorProto.UINT8
NP = {INT8: np.int8, UINT8: np.uint8}


def _model(nodes, inits, x_type, y_type) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, None)],
                              [helper.make_tensor_value_info("y", y_type, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _grid(scale: float, zp: int, t) -> list:
    return [numpy_helper.from_array(np.array(scale, np.float32), "s"),
            numpy_helper.from_array(np.array(zp, NP[t]), "z")]


def _bounds(lo, hi) -> tuple[list, list]:
    """Clip's inputs after x and their initializers (None: the bound is absent)."""
    names, inits = [], []
    for name, v in (("lo", lo), ("hi", hi)):
        names.append(name if v is not None else "")
        if v is not None:
            inits.append(numpy_helper.from_array(np.array(v, np.float32), name))
    while names and not names[-1]:
        names.pop()
    return names, inits


def _dq_clip_q(scale, zp, t, lo, hi, op="Clip") -> onnx.ModelProto:
    """codes -> DequantizeLinear -> Clip(lo, hi) (or Relu) -> QuantizeLinear -> DequantizeLinear, one grid."""
    names, binits = _bounds(lo, hi)
    act = helper.make_node("Clip", ["d"] + names, ["c"]) if op == "Clip" else helper.make_node("Relu", ["d"], ["c"])
    nodes = [helper.make_node("DequantizeLinear", ["x", "s", "z"], ["d"]), act,
             helper.make_node("QuantizeLinear", ["c", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    return _model(nodes, _grid(scale, zp, t) + binits, t, TensorProto.FLOAT)


def _rewritten(model: onnx.ModelProto, rewrite) -> onnx.ModelProto:
    g = Graph(onnx.ModelProto.FromString(model.SerializeToString()))
    rewrite(g)
    return g.finalize()


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = make_session(model.SerializeToString(), ["CPUExecutionProvider"],
                        graph_optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return sess.run(None, {"x": x})[0]


CASES = [  # scale, zero point, type, lo, hi, the op the integers get (None: nothing)
    (6 / 127, 0, INT8, 0.0, 6.0, "Max"),  # ReLU6 on the signed grid: the top bound is outside it
    (5.0 / 127, 0, INT8, 0.0, 6.0, "Max"),
    (6 / 255, 0, UINT8, 0.0, 6.0, None),  # ReLU6 on the unsigned grid: nothing left to do
    (8.0 / 127, 0, INT8, 0.0, 6.0, "Clip"),  # a grid wider than 6: both bounds act
    (8.0 / 255, 0, UINT8, 0.0, 6.0, "Min"),
    (0.013, 0, INT8, -1.0, 1.0, "Clip"),  # Hardtanh(-1, 1): off-grid bounds
    (0.05, 128, UINT8, -1.03, 2.0, "Clip"),  # a signed grid written as uint8 with zero point 128
    (0.1, 10, UINT8, 0.0, None, "Max"),  # clamp(min=0) on an asymmetric grid
    (0.1, 0, INT8, None, 0.77, "Min"),  # clamp(max=...)
    (0.01, 0, INT8, -5.0, 5.0, None),  # both bounds outside the grid
]


@pytest.mark.parametrize("scale,zp,t,lo,hi,op", CASES)
def test_a_clip_between_two_quantizers_runs_on_the_integers(scale, zp, t, lo, hi, op):
    model = _dq_clip_q(scale, zp, t, lo, hi)
    new = _rewritten(model, clips_on_integers)
    assert [n.op_type for n in new.graph.node] == ([op] if op else []) + ["DequantizeLinear"]
    codes = np.arange(np.iinfo(NP[t]).min, np.iinfo(NP[t]).max + 1).astype(NP[t])
    np.testing.assert_array_equal(_run(new, codes), _run(model, codes))


@pytest.mark.parametrize("t,zp", [(INT8, 0), (UINT8, 0), (UINT8, 128), (UINT8, 7)])
def test_a_relu_between_two_quantizers_runs_on_the_integers(t, zp):
    model = _dq_clip_q(0.02, zp, t, None, None, op="Relu")
    new = _rewritten(model, clips_on_integers)
    codes = np.arange(np.iinfo(NP[t]).min, np.iinfo(NP[t]).max + 1).astype(NP[t])
    assert [n.op_type for n in new.graph.node] == ([] if zp == 0 and t == UINT8 else ["Max"]) + ["DequantizeLinear"]
    np.testing.assert_array_equal(_run(new, codes), _run(model, codes))


def test_a_bound_on_a_rounding_tie_is_left_alone():
    """3.5 steps: the runtime's division may round the bound either way, so the float Clip stays."""
    model = _dq_clip_q(0.1, 0, INT8, 0.0, 0.35, op="Clip")
    assert [n.op_type for n in _rewritten(model, clips_on_integers).graph.node] == [
        "DequantizeLinear", "Clip", "QuantizeLinear", "DequantizeLinear"]


def test_a_clip_with_a_tensor_bound_is_left_alone():
    model = _dq_clip_q(0.1, 0, INT8, 0.0, 6.0)
    model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.full(3, 6.0, np.float32), "hi"))
    assert [n.op_type for n in _rewritten(model, clips_on_integers).graph.node] == [
        "DequantizeLinear", "Clip", "QuantizeLinear", "DequantizeLinear"]


@pytest.mark.parametrize("lo,hi,scale,t", [(0.0, 6.0, 6 / 127, INT8), (0.0, 6.0, 9 / 127, INT8),
                                           (-1.0, 1.0, 0.011, INT8), (0.0, 6.0, 6 / 255, UINT8),
                                           (-0.3, None, 0.02, INT8)])
def test_the_quantizer_after_a_clip_moves_before_it_exactly(lo, hi, scale, t):
    """conv -> Clip -> Q -> DQ becomes conv -> Q -> (integer clip) -> DQ; onnxruntime's outputs are the same
    bit for bit on data that spans the bounds and the grid's ends (the file before the rewrite is the
    reference: float Clip, then QuantizeLinear)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    names, binits = _bounds(lo, hi)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c"] + names, ["a"]),
             helper.make_node("QuantizeLinear", ["a", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    model = _model(nodes, [numpy_helper.from_array(w, "w")] + _grid(scale, 0, t) + binits, TensorProto.FLOAT,
                   TensorProto.FLOAT)
    new = _rewritten(model, lambda g: (hoist_quantizers(g), clips_on_integers(g)))
    ops = [n.op_type for n in new.graph.node]
    # one quantizer, right after the conv: whatever clip is left reads integers
    assert ops[:2] == ["Conv", "QuantizeLinear"] and ops[-1] == "DequantizeLinear" and len(ops) <= 4, ops
    assert set(ops[2:-1]) <= {"Max", "Min", "Clip"}, ops
    x = (rng.standard_normal((4, 4, 9, 9)) * 1.5).astype(np.float32)
    ref = _run(model, x)
    assert (ref == ref.max()).sum() > 1 and (ref == ref.min()).sum() > 1  # the data reaches both ends
    np.testing.assert_array_equal(_run(new, x), ref)


def test_every_site_of_a_deep_graph_is_hoisted_in_a_few_walks():
    """100 blocks of conv -> ReLU -> MaxPool(1x1) -> Q -> DQ: the quantizer moves two ops up in every block (200 moves;
    the pass once stopped after 64, leaving the deeper blocks' convs in float), and the file equals the graph before
    the rewrite."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], _grid(0.05, 0, INT8), "x"
    for i in range(100):
        inits.append(numpy_helper.from_array((rng.standard_normal((4, 4, 1, 1)) * 0.5).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
                  helper.make_node("MaxPool", [f"r{i}"], [f"m{i}"], kernel_shape=[1, 1]),
                  helper.make_node("QuantizeLinear", [f"m{i}", "s", "z"], [f"q{i}"]),
                  helper.make_node("DequantizeLinear", [f"q{i}", "s", "z"], ["y" if i == 99 else f"d{i}"])]
        x = f"d{i}"
    model = _model(nodes, inits, TensorProto.FLOAT, TensorProto.FLOAT)
    g = Graph(onnx.ModelProto.FromString(model.SerializeToString()))
    assert hoist_quantizers(g) == 200
    new = g.finalize()
    readers = {}
    for n in new.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.op_type)
    convs = [n for n in new.graph.node if n.op_type == "Conv"]
    assert len(convs) == 100 and all(readers[c.output[0]] == ["QuantizeLinear"] for c in convs)
    xin = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    np.testing.assert_array_equal(_run(new, xin), _run(model, xin))


# ================================================ exported models (bench.ordinary's MobileNetV2 block)
class Clamp(nn.Module):
    def forward(self, x):
        return torch.clamp(x, min=0.0, max=4.0)


ACTS = {"relu6": nn.ReLU6, "hardtanh": lambda: nn.Hardtanh(-1.0, 1.0), "clamp": Clamp}


@pytest.mark.parametrize("act", list(ACTS))
def test_mobilenet_blocks_with_relu6_run_every_conv_on_an_integer_kernel(act, tmp_path):
    """Before: '... is read by (Clip) without a quantizer' for every conv before a ReLU6 on the default
    recipe (signed grids, where onnxruntime's own ClipQuantFusion does not apply), 6 of 12 layers integer."""
    torch.manual_seed(0)
    a = ACTS[act]
    m = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), a(), InvertedResidual(16, 16, act=a),
                      InvertedResidual(16, 16, act=a), nn.Conv2d(16, 32, 1), a(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(32, 10))
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 2.0)
    m.eval()
    calib = [torch.randn(8, 3, 32, 32) for _ in range(4)]
    # Hardtanh(-1, 1) on the default asymmetric grid keeps its Clip: an integer zero point cannot put both -1 and
    # 1 on the grid (2/255 steps), so the grid reaches past one bound and the Clip is not redundant; the
    # symmetric grid ends on the bounds
    recipe = "int8_per_channel" if act == "hardtanh" else None
    res, ops = quantize_calibrate_export(m, calib, str(tmp_path / f"{act}.onnx"), recipe=recipe, speed_check=False)
    assert "Clip" not in ops, ops
    float_layers = [(k.layer, k.reason) for k in res.layer_kernels if not k.integer and not k.by_choice]
    assert float_layers == [], float_layers
    assert_file_matches_pytorch(m, res, torch.randn(8, 3, 32, 32))
