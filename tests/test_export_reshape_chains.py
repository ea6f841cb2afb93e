"""Fewer reshapes around a transformer's Gemms (:mod:`lq.export.passes._reshape_chains`).

Each rewrite must keep every number: the rewritten graphs give onnxruntime's very outputs of the originals
(optimizations off and on). Chains the rewrite must not merge (a shape that copies dims from its input, a first
reshape read twice, two different grids) stay. Exported, an MLP block keeps its first Linear's output 2-D through
the GELU into the second, an attention block runs no reshape of a reshape in onnxruntime's optimized graph, a
Gemm output read by more than elementwise ops keeps its unflatten, and every file equals PyTorch at batch sizes
and token counts the export never saw.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export.passes._reshape_chains import merge_reshape_chains

from _export_checks import LEVELS, assert_file_matches_pytorch, quantize_calibrate_export, rewritten, run_graph

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)


def _chain(second=(-1, 3, 8), allowzero=0, through_grid=False, other_scale=0.05, read_twice=False) -> onnx.ModelProto:
    """x (2, 4, 6) -> [Q -> DQ ->] Reshape(-1, 24) -> [Q ->] Reshape(second) [-> DQ] -> y."""
    inits = [numpy_helper.from_array(np.array([-1, 24], np.int64), "s1"),
             numpy_helper.from_array(np.array(second, np.int64), "s2"),
             numpy_helper.from_array(np.array(0.05, np.float32), "sa"),
             numpy_helper.from_array(np.array(other_scale, np.float32), "sb"),
             numpy_helper.from_array(np.array(120, np.uint8), "za")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if through_grid:
        nodes = [helper.make_node("QuantizeLinear", ["x", "sa", "za"], ["xq"]),
                 helper.make_node("DequantizeLinear", ["xq", "sa", "za"], ["xd"]),
                 helper.make_node("Reshape", ["xd", "s1"], ["r1"]),
                 helper.make_node("QuantizeLinear", ["r1", "sb", "za"], ["r1q"]),
                 helper.make_node("Reshape", ["r1q", "s2"], ["r2"], allowzero=allowzero),
                 helper.make_node("DequantizeLinear", ["r2", "sb", "za"], ["y"])]
    else:
        nodes = [helper.make_node("Reshape", ["x", "s1"], ["r1"]),
                 helper.make_node("Reshape", ["r1", "s2"], ["y"], allowzero=allowzero)]
    if read_twice:
        nodes.append(helper.make_node("Relu", ["r1"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 6])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("kw", [{}, dict(through_grid=True), dict(second=(2, 3, 8), allowzero=1)])
def test_a_reshape_of_a_reshape_is_one_reshape_with_the_same_numbers(kw):
    model = _chain(**kw)
    done, new = rewritten(model, merge_reshape_chains)
    assert done == 1
    assert [n.op_type for n in new.graph.node].count("Reshape") == 1
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] != "x" for n in new.graph.node)
    x = np.random.default_rng(0).normal(0, 3, (2, 4, 6)).astype(np.float32)
    for level in LEVELS:
        np.testing.assert_array_equal(run_graph(new, x, level)[0], run_graph(model, x, level)[0])


@pytest.mark.parametrize("kw", [
    dict(second=(2, 0, 4)),  # 0 copies the first reshape's dim: the result depends on it
    dict(read_twice=True),  # the first reshape's output is read by something else too
    dict(through_grid=True, other_scale=0.07),  # a requantization between them: not the same integers
])
def test_chains_the_rewrite_must_not_merge_stay(kw):
    model = _chain(**kw)
    done, new = rewritten(model, merge_reshape_chains)
    assert done == 0 and [n.op_type for n in new.graph.node] == [n.op_type for n in model.graph.node]


class Mlp(nn.Module):
    """A pre-norm transformer MLP block on (batch, tokens, features); ``tap``: the first Linear's output is also
    read by a slice (not elementwise), so it must go back to 3-D."""

    def __init__(self, d: int = 16, tap: bool = False):
        super().__init__()
        self.norm, self.up, self.down, self.tap = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), tap

    def forward(self, x):
        h = self.up(self.norm(x))
        y = x + self.down(F.gelu(h))
        return y + h[..., : y.shape[-1]] if self.tap else y


def _calib(*lead):
    return [torch.randn(*lead, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]


@pytest.mark.parametrize("dynamic_tokens", [False, True])
def test_an_mlp_computes_its_gelu_on_the_gemm_rows(dynamic_tokens, tmp_path):
    """up -> GELU -> down reads no reshape between the Gemms: one flatten before ``up`` and one unflatten after
    ``down`` are the file's only reshapes (there were four), with static and with dynamic token counts."""
    torch.manual_seed(0)
    model = Mlp()
    res, ops = quantize_calibrate_export(model, _calib(4, 10), str(tmp_path / "mlp.onnx"), speed_check=False,
                                         **(dict(dynamic_dims=(1,)) if dynamic_tokens else {}))
    assert ops.count("Gemm") == 2 and ops.count("Reshape") == 2, ops
    for batch, tokens in ((1, 10), (7, 10)) + (((3, 3), (2, 17)) if dynamic_tokens else ()):
        assert_file_matches_pytorch(model, res, torch.randn(batch, tokens, 16, generator=torch.Generator().manual_seed(3)))


def test_a_gemm_output_read_by_more_than_elementwise_ops_keeps_its_shape(tmp_path):
    torch.manual_seed(0)
    model = Mlp(tap=True)
    res, ops = quantize_calibrate_export(model, _calib(4, 10), str(tmp_path / "tap.onnx"), speed_check=False)
    assert ops.count("Gemm") == 2 and ops.count("Reshape") >= 4, ops  # up's unflatten and down's flatten stay
    for batch in (1, 5):
        assert_file_matches_pytorch(model, res, torch.randn(batch, 10, 16, generator=torch.Generator().manual_seed(4)))


class Attention(nn.Module):
    """ViT's attention: qkv Linear -> view(b, n, 3, heads, d) -> attention -> reshape(b, n, c) -> proj Linear."""

    def __init__(self, c: int = 16, heads: int = 2):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(c, 3 * c), nn.Linear(c, c), heads

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = (q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5).softmax(-1)
        return x + self.proj((a @ v).transpose(1, 2).reshape(b, n, c))


def test_attention_runs_no_reshape_of_a_reshape(tmp_path):
    """The qkv Gemm's unflatten and the model's view, the model's reshape and proj's flatten: one reshape each in
    onnxruntime's optimized graph (before: two in a row, twice)."""
    torch.manual_seed(0)
    model = Attention()
    res, ops = quantize_calibrate_export(model, _calib(4, 10), str(tmp_path / "attn.onnx"), speed_check=False)
    assert ops.count("Gemm") == 2, ops
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(res.path, so, providers=["CPUExecutionProvider"])
    opt = onnx.load(so.optimized_model_filepath)
    prod = {o: n for n in opt.graph.node for o in n.output}
    chains = [n.name for n in opt.graph.node if n.op_type == "Reshape" and prod.get(n.input[0]) is not None
              and prod[n.input[0]].op_type == "Reshape"]
    assert not chains, chains
    for batch in (1, 6):
        assert_file_matches_pytorch(model, res, torch.randn(batch, 10, 16, generator=torch.Generator().manual_seed(5)))
