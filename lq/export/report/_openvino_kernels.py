"""Which precision OpenVINO's CPU plugin runs every quantized layer at (``target="openvino"``), and why not int8.

The answer comes from the plugin's compiled graph (:func:`lq.export.verify._openvino.compiled_layers`): each of
its convolutions and matmuls names the ONNX nodes it was made from (the node's own name, or the name with what the
plugin split off it or moved into it: ``node_linear/WithoutBiases``, ``node_MatMul_2/DequantizationMultiply``) and the precision it runs at (``i8``/``u8``: the integer kernel;
``f32``: dequantized first). A layer is matched to the compiled layer that names its node.
"""

from __future__ import annotations

import onnx

from lq.export._ir import Graph
from lq.export.report._kernel_report import COMPUTE, LayerKernel, _quantized
from lq.export.verify import _openvino

#: why a quantized layer runs in float where its input or weight has no quantizer in the file
NOT_QUANTIZED = "its input or weight is not quantized in the file"
#: why it runs in float where both are
NOT_FUSED = ("OpenVINO's low-precision transformations did not move its quantizers into it (see the compiled graph: "
             "lq.export.verify._openvino.compiled_layers)")


def layer_kernels(model: onnx.ModelProto, data: bytes, layer_of: dict[str, str]) -> list[LayerKernel]:
    """For every quantized conv/gemm/matmul of ``model`` (``data``: the file's bytes): what OpenVINO runs."""
    compiled = _openvino.compiled_layers(data)
    by_node = {name: c for c in compiled for name in c.names}
    # the plugin names what it split off a node, or moved into it, after it: node_linear/WithoutBiases,
    # node_MatMul_2/DequantizationMultiply
    for c in compiled:
        for name in c.names:
            if "/" in name:
                by_node.setdefault(name.split("/")[0], c)
    g = Graph(model)
    prod = g.producers()
    out = []
    for n in g.nodes:
        if n.op_type not in COMPUTE or not _quantized(n, prod):
            continue
        c = by_node.get(n.name)
        layer = layer_of.get(n.name) or n.name
        if c is None:
            out.append(LayerKernel(layer, n.op_type, "not in OpenVINO's compiled graph",
                                   "OpenVINO merged or removed it", runs_integer=False))
            continue
        quantized = all(prod.get(i) is not None and prod[i].op_type == "DequantizeLinear" for i in n.input[:2])
        out.append(LayerKernel(layer, n.op_type, f"{c.layer_type} ({c.precision}, {c.primitive})",
                               None if c.integer else (NOT_FUSED if quantized else NOT_QUANTIZED),
                               runs_integer=c.integer))
    return out
