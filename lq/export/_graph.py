"""Rewrites of an exported ONNX graph: lq placeholders -> Q/DQ, BatchNorm folding, Q/DQ placement.

Everything here works on an ``onnx.ModelProto`` produced by either exporter,
so the numerics do not depend on how a model calls the quantization ops. The
passes keep the exported graph numerically equal to PyTorch's fake-quant
forward (eval mode): every rewrite is exact, and where none is possible the
graph is left as it is and the reason is recorded.

Numerics of the lowering:

* integer fake quantization with amax ``a`` and ``maxbound = 2^(b-1+unsigned) - 1``
  becomes ``QuantizeLinear -> DequantizeLinear`` with scale ``a / maxbound``
  (float32), zero point 0 (int8, or uint8 when unsigned); a per-channel amax
  gives a 1-D scale and ``axis`` (opset >= 13);
* constant inputs (weights) are quantized here, with lq's own rounding, and
  stored as int8 initializers read by a DequantizeLinear (``weight_format="int8"``),
  or kept as float fake-quantized weights behind Q -> DQ (``"qdq"``);
* BatchNorm after a conv/linear with a quantized weight is folded exactly:
  ``q' = sign(k) q`` and ``scale' = |k| scale`` per output channel
  (``k = gamma / sqrt(var + eps)``), which turns a per-tensor weight scale
  into a per-channel one;
* FP8 E4M3 becomes Q/DQ with a ``float8e4m3fn`` zero point (opset >= 19);
  block quantization (static or dynamic) of a weight becomes a blocked
  DequantizeLinear (``block_size``, opset >= 21); dynamic block quantization of
  an activation has data-dependent scales and is refused with the layer's name;
* for onnxruntime, signed activations are stored as uint8 with zero point 128
  (the same grid as int8 with zero point 0: onnxruntime's x86 INT8 kernels take
  uint8 activations), a quantizer after ReLU/MaxPool/reshapes is also applied
  to the conv/add output before them (exact, and it makes ``DQ -> Conv -> Q``
  for QLinearConv), ReLU between two quantizers becomes an integer ``Max``,
  and biases become int32 (``scale = s_input * s_weight``).
"""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from lq import _reference
from lq.export._symbolic import DOMAIN

AMAX_EPSILON = _reference.AMAX_EPSILON
QDQ = ("QuantizeLinear", "DequantizeLinear")


class ExportError(RuntimeError):
    """Export failed; the message names the layer(s) and what is allowed. Never raised after touching files
    that hold trained weights."""


@dataclasses.dataclass
class QuantNodeInfo:
    """One quantized tensor of the exported graph."""

    layer: str
    kind: str  # "activation" | "weight"
    dtype: str  # "int8", "uint8", "float8e4m3fn", "int4", ...
    axis: int | None
    scale: np.ndarray | None  # None for a scale computed in the graph (dynamic amax)
    block_size: int | None = None


