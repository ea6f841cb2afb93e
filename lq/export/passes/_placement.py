"""Q/DQ placement for onnxruntime: where quantizers go so its integer kernels fuse, every move exact."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from lq.export._ir import Graph, attr
from lq.rules import commutes, produces

# ops that commute with per-tensor fake quantization: f(fq(x)) == fq(f(x)) exactly


def _qparams(g: Graph, q):
    s = g.const(q.input[1])
    z = g.const(q.input[2]) if len(q.input) > 2 and q.input[2] else None
    dt = g.const_dtype(q.input[2]) if len(q.input) > 2 and q.input[2] else TensorProto.UINT8
    return s, z, dt


def same_q(g: Graph, a, b) -> bool:
    sa, za, ta = _qparams(g, a)
    sb, zb, tb = _qparams(g, b)
    if sa is None or sb is None or ta != tb:
        return False
    if attr(a, "axis", 1) != attr(b, "axis", 1) or sa.shape != sb.shape or not np.array_equal(sa, sb):
        return False
    if (za is None) != (zb is None):
        return False
    return za is None or (za.shape == zb.shape and np.array_equal(za.astype(np.int64), zb.astype(np.int64)))


def same_scaling(g: Graph, a, b) -> bool:
    """Two Muls of one tensor by equal constants (AWQ's ``1 / s`` of Linears reading one input)."""
    ca, cb = g.const(a.input[1]), g.const(b.input[1])
    return (ca is not None and cb is not None and ca.dtype == cb.dtype and ca.shape == cb.shape
            and np.array_equal(ca, cb))


def _dedupe(g: Graph, op_type: str, same) -> int:
    """Several ``op_type`` nodes with the same first input and ``same(g, a, b)`` -> the first one."""
    merged = 0
    cons = g.consumers()
    dropped: set[int] = set()
    for name, users in cons.items():
        qs = [u for u in users if u.op_type == op_type and u.input[0] == name]
        for i, a in enumerate(qs):
            if id(a) in dropped:
                continue
            for b in qs[i + 1:]:
                if id(b) not in dropped and same(g, a, b) and b.output[0] not in g.graph_outputs:
                    g.replace_uses(b.output[0], a.output[0], cons.get(b.output[0], ()))
                    dropped.add(id(b))
                    merged += 1
    g.nodes = [n for n in g.nodes if id(n) not in dropped]
    return merged


def dedupe_quantizers(g: Graph) -> int:
    """Several identical QuantizeLinear (same input, same params) -> one."""
    return _dedupe(g, "QuantizeLinear", same_q)


def dedupe_scalings(g: Graph) -> int:
    """Several Muls of one tensor by equal constants -> one (one per-channel Mul before Q/K/V's MatMulNBits)."""
    return _dedupe(g, "Mul", same_scaling)


def hoist_quantizers(g: Graph) -> int:
    """Quantize the output of a Conv/Gemm/Add where its only reader is a chain of ops that commute with
    fake quantization (ReLU, ReLU6/Clip, MaxPool, reshapes) ending in a QuantizeLinear.

    ``P -> f -> Q -> DQ`` becomes ``P -> Q -> DQ -> f -> Q -> DQ``: exact (the ``commutes`` column of
    :mod:`lq.rules`), and it gives onnxruntime ``DQ -> P -> Q`` (QLinearConv, QLinearAdd ...) and
    ``DQ -> f -> Q`` (f in int8; a ReLU/Clip there then runs on the integers: :func:`clips_on_integers`).
    """
    moved = 0
    for _ in range(64):  # sweeps: a chain of k commuting ops needs k of them, not one per site
        done = _hoist_sweep(g)
        moved += done
        if not done:
            break
    return moved


def _hoist_sweep(g: Graph) -> int:
    """One walk of :func:`hoist_quantizers` over the graph: every site whose tensors no earlier move of this walk
    touched (those wait for the next walk), the new nodes put in place once at the end (one linear walk, however
    many sites a model has)."""
    prod, cons = g.producers(), g.consumers()
    touched: set[str] = set()
    before: dict[int, list] = {}  # id(node) -> nodes to insert before it
    moved = 0
    for f in g.nodes:
        if not commutes(f.op_type, f) or f.domain not in ("", "ai.onnx"):
            continue
        t = f.output[0]
        u_in = f.input[0]
        if t in touched or u_in in touched:
            continue
        shape_of_t, users = _shape_readers_apart(cons.get(t, []))
        if not users or t in g.graph_outputs or any(u.op_type != "QuantizeLinear" for u in users):
            continue
        q = users[0]
        if any(not same_q(g, q, u) for u in users[1:]):
            continue
        s, z, dt = _qparams(g, q)
        if s is None or s.ndim != 0:
            continue
        p = prod.get(u_in)
        shape_of_in, others = _shape_readers_apart(c for c in cons.get(u_in, []) if c is not f)
        if others and p is not None and all(c.op_type == "QuantizeLinear" and same_q(g, q, c) for c in others):
            if others[0].output[0] in touched:
                continue
            # the input is quantized on the same grid already (a U-Net skip tensor: max-pooled into the next
            # conv and quantized for the concat): f reads that quantized value, the input keeps one reader
            dq_out = g.fresh(f"{others[0].name}_shared_dq")
            dq = g.make_node("DequantizeLinear", [others[0].output[0], q.input[1], q.input[2]], [dq_out],
                             hint=f"{others[0].name}_shared_dq", like=q)
            f.input[0] = dq_out
            before.setdefault(id(f), []).append(dq)
            for c in shape_of_t:
                c.input[0] = q.output[0]
            touched |= {t, u_in, q.output[0], others[0].output[0]}
            moved += 1
            continue
        if p is None or u_in in g.graph_outputs or others:
            continue
        if not (produces(p.op_type) or commutes(p.op_type, p)):
            continue
        if p.op_type == "DequantizeLinear":
            continue
        # insert Q/DQ between p and f
        q_out = g.fresh(f"{q.name}_hoisted_q")
        dq_out = g.fresh(f"{q.name}_hoisted_dq")
        new_q = g.make_node("QuantizeLinear", [u_in, q.input[1], q.input[2]], [q_out], hint=f"{q.name}_hoisted",
                            like=q)
        new_dq = g.make_node("DequantizeLinear", [q_out, q.input[1], q.input[2]], [dq_out],
                             hint=f"{q.name}_hoisted_dq", like=q)
        f.input[0] = dq_out
        for c in shape_of_in:
            c.input[0] = q_out
        for c in shape_of_t:
            c.input[0] = q.output[0]
        before.setdefault(id(f), []).extend([new_q, new_dq])
        touched |= {t, u_in, q.output[0]}
        moved += 1
    if before:
        g.nodes[:] = [m for n in g.nodes for m in (*before.get(id(n), ()), n)]
    return moved


def shapes_from_quantized(g: Graph) -> int:
    """A Shape that reads a tensor whose other readers are QuantizeLinear of one grid reads the quantized copy
    instead (same shape): onnxruntime fuses ``DQ -> Conv -> Q`` only when the Q alone reads the conv's output, and
    the legacy exporter writes ``if y.shape == x.shape`` or ``x.view(x.size(0), -1)`` as a Shape on it."""
    done = 0
    cons = g.consumers()
    for t, readers in cons.items():
        shapes, others = _shape_readers_apart(readers)
        if not shapes or not others or t in g.graph_outputs:
            continue
        if any(o.op_type != "QuantizeLinear" or not same_q(g, others[0], o) for o in others):
            continue
        for c in shapes:
            c.input[0] = others[0].output[0]
            done += 1
    return done


def _shape_readers_apart(readers) -> tuple[list, list]:
    """(the Shape nodes among ``readers``, the others). A Shape reads only the shape, which a quantizer keeps,
    so it may read the quantized copy instead (F.interpolate(x, size=...) and x.view(x.size(0), -1) read x's
    shape) and does not stop a quantizer from moving up."""
    readers = list(readers)
    return [r for r in readers if r.op_type == "Shape"], [r for r in readers if r.op_type != "Shape"]


def clips_on_integers(g: Graph) -> None:
    """``DQ(q) -> ReLU/Clip -> Q`` on one grid -> the clip on the integers: ``Max(q, code(lo))``,
    ``Min(q, code(hi))``, ``Clip(q, code(lo), code(hi))``, or ``q`` itself where a bound lies outside the grid.

    ``code(b)`` is the quantizer's own rounding of the bound (``Q(b)``, saturated). A rounding that keeps
    order distributes over min and max, so ``Q(clip(DQ(q), lo, hi)) == clamp(q, Q(lo), Q(hi))`` for any
    constant bounds: a ReLU is ``Max(q, zero_point)``, a ReLU6 on a grid that ends below 6 only that, and a
    ReLU on an unsigned grid (zero point 0) nothing. onnxruntime then runs one 1-byte elementwise op, or none,
    between two fused INT8 kernels instead of dequantize, float clip and quantize. A bound that falls within
    a thousandth of a step of a rounding tie is left alone (the float op stays), since the runtime's own
    division may round it either way.
    """
    prod, cons = g.producers(), g.consumers()
    drop: set[int] = set()
    for r in list(g.nodes):
        bounds = _clip_bounds(g, r)
        if bounds is None:
            continue
        dq = prod.get(r.input[0])
        users = cons.get(r.output[0], [])
        if dq is None or dq.op_type != "DequantizeLinear" or not users or r.output[0] in g.graph_outputs:
            continue
        if len(cons.get(dq.output[0], [])) != 1 or any(u.op_type != "QuantizeLinear" for u in users):
            continue
        if any(o in g.graph_outputs for u in users for o in u.output) or not all(same_q(g, dq, q) for q in users):
            continue
        s, z, t = _qparams(g, dq)
        if s is None or z is None or s.ndim != 0 or t not in _CODE_TYPES:
            continue
        codes = [_code(b, float(s), int(z), t) for b in bounds]
        if None in codes:
            continue
        (lo, hi), dtype = codes, _CODE_TYPES[t]
        info = np.iinfo(dtype)
        kept = dq.input[0]
        low = [g.add_const(f"{r.name}_lo", np.array(lo, dtype))] if lo > info.min else []
        high = [g.add_const(f"{r.name}_hi", np.array(hi, dtype))] if hi < info.max else []
        if low or high:
            op = "Clip" if low and high else "Max" if low else "Min"
            node = g.make_node(op, [kept] + low + high, hint=f"{r.name}_int", like=r)
            g.nodes.insert(g.nodes.index(r), node)
            kept = node.output[0]
        for q in users:
            g.replace_uses(q.output[0], kept, cons.get(q.output[0], ()))
            drop.add(id(q))
        drop.update((id(dq), id(r)))
    g.nodes = [n for n in g.nodes if id(n) not in drop]


_CODE_TYPES = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8}


