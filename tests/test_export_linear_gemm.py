"""A Linear on a 3-D input (MatMul + bias Add) written as Reshape -> Gemm -> Reshape (:mod:`lq.export.passes._linear_gemm`).

The rewrite reshapes the integers before they are dequantized and computes the same sums: these tests check
the rewritten graph against onnxruntime on the original one (optimizations off and on), on 3-D and 4-D inputs
and for a quantized input several Linears read (flattened once); that MatMuls the rewrite must not touch stay
(an output read twice, a non-constant bias, two activations, an opset without Shape's end); and that an
exported transformer block runs its Linears as QGemm, for token counts the export never saw, equal to PyTorch.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export.passes._int16 import int16_risks
from lq.export.passes._linear_gemm import linears_as_gemm

from _export_checks import LEVELS, assert_file_matches_pytorch, quantize_calibrate_export, rewritten, run_graph

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)

K, N = 12, 7


def _graph(lead=(2, 5), readers: int = 1, read_twice: bool = False, bias_input: bool = False, two_activations=False,
           bias_shape=(N,), opset: int = 17) -> onnx.ModelProto:
    """x -> Q -> DQ -> MatMul(., DQ(int8 W, per column)) -> Add(b) -> y_i, for ``readers`` Linears of one input."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(0.03, np.float32), "sa"),
             numpy_helper.from_array(np.array(128, np.uint8), "za")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sa", "za"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sa", "za"], ["xdq"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, K])]
    outputs = []
    for i in range(readers):
        if two_activations:  # the "weight" is a second activation: an attention-style matmul
            inputs.append(helper.make_tensor_value_info(f"w{i}", TensorProto.FLOAT, [K, N]))
            w = f"w{i}"
        else:
            # 7-bit weights, as lq writes them for onnxruntime: full-range int8 ones saturate its AVX2 kernels,
            # differently in MatMul and Gemm (tests/test_avx2_kernels.py)
            inits += [numpy_helper.from_array(rng.integers(-63, 64, (K, N)).astype(np.int8), f"wq{i}"),
                      numpy_helper.from_array((0.01 + 0.02 * rng.random(N)).astype(np.float32), f"ws{i}")]
            nodes.append(helper.make_node("DequantizeLinear", [f"wq{i}", f"ws{i}"], [f"w{i}"], axis=1))
            w = f"w{i}"
        nodes.append(helper.make_node("MatMul", ["xdq", w], [f"m{i}"]))
        if bias_input:
            inputs.append(helper.make_tensor_value_info(f"b{i}", TensorProto.FLOAT, [N]))
        else:
            inits.append(numpy_helper.from_array(rng.standard_normal(bias_shape).astype(np.float32), f"b{i}"))
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
        if read_twice:
            nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
            outputs.append(helper.make_tensor_value_info(f"r{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _feeds(model: onnx.ModelProto) -> dict:
    rng = np.random.default_rng(1)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input}


@pytest.mark.parametrize("kw", [dict(), dict(lead=(2, 3, 5)), dict(readers=3), dict(bias_shape=(1, 1, N))],
                         ids=["3d", "4d", "three-linears-one-input", "bias-1-1-n"])
def test_linear_becomes_gemm_with_the_same_numbers(kw):
    model = _graph(**kw)
    done, new = rewritten(model, linears_as_gemm)
    readers = kw.get("readers", 1)
    assert done == readers
    ops = [n.op_type for n in new.graph.node]
    assert ops.count("Gemm") == readers and "MatMul" not in ops and "Add" not in ops, ops
    assert ops.count("Shape") == 1 and ops.count("Reshape") == 1 + readers, ops  # the input flattened once
    assert len([n for n in new.graph.node if n.op_type == "Reshape" and n.input[0] == "xq"]) == 1  # the integers
    assert int16_risks(model) == [] and int16_risks(new) == []  # the same numbers on every CPU
    feeds = _feeds(model)
    for level in LEVELS:
        want, got = run_graph(model, feeds, level), run_graph(new, feeds, level)
        for w, g_ in zip(want, got):
            assert g_.shape == w.shape
            np.testing.assert_allclose(g_, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(read_twice=True), dict(bias_input=True), dict(two_activations=True),
                                dict(opset=13)],
                         ids=["matmul-read-twice", "bias-not-constant", "two-activations", "opset-13"])
def test_matmuls_the_rewrite_must_not_touch_stay(kw):
    model = _graph(**kw)
    done, new = rewritten(model, linears_as_gemm)
    assert done == 0 and [n.op_type for n in new.graph.node] == [n.op_type for n in model.graph.node]


class Block(nn.Module):
    """A pre-norm transformer MLP block on (batch, tokens, features): LayerNorm, Linear, GELU, Linear, residual."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def test_exported_block_runs_its_linears_as_qgemm_for_any_token_count(tmp_path):
    torch.manual_seed(0)
    model = Block()
    calib = [torch.randn(4, 10, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    res, ops = quantize_calibrate_export(model, calib, str(tmp_path / "block.onnx"), dynamic_dims=(1,),
                                         speed_check=False)
    kernels = {k.layer: k for k in res.layer_kernels if k.op in ("Gemm", "MatMul")}
    assert kernels["up"].op == "Gemm" and kernels["up"].kernel == "QGemm", kernels
    assert kernels["down"].op == "Gemm" and kernels["down"].kernel == "QGemm", kernels
    assert "MatMul" not in ops and ops.count("Gemm") == 2, ops
    for tokens in (3, 17):  # token counts the export never saw: the reshape back follows the input's shape
        assert_file_matches_pytorch(model, res, torch.randn(5, tokens, 16, generator=torch.Generator().manual_seed(7)))


def test_reshape_back_is_a_constant_where_only_the_batch_is_unknown(tmp_path):
    """Exported with a dynamic batch only, every Gemm's unflatten reads a constant ``[-1, tokens, N]``
    (:func:`lq.export.passes._linear_gemm.static_leading_shapes`), the GELU between the two Linears included: no
    Shape or Concat is left to run, and the file still equals PyTorch at batch sizes it never saw. With the token
    count dynamic (the test above) the shapes stay computed."""
    torch.manual_seed(0)
    model = Block()
    calib = [torch.randn(4, 10, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    res, ops = quantize_calibrate_export(model, calib, str(tmp_path / "block.onnx"), speed_check=False)
    assert ops.count("Gemm") == 2 and "Shape" not in ops and "Concat" not in ops, ops
    for batch in (1, 7):
        assert_file_matches_pytorch(model, res, torch.randn(batch, 10, 16, generator=torch.Generator().manual_seed(3)))
    dynamic, dyn_ops = quantize_calibrate_export(Block(), calib, str(tmp_path / "dyn.onnx"), dynamic_dims=(1,),
                                                 speed_check=False)
    # tokens unknown: the Gemms reshape back by the input's shape (one Shape: the MLP's second Linear reuses the
    # first's leading dims, lq.export.passes._reshape_chains)
    assert dyn_ops.count("Shape") == 1 and dyn_ops.count("Concat") == 1, dyn_ops
