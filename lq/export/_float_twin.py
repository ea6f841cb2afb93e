"""The FP32 twin of an export: the same graph with every lq fake-quant placeholder made an Identity.

The export times its INT8 file against this twin on the verification sample, so a user learns when Q/DQ
placement made the "INT8" model slower than the float one. Taking the twin from the exporter's own graph
(before any rewrite) costs no second ``torch.onnx.export`` and compares the same operators, weights and
shapes; onnxruntime applies its own float fusions (Conv+BatchNorm, GELU, ...) to it as it would to a
plain FP32 export.
"""

from __future__ import annotations

import onnx
from onnx import helper

from lq.export._finish import remove_placeholder_opset
from lq.export._ir import subgraphs
from lq.export._symbolic import DOMAIN


def float_twin(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the exporter's graph (lq placeholders still in it) with each placeholder passing its input on."""
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    _pass_through(twin.graph)
    remove_placeholder_opset(twin)
    return twin


def _pass_through(graph: onnx.GraphProto) -> None:
    """Each placeholder of ``graph`` and of its loop bodies -> an Identity of its input."""
    nodes = []
    for n in graph.node:
        if n.domain == DOMAIN:
            nodes.append(helper.make_node("Identity", [n.input[0]], [n.output[0]], name=n.name))
        else:
            for sub in subgraphs(n):
                _pass_through(sub)
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)
