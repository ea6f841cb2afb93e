"""Fewer reshapes around the Gemms of a transformer: a chain of reshapes written as one, and a Gemm's output kept
2-D through the elementwise ops (a GELU) that lead only to the next Gemm.

:mod:`lq.export.passes._linear_gemm` writes each Linear on a ``(batch, tokens, features)`` input as
``Reshape(-1, K) -> Gemm -> Reshape(batch, tokens, N)``. Next to the model's own reshapes (attention's
``view(b, n, 3, heads, d)`` after the qkv Linear, its ``reshape(b, n, c)`` before the output Linear) that gives
two reshapes in a row, which onnxruntime runs one after the other; and between the two Linears of an MLP the
activation goes back to 3-D only to be flattened again. At batch 1 each op costs a few microseconds against
matmuls that take about as long: bench.styles' transformer ran 24 reshapes where its FP32 file runs 6.

Both rewrites keep every number: a reshape of a reshape is the second reshape of the original when the second
shape is a constant that does not copy dims from its input (no ``0`` entries, or ``allowzero``), and a
``QuantizeLinear`` of ``Reshape(DequantizeLinear(q))`` with the same per-tensor scale and zero point is
``Reshape(q)``; elementwise ops compute the same values on a 2-D view of the same data. onnxruntime target only
(the shape of a Gemm's neighbourhood is what its fusions see); run on the finished graph.
"""

from __future__ import annotations

import numpy as np

from lq.export._ir import Graph, attr, drop_unread
from lq.export.passes._linear_gemm import ELEMENTWISE, UNFLATTEN, leading_shape, scalar

#: ops that map each element to one element (the decomposed GELU's Erf, the fused Gelu onnxruntime's exporter
#: writes, the usual activations)
UNARY = frozenset({"Erf", "Gelu", "FastGelu", "QuickGelu", "Relu", "Sigmoid", "Tanh", "HardSwish", "HardSigmoid",
                   "LeakyRelu", "Identity", "Neg", "Abs", "Exp", "Sqrt", "Softplus"})


def _static_shape(g: Graph, node) -> bool:
    """Whether this Reshape's result does not depend on its input's dims (a constant target shape that copies no
    dim: no ``0`` entry, or ``allowzero=1``)."""
    s = g.const(node.input[1]) if len(node.input) > 1 else None
    return s is not None and s.ndim == 1 and (attr(node, "allowzero", 0) == 1 or not (s == 0).any())


def _scalar_param(g: Graph, node, k: int) -> np.ndarray | None:
    v = g.const(node.input[k]) if len(node.input) > k and node.input[k] else None
    return v if v is not None and v.size == 1 else None


def _same_grid(g: Graph, dq, q) -> bool:
    """A per-tensor DequantizeLinear and QuantizeLinear with one scale and one zero point (type and value):
    ``Q(DQ(codes))`` is ``codes``."""
    s_dq, s_q = _scalar_param(g, dq, 1), _scalar_param(g, q, 1)
    if s_dq is None or s_q is None or s_dq.dtype != s_q.dtype or s_dq.item() != s_q.item():
        return False
    z_dq, z_q = _scalar_param(g, dq, 2), _scalar_param(g, q, 2)
    if (z_dq is None) != (z_q is None):
        return False
    if z_dq is None:  # both default: uint8 zero, unless output_dtype says otherwise
        return attr(q, "output_dtype", 0) == 0
    return z_dq.dtype == z_q.dtype and z_dq.item() == z_q.item() and attr(q, "output_dtype", 0) == 0


def merge_reshape_chains(g: Graph) -> int:
    """Write ``Reshape(Reshape(x, s1), s2)`` as ``Reshape(x, s2)`` where ``s2`` is static and the first reshape
    feeds only the second, also across a ``DequantizeLinear -> Reshape -> QuantizeLinear`` of one grid (the
    integers are reshaped as they are). One walk over the reshapes (a longer chain folds into its last one);
    returns how many reshapes it removed."""
    prod, cons = g.producers(), g.consumers()
    gone: set[int] = set()
    removed = 0
    for b in [n for n in g.nodes if n.op_type == "Reshape" and _static_shape(g, n)]:
        while (found := _chain_source(g, prod, cons, b.input[0])) is not None:
            src, dropped = found
            b.input[0] = src
            for m in dropped:
                cons[m.input[0]] = [r for r in cons.get(m.input[0], []) if r is not m]
            cons.setdefault(src, []).append(b)
            gone.update(id(m) for m in dropped)
            removed += sum(m.op_type == "Reshape" for m in dropped)
    if gone:
        g.nodes = [n for n in g.nodes if id(n) not in gone]
    return removed


