"""Record one run of a model: every module call and every torch call made directly in each module's forward.

The model runs once on the sample (eval mode, no gradients) with a forward pre-hook and an always-called
forward hook on each of its modules and a ``TorchFunctionMode`` that sees every torch function, tensor method
and operator. Each module call gets its own graph, an ``fx.Graph`` of what its forward did (its children are
``call_module`` nodes, as torch.fx's per-module tracing writes them), so Python control flow, helper methods,
lists of tensors and ``isinstance`` checks are simply what ran on the sample. A conv or linear function called
on a module's own weight (``F.linear(x, self.qkv.weight, self.qkv.bias)``) with that module's settings is
recorded as a call of the module: it computes the same, and the placement treats both alike.

Every hook and the mode are removed in ``finally``; the model's buffers (BatchNorm statistics of a training-mode
run) are put back as they were.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lq.capture._keys import call_key

#: functions that compute what a layer module computes, with the argument names of their signatures, and the
#: module types whose own forward they are
LAYER_FUNCTIONS = {
    F.linear: (("input", "weight", "bias"), (nn.Linear,)),
    F.conv1d: (("input", "weight", "bias", "stride", "padding", "dilation", "groups"), (nn.Conv1d,)),
    F.conv2d: (("input", "weight", "bias", "stride", "padding", "dilation", "groups"), (nn.Conv2d,)),
    F.conv3d: (("input", "weight", "bias", "stride", "padding", "dilation", "groups"), (nn.Conv3d,)),
}


@dataclasses.dataclass
class Capture:
    """What one run of the model did, module by module."""

    #: id(module) -> the graph of its forward (its first call); only modules that ran
    graphs: dict[int, fx.Graph]
    #: id(module) -> its path in the model ("" for the model itself)
    names: dict[int, str]
    #: id(module) -> how many times it was called
    calls: Counter
    #: id(module) -> why its graph cannot stand for all its calls (its calls recorded different ops)
    varying: dict[int, str]
    #: ``(caller path, layer path)`` of layers whose weight a function used in place of calling the layer
    functional_layers: list[tuple[str, str]]
    #: notes for the summary (parameters used by functions outside their module's subtree ...)
    notes: list[str]

    def output_shapes(self, model: nn.Module) -> dict[int, tuple]:
        """id(module) -> the shape of its first call's output, for the modules the capture saw called by another
        (each node records the shape of the tensor it holds: ``node.meta["lq_shape"]``)."""
        modules = dict(model.named_modules())
        shapes: dict[int, tuple] = {}
        for mid, graph in self.graphs.items():
            path = self.names.get(mid)
            if path is None:
                continue
            for n in graph.nodes:
                if n.op == "call_module" and "lq_shape" in n.meta:
                    child = modules.get(f"{path}.{n.target}" if path else n.target)
                    if child is not None:
                        shapes.setdefault(id(child), n.meta["lq_shape"])
        return shapes

    def ran(self, module: nn.Module) -> bool:
        """``module`` was called, or a function computed its forward on its weight."""
        return self.calls.get(id(module), 0) > 0 or self.names.get(id(module)) in {p for _, p in self.functional_layers}


class _Frame:
    """One module call being recorded."""

    def __init__(self, module: nn.Module, path: str):
        self.module = module
        self.path = path
        self.graph = fx.Graph()
        self.env: dict[int, fx.Node] = {}  # id(tensor) -> the node that holds it
        self.attrs: dict[int, fx.Node] = {}  # id(parameter / buffer) -> its get_attr node
        self.counts: Counter = Counter()  # call key -> calls so far (the ordinal of the next one)
        self.pending: fx.Node | None = None  # this call's node in the caller's graph


def _relative(inner: str, outer: str) -> str | None:
    """``inner``'s path relative to ``outer`` when it lies inside it, else None."""
    if outer == "":
        return inner or None
    if inner.startswith(outer + "."):
        return inner[len(outer) + 1:]
    return None


