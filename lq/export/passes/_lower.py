"""Lowering: lq's placeholder ops -> QuantizeLinear/DequantizeLinear with constant scales.

* integer fake quantization with amax ``a`` and ``maxbound = 2^(b-1+unsigned) - 1``
  becomes ``QuantizeLinear -> DequantizeLinear`` with scale ``a / maxbound``
  (float32), zero point 0 (int8, or uint8 when unsigned); a per-channel amax
  gives a 1-D scale and ``axis`` (opset >= 13);
* constant inputs (weights) are quantized here, with lq's own rounding, and
  stored as int8 initializers read by a DequantizeLinear (``weight_format="int8"``),
  or kept as float fake-quantized weights behind Q -> DQ (``"qdq"``);
* FP8 E4M3 becomes Q/DQ with a ``float8e4m3fn`` zero point (opset >= 19);
  block quantization (static or dynamic) of a weight becomes a blocked
  DequantizeLinear (``block_size``, opset >= 21); dynamic block quantization of
  an activation has data-dependent scales and is refused with the layer's name;
* for onnxruntime, signed activations are stored as uint8 with zero point 128
  (the same grid as int8 with zero point 0: onnxruntime's x86 INT8 kernels take
  uint8 activations), and narrow range gets an integer ``Max`` after the Q.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from onnx import TensorProto, helper

from lq import _reference
from lq.export._ir import ExportError, Graph, QuantNodeInfo, attr, layer_name
from lq.export.trace._loop_ops import DYNAMIC_LSTM
from lq.export.trace._symbolic import DOMAIN

AMAX_EPSILON = _reference.AMAX_EPSILON

@dataclasses.dataclass
class LowerOptions:
    opset: int
    weight_format: str = "int8"  # "int8" | "qdq"
    activation_dtype: str = "int8"  # representation of signed activations: "int8" (zp 0) | "uint8" (zp 128)
    narrow_clamp: bool = True  # exact narrow range for activations (an integer Max after QuantizeLinear)


def _int_type(num_bits: int, unsigned: bool, opset: int, *, storage: bool):
    """ONNX element type of a quantized tensor: 8-bit types where the range fits, else 4/16 bit (opset 21)."""
    if num_bits <= 8 and (storage or num_bits == 8):
        # weights of any width <= 8 are stored in 8 bits (onnxruntime's INT8 kernels take 8-bit weights)
        return TensorProto.UINT8 if unsigned else TensorProto.INT8
    if num_bits == 4 and opset >= 21:
        return TensorProto.UINT4 if unsigned else TensorProto.INT4
    if num_bits == 16 and opset >= 21:
        return TensorProto.UINT16 if unsigned else TensorProto.INT16
    return None


_NP = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8, TensorProto.INT16: np.int16,
       TensorProto.UINT16: np.uint16, TensorProto.INT4: np.int8, TensorProto.UINT4: np.uint8}
TYPE_NAMES = {TensorProto.INT8: "int8", TensorProto.UINT8: "uint8", TensorProto.INT16: "int16",
              TensorProto.UINT16: "uint16", TensorProto.INT4: "int4", TensorProto.UINT4: "uint4",
              TensorProto.FLOAT8E4M3FN: "float8e4m3fn"}


def _zero_point(g: Graph, elem_type: int, shape=(), value: int = 0) -> str:
    if elem_type in (TensorProto.INT4, TensorProto.UINT4, TensorProto.FLOAT8E4M3FN):
        t = helper.make_tensor("zp", elem_type, list(shape), [value] * int(np.prod(shape) if shape else 1))
        return g.add_const("zero_point", None, proto=t)
    return g.add_const("zero_point", np.full(shape, value, dtype=_NP[elem_type]))


def _scale_from_amax(amax: np.ndarray, maxbound: float) -> np.ndarray:
    a = amax.astype(np.float64)
    s = a / maxbound
    tiny = AMAX_EPSILON / maxbound
    return np.where(a <= AMAX_EPSILON, tiny, s).astype(np.float32)


def _quant_axis(amax_shape, x_rank: int, layer: str, opset: int):
    """(axis, per_channel) of an amax that broadcasts against an input of rank ``x_rank``."""
    if int(np.prod(amax_shape)) == 1:
        return None
    big = [i for i, s in enumerate(amax_shape) if s != 1]
    if len(big) != 1:
        raise ExportError(
            f"quantizer '{layer}' has an amax of shape {tuple(amax_shape)} with more than one per-channel axis; "
            "ONNX QuantizeLinear allows per-tensor or ONE axis (use axis=int in the QuantDescriptor)")
    if x_rank < 0:
        x_rank = len(amax_shape)
    axis = x_rank - len(amax_shape) + big[0]
    if opset < 13:
        raise ExportError(f"quantizer '{layer}' is per-channel (axis {axis}); per-channel QuantizeLinear needs "
                          f"opset >= 13, got opset {opset}")
    return axis


def lower_placeholders(g: Graph, opts: LowerOptions, infos: list[QuantNodeInfo]) -> None:
    """Replace every ``lq.export`` placeholder with Q/DQ; constant inputs become quantized initializers."""
    out_nodes = []
    errors: list[str] = []
    for n in g.nodes:
        if n.domain != DOMAIN or n.op_type == DYNAMIC_LSTM:  # that one is written once its weights are integer
            out_nodes.append(n)
            continue
        layer = layer_name(n)
        try:
            out_nodes.extend(_lower_one(g, n, layer, opts, infos))
        except ExportError as e:
            errors.append(str(e))
    if errors:
        raise ExportError("cannot export the quantizers:\n  - " + "\n  - ".join(dict.fromkeys(errors)))
    g.nodes = out_nodes


def _lower_one(g: Graph, n, layer: str, opts: LowerOptions, infos) -> list:
    op = n.op_type
    x = n.input[0]
    x_rank = int(attr(n, "x_rank", -1))
    xc = g.const(x)
    if xc is not None:
        x_rank = xc.ndim
    if op == "Quant":
        raise ExportError(f"quantizer '{layer}' returns integers (fake_quant=False); only fake quantization "
                          "exports to Q/DQ: set fake_quant=True")
    if op == "FakeQuant":
        return _lower_int(g, n, layer, opts, infos, x_rank, xc)
    if op == "ScaledE4M3":
        return _lower_fp8(g, n, layer, opts, infos, x_rank, xc)
    if op == "DynamicBlockQuant":
        return _lower_block(g, n, layer, opts, infos, xc)
    if op == "FakeAffineQuant":
        return _lower_affine(g, n, layer, opts, infos, x_rank)
    raise ExportError(f"unknown lq placeholder {op} at '{layer}'")


def _qdq_nodes(g, n, x, out, scale_name, zp_name, axis, hint):
    kw = {} if axis is None else {"axis": int(axis)}
    qout = g.fresh(f"{hint}_q")
    q = g.make_node("QuantizeLinear", [x, scale_name, zp_name], [qout], hint=f"{hint}/QuantizeLinear", like=n, **kw)
    dq = g.make_node("DequantizeLinear", [qout, scale_name, zp_name], [out], hint=f"{hint}/DequantizeLinear",
                     like=n, **kw)
    return [q, dq]


def _lower_int(g: Graph, n, layer, opts, infos, x_rank, xc):
    x, out = n.input[0], n.output[0]
    num_bits = int(attr(n, "num_bits", 8))
    unsigned = bool(attr(n, "unsigned", 0))
    narrow = bool(attr(n, "narrow_range", 0))
    maxbound = float(2 ** (num_bits - 1 + int(unsigned)) - 1)
    amax = g.const(n.input[1])
    hint = layer.replace(".", "/")
    if amax is None:
        # dynamic amax (computed in the graph): per-tensor Q/DQ with a computed scale
        if xc is not None:
            raise ExportError(f"quantizer '{layer}' has a computed amax on a constant input")
        et = _int_type(num_bits, unsigned, opts.opset, storage=False)
        if et is None:
            raise ExportError(_bits_msg(layer, num_bits, opts.opset))
        mb = g.add_const("maxbound", np.array(maxbound, dtype=np.float32))
        tiny = g.add_const("tiny", np.array(AMAX_EPSILON / maxbound, dtype=np.float32))
        div = g.make_node("Div", [n.input[1], mb], hint=f"{hint}/scale", like=n)
        mx = g.make_node("Max", [div.output[0], tiny], hint=f"{hint}/scale", like=n)
        red = mx
        if True:
            shape0 = g.add_const("scalar_shape", np.zeros((0,), dtype=np.int64))
            red = g.make_node("Reshape", [mx.output[0], shape0], hint=f"{hint}/scale", like=n)
        zp = _zero_point(g, et)
        infos.append(QuantNodeInfo(layer, "activation", TYPE_NAMES[et], None, None))
        return [div, mx, red] + _qdq_nodes(g, n, x, out, red.output[0], zp, None, hint)
    amax = amax.astype(np.float32)
    if not np.all(np.isfinite(amax)) or np.any(amax < 0):
        raise ExportError(f"quantizer '{layer}' has a negative or non-finite amax ({amax.ravel()[:4]}...)")
    if xc is not None and _static_block(amax.shape, xc.shape, _one_block_row(g, n, amax.shape, xc.shape)) is not None:
        return _lower_static_block(g, n, layer, opts, infos, xc, amax, num_bits, unsigned, narrow, maxbound, hint)
    if xc is not None and not np.all(np.isfinite(xc)):
        raise ExportError(f"the tensor quantized by '{layer}' holds NaN/Inf ({int(np.sum(~np.isfinite(xc)))} of "
                          f"{xc.size} values): the trained weights are not finite")
    if xc is not None:  # weight: quantize here with lq's rounding
        axis = _quant_axis(amax.shape, xc.ndim, layer, opts.opset)
        if num_bits > 8:
            raise ExportError(_bits_msg(layer, num_bits, opts.opset, weight=True))
        et = _int_type(num_bits, unsigned, opts.opset, storage=True)
        q, _ = _reference.quant(torch.from_numpy(np.array(xc, dtype=np.float32)), torch.from_numpy(amax),
                                num_bits, unsigned, narrow)
        q = q.numpy()
        scale = _scale_from_amax(amax, maxbound)
        scale = np.where(amax <= AMAX_EPSILON, np.float32(1.0), scale).astype(np.float32)
        if axis is not None:
            scale = scale.reshape(-1)
        else:
            scale = scale.reshape(())
        qname = g.add_const(f"{hint}/weight_quantized", q.astype(_NP[et]))
        sname = g.add_const(f"{hint}/scale", scale)
        zp = _zero_point(g, et, scale.shape)
        kw = {} if axis is None else {"axis": int(axis)}
        dq = g.make_node("DequantizeLinear", [qname, sname, zp], [out], hint=f"{hint}/DequantizeLinear", like=n, **kw)
        infos.append(QuantNodeInfo(layer, "weight", TYPE_NAMES[et], axis, scale))
        return [dq]
    axis = _quant_axis(amax.shape, x_rank, layer, opts.opset)
    et = _int_type(num_bits, unsigned, opts.opset, storage=False)
    if et is None:
        raise ExportError(_bits_msg(layer, num_bits, opts.opset))
    scale = _scale_from_amax(amax, maxbound)
    scale = scale.reshape(-1) if axis is not None else scale.reshape(())
    zp_value = 0
    if et == TensorProto.INT8 and opts.activation_dtype == "uint8":
        et, zp_value = TensorProto.UINT8, 128
    sname = g.add_const(f"{hint}/scale", scale)
    zp = _zero_point(g, et, scale.shape, zp_value)
    infos.append(QuantNodeInfo(layer, "activation", TYPE_NAMES[et], axis, scale))
    nodes = _qdq_nodes(g, n, x, out, sname, zp, axis, hint)
    if narrow and not unsigned and opts.narrow_clamp and num_bits == 8:
        # QuantizeLinear saturates at -128; narrow range stops at -127: one integer Max keeps it exact
        q, dq = nodes
        lo = g.add_const(f"{hint}/narrow_min", np.array(zp_value - int(maxbound), dtype=_NP[et]))
        mx = g.make_node("Max", [q.output[0], lo], hint=f"{hint}/narrow_range", like=n)
        dq.input[0] = mx.output[0]
        nodes = [q, mx, dq]
    return nodes


def _static_block(amax_shape, x_shape, one_block: bool = False):
    """(axis, block) when ``amax`` is a calibrated per-block amax of ``x`` (lq's blocked view: every dim equal
    except one of size 1 where ``x`` has the block), else None. ``one_block``: the view has one block per row
    (block_size == the row), which only the Reshape back tells from a per-channel amax."""
    if len(amax_shape) != len(x_shape) or int(np.prod(amax_shape)) == 1:
        return None
    diff = [i for i, (a, b) in enumerate(zip(amax_shape, x_shape)) if a != b]
    big = [i for i, a in enumerate(amax_shape) if a != 1]
    if len(diff) != 1 or amax_shape[diff[0]] != 1 or (len(big) < 2 and not one_block):
        return None
    return diff[0], int(x_shape[diff[0]])


def _one_block_row(g: Graph, n, amax_shape, x_shape) -> bool:
    """``x`` is lq's blocked view ``(..., 1, B, ...)`` of a weight with one block per row: the amax is 1 on the
    view's block axis and the axis before it, and the only reader reshapes the two back into one."""
    if len(amax_shape) != len(x_shape) or len(x_shape) < 2:
        return False
    diff = [i for i, (a, b) in enumerate(zip(amax_shape, x_shape)) if a != b]
    if len(diff) != 1 or diff[0] < 1 or x_shape[diff[0] - 1] != 1 or amax_shape[diff[0]] != 1:
        return False
    cons = [c for c in g.nodes if n.output[0] in c.input]
    target = g.const(cons[0].input[1]) if len(cons) == 1 and cons[0].op_type == "Reshape" else None
    a = diff[0]
    return target is not None and [int(v) for v in target] == list(x_shape[:a - 1]) + [x_shape[a]] + list(
        x_shape[a + 1:])


