"""A Linear on a 3-D (or higher) input, exported as ``MatMul`` + bias ``Add``, written as one ``Gemm``.

PyTorch's exporters write ``nn.Linear`` as ``Gemm`` only for a 2-D input; on ``(batch, tokens, features)``
(every Linear of a transformer) it becomes ``MatMul`` followed by ``Add(bias)``. onnxruntime fuses
``DQ -> MatMul`` into ``MatMulIntegerToFloat`` but leaves the bias ``Add`` outside it, where its own float
fusions take it: into ``BiasGelu`` before a GELU and ``SkipLayerNormalization`` before a residual LayerNorm. In
all-MiniLM-L6-v2's INT8 file (batch 32, 64 tokens, AMD EPYC Zen 5) those two took 34 of 132 ms in a profile;
written as ``Gemm`` (onnxruntime: ``QGemm``, the bias as int32 inside the integer kernel, then a plain ``Gelu``
and ``Add`` + ``LayerNormalization``) the file ran 90 instead of 114 ms (MHA transformer of bench.ordinary:
0.341 -> 0.327 ms).

The rewrite, on the integer side so that the quantizer stays where its producer fuses it::

    Q(x) -> DQ -> MatMul(., DQ(W)) -> Add(b)
    Q(x) -> Reshape(-1, K) -> DQ -> Gemm(., DQ(W), b) -> Reshape(Shape(x)[:-1] + [N])

Reshaping the integers and dequantizing them is the same as dequantizing and reshaping (per-tensor scale),
and ``Gemm`` computes the same sums as ``MatMul`` + ``Add``; the bias then becomes int32 like a conv's
(:func:`lq.export.passes._placement.quantize_bias`: at most half of ``s_input * s_weight`` from PyTorch's float bias).
Only for a per-tensor quantized input, an int8/uint8 2-D constant weight and a constant bias over the last
axis, where the MatMul's output is read by the Add alone; opset >= 15 (``Shape`` with ``end``).
"""

from __future__ import annotations

import numpy as np

from lq.export._ir import Graph, attr, drop_unread

#: ``Shape(x, start, end)`` (the output's leading dims without a Slice) exists from this opset on
MIN_OPSET = 15
#: the name suffix of the Reshape that takes a Gemm's output back to the input's leading dims
UNFLATTEN = "/unflatten"


def linears_as_gemm(g: Graph) -> int:
    """Rewrite every eligible ``MatMul`` + bias ``Add``; returns how many."""
    if g.opset < MIN_OPSET:
        return 0
    prod, cons = g.producers(), g.consumers()
    flat: dict[str, tuple[str, str]] = {}  # activation DQ output -> (its 2-D DQ output, x's leading shape)
    replaced_dq: set[int] = set()
    done = 0
    for mm in [n for n in g.nodes if n.op_type == "MatMul"]:
        found = _eligible(g, prod, cons, mm)
        if found is None:
            continue
        dq_a, add, bias, k, n_out = found
        if dq_a.output[0] not in flat:
            flat[dq_a.output[0]] = _flatten(g, dq_a, k)
            replaced_dq.add(id(dq_a))
        a2d, lead = flat[dq_a.output[0]]
        stem = mm.name or "linear"
        gemm_out = g.fresh(f"{stem}/gemm_out")
        gemm = g.make_node("Gemm", [a2d, mm.input[1], g.add_const(f"{stem}/bias", bias)], [gemm_out], like=mm)
        gemm.name = mm.name or gemm.name  # the kernel report finds the layer's kernel by the node's name
        shape = g.make_node("Concat", [lead, g.add_const(f"{stem}/n", np.array([n_out], np.int64))], like=mm,
                            hint=f"{stem}/shape", axis=0)
        back = g.make_node("Reshape", [gemm_out, shape.output[0]], [add.output[0]], like=mm, hint=f"{stem}{UNFLATTEN}")
        k_mm = g.nodes.index(mm)
        g.nodes[k_mm:k_mm + 1] = [gemm, shape, back]
        g.nodes.remove(add)
        done += 1
    if done:
        drop_unread(g, lambda m: id(m) in replaced_dq)
    return done


def _eligible(g: Graph, prod: dict, cons: dict, mm):
    """``(activation DQ, bias Add, bias as float32 (N,), K, N)`` for a rewritable MatMul, else None."""
    dq_a, dq_w = prod.get(mm.input[0]), prod.get(mm.input[1])
    if dq_a is None or dq_w is None or dq_a.op_type != "DequantizeLinear" or dq_w.op_type != "DequantizeLinear":
        return None
    w, scale_a = g.const(dq_w.input[0]), g.const(dq_a.input[1])
    if w is None or w.ndim != 2 or w.dtype not in (np.int8, np.uint8) or attr(dq_w, "block_size", 0):
        return None
    if scale_a is None or scale_a.size != 1 or g.is_const(dq_a.input[0]):
        return None
    readers = cons.get(mm.output[0], [])
    if mm.output[0] in g.graph_outputs or len(readers) != 1 or readers[0].op_type != "Add":
        return None
    add = readers[0]
    other = add.input[1] if add.input[0] == mm.output[0] else add.input[0]
    b = g.const(other)
    k, n_out = w.shape
    if b is None or b.dtype != np.float32 or b.size != n_out or b.shape[-1:] != (n_out,):
        return None
    return dq_a, add, b.reshape(n_out), k, n_out