def _clip_bounds(g: Graph, n) -> tuple[float, float] | None:
    """(lo, hi) of a Relu, or of a Clip whose bounds are absent or scalar constants; None for anything else."""
    if n.op_type == "Relu":
        return 0.0, np.inf
    if n.op_type != "Clip" or n.domain not in ("", "ai.onnx"):
        return None
    out = []
    for k, default in ((1, -np.inf), (2, np.inf)):
        if len(n.input) <= k or not n.input[k]:
            out.append(default)
            continue
        v = g.const(n.input[k])
        if v is None or v.size != 1:
            return None
        out.append(float(v.reshape(())))
    return out[0], out[1]


def _code(bound: float, scale: float, zero_point: int, t) -> int | None:
    """The quantizer's code for ``bound`` (round half to even of ``bound / scale`` in float32, plus the zero
    point, saturated); None when ``bound / scale`` is within a thousandth of a tie."""
    info = np.iinfo(_CODE_TYPES[t])
    qmin, qmax = int(info.min), int(info.max)
    if np.isinf(bound):
        return qmax if bound > 0 else qmin
    v = float(np.float32(bound) / np.float32(scale))
    if abs(abs(v - np.floor(v)) - 0.5) < 1e-3:
        return None
    return int(min(max(np.rint(v) + zero_point, qmin), qmax))


