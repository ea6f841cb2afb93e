"""The graph IR every export pass works on: a mutable view of an ``onnx.ModelProto`` and node helpers.

Both torch.onnx exporters produce an ``onnx.ModelProto``; the passes (``_lower``,
``_fold_bn``, ``_placement``, ``_int16``, ...) rewrite it through :class:`Graph`
so the numerics never depend on how a model called the quantization ops.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

QDQ = ("QuantizeLinear", "DequantizeLinear")


class ExportError(RuntimeError):
    """Export failed; the message names the layer(s) and what is allowed. Never raised after touching files
    that hold trained weights."""


class VerificationError(ExportError):
    """onnxruntime's output is not PyTorch's fake-quant output: too many elements more than a few output steps
    off, top-1 classes that differ beyond a tie, or (when the user set one) more than the tolerance."""


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
#: onnxruntime's contrib-op domain (MatMulNBits, DynamicQuantizeLSTM, QuickGelu)
MS_DOMAIN = "com.microsoft"
#: the ops of a quantized layer's computation (conv, linear, matmul): what the kernel reports and the runtime-fault
#: search look at
COMPUTE = ("Conv", "ConvTranspose", "Gemm", "MatMul")


class NodeList(list):
    """The graph's node list, where ``index`` and ``remove`` find a node by identity, starting where the last search
    ended: ``list``'s own compare protobuf messages by value, from the first node on, and the passes' calls (one
    or more per layer) made their cost grow with the square of the graph (a 96-layer transformer: 0.5 of its 5.7 s
    rewrite)."""

    _hint = 0  # where the last search ended: the passes walk the graph in order, so the next node is near it

    def index(self, node, *args) -> int:
        n = len(self)
        start = min(self._hint, n)
        for k in range(max(0, start - 8), n):
            if self[k] is node:
                self._hint = k
                return k
        for k in range(0, max(0, start - 8)):
            if self[k] is node:
                self._hint = k
                return k
        raise ValueError("node is not in the graph")

    def remove(self, node) -> None:
        del self[self.index(node)]


class Graph:
    """A mutable view of ``model.graph``: node list, constants by name, fresh names."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.g = model.graph
        self.nodes = list(self.g.node)
        self._overrides: set[str] = set()
        self._suffix: dict[str, int] = {}  # fresh(): the last number tried per base name
        self.consts: dict[str, np.ndarray] = {}
        self._const_protos: dict[str, onnx.TensorProto] = {}
        for init in self.g.initializer:
            self._const_protos[init.name] = init
        self._used_names: set[str] = set(self._const_protos)
        for n in self.nodes:
            self._used_names.update(n.output)
            self._used_names.update(n.input)
        self._used_names.update(i.name for i in self.g.input)
        self._used_names.update(_names_inside(self.nodes))  # a loop body's names: never reused outside it
        self.graph_outputs = {o.name for o in self.g.output}
        self.graph_inputs = {i.name for i in self.g.input}
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

    @property
    def nodes(self) -> NodeList:
        return self._nodes

    @nodes.setter
    def nodes(self, value) -> None:
        self._nodes = value if isinstance(value, NodeList) else NodeList(value)

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
        return self._overrides

    def add_const(self, hint: str, array, proto: onnx.TensorProto | None = None) -> str:
        name = self.fresh(hint)
        if proto is not None:
            proto = onnx.TensorProto.FromString(proto.SerializeToString())
            proto.name = name
            self._const_protos[name] = proto
        else:
            self.consts[name] = np.asarray(array)
            self._overrides.add(name)
        return name

    def fresh(self, hint: str) -> str:
        base = hint.replace("::", "_") or "t"
        name, i = base, self._suffix.get(base, 0)  # numbers below it were taken already
        if i:
            name = f"{base}_{i}"
        while name in self._used_names:
            i += 1
            name = f"{base}_{i}"
        self._suffix[base] = i
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

    def replace_uses(self, old: str, new: str, readers=None) -> None:
        """Every read of ``old`` becomes a read of ``new``; ``readers``: the nodes that read ``old`` where the caller
        knows them (a consumers map taken in the same pass), so only those are visited, not the whole graph."""
        for n in (self.nodes if readers is None else readers):
            if old in n.input:  # a test in C on each node; the rewrite only where it reads ``old``
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

    def use_ms_domain(self) -> str:
        """Declare onnxruntime's contrib-op domain in the model (once); returns it for ``make_node(domain=...)``."""
        if not any(o.domain == MS_DOMAIN for o in self.model.opset_import):
            self.model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        return MS_DOMAIN

    # --- output
    def finalize(self) -> onnx.ModelProto:
        self.nodes = _toposort(self.nodes, set(self.graph_inputs) | set(self.consts) | set(self._const_protos))
        # an initializer that only a loop body reads (from the enclosing scope) is used too
        used = {i for n in self.nodes for i in n.input} | self.graph_outputs | _names_inside(self.nodes)
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


def drop_unread(g: Graph, candidate) -> None:
    """Remove the nodes that ``candidate(node)`` accepts and nothing reads any more (repeatedly: a chain that
    only fed a removed node goes as a whole). Graph outputs count as read."""
    while True:
        read = {i for m in g.nodes for i in m.input} | g.graph_outputs | _names_inside(g.nodes)
        dead = {id(m) for m in g.nodes if candidate(m) and not any(o in read for o in m.output if o)}
        if not dead:
            return
        g.nodes = [m for m in g.nodes if id(m) not in dead]


def subgraphs(node: onnx.NodeProto):
    """The graphs held by ``node``'s attributes (a Scan/Loop body, If branches)."""
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def all_nodes(graph: onnx.GraphProto):
    """Every node of ``graph`` and of the graphs inside it, at any depth."""
    for n in graph.node:
        yield n
        for sub in subgraphs(n):
            yield from all_nodes(sub)


def as_model(graph: onnx.GraphProto, like: onnx.ModelProto) -> onnx.ModelProto:
    """A model holding a copy of ``graph`` with ``like``'s opsets: a subgraph wrapped for :class:`Graph`."""
    m = onnx.ModelProto()
    m.ir_version = like.ir_version
    m.opset_import.extend(like.opset_import)
    m.graph.CopyFrom(graph)
    return m


def _names_inside(nodes) -> set[str]:
    """Every value and node name in the subgraphs of ``nodes`` (loop bodies, If branches), at any depth."""
    out: set[str] = set()
    for n in nodes:
        for sub in subgraphs(n):
            out.update(i.name for i in list(sub.input) + list(sub.initializer))
            for m in sub.node:
                out.update(m.input)
                out.update(m.output)
                out.add(m.name)
            out |= _names_inside(sub.node)
    return out


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


def value_shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    """Shape of every value shape inference can tell: a tuple of ints, None where a dimension is symbolic."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        inferred = model
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
    return out