def _normal_padding(p, n: int):
    if isinstance(p, str):
        return p
    if isinstance(p, int):
        return (p,) * n
    return tuple(p)


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.names: dict[int, str] = {}
        for name, m in model.named_modules():
            self.names.setdefault(id(m), name)
        self.owners: dict[int, tuple[str, str, nn.Module]] = {}  # id(param/buffer) -> (module path, attr, module)
        for name, m in model.named_modules():
            for attr, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is not None:
                    self.owners.setdefault(id(t), (name, attr, m))
        self.stack: list[_Frame] = []
        self.graphs: dict[int, fx.Graph] = {}
        self.signatures: dict[int, list] = {}
        self.calls: Counter = Counter()
        self.varying: dict[int, str] = {}
        self.functional: list[tuple[str, str]] = []
        self.notes: list[str] = []
        self.alive: list[torch.Tensor] = []  # every tensor seen, so that no id is reused while recording

    # ------------------------------------------------------------------ values -> nodes
    def _node(self, frame: _Frame, t: torch.Tensor):
        node = frame.env.get(id(t))
        if node is not None:
            return node
        owner = self.owners.get(id(t))
        if owner is not None:
            rel = _relative(f"{owner[0]}.{owner[1]}" if owner[0] else owner[1], frame.path)
            if rel is not None:
                node = frame.attrs.get(id(t))
                if node is None:
                    node = frame.attrs[id(t)] = frame.graph.get_attr(rel)
                return node
        return t  # a constant of this forward (a tensor made outside it)

    def _map(self, frame: _Frame, value):
        if isinstance(value, torch.Tensor):
            return self._node(frame, value)
        if isinstance(value, (list, tuple)):
            out = [self._map(frame, v) for v in value]
            return out if isinstance(value, list) else tuple(out)
        if isinstance(value, dict):
            return {k: self._map(frame, v) for k, v in value.items()}
        return value

    def _bind(self, frame: _Frame, value, node: fx.Node) -> None:
        """Make ``node`` (and getitem nodes of it, for sequences and mappings) the holder of ``value``'s tensors."""
        if isinstance(value, torch.Tensor):
            frame.env[id(value)] = node
            node.meta.setdefault("lq_shape", tuple(value.shape))  # what size-dependent rules read
            self.alive.append(value)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if _has_tensor(v):
                    self._bind(frame, v, frame.graph.call_function(operator.getitem, (node, i)))
        elif isinstance(value, dict):
            for k, v in value.items():
                if _has_tensor(v):
                    self._bind(frame, v, frame.graph.call_function(operator.getitem, (node, k)))
        elif dataclasses.is_dataclass(value) or hasattr(value, "keys"):  # transformers' ModelOutput
            try:
                items = list(value.items()) if hasattr(value, "items") else [
                    (f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
            except Exception:  # noqa: BLE001 - an object the capture cannot look into
                return
            for k, v in items:
                if _has_tensor(v):
                    self._bind(frame, v, frame.graph.call_function(operator.getitem, (node, k)))

    # ------------------------------------------------------------------ torch calls
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frame = self.stack[-1] if self.stack else None
        if frame is None:
            return func(*args, **kwargs)
        key = call_key(func)
        ordinal = frame.counts[key]
        frame.counts[key] += 1
        layer = self._layer_call(frame, func, args, kwargs)
        if layer is not None:
            node = frame.graph.call_module(layer, (self._map(frame, _bound(func, args, kwargs)["input"]),))
        else:
            node = frame.graph.create_node(key[0], key[1], self._map(frame, tuple(args)),
                                           self._map(frame, dict(kwargs)))
        node.meta["lq_call"] = (key, ordinal)
        out = func(*args, **kwargs)
        if _has_tensor(out):
            self._bind(frame, out, node)
        else:
            frame.graph.erase_node(node)  # a Python value (a shape, a flag): not part of the graph
        return out

    def _layer_call(self, frame: _Frame, func, args, kwargs) -> str | None:
        """The path (relative to the calling module) of the layer whose forward this function call is, or None."""
        spec = LAYER_FUNCTIONS.get(func)
        if spec is None:
            return None
        names, types = spec
        a = _bound(func, args, kwargs)
        owner = self.owners.get(id(a.get("weight")))
        if owner is None or owner[1] != "weight" or owner[2] is frame.module or not isinstance(owner[2], types):
            return None
        layer = owner[2]
        if a.get("bias") is not layer.bias:
            return None
        if func is not F.linear:
            n = len(layer.kernel_size)
            same = (layer.padding_mode == "zeros"
                    and _normal_padding(a.get("stride", 1), n) == tuple(layer.stride)
                    and _normal_padding(a.get("padding", 0), n) == _normal_padding(layer.padding, n)
                    and _normal_padding(a.get("dilation", 1), n) == tuple(layer.dilation)
                    and a.get("groups", 1) == layer.groups)
            if not same:
                return None
        rel = _relative(owner[0], frame.path)
        if rel is None:
            self.notes.append(f"{frame.path or 'the model'} calls {getattr(func, '__name__', func)} on the weight "
                              f"of {owner[0]}, which is not inside it: that call is not quantized")
            return None
        self.functional.append((frame.path, owner[0]))
        return rel

    # ------------------------------------------------------------------ module calls
    def pre_hook(self, module: nn.Module, args, kwargs):
        path = self.names.get(id(module))
        if path is None:
            return None
        caller = self.stack[-1] if self.stack else None
        frame = _Frame(module, path)
        if caller is not None:
            rel = _relative(path, caller.path)
            if rel is not None:
                frame.pending = caller.graph.call_module(rel, self._map(caller, tuple(args)),
                                                          self._map(caller, dict(kwargs)))
            else:  # a module that is not inside its caller: opaque to the caller's graph
                frame.pending = caller.graph.call_function(_foreign_module, (path, *self._map(caller, tuple(args))))
        try:
            params = [p for p in inspect.signature(module.forward).parameters.values()
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        except (TypeError, ValueError):
            params = []
        for i, a in enumerate(args):
            ph = frame.graph.placeholder(params[i].name if i < len(params) else f"arg{i}")
            self._bind(frame, a, ph)
        for k, v in kwargs.items():
            self._bind(frame, v, frame.graph.placeholder(k))
        self.stack.append(frame)
        return None

    def post_hook(self, module: nn.Module, args, kwargs, output):
        if not self.stack or self.stack[-1].module is not module:
            return None
        frame = self.stack.pop()
        frame.graph.output(self._map(frame, output))
        mid = id(module)
        self.calls[mid] += 1
        signature = [(n.op, n.target) for n in frame.graph.nodes if n.op != "placeholder"]
        if mid not in self.graphs:
            self.graphs[mid] = frame.graph
            self.signatures[mid] = signature
        elif signature != self.signatures[mid] and mid not in self.varying:
            self.varying[mid] = "its calls on the sample ran different ops"
        caller = self.stack[-1] if self.stack else None
        if caller is not None and frame.pending is not None and _has_tensor(output):
            self._bind(caller, output, frame.pending)
        return None


def _foreign_module(path, *args):
    """Marker of a call of a module that is not inside the calling module (``path``)."""
    raise RuntimeError("a capture marker, never called")


def _has_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if hasattr(value, "items") and hasattr(value, "keys"):
        try:
            return any(_has_tensor(v) for _, v in value.items())
        except Exception:  # noqa: BLE001
            return False
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_has_tensor(getattr(value, f.name, None)) for f in dataclasses.fields(value))
    return False


def _bound(func, args, kwargs) -> dict:
    names = LAYER_FUNCTIONS[func][0]
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


def capture(model: nn.Module, args: tuple = (), kwargs: dict | None = None, *, training: bool = False) -> Capture:
    """Run ``model(*args, **kwargs)`` once without gradients, in eval mode (``training=True``: train mode, the
    model's buffers restored afterwards) and record it."""
    kwargs = kwargs or {}
    rec = _Recorder(model)
    modes = {m: m.training for m in model.modules()}
    saved = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()
             if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)} if training else {}
    handles = []
    try:
        for m in {id(m): m for m in model.modules()}.values():
            handles.append(m.register_forward_pre_hook(rec.pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(rec.post_hook, with_kwargs=True, always_call=True))
        model.train(training)
        with torch.no_grad(), rec:
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
        if saved:
            with torch.no_grad():
                state = model.state_dict(keep_vars=True)
                for k, v in saved.items():
                    state[k].copy_(v)
        rec.alive.clear()
    graphs = rec.graphs
    # the placeholders' tensors are gone: drop the big values the nodes may still point at
    for g in graphs.values():
        for n in g.nodes:
            n.args = _strip(n.args)
            n.kwargs = _strip(n.kwargs)
    return Capture(graphs=graphs, names=dict(rec.names), calls=rec.calls, varying=rec.varying,
                   functional_layers=rec.functional, notes=list(dict.fromkeys(rec.notes)))


class Constant:
    """A tensor of a forward that it did not compute (made outside it): only its shape is kept."""

    def __init__(self, t: torch.Tensor):
        self.shape = tuple(t.shape)
        self.dtype = t.dtype

    def __repr__(self) -> str:
        return f"Constant({list(self.shape)}, {self.dtype})"


def _strip(value):
    if isinstance(value, torch.Tensor):
        return Constant(value)
    if isinstance(value, (list, tuple)):
        out = [_strip(v) for v in value]
        return out if isinstance(value, list) else tuple(out)
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items()}
    return value