def _lower_static_block(g: Graph, n, layer, opts, infos, xc, amax, num_bits, unsigned, narrow, maxbound, hint):
    """Static (calibrated) block quantization of a weight: lq quantizes a blocked view ``(..., n // B, B, ...)``
    with one amax per block; that is a blocked DequantizeLinear (opset 21), folded back to the weight's own
    shape when the view is reshaped back right after."""
    axis, block = _static_block(amax.shape, xc.shape, _one_block_row(g, n, amax.shape, xc.shape))
    if opts.opset < 21:
        raise ExportError(f"quantizer '{layer}' is block-quantized (block_size {block}); blocked DequantizeLinear "
                          f"needs opset >= 21, got opset {opts.opset}")
    if num_bits > 8:
        raise ExportError(_bits_msg(layer, num_bits, opts.opset, weight=True))
    q, _ = _reference.quant(torch.from_numpy(np.array(xc, dtype=np.float32)), torch.from_numpy(amax), num_bits,
                            unsigned, narrow)
    q = q.numpy()
    scale = _scale_from_amax(amax, maxbound)
    scale = np.where(amax <= AMAX_EPSILON, np.float32(1.0), scale).astype(np.float32)
    et = _block_type(num_bits, unsigned)
    out = n.output[0]
    # lq's view splits one axis a into (a, a+1) = (n // B, B); when the consumer reshapes back, do it here
    cons = [c for c in g.nodes if out in c.input]
    a = axis - 1
    if (len(cons) == 1 and cons[0].op_type == "Reshape" and a >= 0 and g.const(cons[0].input[1]) is not None
            and out not in g.graph_outputs):
        target = [int(v) for v in g.const(cons[0].input[1])]
        xs = list(xc.shape)
        orig = xs[:a] + [xs[a] * xs[axis]] + xs[axis + 1:]
        if target == orig:
            q = q.reshape(orig)
            scale = scale.reshape(xs[:a] + [xs[a]] + xs[axis + 1:])
            axis, out = a, cons[0].output[0]
            g.nodes.remove(cons[0])
    return _blocked_weight_dq(g, n, layer, infos, q, et, scale, axis, block, out, hint)


