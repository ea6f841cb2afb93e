"""Weight-layout and file-level finishing passes: transposed weight DQs, Q/DQ weights, opset and metadata."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from lq.export._ir import Graph, attr, set_attr
from lq.export._symbolic import DOMAIN


def transpose_weight_dq(g: Graph) -> None:
    """``DQ(const) -> Transpose`` -> ``DQ(transposed const)`` so MatMul sees its weight DQ directly."""
    prod, cons = g.producers(), g.consumers()
    drop = set()
    for t in g.nodes:
        if t.op_type != "Transpose":
            continue
        dq = prod.get(t.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or len(cons.get(t.input[0], [])) != 1:
            continue
        q = g.const(dq.input[0])
        if q is None or attr(dq, "block_size", 0):
            continue
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


def _dequantize(q, scale, zp, axis):
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
            if q is not None and q.dtype in (np.int8, np.uint8):
                w = _dequantize(q, g.const(n.input[1]), g.const(n.input[2]) if len(n.input) > 2 else None,
                                attr(n, "axis", 1))
                wname = g.add_const(n.input[0] + "_float", np.asarray(w, dtype=np.float32))
                qo = g.fresh(n.name + "_wq")
                kw = {a.name: helper.get_attribute_value(a) for a in n.attribute}
                new_nodes.append(g.make_node("QuantizeLinear", [wname] + list(n.input[1:]), [qo], like=n, **kw))
                n.input[0] = qo
        new_nodes.append(n)
    g.nodes = new_nodes


def remove_placeholder_opset(model: onnx.ModelProto) -> None:
    keep = [o for o in model.opset_import if o.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    for f in list(model.functions):
        if f.domain == DOMAIN:
            model.functions.remove(f)


def value_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Rank of every value shape inference can tell."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        inferred = model
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = len(t.shape.dim)
    return out


def strip_metadata(model: onnx.ModelProto) -> None:
    """Drop the exporter's per-node metadata (stack traces, FX node text): it can outweigh int8 weights."""
    for n in model.graph.node:
        del n.metadata_props[:]
