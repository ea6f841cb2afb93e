"""Weight layout passes: one DequantizeLinear per reader, transposed weights stored transposed, and (for
TensorRT's default) float weights behind a QuantizeLinear instead of int8 initializers.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from lq.export._ir import Graph, attr, set_attr


def _sole_weight_dq(g: Graph, node, prod: dict, cons: dict):
    """``(dq, int weight)`` when ``node``'s first input is a DequantizeLinear of a constant (not blocked) that
    only ``node`` reads, else None: the weight DQs the layout passes may rewrite in place."""
    dq = prod.get(node.input[0])
    if dq is None or dq.op_type != "DequantizeLinear" or len(cons.get(node.input[0], [])) != 1:
        return None
    q = g.const(dq.input[0])
    if q is None or attr(dq, "block_size", 0):
        return None
    return dq, q


def transpose_weight_dq(g: Graph) -> None:
    """``DQ(const) -> Transpose`` -> ``DQ(transposed const)`` so MatMul sees its weight DQ directly."""
    prod, cons = g.producers(), g.consumers()
    drop = set()
    for t in g.nodes:
        if t.op_type != "Transpose" or (found := _sole_weight_dq(g, t, prod, cons)) is None:
            continue
        dq, q = found
        perm = attr(t, "perm", list(range(q.ndim))[::-1])
        s = g.const(dq.input[1])
        new_q = g.add_const(f"{dq.input[0]}_T", np.transpose(q, perm))
        dq.input[0] = new_q
        if s is not None and s.ndim == 1:
            ax = attr(dq, "axis", 1) % q.ndim
            set_attr(dq, "axis", list(perm).index(ax))
        dq.output[0] = t.output[0]
        drop.add(id(t))
    g.nodes = [n for n in g.nodes if id(n) not in drop]


def split_weight_dq(g: Graph) -> None:
    """``DQ(const) -> Split`` -> one ``DQ(const part)`` per output, so each MatMul/Gemm sees its weight's DQ
    directly (onnxruntime fuses only ``DQ -> MatMul``). The fused q/k/v projection weight of attention
    (``in_proj_weight``, quantized per row, then chunked) is the case: without this its three projections
    run in float. Per-axis scales and zero points are split with the weight when the split is along their
    axis; a per-tensor scale is shared."""
    prod, cons = g.producers(), g.consumers()
    drop = set()
    for sp in g.nodes:
        if sp.op_type != "Split" or (found := _sole_weight_dq(g, sp, prod, cons)) is None:
            continue
        dq, q = found
        scale = g.const(dq.input[1])
        zp = g.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        if scale is None:
            continue
        axis = attr(sp, "axis", 0) % q.ndim
        sizes = g.const(sp.input[1]) if len(sp.input) > 1 and sp.input[1] else None
        n_out = len(sp.output)
        if sizes is None:
            if q.shape[axis] % n_out:
                continue
            sizes = [q.shape[axis] // n_out] * n_out
        sizes = [int(v) for v in np.asarray(sizes).reshape(-1)]
        if len(sizes) != n_out or sum(sizes) != q.shape[axis]:
            continue
        dq_axis = attr(dq, "axis", 1) % q.ndim
        per_axis = scale.ndim == 1 and scale.size > 1
        if per_axis and dq_axis != axis:
            continue  # a split across the scale's axis would need the whole scale per part: keep it
        start = 0
        for out, size in zip(sp.output, sizes, strict=True):
            idx = [slice(None)] * q.ndim
            idx[axis] = slice(start, start + size)
            part = g.add_const(f"{dq.input[0]}_part", q[tuple(idx)])
            inputs = [part, dq.input[1], dq.input[2] if zp is not None else ""]
            if per_axis:
                inputs[1] = g.add_const(f"{dq.input[1]}_part", scale[start:start + size])
                if zp is not None and zp.ndim == 1 and zp.size > 1:
                    inputs[2] = g.add_const(f"{dq.input[2]}_part", zp[start:start + size])
            kw = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
            g.nodes.append(g.make_node("DequantizeLinear", [i for i in inputs if i] if zp is None else inputs,
                                       [out], like=dq, **kw))
            start += size
        drop.update((id(sp), id(dq)))
    if drop:
        g.nodes = [n for n in g.nodes if id(n) not in drop]


def dequantize(q, scale, zp, axis):
    qf = q.astype(np.float32) - (0 if zp is None else zp.astype(np.float32).reshape(
        [-1 if d == axis % q.ndim else 1 for d in range(q.ndim)] if zp.ndim == 1 else zp.shape))
    if scale.ndim == 1:
        scale = scale.reshape([-1 if d == axis % q.ndim else 1 for d in range(q.ndim)])
    return (qf * scale.astype(np.float32)).astype(np.float32)


def weights_to_qdq(g: Graph) -> None:
    """``DQ(int8 const)`` -> ``Q(float const) -> DQ`` (the float weight holds the fake-quantized values)."""
    new_nodes = []
    for n in g.nodes:
        if n.op_type == "DequantizeLinear" and g.is_const(n.input[0]):
            q = g.const(n.input[0])
            if q is not None and q.dtype in (np.int8, np.uint8) and not attr(n, "block_size", 0):  # blocked: kept
                w = dequantize(q, g.const(n.input[1]), g.const(n.input[2]) if len(n.input) > 2 else None,
                                attr(n, "axis", 1))
                wname = g.add_const(n.input[0] + "_float", np.asarray(w, dtype=np.float32))
                qo = g.fresh(n.name + "_wq")
                kw = {a.name: helper.get_attribute_value(a) for a in n.attribute}
                new_nodes.append(g.make_node("QuantizeLinear", [wname] + list(n.input[1:]), [qo], like=n, **kw))
                n.input[0] = qo
        new_nodes.append(n)
    g.nodes = new_nodes
