"""The FP32 twin of an export: the same graph with every lq fake-quant placeholder made an Identity.

The export times its INT8 file against this twin on the verification sample, so a user learns when Q/DQ
placement made the "INT8" model slower than the float one. Taking the twin from the exporter's own graph
(before any rewrite) costs no second ``torch.onnx.export`` and compares the same operators, weights and
shapes; onnxruntime applies its own float fusions (Conv+BatchNorm, GELU, ...) to it as it would to a
plain FP32 export.

Recurrent layers are the exception: the INT8 file runs each QuantLSTM layer as a ``Scan`` loop (its step
quantizes ``h``), but a plain FP32 export of ``nn.LSTM`` is one ONNX ``LSTM`` op, which onnxruntime runs as one
fused kernel, faster than a float ``Scan`` of the same step. The twin therefore writes each layer as that
``LSTM`` op (float weights, torch's gate order i, f, g, o rewritten to ONNX's i, o, f, c): against a float
Scan, the bench LSTM of ``bench.ordinary`` measured 1.14x where the user's FP32 file is faster than the INT8
one (0.87x). A layer the op cannot express (an LSTM with ``proj_size``) keeps the float Scan.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from lq.export.finish._finish import remove_placeholder_opset
from lq.export._ir import Graph, attr, drop_unread, subgraphs
from lq.export.passes._dynamic_lstm import gate_rows
from lq.export.trace._loop_ops import DYNAMIC_LSTM, LOOP_STATE, LSTM_SCAN
from lq.export.passes._loops import lower_recurrent
from lq.export.trace._symbolic import DOMAIN

def float_twin(model: onnx.ModelProto, fused_recurrent: bool = True) -> onnx.ModelProto:
    """A copy of the exporter's graph (lq placeholders still in it, recurrent ones not yet lowered) with each
    placeholder passing its input on; recurrent layers as ONNX ``LSTM`` ops (``fused_recurrent``, what an FP32
    export has) or as the float ``Scan`` of the INT8 file's step."""
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    if fused_recurrent:
        g = Graph(twin)
        if recurrent_as_lstm(g):
            twin = g.finalize()
    twin = lower_recurrent(twin)  # what is left: projections, or everything without fused_recurrent
    _pass_through(twin.graph)
    remove_placeholder_opset(twin)
    return twin


def plain_twin(twin: onnx.ModelProto, work) -> onnx.ModelProto | None:
    """The user's plain FP32 export with the current exporter, made from the twin instead of a second trace: the
    twin cleaned up as that exporter cleans up what it wrote (:mod:`lq.export.trace._optimize`: constants folded,
    BatchNorm into the convs, the Identities gone). Where every lq module of ``work`` traces as its float module
    does (``traces_as_float``), that is the same graph: the same operators, initializers and outputs on the five
    library CNNs of ``bench.library``, for 0.02-0.2 s where the export takes 0.5-6 s (Intel Xeon). None where
    it is not (an LSTM, ``nn.MultiheadAttention``), or where this onnxscript lacks the optimizer's pieces: the
    model is then exported."""
    from lq.nn.modules._utils import QuantMixin

    if any(isinstance(m, QuantMixin) and not getattr(m, "traces_as_float", True) for m in work.modules()):
        return None
    import onnx_ir as ir

    from lq.export.trace import _optimize

    model = ir.from_proto(twin)
    if not _optimize.optimize_model(model):
        return None
    return ir.to_proto(model)


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


