"""A transpose of the last two axes written as ``Reshape -> Transpose -> Reshape`` becomes one Transpose.

PyTorch's current exporter (onnxscript's ``scaled_dot_product_attention``) does not know the rank of the key, so
it writes ``key.transpose(-1, -2)`` as

    Reshape(key, Concat([-1], shape[-2:-1], shape[-1:]))     # [d0 * ... * d(r-3), d(r-2), d(r-1)]
    Transpose(perm=[0, 2, 1])                                # [..., d(r-1), d(r-2)]
    Reshape(Concat(shape[:-2], shape[-1:], shape[-2:-1]))    # [d0, ..., d(r-3), d(r-1), d(r-2)]

with ``shape = Shape(key)``. That is ``Transpose(key, perm=[0, ..., r-3, r-1, r-2])``: the same elements in the
same order (a Reshape moves no element), for every value of the dimensions (of a non-empty tensor: with a zero
dimension the ``-1`` has nothing to divide). onnxruntime does not see it: in
MiniLM's INT4 file it ran the head-split Transpose of K, two Reshapes, a second Transpose and the shape arithmetic
(three Slices, two Concats) per layer, where the legacy exporter's file (and onnxruntime's own quantized file made
from it) runs one ``Transpose(perm=[0, 2, 3, 1])``. After the rewrite the Transpose that made ``key`` (the head
split) and the new one are one Transpose (:func:`merge_transposes`); the shape arithmetic goes with its readers.

Matched only where the two shape vectors are provably those above: built by ``Concat`` (axis 0) from constants
and constant ``Slice`` s of ``Shape(key)`` (the ``Shape`` node's ``start``/``end`` included), with ``key``'s rank
known. Anything else (a shape read from another tensor, a computed dimension) is left alone.
"""

from __future__ import annotations

import numpy as np

from lq.export._ir import Graph, attr, drop_unread, set_attr

_SHAPE_OPS = ("Shape", "Slice", "Concat", "Reshape", "Transpose", "Constant", "Gather", "Unsqueeze", "Squeeze")


def swap_last_axes(g: Graph, shapes: dict[str, tuple]) -> int:
    """Rewrite every ``Reshape -> Transpose([0, 2, 1]) -> Reshape`` that swaps the last two axes of a tensor of
    rank >= 3 as one Transpose; returns how many."""
    done = 0
    prod, cons = g.producers(), g.consumers()
    for mid in [n for n in g.nodes if n.op_type == "Transpose" and list(attr(n, "perm", [])) == [0, 2, 1]]:
        first = prod.get(mid.input[0])
        readers = cons.get(mid.output[0], [])
        if first is None or first.op_type != "Reshape" or len(readers) != 1 or readers[0].op_type != "Reshape":
            continue
        last = readers[0]
        if len(cons.get(first.output[0], [])) != 1 or {first.output[0], mid.output[0]} & g.graph_outputs:
            continue
        x = first.input[0]
        rank = _rank(x, prod, shapes)
        if rank is None or rank < 3:
            continue
        d = [("dim", i) for i in range(rank)]
        want_first = [-1, d[-2], d[-1]]
        want_last = d[:-2] + [d[-1], d[-2]]
        if _dims(g, prod, first.input[1], x, rank) != want_first or _dims(g, prod, last.input[1], x, rank) != want_last:
            continue
        node = g.make_node("Transpose", [x], [last.output[0]], hint=(last.name or "swap_last_axes"), like=last,
                           perm=swapped_perm(rank))
        at = g.nodes.index(last)
        g.nodes[at] = node
        g.nodes = [n for n in g.nodes if n is not first and n is not mid]
        prod, cons = g.producers(), g.consumers()
        done += 1
    if done:
        drop_unread(g, lambda n: n.op_type in _SHAPE_OPS)
        merge_transposes(g)
    return done


def swapped_perm(rank: int) -> list[int]:
    """The permutation that swaps the last two of ``rank`` axes."""
    return list(range(rank - 2)) + [rank - 1, rank - 2]


def merge_transposes(g: Graph) -> int:
    """``Transpose(p) -> Transpose(q)``, the first read by the second alone, as one ``Transpose`` (perm ``p[q[i]]``);
    returns how many were merged."""
    merged = 0
    while True:
        prod, cons = g.producers(), g.consumers()
        for second in [n for n in g.nodes if n.op_type == "Transpose"]:
            first = prod.get(second.input[0])
            if first is None or first.op_type != "Transpose" or len(cons.get(first.output[0], [])) != 1 \
                    or first.output[0] in g.graph_outputs:
                continue
            p, q = list(attr(first, "perm", [])), list(attr(second, "perm", []))
            if not p or len(p) != len(q):
                continue
            second.input[0] = first.input[0]
            set_attr(second, "perm", [p[i] for i in q])
            g.nodes = [n for n in g.nodes if n is not first]
            merged += 1
            break
        else:
            return merged


def _ints(g: Graph, name: str) -> list[int] | None:
    c = g.const(name)
    return None if c is None else [int(v) for v in np.asarray(c).reshape(-1)]


def _rank(x: str, prod, shapes: dict[str, tuple]) -> int | None:
    if x in shapes:
        return len(shapes[x])
    p = prod.get(x)
    if p is not None and p.op_type == "Transpose" and attr(p, "perm", None) is not None:
        return len(attr(p, "perm"))
    return None


def _dims(g: Graph, prod, name: str, x: str, rank: int) -> list | None:
    """The 1-D shape vector ``name`` as a list of ints and ``("dim", i)`` (dimension ``i`` of ``x``), or None
    when it is not built from constants and constant slices of ``Shape(x)``."""
    c = g.const(name)
    if c is not None:
        return [int(v) for v in np.asarray(c).reshape(-1)] if np.asarray(c).ndim <= 1 else None
    n = prod.get(name)
    if n is None:
        return None
    if n.op_type == "Constant":
        from onnx import numpy_helper

        value = next((a for a in n.attribute if a.name in ("value", "value_ints")), None)
        if value is None:
            return None
        arr = numpy_helper.to_array(value.t) if value.name == "value" else np.asarray(value.ints)
        return [int(v) for v in np.asarray(arr).reshape(-1)] if np.asarray(arr).ndim <= 1 else None
    if n.op_type == "Shape" and n.input[0] == x:
        start, end = attr(n, "start", 0), attr(n, "end", None)
        return [("dim", i) for i in range(rank)][start:end]
    if n.op_type == "Concat" and attr(n, "axis", 0) in (0, -1):
        out: list = []
        for i in n.input:
            part = _dims(g, prod, i, x, rank)
            if part is None:
                return None
            out += part
        return out
    if n.op_type == "Slice" and len(n.input) >= 3:
        data = _dims(g, prod, n.input[0], x, rank)
        starts, ends, axes, steps = (_ints(g, n.input[i]) if len(n.input) > i and n.input[i] else None
                                     for i in (1, 2, 3, 4))
        if data is None or starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
            return None
        if (len(n.input) > 3 and n.input[3] and axes not in ([0], [-1])) or \
                (len(n.input) > 4 and n.input[4] and steps != [1]):
            return None
        return data[starts[0]:ends[0]]  # ONNX Slice with step 1 clamps as Python's slicing does
    return None
