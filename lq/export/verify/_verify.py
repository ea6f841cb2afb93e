"""Run an exported model in onnxruntime, compare with PyTorch, inspect what onnxruntime fused."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections import Counter

import numpy as np

#: onnxruntime ops that mean "this ran as a real integer kernel"
#: onnxruntime's fused LSTM that quantizes its activations itself, from each GEMM's input: its numbers depend
#: on how many threads split the batch, so a file holding it is verified with one (what PyTorch computes)
from lq.export.passes._dynamic_lstm import RUNTIME_QUANTIZED_LSTM
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


def target_providers(target: str, device: str | None = None) -> list[str]:
    """Where a file for ``target`` is verified and timed: OpenVINO's CPU plugin for ``openvino``, onnxruntime's
    CPU (or CUDA, for a model on a GPU) provider otherwise."""
    if target == "openvino":
        from lq.export.verify import _openvino

        _openvino.require()
        return [_openvino.OPENVINO]
    return default_providers(device)


def runtime_name(providers) -> str:
    """The runtime ``providers`` run a file in, as the export's messages name it."""
    from lq.export.verify import _no_vnni, _openvino

    if providers and providers[0] == _no_vnni.PROVIDER:
        return f"OpenVINO without VNNI (its kernels capped at {_no_vnni.ISA})"
    return "OpenVINO" if _openvino.is_openvino(providers) else "onnxruntime"


def make_session(path_or_bytes, providers=None, *, optimized_model_filepath: str | None = None,
                 intra_op_num_threads: int | None = None, graph_optimization_level=None):
    """An onnxruntime session, or for ``providers=[OPENVINO]`` an OpenVINO one with the same two calls
    (:class:`lq.export.verify._openvino.Session`, f32 precision; ``[OPENVINO_BF16]``: the bf16 hint)."""
    from lq.export.verify import _no_vnni, _openvino

    if providers and providers[0] == _no_vnni.PROVIDER:  # OpenVINO as a CPU without VNNI runs it (a worker process)
        return _no_vnni.Session(path_or_bytes, threads=intra_op_num_threads)
    if _openvino.is_openvino(providers):
        return _openvino.Session(path_or_bytes, threads=intra_op_num_threads,
                                 precision=_openvino.precision_of(providers))
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
    """The largest of :func:`output_steps` (0 when no output comes from a quantized op)."""
    return max(output_steps(model), default=0.0)


def output_steps(model) -> list[float]:
    """Per graph output, one output quantization step: what rounding at the last quantizer before it moves it.

    Two runtimes break rounding ties differently (a value on a boundary, summed in another order or through
    a folded BatchNorm), and a flipped step upstream tips more ties downstream: in a good file every quantized
    tensor is within one step of PyTorch's, on up to a few percent of its elements deep in a network (measured:
    11% at the head of a 5-block MobileNetV3). Verification counts differences in these steps. Walking back
    through data-movement ops: a DequantizeLinear's scale; for a Conv/Gemm/MatMul reading Q/DQ tensors, the
    input scale times the largest L2 norm of the weights one output sums (every input one step off in
    independent directions moves an output by about that; ``s_a * max|w|``, one flipped input, is an order of
    magnitude smaller and a deep good file's logits sit several of those off). 0 for an output that no
    quantized op produces.
    """
    from onnx import numpy_helper

    from lq.export.passes._weight_layout import dequantize
    from lq.export._ir import Graph
    from lq.rules import commutes

    g = Graph(model)
    prod = g.producers()
    consts = {i.name: i for i in model.graph.initializer}

    def const(name):
        return numpy_helper.to_array(consts[name]).astype(np.float64) if name in consts else None

    def dq_values(dq):
        q, s = const(dq.input[0]), const(dq.input[1])
        if any(a.name == "block_size" and a.i for a in dq.attribute):
            return None  # blocked weights (weight-only INT4): no integer kernel, no output step
        qn = prod.get(dq.input[0])
        if q is None and qn is not None and qn.op_type == "QuantizeLinear":  # weight_format="qdq": the float
            return const(qn.input[0])  # weight, within half a step of what the DequantizeLinear gives
        if q is None or s is None:
            return None
        zp = const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        return dequantize(q, s, zp, next((a.i for a in dq.attribute if a.name == "axis"), 1))

    def step_of(name) -> float:
        n = prod.get(name)
        while n is not None and commutes(n.op_type, n) and n.input:
            n = prod.get(n.input[0])
        if n is None:
            return 0.0
        if n.op_type == "DequantizeLinear":
            s = const(n.input[1])
            return float(np.abs(s).max()) if s is not None else 0.0
        if n.op_type in ("Conv", "Gemm", "MatMul") and len(n.input) >= 2:
            a, w = prod.get(n.input[0]), prod.get(n.input[1])
            if a is None or w is None or a.op_type != "DequantizeLinear" or w.op_type != "DequantizeLinear":
                return 0.0
            sa, wv = const(a.input[1]), dq_values(w)
            if sa is not None and wv is not None:
                return float(np.abs(sa).max() * _largest_row_norm(n, wv))
        return 0.0

    return [step_of(out.name) for out in model.graph.output]


