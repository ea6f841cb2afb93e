"""SiLU as onnxruntime's fused QuickGelu (:mod:`lq.export.passes._silu`).

The rewrite must compute what ``Mul(x, Sigmoid(x))`` computes, make onnxruntime run one kernel where ``x`` comes
out of a DequantizeLinear (where its own fusion does not), leave look-alikes alone, and an exported
conv -> SiLU -> conv model must still equal PyTorch; TensorRT's file keeps the standard ops.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export.passes._silu import silus_as_quick_gelu

from _export_checks import assert_file_matches_pytorch, quantize_calibrate_export, rewritten

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)


def _silu_after_dq(other: str = "x", shared_gate: bool = False) -> onnx.ModelProto:
    """y = Mul(other, Sigmoid(x)) with x = DequantizeLinear(QuantizeLinear(input)), as a SiLU between Q/DQ."""
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.uint8(128), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["inp", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["x"]),
             helper.make_node("Sigmoid", ["x"], ["g"]), helper.make_node("Mul", ["g", other], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if shared_gate:
        outputs.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("inp", TensorProto.FLOAT, [4, 64])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray, optimized: str | None = None) -> np.ndarray:
    so = ort.SessionOptions()
    if optimized:
        so.optimized_model_filepath = optimized
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, {"inp": x})[0]


def test_silu_between_qdq_is_one_quick_gelu_with_the_same_numbers(tmp_path):
    model = _silu_after_dq()
    done, new = rewritten(model, silus_as_quick_gelu)
    assert done == 1 and [n.op_type for n in new.graph.node][-1] == "QuickGelu"
    assert any(o.domain == "com.microsoft" for o in new.opset_import)
    x = (3 * np.random.default_rng(0).standard_normal((4, 64))).astype(np.float32)
    want = _run(model, x)
    np.testing.assert_allclose(_run(new, x, str(tmp_path / "opt.onnx")), want, rtol=1e-6, atol=1e-7)
    xq = torch.from_numpy(np.clip(np.round(x / 0.05) + 128, 0, 255) - 128) * 0.05
    np.testing.assert_allclose(want, F.silu(xq).numpy(), rtol=1e-5, atol=1e-6)  # the function itself
    ops = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    assert "QuickGelu" in ops and "Sigmoid" not in ops and "Mul" not in ops, ops
    # without the rewrite onnxruntime leaves the two ops separate here
    _run(model, x, str(tmp_path / "plain.onnx"))
    plain = [n.op_type for n in onnx.load(str(tmp_path / "plain.onnx")).graph.node]
    assert "Sigmoid" in plain and "Mul" in plain, plain


@pytest.mark.parametrize("kw", [{"other": "inp"}, {"shared_gate": True}])
def test_look_alikes_stay(kw):
    done, new = rewritten(_silu_after_dq(**kw), silus_as_quick_gelu)
    assert done == 0 and "QuickGelu" not in [n.op_type for n in new.graph.node]


class ConvSiLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn, self.conv2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 8, 1)

    def forward(self, x):
        return self.conv2(F.silu(self.bn(self.conv1(x))))


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_an_exported_silu_is_quick_gelu_for_onnxruntime_only(tmp_path, target):
    torch.manual_seed(0)
    model = ConvSiLU().eval()
    calib = [torch.randn(4, 8, 10, 10, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    res, ops = quantize_calibrate_export(model, calib, str(tmp_path / "m.onnx"), target=target, speed_check=False)
    assert_file_matches_pytorch(model, res, torch.randn(4, 8, 10, 10, generator=torch.Generator().manual_seed(3)))
    if target == "onnxruntime":
        assert ops.count("QuickGelu") == 1 and "Sigmoid" not in ops, ops
        assert {(k.layer, k.op): k.kernel for k in res.layer_kernels}[("conv1", "Conv")] == "QLinearConv"
    else:
        assert "QuickGelu" not in ops and ops.count("Sigmoid") == 1, ops
