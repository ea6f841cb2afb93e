"""BatchNorm folding into the Conv/Gemm that feeds it, exact for quantized weights.

``q' = sign(k) q`` and ``scale' = |k| scale`` per output channel (``k = gamma / sqrt(var + eps)``): a
per-tensor weight scale becomes a per-channel one and the integers keep their magnitude.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lq.export._ir import Graph, attr, layer_name, set_attr

@dataclasses.dataclass
class FoldRecord:
    layer: str
    bn: str
    clipped: int = 0
    skipped: str | None = None


def fold_batchnorm(g: Graph) -> list[FoldRecord]:
    """Fold inference BatchNormalization into the Conv/Gemm that feeds it (and only it)."""
    records: list[FoldRecord] = []
    prod = g.producers()
    cons = g.consumers()
    removed: set[int] = set()
    for bn in list(g.nodes):
        if bn.op_type != "BatchNormalization" or attr(bn, "training_mode", 0):
            continue
        if len([o for o in bn.output if o]) != 1 or any(o in cons for o in bn.output[1:] if o):
            continue
        t = bn.input[0]
        p = prod.get(t)
        if p is None or p.op_type not in ("Conv", "Gemm") or t in g.graph_outputs or len(cons.get(t, [])) != 1:
            continue
        params = [g.const(i) for i in bn.input[1:5]]
        if any(v is None for v in params):
            continue
        rec = FoldRecord(layer_name(p), layer_name(bn))
        gamma, beta, mean, var = (v.astype(np.float64) for v in params)
        eps = float(attr(bn, "epsilon", 1e-5))
        k = gamma / np.sqrt(var + eps)
        if p.op_type == "Conv":
            out_axis = 0
        else:
            if float(attr(p, "alpha", 1.0)) != 1.0 or float(attr(p, "beta", 1.0)) != 1.0 or attr(p, "transA", 0):
                rec.skipped = "Gemm with alpha/beta != 1 or transA"
                records.append(rec)
                continue
            out_axis = 0 if attr(p, "transB", 0) else 1
        ok = _fold_weight(g, p, k, out_axis, prod, cons, rec)
        if not ok:
            records.append(rec)
            continue
        # bias
        bias_name = p.input[2] if len(p.input) > 2 and p.input[2] else None
        b = g.const(bias_name) if bias_name else np.zeros_like(k)
        if b is None:
            rec.skipped = "bias is not a constant"
            records.append(rec)
            continue
        nb = ((b.astype(np.float64) - mean) * k + beta).astype(np.float32)
        bname = g.add_const(f"{rec.layer.replace('.', '/')}/bias_folded", nb)
        while len(p.input) < 3:
            p.input.append("")
        p.input[2] = bname
        p.output[0] = bn.output[0]
        removed.add(id(bn))
        records.append(rec)
    g.nodes = [n for n in g.nodes if id(n) not in removed]
    return records


def _fold_weight(g: Graph, p, k: np.ndarray, out_axis: int, prod, cons, rec: FoldRecord) -> bool:
    w = p.input[1]
    wc = g.const(w)
    if wc is not None:
        if len(cons.get(w, [])) != 1:
            rec.skipped = "weight shared with another node"
            return False
        shape = [1] * wc.ndim
        shape[out_axis] = -1
        g.replace_uses(w, g.add_const(f"{rec.layer.replace('.', '/')}/weight_folded",
                                      (wc.astype(np.float64) * k.reshape(shape)).astype(wc.dtype)), cons[w])
        return True
    dq = prod.get(w)
    if dq is None or dq.op_type != "DequantizeLinear" or len(cons.get(w, [])) != 1:
        rec.skipped = "weight is neither a constant nor a DequantizeLinear of a constant"
        return False
    q, s = g.const(dq.input[0]), g.const(dq.input[1])
    zp = g.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    if q is None or s is None or attr(dq, "block_size", 0) or q.dtype not in (np.int8, np.uint8):
        rec.skipped = "weight DequantizeLinear is not a per-tensor/per-channel int8 constant"
        return False
    if zp is not None and np.any(zp != 0):
        rec.skipped = "weight zero point is not 0"
        return False
    ax = attr(dq, "axis", 1) if s.ndim == 1 else None
    if ax is not None and ax % q.ndim != out_axis:
        rec.skipped = f"weight is quantized per channel along axis {ax}, not along the output channels"
        return False
    if q.dtype == np.uint8 and np.any(k < 0):
        rec.skipped = "unsigned weight quantization cannot absorb a negative BatchNorm scale"
        return False
    n_out = q.shape[out_axis]
    sign = np.where(k < 0, -1, 1)
    shape = [1] * q.ndim
    shape[out_axis] = n_out
    qi = q.astype(np.int32) * sign.reshape(shape)
    zero_k = (k == 0).reshape(shape)
    qi = np.where(zero_k, 0, qi)
    lo, hi = (-128, 127) if q.dtype == np.int8 else (0, 255)
    rec.clipped = int(np.sum((qi < lo) | (qi > hi)))
    qi = np.clip(qi, lo, hi).astype(q.dtype)
    s_vec = np.broadcast_to(s.astype(np.float64).reshape(-1) if s.ndim else s.astype(np.float64), (n_out,))
    ns = s_vec * np.abs(k)
    ns = np.where(k == 0, 1.0, ns).astype(np.float32)
    hint = rec.layer.replace(".", "/")
    new_q = g.add_const(f"{hint}/weight_quantized_folded", qi)
    new_s = g.add_const(f"{hint}/scale_folded", ns)
    new_zp = g.add_const(f"{hint}/zero_point", np.zeros((n_out,), dtype=q.dtype))
    dq.input[0], dq.input[1] = new_q, new_s
    while len(dq.input) < 3:
        dq.input.append("")
    dq.input[2] = new_zp
    set_attr(dq, "axis", out_axis)
    return True


