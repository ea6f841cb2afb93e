"""Block-quantized Linear weights -> onnxruntime's ``com.microsoft.MatMulNBits`` (4- or 8-bit weights).

onnxruntime runs a blocked ``DequantizeLinear -> (Transpose) -> MatMul`` as written: it dequantizes the whole
weight on every run, then calls its float GEMM (slower than the FP32 file). Its own block-quantized kernel is the
contrib op ``MatMulNBits``: ``Y = A @ dequant(B)^T + bias`` with

* ``B``: uint8 ``[N, K / block, block * bits / 8]``, the codes of row ``n`` (an output feature) in blocks along
  ``K`` (the input features), two 4-bit codes per byte, the first in the low nibble;
* ``scales``: float ``[N, K / block]``; ``zero_points``: optional, packed the same way, default ``2^(bits-1)``;
* dequantization ``(code - zero_point) * scale``; ``block`` a power of two >= 16; ``bits`` 4 or 8.

lq's blocked weight ``(q - z) * s`` on the signed grid (``q`` in [-7, 7], or [-8, 7] without narrow range) is the
same number as ``((q + 8) - (z + 8)) * s``: code ``q + 8``, zero point ``z + 8`` (8 for lq's symmetric
quantizers, so no zero-point input at all); likewise ``+ 128`` for 8 bits. Integers that fit 4 bits are written
as 4-bit codes whatever width the quantizer had (exact either way, half the bytes). ``accuracy_level`` is left
at onnxruntime's default (its float kernel on the dequantized blocks: the same sums as PyTorch's fake-quant
Linear; level 4 would quantize the activations too).

The rewrite needs the block axis to be the contracted one (``K``): a weight blocked along its output features
cannot be written this way and keeps its blocked DequantizeLinear (:func:`write_matmul_nbits` says which and why).
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from lq.export._ir import MS_DOMAIN, Graph, attr, layer_name

OP = "MatMulNBits"
#: block sizes onnxruntime's MatMulNBits takes (powers of two from 16)
MIN_BLOCK = 16


def write_matmul_nbits(g: Graph) -> list[str]:
    """Rewrite every ``DQ(blocked const) [-> Transpose] -> MatMul/Gemm [-> Add(bias)]`` as one MatMulNBits.

    Returns one note per blocked weight left as a DequantizeLinear (with the reason)."""
    notes: list[str] = []
    cons = g.consumers()
    drop: set[int] = set()
    new_nodes: dict[int, object] = {}  # id(matmul) -> its MatMulNBits
    for dq in [n for n in g.nodes if n.op_type == "DequantizeLinear" and attr(n, "block_size", 0)]:
        q = g.const(dq.input[0])
        scale = g.const(dq.input[1])
        if q is None or scale is None or q.ndim != 2:
            continue
        zp = g.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        block, axis = int(attr(dq, "block_size")), int(attr(dq, "axis", 1)) % 2
        readers = cons.get(dq.output[0], [])
        if dq.output[0] in g.graph_outputs:
            continue
        done = []
        for r in readers:
            found = _matmul_of(g, r, dq.output[0], cons)
            if found is None:
                continue
            mm, transposed_by, k_axis = found  # k_axis: the axis of q that the product contracts
            why = _unsupported(block, axis, k_axis)
            if why:
                notes.append(f"{layer_name(dq) or dq.name}: kept as a blocked DequantizeLinear ({why})")
                continue
            w = (q if k_axis == 1 else q.T).astype(np.int64)
            s = (scale if k_axis == 1 else scale.T).astype(np.float32)
            z = None if zp is None else (zp if k_axis == 1 else zp.T).astype(np.int64)
            bias, add = _bias(g, mm, cons, w.shape[0])
            node = _node(g, mm, w, s, z, _signed(q), block, bias)
            new_nodes[id(mm)] = node
            node.output[0] = (add or mm).output[0]
            drop.add(id(mm))
            if add is not None:
                drop.add(id(add))
            if transposed_by is not None:
                done.append(transposed_by)
            done.append(r)
        if done and all(r in done for r in readers):
            drop.add(id(dq))
            drop.update(id(t) for t in done if t.op_type == "Transpose")
    if new_nodes:
        g.nodes = [new_nodes.get(id(n), n) for n in g.nodes if id(n) not in drop or id(n) in new_nodes]
        g.use_ms_domain()
    return notes


def _unsupported(block: int, axis: int, k_axis: int) -> str:
    if axis != k_axis:
        return ("its blocks run along the output features; MatMulNBits takes blocks along the input features "
                "(block_axis=-1 of a Linear weight)")
    if block < MIN_BLOCK or block & (block - 1):
        return f"block_size {block}; MatMulNBits takes powers of two >= {MIN_BLOCK}"
    return ""


def _signed(q: np.ndarray) -> bool:
    return np.issubdtype(q.dtype, np.signedinteger) or str(q.dtype) == "int4"


def _matmul_of(g: Graph, reader, value: str, cons):
    """``(matmul, transpose or None, contracted axis of the weight)`` when ``value`` (the dequantized 2-D
    weight) is the right-hand side of a MatMul or Gemm, directly or through a 2-D Transpose read by it alone."""
    transpose = None
    if reader.op_type == "Transpose" and list(attr(reader, "perm", [1, 0])) == [1, 0]:
        users = cons.get(reader.output[0], [])
        if len(users) != 1 or reader.output[0] in g.graph_outputs:
            return None
        transpose, value, reader = reader, reader.output[0], users[0]
    flip = transpose is not None
    if reader.op_type == "MatMul" and reader.input[1] == value and reader.input[0] != value:
        return reader, transpose, 1 if flip else 0
    if (reader.op_type == "Gemm" and reader.input[1] == value and reader.input[0] != value
            and not attr(reader, "transA", 0) and attr(reader, "alpha", 1.0) == 1.0
            and attr(reader, "beta", 1.0) == 1.0):
        trans_b = bool(attr(reader, "transB", 0))
        return reader, transpose, 1 if trans_b != flip else 0
    return None


def _bias(g: Graph, mm, cons, n_out: int):
    """``(bias [N] float32 or None, the Add it came from or None)``: a Gemm's C, or a constant ``Add`` over the
    last axis that alone reads the MatMul's output."""
    if mm.op_type == "Gemm":
        c = g.const(mm.input[2]) if len(mm.input) > 2 and mm.input[2] else None
        if c is None:
            return None, None
        return np.broadcast_to(c.astype(np.float32), (n_out,)).copy() if c.size in (1, n_out) else None, None
    users = cons.get(mm.output[0], [])
    if len(users) != 1 or users[0].op_type != "Add" or mm.output[0] in g.graph_outputs:
        return None, None
    add = users[0]
    other = add.input[1] if add.input[0] == mm.output[0] else add.input[0]
    b = g.const(other)
    if b is None or b.size != n_out or (b.ndim and b.shape[-1] != n_out) or b.ndim > 1:
        return None, None
    return b.astype(np.float32).reshape(n_out), add