def _largest_row_norm(node, w: np.ndarray) -> float:
    """The largest L2 norm of the weights that one output of a Conv/Gemm/MatMul sums (its fan-in)."""
    if node.op_type == "Conv" or w.ndim < 2:
        w = w.reshape(len(w), -1) if w.ndim else w.reshape(1, 1)
        return float(np.sqrt((w * w).sum(1)).max())
    trans_b = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
    return float(np.sqrt((w * w).sum(-1 if trans_b else -2)).max())


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


# =========================================================================== the verdict, in output steps
#: Two runtimes break rounding ties differently, and in a deep network one flipped step tips others downstream.
#: Measured on randomly initialized MobileNetV3-like nets (5 inverted residual blocks, BatchNorm at unit
#: variance, 64 x 200 logits: the most chaotic case, nothing trained them to be robust), good files, default and
#: int8_reduce_range recipes: 9-19% of the logits beyond 2 steps, 0.23-1.52% beyond 4, 0.00-0.11% beyond 6,
#: at most 5.6-8.2 steps off (PyTorch's own fake-quant model moves as much for an input 1e-5 larger). The counts
#: beyond 1 and 2 steps are reported; the verdict uses FAR_STEPS: an output fails when more than FAR_FRACTION of
#: its elements are beyond it. 1% is 9x what a good file showed; it lets a padded sequence's odd positions and
#: masked outputs through, and fails a weight scale 2% off in the first layer (2.7-6.8% beyond 6 steps) or 5%
#: off in the first or a middle one (3.3-17%).
FAR_STEPS = 6.0
FAR_FRACTION = 0.01
#: For an output with a class axis ((batch, classes) logits), the file fails when its top-1 class differs from
#: PyTorch's on more than TOP1_FRACTION of the sample's rows: under 100 rows, any one disagreement (a file that
#: changes a few percent of the predictions is what a user must not ship). A disagreement where PyTorch's two
#: classes are within TIE_STEPS steps is not counted: each can move FAR_STEPS, so the file computes the same
#: logits to rounding and the argmax of two equal values is arbitrary.
TOP1_FRACTION = 0.01
TIE_STEPS = 2 * FAR_STEPS
#: The top-1 verdict is judged on at least this many rows: where the sample has fewer and a row's class differs,
#: new rows mixed from the sample's are run as well (:func:`lq.export.prepare._inputs.perturbed`), so that 1% means
#: something (one row of 32 is 3.1%: a good MobileNetV2 file, held-out accuracy 85.6% against the fake-quant
#: model's 86.2%, was refused on it), and the model's own rounding noise is measured on all of them.
TOP1_MIN_ROWS = 256
#: ...and at least this many rows must differ: a verdict never hinges on one or two rows
TOP1_MIN_DIFFER = 3
#: A model whose own output moves by many steps under rounding-level noise (see :mod:`lq.export.verify._rounding_noise`:
#: every activation quantizer's input moved by up to 1% of its step) cannot meet FAR_FRACTION with any runtime:
#: such an output is allowed FAR_FRACTION plus NOISE_FACTOR times the fraction beyond FAR_STEPS that the noise
#: itself gives. Measured (EfficientNet-style, 16 MBConv blocks, 256 test digits, int8_onnxruntime): the file
#: 24.1% beyond 6 steps, PyTorch under the noise 21.6% (0.1% noise: 11.4%; FP32 vs fake quant: 20.5%), top-1
#: equal on every row but one tie; on the shallow nets above the noise gives 0-0.1%, so their rule is unchanged.
NOISE_FACTOR = 2.0
#: An output that no quantized op produces has no step in the graph: one step is then this fraction of its
#: largest magnitude (FAR_STEPS of it: 6%, about the 5% of max|output| verification used before it counted).
UNSTEPPED_FRACTION = 0.01