def _block_type(num_bits: int, unsigned: bool) -> int:
    """Storage type of block-quantized weight integers: 4-bit types for <= 4 bits (half the bytes), else 8-bit."""
    if num_bits <= 4:
        return TensorProto.UINT4 if unsigned else TensorProto.INT4
    return TensorProto.UINT8 if unsigned else TensorProto.INT8


def _blocked_weight_dq(g: Graph, n, layer, infos, q: np.ndarray, et: int, scale, axis: int, block: int, out: str,
                       hint: str) -> list:
    """The integers of a block-quantized weight as a constant read by one blocked DequantizeLinear."""
    if et in (TensorProto.INT4, TensorProto.UINT4):  # through ml_dtypes' 4-bit types: no Python list per value
        import ml_dtypes
        from onnx import numpy_helper

        q4 = q.astype(np.int8 if et == TensorProto.INT4 else np.uint8)
        q4 = q4.astype(ml_dtypes.int4 if et == TensorProto.INT4 else ml_dtypes.uint4)
        qname = g.add_const(f"{hint}/weight_quantized", None, proto=numpy_helper.from_array(q4, "w"))
    else:
        qname = g.add_const(f"{hint}/weight_quantized", q.astype(_NP[et]))
    sname = g.add_const(f"{hint}/scale", scale)
    zp = _zero_point(g, et, scale.shape)
    infos.append(QuantNodeInfo(layer, "weight", TYPE_NAMES[et], axis, scale, block_size=block))
    return [g.make_node("DequantizeLinear", [qname, sname, zp], [out], hint=f"{hint}/DequantizeLinear", like=n,
                        axis=axis, block_size=block)]


