"""``DynamicLSTM`` placeholders -> onnxruntime's fused ``com.microsoft.DynamicQuantizeLSTM``.

A ``QuantLSTM`` with ``runtime_dynamic`` activations traces each layer and direction as one placeholder
(:func:`lq.export.trace._loop_ops.dynamic_lstm`) whose weights are the weight quantizers' output. Once lowering has
made those ``DequantizeLinear(int8 constant, per-row scale)``, this pass writes the op onnxruntime runs as
one kernel: the integer weights transposed to its ``[1, K, 4H]`` layout and reordered from torch's gate
order (i, f, g, o) to ONNX's (i, o, f, c), their per-row scales as ``W_scale``/``R_scale`` (per channel),
``B = [b_ih | b_hh]``, the state with a direction axis. The op quantizes its activations itself (the
numbers :mod:`lq.nn.modules._runtime_dynamic` computes in PyTorch).

AVX2: onnxruntime multiplies uint8 activations by int8 weights in kernels that add pairs of products in a
saturating int16 on CPUs without VNNI; with 7-bit weights (``|q| <= 63``) no pair can saturate. Wider
weights are written as uint8 with zero point 128 (the same values), which selects the exact uint8 x uint8
kernels; the op requires one zero point for all channels, which 128 is.
"""

from __future__ import annotations

import numpy as np

from lq.export._ir import MS_DOMAIN, ExportError, Graph, attr, drop_unread, layer_name
from lq.export.trace._loop_ops import DYNAMIC_LSTM

#: the onnxruntime op a QuantLSTM with recurrent="dynamic" runs as (it quantizes its own activations)
RUNTIME_QUANTIZED_LSTM = "DynamicQuantizeLSTM"
from lq.export.trace._symbolic import DOMAIN

#: torch's gate blocks (i, f, g, o) in the order of ONNX's LSTM (i, o, f, c)
ONNX_GATES = (0, 3, 1, 2)
#: the largest |int8 weight| whose uint8 x int8 pair sums fit int16 (255 * 63 * 2 = 32130)
_INT16_SAFE = 63


def is_placeholder(n) -> bool:
    return n.domain == DOMAIN and n.op_type == DYNAMIC_LSTM


def gate_rows(a: np.ndarray, hidden: int) -> np.ndarray:
    """``a``'s leading axis (4 * hidden rows, torch's gate order) in ONNX's gate order."""
    return np.concatenate([a[k * hidden:(k + 1) * hidden] for k in ONNX_GATES])