@dataclasses.dataclass
class OutputCheck:
    """How one output of the file compares with PyTorch's fake-quant output over the verification sample.

    Attributes:
        name: the graph output.
        step: one output quantization step (see :func:`output_steps`), or UNSTEPPED_FRACTION of max|output|
            when no quantized op produces the output (``from_graph`` False).
        elements: elements compared; ``beyond_1`` / ``beyond_2`` / ``beyond_far``: how many differ by more than
            1 / 2 / FAR_STEPS steps.
        max_diff: the largest |onnxruntime - PyTorch| (also in steps: ``max_steps``).
        rows: rows of a (batch, classes) output whose top-1 class was compared (0: no class axis);
            ``top1_differ``: rows where it differs beyond a tie, ``top1_ties``: rows where it differs on a tie.
    """

    name: str
    step: float
    from_graph: bool
    elements: int = 0
    beyond_1: int = 0
    beyond_2: int = 0
    beyond_far: int = 0
    max_diff: float = 0.0
    rows: int = 0
    top1_differ: int = 0
    top1_ties: int = 0
    noise_elements: int = 0
    noise_far: int = 0
    noise_rows: int = 0
    noise_top1_differ: int = 0

    @property
    def noise_frac_far(self) -> float | None:
        """Fraction of the output beyond FAR_STEPS when PyTorch itself runs under rounding-level noise (None: not
        measured, the file was within FAR_FRACTION without it)."""
        return self.noise_far / self.noise_elements if self.noise_elements else None

    @property
    def allowed_top1(self) -> float:
        """The fraction of rows whose top-1 class may differ beyond a tie: TOP1_FRACTION, plus NOISE_FACTOR times
        the fraction that the model's own rounding noise flips where that was measured (an untrained or barely
        decided classifier flips some under any runtime)."""
        return TOP1_FRACTION + NOISE_FACTOR * (self.noise_top1_differ / self.noise_rows if self.noise_rows else 0.0)

    @property
    def allowed_far(self) -> float:
        """The fraction of elements allowed beyond FAR_STEPS: FAR_FRACTION, plus NOISE_FACTOR times what the
        model's own rounding noise gives where that was measured."""
        return FAR_FRACTION + NOISE_FACTOR * (self.noise_frac_far or 0.0)

    @property
    def max_steps(self) -> float:
        return self.max_diff / self.step if self.step > 0 else (0.0 if self.max_diff == 0 else float("inf"))

    @property
    def frac_1(self) -> float:
        return self.beyond_1 / self.elements if self.elements else 0.0

    @property
    def frac_2(self) -> float:
        return self.beyond_2 / self.elements if self.elements else 0.0

    @property
    def frac_far(self) -> float:
        return self.beyond_far / self.elements if self.elements else 0.0

    @property
    def top1_agreement(self) -> float | None:
        """Fraction of rows whose top-1 class is PyTorch's or a tie with it (None: no class axis)."""
        return 1.0 - self.top1_differ / self.rows if self.rows else None

    def text(self) -> str:
        """One line: what was measured on this output."""
        s = (f"{self.name}: step {self.step:.3g}{'' if self.from_graph else ' (no quantizer: 1% of max|output|)'}, "
             f"of {self.elements} elements {self.frac_1:.2%} beyond 1 step, {self.frac_2:.2%} beyond 2, "
             f"{self.frac_far:.2%} beyond {FAR_STEPS:g}; max {self.max_steps:.3g} steps ({self.max_diff:.3g})")
        if self.noise_elements:
            s += (f"; PyTorch itself under rounding-level noise: {self.noise_frac_far:.2%} beyond {FAR_STEPS:g} "
                  f"(allowed {100 * self.allowed_far:.3g}%)")
            if self.noise_rows:
                s += f" and top-1 moved on {self.noise_top1_differ} of {self.noise_rows} rows"
        if self.rows:
            s += f", top-1 differs on {self.top1_differ} of {self.rows} rows" + (
                f" (+{self.top1_ties} tie(s))" if self.top1_ties else "")
        return s