# =========================================================================== graph wrapper
class Graph:
    """A mutable view of ``model.graph``: node list, constants by name, fresh names."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.g = model.graph
        self.nodes: list[onnx.NodeProto] = list(self.g.node)
        self.consts: dict[str, np.ndarray] = {}
        self._const_protos: dict[str, onnx.TensorProto] = {}
        for init in self.g.initializer:
            self._const_protos[init.name] = init
        self._used_names: set[str] = set(self._const_protos)
        for n in self.nodes:
            self._used_names.update(n.output)
            self._used_names.update(n.input)
        self._used_names.update(i.name for i in self.g.input)
        self.graph_outputs = {o.name for o in self.g.output}
        self.graph_inputs = {i.name for i in self.g.input}
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

    # --- constants
    def const(self, name: str) -> np.ndarray | None:
        if not name:
            return None
        if name in self.consts:
            return self.consts[name]
        proto = self._const_protos.get(name)
        if proto is None:
            return None
        arr = numpy_helper.to_array(proto, base_dir=getattr(self, "base_dir", ""))
        self.consts[name] = arr
        return arr

    def is_const(self, name: str) -> bool:
        return bool(name) and (name in self.consts or name in self._const_protos)

    def const_dtype(self, name: str) -> int | None:
        p = self._const_protos.get(name)
        if p is not None and name not in self._const_overrides():
            return p.data_type
        a = self.consts.get(name)
        if a is None:
            return None
        try:
            return helper.np_dtype_to_tensor_dtype(a.dtype)
        except Exception:
            return None

    def _const_overrides(self):
        return getattr(self, "_overrides", set())

    def add_const(self, hint: str, array, proto: onnx.TensorProto | None = None) -> str:
        name = self.fresh(hint)
        if proto is not None:
            proto = onnx.TensorProto.FromString(proto.SerializeToString())
            proto.name = name
            self._const_protos[name] = proto
        else:
            self.consts[name] = np.asarray(array)
            self._overrides = self._const_overrides() | {name}
        return name

    def fresh(self, hint: str) -> str:
        base = hint.replace("::", "_") or "t"
        name, i = base, 0
        while name in self._used_names:
            i += 1
            name = f"{base}_{i}"
        self._used_names.add(name)
        return name

    # --- topology
    def producers(self) -> dict[str, onnx.NodeProto]:
        return {o: n for n in self.nodes for o in n.output if o}

    def consumers(self) -> dict[str, list[onnx.NodeProto]]:
        out: dict[str, list] = defaultdict(list)
        for n in self.nodes:
            for i in n.input:
                if i:
                    out[i].append(n)
        return out

    def replace_uses(self, old: str, new: str) -> None:
        for n in self.nodes:
            for k, i in enumerate(n.input):
                if i == old:
                    n.input[k] = new
        if old in self.graph_outputs:
            raise AssertionError("graph outputs are never renamed")

    def make_node(self, op_type, inputs, outputs=None, hint=None, domain="", like=None, **attrs):
        hint = hint or op_type
        if outputs is None:
            outputs = [self.fresh(f"{hint}_out")]
        node = helper.make_node(op_type, inputs, outputs, name=self.fresh(hint), domain=domain, **attrs)
        if like is not None:
            for p in like.metadata_props:
                node.metadata_props.add(key=p.key, value=p.value)
        return node

    # --- output
    def finalize(self) -> onnx.ModelProto:
        self.nodes = _toposort(self.nodes, set(self.graph_inputs) | set(self.consts) | set(self._const_protos))
        used = {i for n in self.nodes for i in n.input} | self.graph_outputs
        del self.g.node[:]
        self.g.node.extend(self.nodes)
        inits = []
        overrides = self._const_overrides()
        for name in sorted(used):
            if name in overrides or (name in self.consts and name not in self._const_protos):
                inits.append(_to_tensor(self.consts[name], name))
            elif name in self._const_protos:
                inits.append(self._const_protos[name])
        del self.g.initializer[:]
        self.g.initializer.extend(inits)
        del self.g.value_info[:]  # stale after rewrites; shape inference recomputes what is needed
        return self.model


def _to_tensor(arr: np.ndarray, name: str) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def _toposort(nodes, available: set[str]):
    avail = set(available)
    pending = list(nodes)
    out = []
    while pending:
        progressed = False
        rest = []
        for n in pending:
            if all((not i) or i in avail for i in n.input):
                out.append(n)
                avail.update(n.output)
                progressed = True
            else:
                rest.append(n)
        pending = rest
        if not progressed:  # graph inputs we did not list (or a cycle): keep the remaining order
            out.extend(pending)
            break
    return out


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def set_attr(node: onnx.NodeProto, name: str, value) -> None:
    for k, a in enumerate(node.attribute):
        if a.name == name:
            del node.attribute[k]
            break
    node.attribute.append(helper.make_attribute(name, value))


def layer_name(node: onnx.NodeProto) -> str:
    """The PyTorch module path that produced ``node`` (dynamo metadata or legacy scope names)."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = [s for s in ast.literal_eval(p.value) if s]
            except (ValueError, SyntaxError):
                break
            mods = scopes[:-1] if len(scopes) > 1 else scopes
            if not mods:
                return node.name or "<model>"
            # entries are either cumulative ("layer1", "layer1.0") or relative ("layer1", "0")
            parts: list[str] = []
            for s in mods:
                if parts and s.startswith(".".join(parts) + "."):
                    parts = s.split(".")
                else:
                    parts.append(s)
            return ".".join(parts)
    name = node.name or ""
    if "/" in name:  # legacy: "/layer1/layer1.0/conv1/_input_quantizer/FakeQuant_3"
        scopes = [s for s in name.split("/")[:-1] if s]
        if scopes:
            return ".".join(_dedupe_scopes(scopes))
    return name or "<unnamed>"


