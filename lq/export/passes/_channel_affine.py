"""A per-channel ``x * gamma + beta`` written as one ``BatchNormalization`` (mean 0, variance 1, epsilon 0).

PyTorch's exporters write ``GroupNorm`` as ``Reshape -> InstanceNormalization -> Reshape`` followed by its
affine as two broadcast ops, ``Mul(gamma)`` and ``Add(beta)``, each a full pass over the tensor. onnxruntime's
CPU ``BatchNormalization`` computes ``x * (scale / sqrt(var + eps)) + (B - mean * scale / sqrt(var + eps))``
channel by channel; with ``var = 1``, ``eps = 0`` and ``mean = 0`` that is ``x * gamma + beta`` with the same
two roundings as the pair, in one pass. In the GroupNorm/SiLU ResNet of ``bench.ordinary`` the six affine pairs
took 1.1 of 9.7 ms at batch 32 (INT8 file, AVX-512 VNNI); as BatchNormalization, 0.5 ms.

Only where the pair is exactly a per-channel affine along axis 1 and not right after a conv (see
:data:`_FOLDED_INTO`): ``gamma`` and ``beta`` constants of shape
``(C, 1, ..., 1)`` (or with a leading 1) that line up with axis 1 of an input of rank >= 3 whose channel
size is ``C``, the Mul read by the Add alone. Anything else (a LayerNorm affine along the last axis, a
broadcast that grows the tensor) is left as it is.
"""

from __future__ import annotations

import numpy as np

from lq.export._ir import Graph, attr


#: ops onnxruntime folds a following BatchNormalization into (changing the weights it then quantizes: a float
#: conv before a quantizer becomes a QLinearConv with weights onnxruntime rounds itself), so the pair is left
#: as the exporter wrote it there
_FOLDED_INTO = ("Conv", "ConvTranspose")


def affines_as_batchnorm(g: Graph, shapes: dict[str, tuple]) -> int:
    """Rewrite every eligible ``Mul(x, gamma) -> Add(., beta)`` pair; returns how many were rewritten.
    ``shapes``: value name -> shape (ints, or None where unknown), from shape inference."""
    done = 0
    prod, cons = g.producers(), g.consumers()  # producers stay valid: a rewrite keeps the Add's output
    for mul in [n for n in g.nodes if n.op_type == "Mul"]:
        readers = cons.get(mul.output[0], [])
        if len(readers) != 1 or readers[0].op_type != "Add" or mul.output[0] in g.graph_outputs:
            continue
        add = readers[0]
        x, gamma = _split_const(g, mul, mul.output[0])
        beta = _split_const(g, add, mul.output[0])[1]
        if x is None or gamma is None or beta is None:
            continue
        writer = prod.get(x)
        if writer is not None and writer.op_type in _FOLDED_INTO:
            continue  # onnxruntime folds the affine into the conv's weights itself (a BatchNormalization too)
        shape = _shape(prod, x, shapes)
        c = None if shape is None or len(shape) < 3 else shape[1]
        if not c or _per_channel(gamma, len(shape), c) is None or _per_channel(beta, len(shape), c) is None:
            continue
        inputs = [x] + [g.add_const(f"{mul.name or 'affine'}_{k}", v) for k, v in (
            ("scale", _per_channel(gamma, len(shape), c)), ("bias", _per_channel(beta, len(shape), c)),
            ("mean", np.zeros(c, np.float32)), ("var", np.ones(c, np.float32)))]
        bn = g.make_node("BatchNormalization", inputs, [add.output[0]], hint="channel_affine", like=mul, epsilon=0.0)
        g.nodes[g.nodes.index(add)] = bn
        g.nodes.remove(mul)
        done += 1
    return done


def _shape(prod: dict, x: str, shapes: dict[str, tuple]) -> tuple | None:
    """``x``'s shape; for ``Reshape(t, Shape(y))`` (how the exporters restore a GroupNorm's shape, which shape
    inference leaves unknown) the shape of ``y``."""
    shape = shapes.get(x)
    if shape is not None and len(shape) > 1 and shape[1]:
        return shape
    p = prod.get(x)
    if p is not None and p.op_type == "Reshape":
        s = prod.get(p.input[1])
        if s is not None and s.op_type == "Shape" and attr(s, "start", 0) == 0 and attr(s, "end") is None:
            return shapes.get(s.input[0], shape)
    return shape


def _split_const(g: Graph, node, other: str | None = None):
    """(the non-constant input, the float32 constant) of a two-input ``node``; (None, None) if it has no such
    pair. For the Add, ``other`` names the input that must be the Mul's output."""
    a, b = node.input[0], node.input[1]
    for x, k in ((a, b), (b, a)):
        v = g.const(k) if g.is_const(k) else None
        if v is not None and v.dtype == np.float32 and not g.is_const(x) and (node.op_type == "Mul" or x == other):
            return x, v
    return None, None


def _per_channel(v: np.ndarray, rank: int, c: int) -> np.ndarray | None:
    """``v`` as ``C`` values, one per channel of a rank-``rank`` tensor with ``c`` channels, if it broadcasts
    along axis 1 only (``(C, 1, .., 1)`` of rank ``rank - 1`` or ``(1, C, 1, .., 1)`` of rank ``rank``)."""
    if v.ndim == rank - 1:
        v = v[None]
    if v.ndim != rank or v.shape[0] != 1 or any(d != 1 for d in v.shape[2:]) or v.shape[1] not in (1, c):
        return None
    return np.ascontiguousarray(np.broadcast_to(v.reshape(-1), (c,)), dtype=np.float32)