def write_dynamic_lstms(g: Graph) -> list[tuple[str, bool]]:
    """Every ``DynamicLSTM`` placeholder of ``g`` -> Unsqueeze (state) + ``DynamicQuantizeLSTM`` + Squeeze
    (outputs); returns ``(layer, weights stored as uint8)`` of each. Runs after lowering (the weights must be
    integer constants)."""
    done = []
    prod = g.producers()
    for n in list(g.nodes):
        if not is_placeholder(n):
            continue
        layer = layer_name(n)
        hidden = int(attr(n, "hidden_size", 0))
        x, h0, c0, w_ih, w_hh = n.input[:5]
        b_ih, b_hh = (list(n.input[5:7]) + ["", ""])[:2]
        (wq, ws), (rq, rs) = _int_weight(g, prod, w_ih, layer), _int_weight(g, prod, w_hh, layer)
        unsigned = max(np.abs(wq).max(initial=0), np.abs(rq).max(initial=0)) > _INT16_SAFE
        inputs = [x, g.add_const(f"{layer}/W", _layout(wq, hidden, unsigned)),
                  g.add_const(f"{layer}/R", _layout(rq, hidden, unsigned)),
                  g.add_const(f"{layer}/B", _bias(g, b_ih, b_hh, hidden, layer)), ""]
        axis0 = g.add_const(f"{layer}/axis0", np.array([0], dtype=np.int64))
        axis1 = g.add_const(f"{layer}/axis1", np.array([1], dtype=np.int64))
        new = []
        for state in (h0, c0):
            u = g.make_node("Unsqueeze", [state, axis0], hint=f"{layer}/Unsqueeze", like=n)
            new.append(u)
            inputs.append(u.output[0])
        zp = np.full((1, 4 * hidden), 128 if unsigned else 0, dtype=np.uint8 if unsigned else np.int8)
        inputs += ["", g.add_const(f"{layer}/W_scale", gate_rows(ws, hidden)[None]),
                   g.add_const(f"{layer}/W_zero_point", zp),
                   g.add_const(f"{layer}/R_scale", gate_rows(rs, hidden)[None]),
                   g.add_const(f"{layer}/R_zero_point", zp)]
        y4, yh, yc = (g.fresh(f"{layer}/{k}") for k in ("Y", "Y_h", "Y_c"))
        new.append(g.make_node(RUNTIME_QUANTIZED_LSTM, inputs, [y4, yh, yc], hint=f"{layer}/DynamicQuantizeLSTM",
                               domain=MS_DOMAIN, like=n, hidden_size=hidden,
                               direction="reverse" if int(attr(n, "reverse", 0)) else "forward"))
        for src, dst, axis in ((y4, n.output[0], axis1), (yh, n.output[1], axis0), (yc, n.output[2], axis0)):
            if dst:
                new.append(g.make_node("Squeeze", [src, axis], [dst], hint=f"{layer}/Squeeze", like=n))
        i = g.nodes.index(n)
        g.nodes[i:i + 1] = new
        done.append((layer, bool(unsigned)))
    if done:
        drop_unread(g, lambda m: m.op_type == "DequantizeLinear")
        g.use_ms_domain()
    return done


def _int_weight(g: Graph, prod: dict, name: str, layer: str) -> tuple[np.ndarray, np.ndarray]:
    """``(q (4H, K) int, scale (4H,))`` of a weight that lowering made ``DequantizeLinear(constant)``."""
    dq = prod.get(name)
    q = g.const(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    if q is None or q.ndim != 2 or q.dtype != np.int8:
        raise ExportError(f"QuantLSTM '{layer}' with runtime_dynamic activations needs int8 weight quantizers "
                          "(num_bits <= 8, per tensor or per row) so onnxruntime's DynamicQuantizeLSTM can run it")
    scale = g.const(dq.input[1]).astype(np.float32).reshape(-1)
    zp = g.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    if zp is not None and np.any(zp != 0):  # pragma: no cover - lq's weight quantizers are symmetric
        raise ExportError(f"QuantLSTM '{layer}': a weight zero point other than 0 cannot be written")
    if scale.size != 1 and attr(dq, "axis", 1) not in (0, -2):  # pragma: no cover - per-row quantizers: axis 0
        raise ExportError(f"QuantLSTM '{layer}': a weight scale along axis {attr(dq, 'axis', 1)} cannot be written")
    scale = np.broadcast_to(scale, (q.shape[0],)) if scale.size == 1 else scale  # per tensor: one per row alike
    return q.astype(np.int32), np.ascontiguousarray(scale, dtype=np.float32)


def _layout(q: np.ndarray, hidden: int, unsigned: bool) -> np.ndarray:
    """(4H, K) torch layout -> (1, K, 4H) in ONNX gate order, int8 or uint8 (+128)."""
    w = gate_rows(q, hidden).T[None]
    return np.ascontiguousarray(w + 128, dtype=np.uint8) if unsigned else np.ascontiguousarray(w, dtype=np.int8)


def _bias(g: Graph, b_ih: str, b_hh: str, hidden: int, layer: str) -> np.ndarray:
    parts = []
    for b in (b_ih, b_hh):
        v = g.const(b) if b else np.zeros(4 * hidden, np.float32)
        if v is None:
            raise ExportError(f"QuantLSTM '{layer}': its bias is not a constant in the exported graph")
        parts.append(gate_rows(v.astype(np.float32).reshape(-1), hidden))
    return np.concatenate(parts)[None]