def _dedupe_scopes(scopes):
    out: list[str] = []
    for s in scopes:
        if out and s.startswith(out[-1] + "."):
            out[-1] = s
        else:
            out.append(s)
    return out


# =========================================================================== constant folding
_FOLDABLE = {
    "Identity", "Reshape", "Transpose", "Cast", "Unsqueeze", "Squeeze", "Div", "Mul", "Add", "Sub", "Neg",
    "Abs", "Sqrt", "Reciprocal", "Concat", "Flatten", "Expand", "Slice", "Gather", "Shape", "Max", "Min",
    "Clip", "Round", "Floor", "Ceil", "Pow", "Where", "Equal", "Less", "Greater", "Not", "ConstantOfShape",
}


def fold_constants(g: Graph) -> None:
    """Turn Constant nodes into initializers and evaluate cheap ops whose inputs are all constant."""
    from onnx.reference import ReferenceEvaluator

    changed = True
    while changed:
        changed = False
        keep = []
        for n in g.nodes:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.output) == 1:
                val = _constant_value(n)
                if val is not None and n.output[0] not in g.graph_outputs:
                    g.consts[n.output[0]] = val
                    g._overrides = g._const_overrides() | {n.output[0]}
                    changed = True
                    continue
            if (n.op_type in _FOLDABLE and n.domain in ("", "ai.onnx") and n.input
                    and all((not i) or g.is_const(i) for i in n.input)
                    and not any(o in g.graph_outputs for o in n.output)):
                try:
                    if n.op_type == "Identity":
                        vals = [g.const(n.input[0])]
                    else:
                        ins = [g.const(i) for i in n.input if i]
                        vals = ReferenceEvaluator(_single_node_model(n, g)).run(None, {
                            f"i{k}": v for k, v in enumerate(ins)})
                except Exception:
                    keep.append(n)
                    continue
                for o, v in zip(n.output, vals):
                    g.consts[o] = np.asarray(v)
                    g._overrides = g._const_overrides() | {o}
                changed = True
                continue
            keep.append(n)
        g.nodes = keep


def _constant_value(n):
    a = n.attribute[0] if n.attribute else None
    if a is None:
        return None
    if a.name == "value":
        return numpy_helper.to_array(a.t)
    if a.name == "value_float":
        return np.array(a.f, dtype=np.float32)
    if a.name == "value_int":
        return np.array(a.i, dtype=np.int64)
    if a.name == "value_floats":
        return np.array(list(a.floats), dtype=np.float32)
    if a.name == "value_ints":
        return np.array(list(a.ints), dtype=np.int64)
    return None