def _bits_msg(layer, num_bits, opset, weight=False):
    allowed = "num_bits <= 8 for weights" if weight else "num_bits=8 (int8/uint8), or 4 and 16 at opset >= 21"
    return (f"quantizer '{layer}' has num_bits={num_bits}, which ONNX QuantizeLinear cannot express at opset "
            f"{opset}; allowed: {allowed}, or (4, 3) for FP8 at opset >= 19")


def _lower_fp8(g: Graph, n, layer, opts, infos, x_rank, xc):
    x, out = n.input[0], n.output[0]
    if opts.opset < 19:
        raise ExportError(f"quantizer '{layer}' is FP8 E4M3 (num_bits=(4, 3)); FP8 QuantizeLinear needs opset >= 19 "
                          f"(float8e4m3fn), got opset {opts.opset}: pass opset=19 or higher")
    amax = g.const(n.input[1])
    if amax is None:
        raise ExportError(f"FP8 quantizer '{layer}' has a computed (dynamic) amax; export needs a calibrated amax")
    amax = amax.astype(np.float32)
    axis = _quant_axis(amax.shape, x_rank, layer, opts.opset)
    scale = np.where(amax <= AMAX_EPSILON, np.float32(1.0), amax.astype(np.float64) / _reference.E4M3_MAX)
    scale = scale.astype(np.float32)
    scale = scale.reshape(-1) if axis is not None else scale.reshape(())
    hint = layer.replace(".", "/")
    sname = g.add_const(f"{hint}/scale", scale)
    zp = _zero_point(g, TensorProto.FLOAT8E4M3FN, scale.shape)
    kind = "weight" if xc is not None else "activation"
    infos.append(QuantNodeInfo(layer, kind, "float8e4m3fn", axis, scale))
    if xc is not None:
        # weights: store the E4M3 values themselves
        xq = _reference.scaled_e4m3(torch.from_numpy(np.array(xc, dtype=np.float32)), torch.from_numpy(amax))
        s = torch.from_numpy(scale.reshape(amax.shape) if axis is not None else scale)
        v = (xq / s).clamp(-_reference.E4M3_MAX, _reference.E4M3_MAX).numpy().astype(np.float32)
        t = helper.make_tensor("w", TensorProto.FLOAT8E4M3FN, list(v.shape), v.ravel().tolist())
        qname = g.add_const(f"{hint}/weight_fp8", None, proto=t)
        kw = {} if axis is None else {"axis": int(axis)}
        return [g.make_node("DequantizeLinear", [qname, sname, zp], [out], hint=f"{hint}/DequantizeLinear", like=n,
                            **kw)]
    return _qdq_nodes(g, n, x, out, sname, zp, axis, hint)


