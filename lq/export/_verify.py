"""Run an exported model in onnxruntime, compare with PyTorch, inspect what onnxruntime fused."""

from __future__ import annotations

import os
import tempfile
from collections import Counter

import numpy as np

#: onnxruntime ops that mean "this ran as a real integer kernel"
#: onnxruntime's fused LSTM that quantizes its activations itself, from each GEMM's input: its numbers depend
#: on how many threads split the batch, so a file holding it is verified with one (what PyTorch computes)
RUNTIME_QUANTIZED_LSTM = "DynamicQuantizeLSTM"
INT8_KERNELS = ("QLinearConv", "QLinearMatMul", "QLinearAdd", "QGemm", "QLinearMul", "QLinearConcat",
                "QLinearAveragePool", "QLinearGlobalAveragePool", "MatMulIntegerToFloat", "ConvInteger",
                "MatMulInteger", "DynamicQuantizeMatMul", "QLinearLeakyRelu", "QLinearSigmoid", "QLinearSoftmax",
                "MatMulNBits", RUNTIME_QUANTIZED_LSTM)


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


def optimized_model(path_or_bytes, providers=None):
    """The graph onnxruntime actually runs (all its fusions applied), as an ``onnx.ModelProto``."""
    import onnx

    with tempfile.TemporaryDirectory() as d:
        opt = os.path.join(d, "optimized.onnx")
        make_session(path_or_bytes, providers, optimized_model_filepath=opt)
        return onnx.load(opt, load_external_data=False)


def optimized_op_counts(path: str, providers=None) -> Counter:
    """Op types (with their domain for non-ONNX ops) of the graph onnxruntime actually runs."""
    return Counter(n.op_type for n in optimized_model(path, providers).graph.node)


def output_step(model) -> float:
    """The change of a model output that one quantization step flipped at the last quantizer before it causes.

    A flip (a value on a rounding boundary summed in another order) is normal between two runtimes; the
    verification tolerance never goes below two of them. Per graph output, walking back through
    data-movement ops: a DequantizeLinear's scale, or for a Conv/Gemm/MatMul reading Q/DQ tensors the input
    scale times the largest weight magnitude. 0 when no output comes from a quantized op.
    """
    from onnx import numpy_helper

    from lq.export._finish import _dequantize
    from lq.export._ir import Graph
    from lq.export._rules import commutes

    g = Graph(model)
    prod = g.producers()
    consts = {i.name: i for i in model.graph.initializer}

    def const(name):
        return numpy_helper.to_array(consts[name]).astype(np.float64) if name in consts else None

    def dq_values(dq):
        q, s = const(dq.input[0]), const(dq.input[1])
        if q is None or s is None or any(a.name == "block_size" and a.i for a in dq.attribute):
            return None  # blocked weights (weight-only INT4): no integer kernel, no output step
        zp = const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        return _dequantize(q, s, zp, next((a.i for a in dq.attribute if a.name == "axis"), 1))

    best = 0.0
    for out in model.graph.output:
        n = prod.get(out.name)
        while n is not None and commutes(n.op_type, n) and n.input:
            n = prod.get(n.input[0])
        if n is None:
            continue
        if n.op_type == "DequantizeLinear":
            s = const(n.input[1])
            best = max(best, float(np.abs(s).max()) if s is not None else 0.0)
        elif n.op_type in ("Conv", "Gemm", "MatMul") and len(n.input) >= 2:
            a, w = prod.get(n.input[0]), prod.get(n.input[1])
            if a is None or w is None or a.op_type != "DequantizeLinear" or w.op_type != "DequantizeLinear":
                continue
            sa, wv = const(a.input[1]), dq_values(w)
            if sa is not None and wv is not None:
                best = max(best, float(np.abs(sa).max() * np.abs(wv).max()))
    return best


def nonfinite_report(outs: list[np.ndarray], names: list[str]) -> str:
    """``""`` when every output is finite, else which outputs hold NaN/Inf and how many."""
    bad = []
    for name, o in zip(names, outs):
        o = np.asarray(o)
        if o.dtype.kind == "f" and not np.isfinite(o).all():
            bad.append(f"{name}: {int(np.isnan(o).sum())} NaN, {int(np.isinf(o).sum())} Inf of {o.size}")
    return "; ".join(bad)


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