def _single_node_model(n, g: Graph):
    ins = [i for i in n.input if i]
    node = helper.make_node(n.op_type, [f"i{k}" for k in range(len(ins))], [f"o{k}" for k in range(len(n.output))],
                            **{a.name: helper.get_attribute_value(a) for a in n.attribute})
    inputs = [helper.make_tensor_value_info(f"i{k}", helper.np_dtype_to_tensor_dtype(g.const(i).dtype), None)
              for k, i in enumerate(ins)]
    outputs = [helper.make_tensor_value_info(f"o{k}", TensorProto.UNDEFINED, None) for k in range(len(n.output))]
    graph = helper.make_graph([node], "fold", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", max(g.opset, 13))])


# =========================================================================== lowering
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
        if n.domain != DOMAIN:
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
    if xc is not None and _static_block(amax.shape, xc.shape) is not None:
        return _lower_static_block(g, n, layer, opts, infos, xc, amax, num_bits, unsigned, narrow, maxbound, hint)
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


def _static_block(amax_shape, x_shape):
    """(axis, block) when ``amax`` is a calibrated per-block amax of ``x`` (lq's blocked view: every dim equal
    except one of size 1 where ``x`` has the block), else None."""
    if len(amax_shape) != len(x_shape) or int(np.prod(amax_shape)) == 1:
        return None
    diff = [i for i, (a, b) in enumerate(zip(amax_shape, x_shape)) if a != b]
    big = [i for i, a in enumerate(amax_shape) if a != 1]
    if len(diff) != 1 or amax_shape[diff[0]] != 1 or len(big) < 2:
        return None
    return diff[0], int(x_shape[diff[0]])


def _lower_static_block(g: Graph, n, layer, opts, infos, xc, amax, num_bits, unsigned, narrow, maxbound, hint):
    """Static (calibrated) block quantization of a weight: lq quantizes a blocked view ``(..., n // B, B, ...)``
    with one amax per block; that is a blocked DequantizeLinear (opset 21), folded back to the weight's own
    shape when the view is reshaped back right after."""
    axis, block = _static_block(amax.shape, xc.shape)
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
    et = TensorProto.UINT8 if unsigned else TensorProto.INT8
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
    et = TensorProto.UINT8 if unsigned else TensorProto.INT8
    if num_bits <= 4:
        et = TensorProto.UINT4 if unsigned else TensorProto.INT4
    qv = q.numpy().reshape(x.shape)
    hint = layer.replace(".", "/")
    if et in (TensorProto.INT4, TensorProto.UINT4):
        t = helper.make_tensor("w", et, list(qv.shape), qv.astype(np.int64).ravel().tolist())
        qname = g.add_const(f"{hint}/weight_quantized", None, proto=t)
    else:
        qname = g.add_const(f"{hint}/weight_quantized", qv.astype(_NP[et]))
    sname = g.add_const(f"{hint}/scale", scale)
    zp = _zero_point(g, et, scale.shape)
    infos.append(QuantNodeInfo(layer, "weight", TYPE_NAMES[et], axis, scale, block_size=block))
    return [g.make_node("DequantizeLinear", [qname, sname, zp], [out], hint=f"{hint}/DequantizeLinear", like=n,
                        axis=axis, block_size=block)]


def _lower_affine(g: Graph, n, layer, opts, infos, x_rank):
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
    hint = layer.replace(".", "/")
    sname = g.add_const(f"{hint}/scale", np.array(step.item(), dtype=np.float32))
    zname = _zero_point(g, TensorProto.INT8, (), zpo)
    infos.append(QuantNodeInfo(layer, "activation", "int8", None, g.const(sname)))
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


# =========================================================================== BatchNorm folding
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
                                      (wc.astype(np.float64) * k.reshape(shape)).astype(wc.dtype)))
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


# =========================================================================== Q/DQ placement
# ops that commute with per-tensor fake quantization: f(fq(x)) == fq(f(x)) exactly
_COMMUTE = {"Relu", "MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity"}
_COMPUTE = {"Conv", "Gemm", "MatMul", "Add", "ConvTranspose", "Concat"}
_POOLS = {"GlobalAveragePool", "AveragePool"}


def _qparams(g: Graph, q):
    s = g.const(q.input[1])
    z = g.const(q.input[2]) if len(q.input) > 2 and q.input[2] else None
    dt = g.const_dtype(q.input[2]) if len(q.input) > 2 and q.input[2] else TensorProto.UINT8
    return s, z, dt


def _same_q(g: Graph, a, b) -> bool:
    sa, za, ta = _qparams(g, a)
    sb, zb, tb = _qparams(g, b)
    if sa is None or sb is None or ta != tb:
        return False
    if attr(a, "axis", 1) != attr(b, "axis", 1) or sa.shape != sb.shape or not np.array_equal(sa, sb):
        return False
    if (za is None) != (zb is None):
        return False
    return za is None or (za.shape == zb.shape and np.array_equal(za.astype(np.int64), zb.astype(np.int64)))


def dedupe_quantizers(g: Graph) -> int:
    """Several identical QuantizeLinear (same input, same params) -> one."""
    merged = 0
    cons = g.consumers()
    dropped: set[int] = set()
    for name, users in cons.items():
        qs = [u for u in users if u.op_type == "QuantizeLinear" and u.input[0] == name]
        for i, a in enumerate(qs):
            if id(a) in dropped:
                continue
            for b in qs[i + 1:]:
                if id(b) not in dropped and _same_q(g, a, b) and b.output[0] not in g.graph_outputs:
                    g.replace_uses(b.output[0], a.output[0])
                    dropped.add(id(b))
                    merged += 1
    g.nodes = [n for n in g.nodes if id(n) not in dropped]
    return merged