# =========================================================================== LSTMScan -> LSTM (float)
def recurrent_as_lstm(g: Graph) -> int:
    """Every recurrent placeholder -> one float ONNX ``LSTM`` reading the layer's input ``x`` (the projection,
    the step's quantizer and the weights' placeholders go); returns how many. A ``DynamicLSTM`` reads ``x``
    itself; an ``LSTMScan`` only where its input projection is ``MatMul(x, W^T) [+ b_ih]``."""
    prod, done = g.producers(), 0
    for n in [m for m in g.nodes if m.domain == DOMAIN and m.op_type in (LSTM_SCAN, DYNAMIC_LSTM)]:
        hidden = int(attr(n, "hidden_size", 0))
        found = _lstm_parts(g, prod, n)
        if hidden <= 0 or found is None:
            continue
        x, w, r, b_ih, b_hh = found
        if w is None or r is None or w.ndim != 2 or w.shape[0] != 4 * hidden or r.shape != (4 * hidden, hidden):
            continue
        zeros = np.zeros(4 * hidden, np.float32)
        b_ih, b_hh = (zeros if b is None else b for b in (b_ih, b_hh))
        stem = n.name or "lstm"
        ww = g.add_const(f"{stem}/W", gate_rows(w, hidden).astype(np.float32)[None])
        rr = g.add_const(f"{stem}/R", gate_rows(r, hidden).astype(np.float32)[None])
        bb = g.add_const(f"{stem}/B", np.concatenate([gate_rows(b_ih, hidden), gate_rows(b_hh, hidden)])
                         .astype(np.float32)[None])
        axis0, axis1 = (g.add_const(f"{stem}/axis", np.array([a], np.int64)) for a in (0, 1))
        new = []

        def node(op, inputs, outputs=None, **attrs):
            m = g.make_node(op, inputs, outputs, hint=f"{stem}/{op}", like=n, **attrs)
            new.append(m)
            return list(m.output)

        h0, c0 = n.input[1], n.input[2]
        (h0u,), (c0u,) = node("Unsqueeze", [h0, axis0]), node("Unsqueeze", [c0, axis0])
        y, h_n, c_n = (list(n.output) + ["", "", ""])[:3]
        y4, yh, yc = node("LSTM", [x, ww, rr, bb, "", h0u, c0u], [g.fresh(f"{stem}/Y"), g.fresh(f"{stem}/Y_h"),
                                                                   g.fresh(f"{stem}/Y_c")], hidden_size=hidden,
                          direction="reverse" if int(attr(n, "reverse", 0)) else "forward")
        for full, out, axis in ((y4, y, axis1), (yh, h_n, axis0), (yc, c_n, axis0)):
            if out:
                node("Squeeze", [full, axis], [out])
        k = g.nodes.index(n)
        g.nodes[k:k + 1] = new
        done += 1
    if done:  # the projections, the steps' quantizers and the weights' placeholders: nothing reads them now
        drop_unread(g, lambda m: True)
    return done


def _lstm_parts(g: Graph, prod: dict, n):
    """``(x, W_ih (4H, F), W_hh, b_ih, b_hh)`` of a recurrent placeholder (None for a missing bias), or None
    where the twin cannot be the ONNX ``LSTM`` op (a projection, an input projection it cannot read)."""
    read = lambda v: _constant(g, prod, v) if v else None  # noqa: E731
    ins = list(n.input) + [""] * (7 - len(n.input))
    if n.op_type == DYNAMIC_LSTM:
        return ins[0], read(ins[3]), read(ins[4]), read(ins[5]), read(ins[6])
    xw, w_hh, b_hh, w_hr = ins[0], ins[4], ins[5], ins[6]
    found = _projection(g, prod, xw)
    if w_hr or found is None:
        return None
    x, w_t, b_ih = found
    if (b_hh and read(b_hh) is None) or w_t is None or w_t.ndim != 2:
        return None
    return x, w_t.T, read(w_hh), b_ih, read(b_hh)


def _projection(g: Graph, prod: dict, xw: str):
    """``(x, W^T, b_ih or None)`` when ``xw`` is ``MatMul(x, W^T)`` or that plus a constant bias; else None."""
    p = prod.get(xw)
    bias = None
    if p is not None and p.op_type == "Add":
        for mm, b in ((p.input[0], p.input[1]), (p.input[1], p.input[0])):
            q = prod.get(mm)
            if q is not None and q.op_type == "MatMul":
                bias = _constant(g, prod, b)
                p = q if bias is not None and bias.ndim == 1 else None
                break
        else:
            p = None
    if p is None or p.op_type != "MatMul":
        return None
    return p.input[0], _constant(g, prod, p.input[1]), bias


def _constant(g: Graph, prod: dict, v: str) -> np.ndarray | None:
    """The float value of ``v`` read through lq placeholders (the twin drops them), Identity and Transpose."""
    if g.is_const(v):
        return np.asarray(g.const(v), np.float32)
    p = prod.get(v)
    if p is None:
        return None
    if p.domain == DOMAIN and p.op_type != LOOP_STATE or p.op_type == "Identity":
        return _constant(g, prod, p.input[0])
    if p.op_type == "Transpose":
        a = _constant(g, prod, p.input[0])
        return None if a is None else np.transpose(a, attr(p, "perm", None))
    return None
