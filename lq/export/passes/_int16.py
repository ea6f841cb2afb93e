"""Integer encodings that no x86 kernel of onnxruntime can saturate, checked from the ONNX file alone.

onnxruntime's x86 integer GEMM/conv kernels for uint8 activations x int8 weights
(QLinearConv, QGemm, QLinearMatMul, MatMulInteger...) multiply on CPUs without
VNNI with ``vpmaddubsw``: two adjacent products along the reduction axis are
added into a *saturating int16* before they reach the int32 accumulator. With
activations up to 255 (uint8; int8 activations are shifted to uint8 first) and
full-range int8 weights, a pair reaches ``2 * 255 * 127 = 64770`` and the result
silently differs from the Q/DQ graph. AVX-512 VNNI, AVX-VNNI and AMX accumulate
in int32, and the uint8 x uint8 kernels widen both sides to int16 before
``vpmaddwd`` (int32 pairs), so neither saturates.

Which two reduction elements the kernel pairs depends on its packing, so the
check here is the one that holds for any pairing: for each output channel the
two largest weight magnitudes, times the largest activation code (255), must
stay within int16. It holds for 7-bit weights (``|q| <= 63``) at any activation;
8-bit weights that fail it are re-encoded as uint8 with zero point 128 (the same
real values, so the file computes exactly what it computed before) and run on
the uint8 x uint8 kernels instead.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto

from lq.export._ir import Graph, attr, layer_name

INT16_MAX = 32767
#: the largest activation code an x86 u8 x s8 kernel multiplies (int8 activations are shifted to uint8)
ACTIVATION_CODE_MAX = 255
#: ops that onnxruntime fuses with their DequantizeLinear inputs into an integer kernel
INTEGER_KERNEL_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclasses.dataclass
class Int16Risk:
    """An integer kernel whose adjacent product pairs can leave int16 on a CPU without VNNI."""

    node: str
    layer: str
    op_type: str
    worst_pair: int  # the largest |a_i w_i + a_j w_j| the encoding allows
    reason: str

    def __str__(self) -> str:
        return (f"{self.layer} ({self.op_type}): a pair of products can reach {self.worst_pair} > {INT16_MAX} "
                f"({self.reason})")


def output_axis(op_type: str, node, ndim: int) -> int:
    """The output-channel axis of a constant weight of ``node``: every other axis is reduced over."""
    if op_type == "Conv":
        return 0
    if op_type == "ConvTranspose":
        return 1 % ndim
    if op_type == "Gemm":
        return 0 if attr(node, "transB", 0) else 1
    return ndim - 1  # MatMul: (..., K, N)


def worst_pair_per_channel(q: np.ndarray, out_axis: int) -> np.ndarray:
    """For each output channel, the sum of its two largest weight magnitudes (any pairing the kernel picks)."""
    mag = np.abs(q.astype(np.int32))
    mag = np.moveaxis(mag, out_axis, 0).reshape(mag.shape[out_axis], -1)
    if mag.shape[1] < 2:
        return mag.max(axis=1) if mag.shape[1] else np.zeros(mag.shape[0], np.int32)
    top2 = -np.partition(-mag, 1, axis=1)[:, :2]
    return top2.sum(axis=1)


def _dq_dtype(g: Graph, dq) -> int | None:
    """Element type of the integers a DequantizeLinear reads."""
    if len(dq.input) > 2 and dq.input[2]:
        return g.const_dtype(dq.input[2])
    c = g.const(dq.input[0])
    if c is not None:
        return g.const_dtype(dq.input[0])
    return TensorProto.UINT8  # no zero point: uint8 by the ONNX default


#: integer ops written out in the graph (onnxruntime's quantize_dynamic, QOperator files): B is read as is
INTEGER_OPS = {"MatMulInteger": "MatMul", "ConvInteger": "Conv"}


def _weight_risk(n, op_type: str, w: np.ndarray) -> Int16Risk | None:
    """The risk of uint8 activations (up to 255) times the int8 constant ``w`` of ``n``, or None."""
    per_ch = worst_pair_per_channel(w, output_axis(op_type, n, w.ndim))
    pair = int(per_ch.max()) if per_ch.size else 0
    if pair * ACTIVATION_CODE_MAX <= INT16_MAX:
        return None
    return Int16Risk(n.name, layer_name(n), n.op_type, pair * ACTIVATION_CODE_MAX,
                     f"uint8 activations up to {ACTIVATION_CODE_MAX} x int8 weights with two magnitudes summing "
                     f"to {pair}")


def _risk(g: Graph, n, prod) -> tuple[Int16Risk | None, object]:
    """The saturation risk of one candidate node and the weight DequantizeLinear that causes it."""
    if n.op_type in INTEGER_OPS and len(n.input) >= 2:
        w = g.const(n.input[1])
        return (_weight_risk(n, INTEGER_OPS[n.op_type], w) if w is not None and w.dtype == np.int8 else None), None
    if n.op_type not in INTEGER_KERNEL_OPS or len(n.input) < 2:
        return None, None
    a, b = prod.get(n.input[0]), prod.get(n.input[1])
    if a is None or b is None or a.op_type != "DequantizeLinear" or b.op_type != "DequantizeLinear":
        return None, None
    if attr(b, "block_size", 0):
        return None, None  # blocked weights run on other kernels (MatMulNBits) or stay float
    ta, tb = _dq_dtype(g, a), _dq_dtype(g, b)
    if ta not in (TensorProto.UINT8, TensorProto.INT8) or tb != TensorProto.INT8:
        return None, None  # uint8 x uint8 widens to int16 before multiplying: no pair can saturate
    wq = g.const(b.input[0])
    if wq is not None:
        return _weight_risk(n, n.op_type, wq), b
    return Int16Risk(n.name, layer_name(n), n.op_type, 2 * ACTIVATION_CODE_MAX * 128,
                     "int8 operands computed in the graph: onnxruntime shifts one to uint8, the other stays "
                     "full-range"), b


def int16_risks(model: onnx.ModelProto) -> list[Int16Risk]:
    """Every integer GEMM/conv of ``model`` whose u8 x s8 pair sums can leave int16 (hardware-independent)."""
    g = Graph(model)
    prod = g.producers()
    out = []
    for n in g.nodes:
        r, _ = _risk(g, n, prod)
        if r is not None:
            out.append(r)
    return out


def encode_int16_safe(g: Graph) -> list[str]:
    """Re-encode the int8 weights of every risky integer kernel as uint8 with zero point 128 (same values).

    Returns the layers that were re-encoded. The uint8 integers are a new constant, so another reader of the
    int8 ones keeps them; activations are left alone (:func:`int16_risks` reports a risky activation product).
    """
    prod = g.producers()
    done: list[str] = []
    seen: set[int] = set()
    for n in g.nodes:
        r, dq = _risk(g, n, prod)
        if r is None or dq is None or id(dq) in seen or g.const(dq.input[0]) is None:
            continue
        seen.add(id(dq))
        q = g.const(dq.input[0])
        zp = g.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        if zp is not None and np.any(zp != 0):
            continue
        shifted = (q.astype(np.int16) + 128).astype(np.uint8)
        dq.input[0] = g.add_const(f"{dq.input[0]}_u8", shifted)
        s = g.const(dq.input[1])
        zshape = s.shape if s is not None and s.ndim == 1 else ()
        new_zp = g.add_const("zero_point_u8", np.full(zshape, 128, dtype=np.uint8))
        while len(dq.input) < 3:
            dq.input.append("")
        dq.input[2] = new_zp
        done.append(r.layer)
    return done
