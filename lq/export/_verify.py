"""Run an exported model in onnxruntime, compare with PyTorch, inspect what onnxruntime fused."""

from __future__ import annotations

import os
import tempfile
from collections import Counter

import numpy as np

#: onnxruntime ops that mean "this ran as a real integer kernel"
INT8_KERNELS = ("QLinearConv", "QLinearMatMul", "QLinearAdd", "QGemm", "QLinearMul", "QLinearConcat",
                "QLinearAveragePool", "QLinearGlobalAveragePool", "MatMulIntegerToFloat", "ConvInteger",
                "MatMulInteger", "DynamicQuantizeMatMul", "QLinearLeakyRelu", "QLinearSigmoid", "QLinearSoftmax",
                "MatMulNBits")


def _ort():
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - onnxruntime is a dependency
        raise ImportError("onnxruntime is needed to verify an export: pip install onnxruntime") from e
    return ort


def default_providers(device: str | None = None) -> list[str]:
    ort = _ort()
    avail = ort.get_available_providers()
    if device == "cuda" and "CUDAExecutionProvider" in avail:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def make_session(path_or_bytes, providers=None, *, optimized_model_filepath: str | None = None,
                 intra_op_num_threads: int | None = None, graph_optimization_level=None):
    ort = _ort()
    so = ort.SessionOptions()
    if optimized_model_filepath:
        so.optimized_model_filepath = optimized_model_filepath
    if intra_op_num_threads:
        so.intra_op_num_threads = intra_op_num_threads
    if graph_optimization_level is not None:
        so.graph_optimization_level = graph_optimization_level
    so.log_severity_level = 3
    return ort.InferenceSession(path_or_bytes, so, providers=providers or default_providers())


def verify_level(target: str):
    """onnxruntime graph optimization level to verify a file for ``target`` with.

    An onnxruntime file is checked as onnxruntime will run it (all fusions on: the integer kernels). A
    TensorRT file is checked for its Q/DQ semantics (basic optimizations, no QDQ fusion): TensorRT
    accumulates in int32, while onnxruntime's CPU kernels for its int8 x int8 encoding can saturate on
    CPUs without VNNI, which says nothing about the file's correctness on TensorRT.
    """
    ort = _ort()
    if target == "tensorrt":
        return ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def run(session, inputs) -> list[np.ndarray]:
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise ValueError(f"the ONNX model takes {len(names)} input(s) {names}, got {len(inputs)}")
    feed = {n: np.ascontiguousarray(x) for n, x in zip(names, inputs)}
    return session.run(None, feed)


def optimized_op_counts(path: str, providers=None) -> Counter:
    """Op types (with their domain for non-ONNX ops) of the graph onnxruntime actually runs."""
    import onnx

    with tempfile.TemporaryDirectory() as d:
        opt = os.path.join(d, "optimized.onnx")
        make_session(path, providers, optimized_model_filepath=opt)
        m = onnx.load(opt, load_external_data=False)
    return Counter(n.op_type for n in m.graph.node)


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    if len(a) != len(b):
        raise ValueError(f"onnxruntime returned {len(a)} outputs, PyTorch {len(b)}")
    worst = 0.0
    for x, y in zip(a, b):
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        if x.shape != y.shape:
            raise ValueError(f"output shape differs: onnxruntime {x.shape}, PyTorch {y.shape}")
        if x.size:
            d = np.abs(x - y)
            d = np.where(np.isnan(x) & np.isnan(y), 0.0, d)
            worst = max(worst, float(np.nanmax(np.where(np.isnan(d), np.inf, d))))
    return worst