def _lower_block(g: Graph, n, layer, opts, infos, xc):
    out = n.output[0]
    axis = int(attr(n, "axis"))
    block = int(attr(n, "block_size"))
    num_bits = int(attr(n, "num_bits", 8))
    unsigned = bool(attr(n, "unsigned", 0))
    narrow = bool(attr(n, "narrow_range", 0))
    if xc is None:
        raise ExportError(
            f"quantizer '{layer}' uses dynamic block quantization of an activation: its scales are computed from "
            "the data at run time, which ONNX Q/DQ cannot express; allowed: block quantization of weights "
            "(constant inputs) at opset >= 21, or per-tensor/per-channel quantizers for activations")
    if opts.opset < 21:
        raise ExportError(f"quantizer '{layer}' is block-quantized (block_size {block}); blocked DequantizeLinear "
                          f"needs opset >= 21, got opset {opts.opset}")
    if num_bits > 8:
        raise ExportError(_bits_msg(layer, num_bits, opts.opset, weight=True))
    x = torch.from_numpy(np.array(xc, dtype=np.float32))
    axis = axis % x.dim()
    xb = _reference._block_view(x, axis, block)
    amax = _reference.block_amax(x, axis, block)
    q, _ = _reference.quant(xb, amax, num_bits, unsigned, narrow)
    maxbound = float(2 ** (num_bits - 1 + int(unsigned)) - 1)
    scale = _scale_from_amax(amax.numpy(), maxbound)
    scale = np.where(amax.numpy() <= AMAX_EPSILON, np.float32(1.0), scale).astype(np.float32)
    sshape = list(x.shape)
    sshape[axis] //= block
    scale = scale.reshape(sshape)
    et = _block_type(num_bits, unsigned)
    qv = q.numpy().reshape(x.shape)
    return _blocked_weight_dq(g, n, layer, infos, qv, et, scale, axis, block, out, layer.replace(".", "/"))