# =========================================================================== onnxruntime-friendly details
def quantize_bias(g: Graph) -> int:
    """Float bias of a Conv/Gemm whose input and weight come from DequantizeLinear -> int32 bias + DQ.

    ``bias_q = round(bias / (s_input * s_weight))`` with scale ``s_input * s_weight`` (per output channel):
    what onnxruntime's QLinearConv/QGemm take. The rounding error is at most half of ``s_input * s_weight``,
    far below one output quantization step, yet it is not PyTorch's float bias: it is only paid where it
    buys an integer kernel. A Conv fuses into QLinearConv only when quantizers read its output, so a Conv
    whose output goes on in float (PReLU, GELU, a model output ...) keeps its exact float bias; a Gemm
    fuses into QGemm with a float output too, so it always gets the int32 bias.
    """
    prod, cons = g.producers(), g.consumers()
    done = 0
    for n in list(g.nodes):
        if n.op_type not in ("Conv", "Gemm") or len(n.input) < 3 or not n.input[2]:
            continue
        if n.op_type == "Conv" and (n.output[0] in g.graph_outputs or not cons.get(n.output[0])
                                    or any(u.op_type != "QuantizeLinear" for u in cons[n.output[0]])):
            continue
        b = g.const(n.input[2])
        if b is None or b.dtype != np.float32 or b.ndim != 1:
            continue
        dq_a, dq_w = prod.get(n.input[0]), prod.get(n.input[1])
        if dq_a is None or dq_w is None or dq_a.op_type != "DequantizeLinear" or dq_w.op_type != "DequantizeLinear":
            continue
        if attr(dq_w, "block_size", 0):
            continue
        sa, sw = g.const(dq_a.input[1]), g.const(dq_w.input[1])
        wq = g.const(dq_w.input[0])
        if sa is None or sw is None or wq is None or sa.ndim != 0 or wq.dtype not in (np.int8, np.uint8):
            continue
        if n.op_type == "Conv":
            out_axis = 0
        else:
            if float(attr(n, "alpha", 1.0)) != 1.0 or float(attr(n, "beta", 1.0)) != 1.0:
                continue
            out_axis = 0 if attr(n, "transB", 0) else 1
        if sw.ndim == 1 and attr(dq_w, "axis", 1) % wq.ndim != out_axis:
            continue
        nb = b.shape[0]
        s = (sa.astype(np.float64) * np.broadcast_to(sw.astype(np.float64), (nb,))).astype(np.float32)
        if np.any(s <= 0):
            continue
        q = np.round(b.astype(np.float64) / s.astype(np.float64))
        if np.any(np.abs(q) > 2**31 - 1):
            continue
        qn = g.add_const(n.input[2] + "_int32", q.astype(np.int32))
        sn = g.add_const(n.input[2] + "_scale", s)
        zn = g.add_const(n.input[2] + "_zero_point", np.zeros((nb,), dtype=np.int32))
        out = g.fresh(n.input[2] + "_dq")
        g.nodes.insert(g.nodes.index(n), g.make_node("DequantizeLinear", [qn, sn, zn], [out], hint="bias_dq", like=n,
                                                     axis=0))
        n.input[2] = out
        done += 1
    return done