def _chain_source(g: Graph, prod: dict, cons: dict, name: str):
    """``(what the second reshape can read instead, the nodes that then go)`` for the value ``name`` a static
    Reshape reads, or None. ``cons``: the readers of each value, kept current by the caller."""
    def only_reader(value: str) -> bool:
        return value not in g.graph_outputs and len(cons.get(value, [])) == 1

    p = prod.get(name)
    if p is None or not only_reader(name):
        return None
    if p.op_type == "Reshape":
        return p.input[0], [p]
    if p.op_type != "QuantizeLinear":
        return None
    a = prod.get(p.input[0])
    if a is None or a.op_type != "Reshape" or not only_reader(p.input[0]):
        return None
    dq = prod.get(a.input[0])
    if dq is None or dq.op_type != "DequantizeLinear" or not _same_grid(g, dq, p):
        return None
    return dq.input[0], [p, a] + ([dq] if only_reader(dq.output[0]) else [])  # a DQ nothing else reads goes too


def rows_between_gemms(g: Graph) -> int:
    """Where a Gemm's unflatten is read only by elementwise ops that end in per-tensor QuantizeLinears, each read
    only by ``Reshape(x, [-1, N])`` (the next Linear's flatten, N the Gemm's output width), drop the unflatten and
    those flattens: the chain computes on the Gemm's ``(rows, N)`` output. Returns how many unflattens it dropped."""
    done = 0
    prod, cons = g.producers(), g.consumers()  # the Concats _width reads are not rewritten here
    for back in [n for n in g.nodes if n.op_type == "Reshape" and n.name.endswith(UNFLATTEN)]:
        width, lead = _width(g, prod, back)
        found = None if width is None else _elementwise_to_flattens(g, cons, back.output[0], width, lead)
        if found is None:
            continue
        readers, flattens, leads = found
        gone = set()
        for old, new in [(back, back.input[0])] + [(f, f.input[0]) for f in flattens] + [(s, lead) for s in leads]:
            moved = cons.pop(old.output[0], [])  # the next Linear's leading dims: those this unflatten gave
            g.replace_uses(old.output[0], new, moved)
            cons[new] = [m for m in cons.get(new, []) if m is not old] + moved
            gone.add(id(old))
        g.nodes = [n for n in g.nodes if id(n) not in gone]
        done += 1
    if done:
        drop_unread(g, lambda m: m.op_type in ("Shape", "Concat"))
    return done


def _width(g: Graph, prod: dict, back) -> tuple[int | None, str | None]:
    """``(the last dim an unflatten gives (the Gemm's N), the value holding the leading dims it gives)``: from
    its constant shape (no such value: None), or from its ``Concat(leading dims, [N])``."""
    s, lead = g.const(back.input[1]), None
    if s is None:
        concat = prod.get(back.input[1])
        if concat is None or concat.op_type != "Concat" or len(concat.input) != 2:
            return None, None
        s, lead = g.const(concat.input[1]), concat.input[0]
    ok = s is not None and s.ndim == 1 and s.size and int(s[-1]) > 0
    return (int(s[-1]), lead) if ok else (None, None)


def _elementwise_to_flattens(g: Graph, cons: dict, start: str, width: int, lead: str | None):
    """``(the nodes that read start, the flattens the chain ends in, the Shape nodes reading its quantized ends)``
    when everything downstream of ``start`` up to per-tensor QuantizeLinears is elementwise on values of the chain
    or scalar constants, and each QuantizeLinear is read only by ``Reshape(x, [-1, width])`` and, where ``lead``
    names the unflatten's leading dims, by ``Shape(x, end=-1)`` (the next unflatten's, which then reads
    ``lead``); else None."""
    inside, frontier, flattens, leads = {start}, [start], [], []
    accepted: set[int] = set()
    waiting: set[int] = set()  # binary ops seen before their other operand joined the chain
    while frontier:
        v = frontier.pop()
        if v in g.graph_outputs or not cons.get(v):
            return None
        for n in cons[v]:
            if id(n) in accepted:
                continue
            if n.op_type == "QuantizeLinear" and n.input[0] == v:
                readers = cons.get(n.output[0], [])
                shapes = [r for r in readers if lead is not None and leading_shape(r)]
                if _scalar_param(g, n, 1) is None or len(shapes) == len(readers) or n.output[0] in g.graph_outputs \
                        or not all(r in shapes or _is_flatten(g, r, width) for r in readers):
                    return None
                accepted.add(id(n))
                flattens.extend(r for r in readers if r not in shapes)
                leads.extend(shapes)
                continue
            if n.op_type in UNARY and n.input[0] == v and len(n.input) == 1:
                pass
            elif n.op_type in ELEMENTWISE and len(n.input) == 2:
                if not all(i in inside or scalar(g, i) for i in n.input):
                    waiting.add(id(n))  # its other operand may come from the chain later
                    continue
                waiting.discard(id(n))
            else:
                return None
            accepted.add(id(n))
            for o in n.output:
                inside.add(o)
                frontier.append(o)
    if waiting or not flattens:  # an op also reading something outside the chain
        return None
    return list(cons[start]), flattens, leads


def _is_flatten(g: Graph, node, width: int) -> bool:
    s = g.const(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
    return s is not None and s.shape == (2,) and int(s[0]) == -1 and int(s[1]) == width