def compare_output(name: str, got: np.ndarray, want: np.ndarray, step: float,
                   into: OutputCheck | None = None) -> OutputCheck:
    """Count how far onnxruntime's ``got`` is from PyTorch's ``want`` in steps of ``step`` (0: no step in the
    graph, UNSTEPPED_FRACTION of max|want| is used); ``into`` adds the counts to an earlier input's (a grown
    sample of a dynamic axis)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"output {name} shape differs: onnxruntime {got.shape}, PyTorch {want.shape}")
    if into is None:
        from_graph = step > 0
        if not from_graph:
            step = UNSTEPPED_FRACTION * (float(np.nanmax(np.abs(want))) if want.size else 0.0)
        into = OutputCheck(name, step, from_graph)
    step = into.step
    d = np.abs(got - want)
    d = np.where(np.isnan(got) & np.isnan(want), 0.0, np.where(np.isnan(d), np.inf, d))
    tiny = 1e-6 * (float(np.abs(want).max()) if want.size else 0.0)  # float noise: not a step
    into.elements += d.size
    into.beyond_1 += int((d > step + tiny).sum())
    into.beyond_2 += int((d > 2 * step + tiny).sum())
    into.beyond_far += int((d > FAR_STEPS * step + tiny).sum())
    into.max_diff = max(into.max_diff, float(d.max()) if d.size else 0.0)
    if want.ndim == 2 and want.shape[1] > 1 and want.shape[0] >= 1:
        t_top, o_top = want.argmax(1), got.argmax(1)
        rows = np.nonzero(t_top != o_top)[0]
        margin = want[rows, t_top[rows]] - want[rows, o_top[rows]]  # how far PyTorch prefers its class
        ties = int((margin <= TIE_STEPS * step + tiny).sum())
        into.rows += want.shape[0]
        into.top1_ties += ties
        into.top1_differ += len(rows) - ties
    return into


def add_noise(check: OutputCheck, noisy: np.ndarray, want: np.ndarray) -> OutputCheck:
    """Count, into ``check``, how far PyTorch's output under rounding-level noise (``noisy``) is from its own
    ``want``, in the check's steps."""
    moved = compare_output(check.name, noisy, want, check.step)  # the same counts, in the check's step
    check.noise_elements += moved.elements
    check.noise_far += moved.beyond_far
    check.noise_rows += moved.rows
    check.noise_top1_differ += moved.top1_differ
    return check


def needs_rows(checks: list[OutputCheck]) -> int:
    """How many more rows the top-1 verdict needs: where a class output differs on some row and has fewer than
    TOP1_MIN_ROWS rows, the rows it lacks (0: none)."""
    return max([TOP1_MIN_ROWS - c.rows for c in checks if c.step > 0 and c.rows and c.top1_differ
                and c.rows < TOP1_MIN_ROWS] + [0])


def needs_noise(checks: list[OutputCheck]) -> bool:
    """True when an output is beyond FAR_FRACTION or TOP1_FRACTION: only then is the model's own rounding noise
    measured."""
    return any(c.step > 0 and (c.frac_far > FAR_FRACTION or (c.rows and c.top1_differ > TOP1_FRACTION * c.rows))
               for c in checks)


def step_verdict(checks: list[OutputCheck]) -> str:
    """``""`` when the file computes what PyTorch does up to rounding, else why not (per failing output): more
    than ``allowed_far`` of an output's elements beyond FAR_STEPS (FAR_FRACTION, more for a model whose own
    rounding noise moves it further), or its top-1 class differing (beyond a tie) on
    more than ``allowed_top1`` of the rows (TOP1_FRACTION, more for a model whose own rounding noise flips rows),
    and on at least TOP1_MIN_DIFFER of them."""
    why = []
    for c in checks:
        if c.step <= 0:  # an output that is 0 everywhere in PyTorch: no step to count in
            if c.max_diff > 1e-6:
                why.append(f"{c.name}: PyTorch's output is 0, onnxruntime's is up to {c.max_diff:.3g}")
            continue
        if c.frac_far > c.allowed_far:
            why.append(f"{c.name}: {c.frac_far:.2%} of its elements are more than {FAR_STEPS:g} output steps "
                       f"({FAR_STEPS * c.step:.3g}) from PyTorch's, allowed {100 * c.allowed_far:.3g}%" + (
                           f" ({FAR_FRACTION:.0%} + {NOISE_FACTOR:g} x the {c.noise_frac_far:.2%} that PyTorch "
                           "itself moves under rounding-level noise)" if c.noise_elements else ""))
        if c.rows and c.top1_differ > c.allowed_top1 * c.rows and c.top1_differ >= TOP1_MIN_DIFFER:
            why.append(f"{c.name}: the top-1 class differs from PyTorch's on {c.top1_differ} of {c.rows} rows "
                       f"({c.top1_differ / c.rows:.1%}; ties within {TIE_STEPS:g} steps not counted), allowed "
                       f"{100 * c.allowed_top1:.3g}%" + (
                           f" ({TOP1_FRACTION:.0%} + {NOISE_FACTOR:g} x the {c.noise_top1_differ} of {c.noise_rows} "
                           "rows that PyTorch itself moves under rounding-level noise)" if c.noise_top1_differ else ""))
    return "; ".join(why)