def spatial_mean(g: Graph, mean, rank: int) -> bool:
    """``mean`` averages a rank-``rank`` tensor over all its spatial axes (2 .. rank-1): a GlobalAveragePool, or a
    ReduceMean with exactly those axes (an attribute, or a constant input from opset 18 on)."""
    if mean.op_type == "GlobalAveragePool":
        return True
    if mean.op_type != "ReduceMean":
        return False
    axes = attr(mean, "axes")
    if axes is None and len(mean.input) > 1 and mean.input[1]:
        a = g.const(mean.input[1])
        axes = None if a is None else a.tolist()
    return axes is not None and sorted(a % rank for a in axes) == list(range(2, rank))


def global_pools(g: Graph, ranks: dict[str, int]) -> int:
    """``ReduceMean`` over all spatial axes -> ``GlobalAveragePool`` (quantized pooling in ORT); without keepdims
    (``x.mean((2, 3))``, a classifier head written as a mean) followed by ``Flatten``, as
    ``nn.AdaptiveAvgPool2d(1)`` + ``nn.Flatten()`` exports: the same numbers, and the same kernels whichever way the
    head is written."""
    done = 0
    for n in list(g.nodes):
        if n.op_type != "ReduceMean":
            continue
        r = ranks.get(n.input[0], -1)
        if r < 3 or not spatial_mean(g, n, r):
            continue
        k = g.nodes.index(n)
        if attr(n, "keepdims", 1):
            g.nodes[k] = g.make_node("GlobalAveragePool", [n.input[0]], list(n.output), hint="GlobalAveragePool",
                                     like=n)
        else:
            pooled = g.fresh(f"{n.output[0]}_pooled")
            users = g.consumers().get(n.output[0], [])
            g.nodes[k] = g.make_node("GlobalAveragePool", [n.input[0]], [pooled], hint="GlobalAveragePool", like=n)
            q = users[0] if len(users) == 1 and n.output[0] not in g.graph_outputs else None
            if q is not None and q.op_type == "QuantizeLinear":  # quantize the pooled map, flatten the integers
                q.input[0] = pooled
                flat_in, q.output[0] = q.output[0], g.fresh(f"{q.output[0]}_pooled")
                g.nodes.insert(g.nodes.index(q) + 1, g.make_node("Flatten", [q.output[0]], [flat_in], like=n, axis=1))
            else:
                g.nodes.insert(k + 1, g.make_node("Flatten", [pooled], list(n.output), like=n, axis=1))
        done += 1
    return done


