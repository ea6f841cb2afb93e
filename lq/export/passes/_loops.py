"""Recurrent layers as ONNX ``Scan`` loops, and the way the export's passes reach into loop bodies.

A ``QuantLSTM`` traced in lq's export (:mod:`lq.export.trace._loop_ops`) leaves, per layer and direction, one
``lq.export::LSTMScan`` placeholder. Its inputs are ``xw`` (the quantized input projection of every step,
computed outside), ``h0``, ``c0``, ``h_q`` (the layer's input quantizer applied to an ``lq.export::LoopState``
marker), the quantized recurrent weight ``w_hh`` (and optionally ``b_hh`` and the projection weight ``w_hr``).
:func:`lower_recurrent` turns each placeholder into a ``Scan`` whose body is one LSTM step:

    h_q = <the nodes between the marker and h_q>(h)          # the quantizer, exactly as traced
    gates = xw_t + Gemm(h_q, <the nodes of w_hh>, b_hh, transB=1)
    i, f, g, o = gates[:, :H], gates[:, H:2H] ...           # torch's gate order
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g);  h' = sigmoid(o) * tanh(c')   [h' = Gemm(h', w_hr) with proj_size]

The quantizer and weight nodes are *copied* into the body (with the constants they read) rather than written
anew, so the body still holds lq placeholders: :func:`rewrite_bodies` runs the export's own passes on every
body (lowering to Q/DQ, int32 bias, int16-safe weights ...), which is why onnxruntime fuses the step's Q/DQ +
Gemm into an integer kernel inside the loop. Reverse directions use Scan's reverse scan axes. The loop runs
for any sequence length, so the time axis can be a dynamic input dimension.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from lq.export._ir import ExportError, Graph, as_model, attr, drop_unread, layer_name
from lq.export.trace._loop_ops import LOOP_STATE, LSTM_SCAN
from lq.export.trace._symbolic import DOMAIN


# =========================================================================== loop bodies
def rewrite_bodies(g: Graph, rewrite: Callable[[Graph], None]) -> None:
    """Run ``rewrite`` (the export's passes) on every subgraph of ``g``'s nodes, in place.

    A body written by :func:`lower_recurrent` refers only to its own inputs and initializers (it copies what
    it reads), so each pass sees a complete graph. Names created in a body avoid every name of the enclosing
    graph: a subgraph must not shadow an outer value."""
    for n in g.nodes:
        for a in n.attribute:
            if a.type != AttributeProto.GRAPH:
                continue
            sub = Graph(as_model(a.g, g.model))
            sub._used_names |= g._used_names
            rewrite(sub)
            a.g.CopyFrom(sub.finalize().graph)
            g._used_names |= sub._used_names


# =========================================================================== LSTMScan -> Scan
def lower_recurrent(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every ``lq.export::LSTMScan`` placeholder of ``model`` -> an ONNX ``Scan`` (see the module docstring);
    the markers and the nodes that only fed the placeholders are removed. ``model`` is returned unchanged
    when it has no placeholder."""
    if not any(n.domain == DOMAIN and n.op_type == LSTM_SCAN for n in model.graph.node):
        return model
    g = Graph(model)
    copied: set[int] = set()
    for n in list(g.nodes):
        if n.domain == DOMAIN and n.op_type == LSTM_SCAN:
            g.nodes[g.nodes.index(n)] = _lstm_scan(g, n, copied)
    drop_unread(g, lambda m: id(m) in copied or (m.domain == DOMAIN and m.op_type == LOOP_STATE))
    left = [n.op_type for n in g.nodes if n.domain == DOMAIN and n.op_type in (LOOP_STATE, LSTM_SCAN)]
    if left:  # pragma: no cover - defensive
        raise ExportError(f"internal error: recurrent placeholders left after lowering: {left}")
    return g.finalize()


class _Body:
    """The nodes, initializers and names of one loop body under construction."""

    def __init__(self, g: Graph, stem: str, like: onnx.NodeProto):
        self.g, self.stem, self.like = g, stem, like
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.names: dict[str, str] = {}  # outer value -> body value

    def name(self, hint: str) -> str:
        return self.g.fresh(f"{self.stem}/{hint}")

    def const(self, hint: str, value: np.ndarray) -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> list[str]:
        outs = [self.name(f"{op_type}_out") for _ in range(n_out)]
        node = helper.make_node(op_type, inputs, outs, name=self.name(op_type), **attrs)
        for p in self.like.metadata_props:  # the layer the step belongs to (kernel report, quantizer table)
            node.metadata_props.add(key=p.key, value=p.value)
        self.nodes.append(node)
        return outs


def _lstm_scan(g: Graph, n: onnx.NodeProto, copied: set[int]) -> onnx.NodeProto:
    """The ``Scan`` standing for one ``LSTMScan`` placeholder ``n``."""
    ins = list(n.input) + [""] * (7 - len(n.input))
    xw, h0, c0, h_q, w_hh, b_hh, w_hr = ins[:7]
    hidden = int(attr(n, "hidden_size", 0))
    reverse = int(attr(n, "reverse", 0))
    layer = layer_name(n)
    if hidden <= 0:  # pragma: no cover - the op always carries it
        raise ExportError(f"internal error: the recurrent placeholder of '{layer}' has no hidden_size")
    body = _Body(g, g.fresh(f"{layer}/scan"), n)
    h_in, c_in, x_in = body.name("h"), body.name("c"), body.name("xw_t")
    prod = g.producers()

    def pull(v: str) -> str:
        """The body's copy of outer value ``v``: the state for the marker, a copied initializer for a constant,
        else a copy of its producer (recursively)."""
        if not v:
            return ""
        if v in body.names:
            return body.names[v]
        p = prod.get(v)
        if p is not None and p.domain == DOMAIN and p.op_type == LOOP_STATE:
            body.names[v] = h_in
        elif p is None and g.is_const(v):
            body.names[v] = body.const(v, g.const(v))
        elif p is None or v in g.graph_inputs:
            raise ExportError(f"QuantLSTM '{layer}': a quantizer of its step reads '{v}', a value computed outside "
                              "the step; only the state and constants can enter the loop body")
        else:
            inputs = [pull(i) for i in p.input]
            c = onnx.NodeProto()
            c.CopyFrom(p)
            c.name = body.name(p.name or p.op_type)
            del c.input[:]
            c.input.extend(inputs)
            for k, o in enumerate(p.output):
                body.names[o] = c.output[k] = body.name(o) if o else ""
            body.nodes.append(c)
            copied.add(id(p))
        return body.names[v]

    hq, w = pull(h_q), pull(w_hh)
    b = pull(b_hh)
    (hw,) = body.op("Gemm", [hq, w] + ([b] if b else []), transB=1)
    (gates,) = body.op("Add", [x_in, hw])
    # four Slices, not a Split: onnx's version converter has no adapter for Split between opsets 18 and 17
    axis = body.const("axis", np.array([1], dtype=np.int64))
    i, f, gg, o = (body.op("Slice", [gates, body.const("start", np.array([k * hidden], dtype=np.int64)),
                                     body.const("end", np.array([(k + 1) * hidden], dtype=np.int64)), axis])[0]
                   for k in range(4))
    (si,), (sf,), (tg,), (so,) = (body.op("Sigmoid", [i]), body.op("Sigmoid", [f]), body.op("Tanh", [gg]),
                                  body.op("Sigmoid", [o]))
    (fc,), (ig,) = body.op("Mul", [sf, c_in]), body.op("Mul", [si, tg])
    (c_out,) = body.op("Add", [fc, ig])
    (tc,) = body.op("Tanh", [c_out])
    (h_out,) = body.op("Mul", [so, tc])
    if w_hr:
        (h_out,) = body.op("Gemm", [h_out, pull(w_hr)], transB=1)
    (y_t,) = body.op("Identity", [h_out])  # a value is one body output only: the scan output is a copy

    def value(name, width=None):  # (batch, features): onnxruntime needs the rank of a loop body's values
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [None, width])

    graph = helper.make_graph(body.nodes, body.stem, [value(h_in), value(c_in, hidden), value(x_in, 4 * hidden)],
                              [value(h_out), value(c_out, hidden), value(y_t)], body.inits)
    y, h_n, c_n = (list(n.output) + ["", "", ""])[:3]
    scan = g.make_node("Scan", [h0, c0, xw], [h_n or g.fresh("h_n"), c_n or g.fresh("c_n"), y], hint=f"{layer}/Scan",
                       like=n, body=graph, num_scan_inputs=1, scan_input_directions=[reverse],
                       scan_output_directions=[reverse])
    return scan