def hoist_quantizers(g: Graph, relu_to_unsigned: bool) -> int:
    """Quantize the output of a Conv/Gemm/Add where its only reader is a chain of ops that commute with
    fake quantization (ReLU, MaxPool, reshapes) ending in a QuantizeLinear.

    ``P -> f -> Q -> DQ`` becomes ``P -> Q -> DQ -> f -> Q -> DQ``: exact (``f`` of a value on the grid is
    on the grid), and it gives onnxruntime ``DQ -> P -> Q`` (QLinearConv, QLinearAdd ...) and
    ``DQ -> f -> Q`` (f in int8). With ``relu_to_unsigned`` the Q after a ReLU that reads a signed,
    zero-point-0 DQ becomes uint8 with the same scale (exact: the values are in [0, 127] steps), so
    onnxruntime drops the ReLU.
    """
    moved = 0
    for _ in range(64):
        prod, cons = g.producers(), g.consumers()
        did = False
        for f in list(g.nodes):
            if f.op_type not in _COMMUTE or f.domain not in ("", "ai.onnx"):
                continue
            t = f.output[0]
            users = cons.get(t, [])
            if not users or t in g.graph_outputs or any(u.op_type != "QuantizeLinear" for u in users):
                continue
            q = users[0]
            if any(not _same_q(g, q, u) for u in users[1:]):
                continue
            s, z, dt = _qparams(g, q)
            if s is None or s.ndim != 0:
                continue
            u_in = f.input[0]
            p = prod.get(u_in)
            if p is None or u_in in g.graph_outputs or len(cons.get(u_in, [])) != 1:
                continue
            if p.op_type not in _COMPUTE and p.op_type not in _COMMUTE and p.op_type not in _POOLS:
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
            idx = g.nodes.index(f)
            g.nodes[idx:idx] = [new_q, new_dq]
            moved += 1
            did = True
            break
        if not did:
            break
    if relu_to_unsigned:
        _relu_unsigned(g)
    return moved


def _relu_unsigned(g: Graph) -> None:
    """``DQ(q) -> ReLU -> Q`` with the same signed grid -> ``Max(q, zero_point)`` on the integers.

    ReLU of a value on a grid whose zero is the zero point is that grid's ``max(q, zp)``, so this is
    exact; onnxruntime then runs one 1-byte elementwise op between two fused INT8 kernels instead of
    dequantize, float ReLU and quantize.
    """
    prod, cons = g.producers(), g.consumers()
    drop: set[int] = set()
    for r in list(g.nodes):
        if r.op_type != "Relu":
            continue
        dq = prod.get(r.input[0])
        users = cons.get(r.output[0], [])
        if dq is None or dq.op_type != "DequantizeLinear" or not users or r.output[0] in g.graph_outputs:
            continue
        if len(cons.get(dq.output[0], [])) != 1 or any(u.op_type != "QuantizeLinear" for u in users):
            continue
        s_in, z_in, t_in = _qparams(g, dq)
        if z_in is None or s_in is None or s_in.ndim != 0 or not _signed_grid(t_in, z_in):
            continue
        if any(o in g.graph_outputs for u in users for o in u.output):
            continue
        ok = True
        for q in users:
            s, z, t = _qparams(g, q)
            if s is None or z is None or t != t_in or s.shape != s_in.shape or not np.array_equal(s, s_in) or \
                    not np.array_equal(z, z_in):
                ok = False
        if not ok:
            continue
        mx = g.make_node("Max", [dq.input[0], dq.input[2]], hint="relu_int", like=r)
        for q in users:
            g.replace_uses(q.output[0], mx.output[0])
            drop.add(id(q))
        drop.update((id(dq), id(r)))
        g.nodes.insert(g.nodes.index(r), mx)
    g.nodes = [n for n in g.nodes if id(n) not in drop]


def _signed_grid(t, z) -> bool:
    """int8 with zero point 0, or its uint8 twin with zero point 128 (same grid, same range)."""
    if t == TensorProto.INT8:
        return bool(np.all(z == 0))
    if t == TensorProto.UINT8:
        return bool(np.all(z == 128))
    return False


