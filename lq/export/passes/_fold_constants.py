"""Constant folding: Constant nodes become initializers, cheap ops on constants are evaluated."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from lq.export._ir import Graph

_FOLDABLE = {
    "Identity", "Reshape", "Transpose", "Cast", "Unsqueeze", "Squeeze", "Div", "Mul", "Add", "Sub", "Neg",
    "Abs", "Sqrt", "Reciprocal", "Concat", "Flatten", "Expand", "Slice", "Gather", "Shape", "Max", "Min",
    "Clip", "Round", "Floor", "Ceil", "Pow", "Where", "Equal", "Less", "Greater", "Not", "ConstantOfShape",
}


def fold_constants(g: Graph) -> None:
    """Turn Constant nodes into initializers and evaluate cheap ops whose inputs are all constant."""
    from onnx.reference import ReferenceEvaluator

    changed = True
    while changed:
        changed = False
        keep = []
        for n in g.nodes:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.output) == 1:
                val = _constant_value(n)
                if val is not None and n.output[0] not in g.graph_outputs:
                    g.consts[n.output[0]] = val
                    g._overrides = g._const_overrides() | {n.output[0]}
                    changed = True
                    continue
            if (n.op_type in _FOLDABLE and n.domain in ("", "ai.onnx") and n.input
                    and all((not i) or g.is_const(i) for i in n.input)
                    and not any(o in g.graph_outputs for o in n.output)):
                try:
                    if n.op_type == "Identity":
                        vals = [g.const(n.input[0])]
                    else:
                        ins = [g.const(i) for i in n.input if i]
                        vals = ReferenceEvaluator(_single_node_model(n, g)).run(None, {
                            f"i{k}": v for k, v in enumerate(ins)})
                except Exception:
                    keep.append(n)
                    continue
                for o, v in zip(n.output, vals):
                    g.consts[o] = np.asarray(v)
                    g._overrides = g._const_overrides() | {o}
                changed = True
                continue
            keep.append(n)
        g.nodes = keep


def _constant_value(n):
    a = n.attribute[0] if n.attribute else None
    if a is None:
        return None
    if a.name == "value":
        return numpy_helper.to_array(a.t)
    if a.name == "value_float":
        return np.array(a.f, dtype=np.float32)
    if a.name == "value_int":
        return np.array(a.i, dtype=np.int64)
    if a.name == "value_floats":
        return np.array(list(a.floats), dtype=np.float32)
    if a.name == "value_ints":
        return np.array(list(a.ints), dtype=np.int64)
    return None


def _single_node_model(n, g: Graph):
    ins = [i for i in n.input if i]
    node = helper.make_node(n.op_type, [f"i{k}" for k in range(len(ins))], [f"o{k}" for k in range(len(n.output))],
                            **{a.name: helper.get_attribute_value(a) for a in n.attribute})
    inputs = [helper.make_tensor_value_info(f"i{k}", helper.np_dtype_to_tensor_dtype(g.const(i).dtype), None)
              for k, i in enumerate(ins)]
    outputs = [helper.make_tensor_value_info(f"o{k}", TensorProto.UNDEFINED, None) for k in range(len(n.output))]
    graph = helper.make_graph([node], "fold", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", max(g.opset, 13))])