def split_shared_producers(g: Graph, max_copies: int = 4) -> int:
    """Give each distinct quantizer of a tensor its own copy of the (cheap) producer chain.

    A tensor read by several quantizers with different scales (e.g. a ReLU output that feeds the next
    conv's input quantizer and a residual add's quantizer) cannot be the output of one fused INT8 kernel.
    ``P -> [ReLU, MaxPool ...] -> {Q_a, Q_b}`` becomes ``P -> ... -> Q_a`` and ``P' -> ... -> Q_b`` with
    ``P'`` a copy of ``P`` (same inputs and weights): exact, and each copy fuses into QLinearConv/QLinearAdd.
    """
    done = 0
    prod, cons = g.producers(), g.consumers()
    for f in list(g.nodes):
        if not commutes(f.op_type, f) or f.domain not in ("", "ai.onnx"):
            continue
        t = f.output[0]
        users = cons.get(t, [])
        if len(users) < 2 or t in g.graph_outputs or any(u.op_type != "QuantizeLinear" for u in users):
            continue
        groups: list[list] = []
        for u in users:
            for grp in groups:
                if same_q(g, grp[0], u):
                    grp.append(u)
                    break
            else:
                groups.append([u])
        if len(groups) < 2 or len(groups) > max_copies:
            continue
        # the chain back to a compute node, every link with a single reader
        chain = [f]
        cur = f
        while True:
            p = prod.get(cur.input[0])
            if p is None or cur.input[0] in g.graph_outputs or len(cons.get(cur.input[0], [])) != 1:
                chain = []
                break
            chain.insert(0, p)
            if produces(p.op_type):
                break
            if not commutes(p.op_type, p):
                chain = []
                break
            cur = p
        if not chain or chain[0].op_type == "Concat":
            continue
        for grp in groups[1:]:
            prev_out = None
            clones = []
            for node in chain:
                c = onnx.NodeProto()
                c.CopyFrom(node)
                c.name = g.fresh(node.name + "_copy")
                if prev_out is not None:
                    c.input[0] = prev_out
                c.output[0] = g.fresh(node.output[0] + "_copy")
                for k in range(1, len(c.output)):
                    c.output[k] = ""
                prev_out = c.output[0]
                clones.append(c)
            for q in grp:
                q.input[0] = prev_out
            # the copy gets its own DequantizeLinear inputs (onnxruntime fuses a DQ into one node only)
            dqs = []
            head = clones[0]
            for k, i in enumerate(head.input):
                p = prod.get(i)
                if p is not None and p.op_type == "DequantizeLinear":
                    d = onnx.NodeProto()
                    d.CopyFrom(p)
                    d.name = g.fresh(p.name + "_copy")
                    d.output[0] = g.fresh(p.output[0] + "_copy")
                    head.input[k] = d.output[0]
                    dqs.append(d)
            idx = g.nodes.index(chain[-1]) + 1
            g.nodes[idx:idx] = dqs + clones
            done += 1
        prod, cons = g.producers(), g.consumers()
    return done