def transpose_weight_dq(g: Graph) -> None:
    """``DQ(const) -> Transpose`` -> ``DQ(transposed const)`` so MatMul sees its weight DQ directly."""
    prod, cons = g.producers(), g.consumers()
    drop = set()
    for t in g.nodes:
        if t.op_type != "Transpose":
            continue
        dq = prod.get(t.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or len(cons.get(t.input[0], [])) != 1:
            continue
        q = g.const(dq.input[0])
        if q is None or attr(dq, "block_size", 0):
            continue
        perm = attr(t, "perm", list(range(q.ndim))[::-1])
        s = g.const(dq.input[1])
        new_q = g.add_const(f"{dq.input[0]}_T", np.transpose(q, perm))
        dq.input[0] = new_q
        if s is not None and s.ndim == 1:
            ax = attr(dq, "axis", 1) % q.ndim
            set_attr(dq, "axis", list(perm).index(ax))
        dq.output[0] = t.output[0]
        drop.add(id(t))
    g.nodes = [n for n in g.nodes if id(n) not in drop]


def _dequantize(q, scale, zp, axis):
    qf = q.astype(np.float32) - (0 if zp is None else zp.astype(np.float32).reshape(
        [-1 if d == axis % q.ndim else 1 for d in range(q.ndim)] if zp.ndim == 1 else zp.shape))
    if scale.ndim == 1:
        scale = scale.reshape([-1 if d == axis % q.ndim else 1 for d in range(q.ndim)])
    return (qf * scale.astype(np.float32)).astype(np.float32)


def weights_to_qdq(g: Graph) -> None:
    """``DQ(int8 const)`` -> ``Q(float const) -> DQ`` (the float weight holds the fake-quantized values)."""
    new_nodes = []
    for n in g.nodes:
        if n.op_type == "DequantizeLinear" and g.is_const(n.input[0]):
            q = g.const(n.input[0])
            if q is not None and q.dtype in (np.int8, np.uint8):
                w = _dequantize(q, g.const(n.input[1]), g.const(n.input[2]) if len(n.input) > 2 else None,
                                attr(n, "axis", 1))
                wname = g.add_const(n.input[0] + "_float", np.asarray(w, dtype=np.float32))
                qo = g.fresh(n.name + "_wq")
                kw = {a.name: helper.get_attribute_value(a) for a in n.attribute}
                new_nodes.append(g.make_node("QuantizeLinear", [wname] + list(n.input[1:]), [qo], like=n, **kw))
                n.input[0] = qo
        new_nodes.append(n)
    g.nodes = new_nodes


def remove_placeholder_opset(model: onnx.ModelProto) -> None:
    keep = [o for o in model.opset_import if o.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    for f in list(model.functions):
        if f.domain == DOMAIN:
            model.functions.remove(f)


# =========================================================================== onnxruntime-friendly details
def quantize_bias(g: Graph) -> int:
    """Float bias of a Conv/Gemm whose input and weight come from DequantizeLinear -> int32 bias + DQ.

    ``bias_q = round(bias / (s_input * s_weight))`` with scale ``s_input * s_weight`` (per output channel):
    what onnxruntime's QLinearConv/QGemm (and TensorRT) take. The rounding error is at most half of
    ``s_input * s_weight``, far below one output quantization step.
    """
    prod = g.producers()
    done = 0
    for n in list(g.nodes):
        if n.op_type not in ("Conv", "Gemm") or len(n.input) < 3 or not n.input[2]:
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


def global_pools(g: Graph, ranks: dict[str, int]) -> int:
    """``ReduceMean`` over all spatial axes with keepdims -> ``GlobalAveragePool`` (quantized pooling in ORT)."""
    done = 0
    for k, n in enumerate(g.nodes):
        if n.op_type != "ReduceMean" or not attr(n, "keepdims", 1):
            continue
        r = ranks.get(n.input[0], -1)
        if r < 3:
            continue
        axes = attr(n, "axes")
        if axes is None and len(n.input) > 1 and n.input[1]:
            a = g.const(n.input[1])
            axes = None if a is None else a.tolist()
        if axes is None:
            continue
        if sorted(a % r for a in axes) != list(range(2, r)):
            continue
        g.nodes[k] = g.make_node("GlobalAveragePool", [n.input[0]], list(n.output), hint="GlobalAveragePool", like=n)
        done += 1
    return done


def value_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Rank of every value shape inference can tell."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        inferred = model
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = len(t.shape.dim)
    return out


def strip_metadata(model: onnx.ModelProto) -> None:
    """Drop the exporter's per-node metadata (stack traces, FX node text): it can outweigh int8 weights."""
    for n in model.graph.node:
        del n.metadata_props[:]


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
        if f.op_type not in _COMMUTE or f.domain not in ("", "ai.onnx"):
            continue
        t = f.output[0]
        users = cons.get(t, [])
        if len(users) < 2 or t in g.graph_outputs or any(u.op_type != "QuantizeLinear" for u in users):
            continue
        groups: list[list] = []
        for u in users:
            for grp in groups:
                if _same_q(g, grp[0], u):
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
            if p.op_type in _COMPUTE:
                break
            if p.op_type not in _COMMUTE:
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