def _node(g: Graph, mm, w: np.ndarray, s: np.ndarray, z, signed: bool, block: int, bias):
    """The MatMulNBits node for weight integers ``w`` [N, K] (blocks along K) with scales ``s`` [N, K / block]."""
    n, k = w.shape
    kb = k // block
    offset4, offset8 = (8, 128) if signed else (0, 0)
    zz = np.zeros_like(s, dtype=np.int64) if z is None else np.broadcast_to(z, s.shape).astype(np.int64)
    fits4 = (w + offset4).min(initial=0) >= 0 and (w + offset4).max(initial=0) <= 15 \
        and (zz + offset4).min() >= 0 and (zz + offset4).max() <= 15
    bits, offset = (4, offset4) if fits4 else (8, offset8)
    codes = (w + offset).astype(np.uint8).reshape(n, kb, block)
    zps = (zz + offset).astype(np.uint8)
    stem = mm.name or "linear"
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    inputs = [mm.input[0], g.add_const(f"{stem}/weight_nbits", np.ascontiguousarray(codes)),
              g.add_const(f"{stem}/scales", np.ascontiguousarray(s.astype(np.float32)))]
    default = 1 << (bits - 1)
    if np.all(zps == default):
        inputs.append("")
    else:
        if bits == 4:
            pad = np.concatenate([zps, np.zeros((n, kb % 2), np.uint8)], axis=1)
            zps = pad[:, 0::2] | (pad[:, 1::2] << 4)
        inputs.append(g.add_const(f"{stem}/zero_points", np.ascontiguousarray(zps)))
    if bias is not None:
        inputs += ["", g.add_const(f"{stem}/bias", bias)]
    while inputs and inputs[-1] == "":
        inputs.pop()
    node = helper.make_node(OP, inputs, [g.fresh(f"{stem}/out")], name=mm.name or g.fresh(stem), domain=MS_DOMAIN,
                            K=int(k), N=int(n), bits=bits, block_size=int(block))
    for p in mm.metadata_props:
        node.metadata_props.add(key=p.key, value=p.value)
    return node