def _flatten(g: Graph, dq_a, k: int) -> tuple[str, str]:
    """``Reshape(-1, K)`` of the integers ``dq_a`` dequantizes, dequantized again with its scale and zero point,
    and ``Shape(x)[:-1]``; inserted after ``dq_a``. Returns (the 2-D float tensor, the leading shape)."""
    q = dq_a.input[0]
    stem = dq_a.name or "input"
    flat = g.make_node("Reshape", [q, g.add_const(f"{stem}/rows", np.array([-1, k], np.int64))], like=dq_a,
                       hint=f"{stem}/flatten")
    dq = g.make_node("DequantizeLinear", [flat.output[0]] + list(dq_a.input[1:]), like=dq_a, hint=f"{stem}/2d",
                     **({"axis": attr(dq_a, "axis")} if attr(dq_a, "axis") is not None else {}))
    lead = g.make_node("Shape", [q], like=dq_a, hint=f"{stem}/leading_shape", start=0, end=-1)
    at = g.nodes.index(dq_a) + 1
    g.nodes[at:at] = [flat, dq, lead]
    return dq.output[0], lead.output[0]


#: ops whose output has their first input's shape: a Gelu that onnxruntime's contrib domain writes (shape inference
#: does not know it) between two linears keeps the shape the first linear's unflatten gave
_SAME_SHAPE = frozenset({"QuantizeLinear", "DequantizeLinear", "Gelu", "FastGelu", "QuickGelu", "Relu", "Sigmoid",
                         "Tanh", "Erf", "Clip", "Cast", "Identity", "HardSwish", "HardSigmoid", "LeakyRelu"})


#: binary ops whose output has their operands' shape when the operands agree, or one is a scalar
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow"})


def leading_shape(node) -> bool:
    """``Shape(x, start=0, end=-1)``: the leading dims a Gemm's unflatten gives back."""
    return node.op_type == "Shape" and attr(node, "start", 0) == 0 and attr(node, "end") == -1


def scalar(g: Graph, name: str) -> bool:
    c = g.const(name)
    return c is not None and c.size == 1


def static_leading_shapes(g: Graph, shapes: dict[str, tuple]) -> int:
    """The ``Concat(Shape(x)[:-1], [N])`` that unflattens a Gemm's output, as one constant ``[-1, d1, ..., N]``
    where every dim of ``x`` but the first (the batch) is known: a vision transformer's tokens. The reshape then
    needs no Shape and Concat of its own on every run; at batch 1, where each op costs a few microseconds, they
    were 18 of a 10-linear transformer's 172 ops (bench.styles' transformer, AMX Xeon: 0.135 -> 0.128 ms). Returns
    how many it rewrote."""
    prod, cons = g.producers(), g.consumers()
    known = dict(shapes)

    def dims_of(name: str, depth: int = 0) -> tuple | None:
        """``name``'s shape where all its dims but the first are known: from shape inference, or through
        shape-keeping ops (a decomposed GELU's Mul, Add, Erf chain) from such a value."""
        d = known.get(name)
        if d and all(v is not None for v in d[1:]):
            return d
        p = prod.get(name)
        if p is None or depth > 24:
            return None
        if p.op_type in _SAME_SHAPE:
            return dims_of(p.input[0], depth + 1)
        if p.op_type in ELEMENTWISE and len(p.input) == 2:  # a scalar operand, or two of one shape
            a, b = (None if scalar(g, i) else dims_of(i, depth + 1) for i in p.input)
            if a is None or b is None:
                return a if scalar(g, p.input[1]) else b if scalar(g, p.input[0]) else None
            return a if a[1:] == b[1:] else None
        return None

    done = 0
    for back in [n for n in g.nodes if n.op_type == "Reshape" and n.name.endswith(UNFLATTEN)]:
        concat = prod.get(back.input[1])
        if concat is None or concat.op_type != "Concat" or len(concat.input) != 2 or len(cons[concat.output[0]]) != 1:
            continue
        lead, n_out = prod.get(concat.input[0]), g.const(concat.input[1])
        if lead is None or not leading_shape(lead) or n_out is None:
            continue
        dims = dims_of(lead.input[0])
        if dims is None:
            continue
        shape = [*dims[1:-1], *n_out.tolist()]
        back.input[1] = g.add_const(f"{back.name}/shape", np.array([-1, *shape], np.int64))
        known[back.output[0]] = (None, *shape)
        done += 1
    if done:
        drop_unread(g, lambda m: m.op_type in ("Shape", "Concat"))
    return done
