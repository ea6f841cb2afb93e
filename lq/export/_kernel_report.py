"""Why a conv/gemm/matmul stays float in onnxruntime: one reason per layer for the export report."""

from __future__ import annotations

import onnx

from lq.export._ir import Graph

def unfused_layers(model: onnx.ModelProto, layer_of: dict[str, str]) -> list[str]:
    """Conv/Gemm/MatMul nodes onnxruntime cannot turn into an INT8 kernel, each with the reason."""
    g = Graph(model)
    prod, cons = g.producers(), g.consumers()
    out = []
    for n in g.nodes:
        if n.op_type not in ("Conv", "Gemm", "MatMul"):
            continue
        name = layer_of.get(n.name) or n.name
        ins = [prod.get(i) for i in n.input[:2]]
        if any(p is None or p.op_type != "DequantizeLinear" for p in ins):
            out.append(f"{name}: input or weight is not quantized")
            continue
        users = cons.get(n.output[0], [])
        if n.op_type == "Conv" or users or n.output[0] not in g.graph_outputs:
            if n.output[0] in g.graph_outputs:
                out.append(f"{name}: its output is a model output (no quantizer reads it)")
            elif not users or any(u.op_type != "QuantizeLinear" for u in users):
                readers = sorted({u.op_type for u in users if u.op_type != "QuantizeLinear"})
                out.append(f"{name}: its output is read by {', '.join(readers)} without a quantizer "
                           "(quantize the reader's inputs, e.g. QuantAdd for a residual add)")
    return out