def _lower_affine(g: Graph, n, layer, opts, infos, x_rank):
    """An affine (asymmetric) quantizer: one scale and a zero point from its range. For onnxruntime the codes
    are uint8 (``zero point + 128``, the same values), the activation type its x86 kernels read."""
    x, out = n.input[0], n.output[0]
    num_bits = int(attr(n, "num_bits", 8))
    lo, hi = g.const(n.input[1]), g.const(n.input[2])
    if lo is None or hi is None:
        raise ExportError(f"affine quantizer '{layer}' has computed min/max ranges; export needs constants")
    if num_bits != 8:
        raise ExportError(f"affine quantizer '{layer}' has num_bits={num_bits}; ONNX export allows num_bits=8")
    step, zp, _, _ = _reference.affine_params(torch.tensor(lo), torch.tensor(hi), num_bits)
    zpo = -int(zp.item())
    if not -128 <= zpo <= 127:
        raise ExportError(f"affine quantizer '{layer}' has a zero point {zpo} outside int8 (its range "
                          f"[{float(lo)}, {float(hi)}] must contain 0)")
    et = TensorProto.UINT8 if opts.activation_dtype == "uint8" else TensorProto.INT8
    hint = layer.replace(".", "/")
    sname = g.add_const(f"{hint}/scale", np.array(step.item(), dtype=np.float32))
    zname = _zero_point(g, et, (), zpo + 128 if et == TensorProto.UINT8 else zpo)
    infos.append(QuantNodeInfo(layer, "activation", TYPE_NAMES[et], None, g.const(sname)))
    return _qdq_nodes(g, n, x, out, sname, zname, None, hint)


def fold_weight_quantize(g: Graph) -> None:
    """``QuantizeLinear(const)`` (e.g. from torch.fake_quantize_*): store the integers, keep only the DQ."""
    keep = []
    for n in g.nodes:
        if (n.op_type == "QuantizeLinear" and g.is_const(n.input[0]) and all(g.is_const(i) for i in n.input if i)
                and n.output[0] not in g.graph_outputs and not attr(n, "block_size", 0)):
            x, s = g.const(n.input[0]), g.const(n.input[1])
            z = g.const(n.input[2]) if len(n.input) > 2 and n.input[2] else None
            if x is None or s is None or (z is not None and z.dtype not in (np.int8, np.uint8)):
                keep.append(n)
                continue
            g.consts[n.output[0]] = _quantize_np(x, s, z, attr(n, "axis", 1))
            g._overrides = g._const_overrides() | {n.output[0]}
            continue
        keep.append(n)
    g.nodes = keep


def _quantize_np(x, scale, zp, axis):
    """ONNX QuantizeLinear (int8/uint8): saturate(round_half_even(x / scale) + zp)."""
    shape = [-1 if d == axis % x.ndim else 1 for d in range(x.ndim)] if x.ndim else []
    s = scale.reshape(shape) if scale.ndim == 1 else scale
    dt = np.uint8 if zp is not None and zp.dtype == np.uint8 else np.int8
    z = 0.0 if zp is None else (zp.astype(np.float32).reshape(shape) if zp.ndim == 1 else zp.astype(np.float32))
    q = np.rint(x.astype(np.float32) / s.astype(np.float32)) + z
    lo, hi = (0, 255) if dt == np.uint8 else (-128, 127)
    return np.clip(q, lo, hi).astype(dt)

