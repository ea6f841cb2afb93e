"""Shared steps of the export-pass tests: quantize, calibrate and export a small model; check the file
against PyTorch's fake-quant model on a second input."""

from __future__ import annotations

import numpy as np
import onnx
import torch

from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.export import export_onnx


def quantize_calibrate_export(model: torch.nn.Module, calib: list, path: str, recipe=None, **export_kw):
    """``quantize_model`` (``recipe``; None: the default) + max calibration on ``calib`` + ``export_onnx``: (the
    result, the file's op types)."""
    quantize_model(model, recipe=recipe)
    model.eval()
    with torch.no_grad():
        calibrate_model(model, calib, method="max")
    res = export_onnx(model, calib[0], path, **export_kw)
    return res, [n.op_type for n in onnx.load(res.path).graph.node]


def assert_file_matches_pytorch(model: torch.nn.Module, res, x: torch.Tensor, target: str = "onnxruntime") -> None:
    """The export verified itself, and onnxruntime's output on ``x`` passes the export's own rule against
    PyTorch's (rounding ties in the quantizers may move it a few output steps). A TensorRT file runs as the export checks it,
    without onnxruntime's QDQ fusions: its int8 x int8 kernels saturate on CPUs without VNNI."""
    from lq.export.verify._verify import make_session, verify_level

    assert res.verified
    with torch.no_grad():
        want = model(x).numpy()
    sess = make_session(res.path, ["CPUExecutionProvider"], graph_optimization_level=verify_level(target))
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert res.judge([got], [want]) == ""


#: onnxruntime with its graph optimizations off and on: a rewrite must give the same numbers under both
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_ALL")


def run_graph(model: onnx.ModelProto, x, level: str) -> list[np.ndarray]:
    """Every output of a graph in onnxruntime at optimization ``level`` (a LEVELS name); ``x``: the array of its
    one input named ``x``, or the feeds by input name."""
    import onnxruntime as ort

    from lq.export.verify._verify import make_session

    sess = make_session(model.SerializeToString(), ["CPUExecutionProvider"],
                        graph_optimization_level=getattr(ort.GraphOptimizationLevel, level))
    return sess.run(None, x if isinstance(x, dict) else {"x": x})


def rewritten(model: onnx.ModelProto, graph_pass, *args) -> tuple[int, onnx.ModelProto]:
    """``(what graph_pass(Graph, *args) returned, the rewritten model)`` on a copy of ``model``."""
    from lq.export._ir import Graph

    g = Graph(onnx.ModelProto.FromString(model.SerializeToString()))
    done = graph_pass(g, *args)
    return done, g.finalize()
