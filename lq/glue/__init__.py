"""Quantize the glue of models written the ordinary way: ``x + y``, ``torch.cat``, ``q @ k``.

:func:`lq.convert.quantize_model` swaps layers (Conv, Linear, ...) for quantized ones; the arithmetic
between them lives in each module's own ``forward`` as functions and operators, where no module swap can
reach it. Without quantizers there, a runtime keeps those ops in float and, worse, cannot fuse the layers
that feed them (onnxruntime runs ``DQ -> Conv -> Q`` as ``QLinearConv`` only when a quantizer reads the
conv's output). This package finds those ops with torch.fx, one module at a time (its children are
leaves), and gives the module quantizers for them (rules: :mod:`lq.glue._rules`) in the PyTorch model
itself, so calibration, QAT and the export see the same thing. A module fx cannot follow keeps its glue
float, and the summary says which and why.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from lq.glue import _outputs
from lq.glue._outputs import OutputSite
from lq.glue import _at_calls
from lq.glue._rewrite import CHILD, GlueQuantized, GlueQuantizer, call_table, commit, glue_class, remove
from lq.glue._rules import (FUNCTIONS, INPUT_QUANTIZER, METHODS, OUTPUT, TIE_THROUGH_METHODS, ACTIVATIONS, RELU_NORM,
                            SLOPED, TIED_LAYERS, MAX_POOLS, GlueRule, ties_through)
from lq.glue._sites import Site, find_sites
from lq.glue._trace import trace
from lq.nn.modules.tensor_quantizer import TensorQuantizer
from lq.rules.onnxruntime import ort_gates_silu

__all__ = ["GluePlan", "OutputSite", "plan", "GlueQuantized", "GlueQuantizer", "CHILD", "remove", "FUNCTIONS", "METHODS",
           "GlueRule", "is_glue_quantized"]

#: classes defined here are library code: their forwards are not rewritten
_LIBRARY_PREFIXES = ("torch.", "lq.", "lightning.", "pytorch_lightning.", "torchmetrics.", "transformers.")
_GLUE_TEXT = re.compile(r"\+|torch\.cat|torch\.concat|@|matmul|\bbmm\b|\.add\(|scaled_dot_product_attention|avg_pool")

_LABELS = {"add": "x + y", "mul": "x * y", "cat": "torch.cat", "matmul": "a @ b", "attention": "scaled_dot_product_attention",
           "pool": "average pooling", "act": "activation input", "output": "output"}


@dataclasses.dataclass
class GluePlan:
    """The glue quantizers planned for one module (nothing is changed until :meth:`commit`)."""

    name: str
    module: nn.Module
    graph: fx.Graph
    sites: list[Site]
    quantizers: nn.ModuleDict | None = None
    cls: type | None = None
    #: placed on a captured graph: the call table (lq.glue._at_calls) instead of a generated class
    captured: bool = False
    #: ``{(call key, ordinal): layer path}``: layers a captured forward called as functions on their weight
    layer_calls: dict = dataclasses.field(default_factory=dict)
    table: dict | None = None
    #: where the quantizers are kept when not on the module itself: the nearest ancestor that is no container.
    #: A container subclass with its own forward (torchvision's ``_DenseBlock(nn.ModuleDict)``) iterates its
    #: children, and a quantizer child would be called as one of its layers
    anchor_name: str | None = None
    anchor: nn.Module | None = None

    def _key(self, quantizer: str) -> str:
        """The quantizer's name in its holder's ``lq_glue``."""
        if self.anchor is None:
            return quantizer
        rel = self.name[len(self.anchor_name) + 1:] if self.anchor_name else self.name
        return f"{rel.replace('.', '_')}_{quantizer}"

    def path(self, quantizer: str) -> str:
        """The module path of one of this plan's quantizers (what state_dict keys and overrides use)."""
        holder = self.name if self.anchor is None else self.anchor_name
        return f"{holder}.{CHILD}.{self._key(quantizer)}" if holder else f"{CHILD}.{self._key(quantizer)}"

    def full(self, ref: str) -> str:
        """The model path of a quantizer a site names relative to the module (``lq_glue.pool_0``: one of this plan's;
        ``conv1._input_quantizer``: a layer's)."""
        if ref.startswith(CHILD + "."):
            return self.path(ref[len(CHILD) + 1:])
        return f"{self.name}.{ref}" if self.name else ref

    def quantizer_paths(self) -> list[str]:
        return [self.path(q) for s in self.sites for q in s.quantizer_names()]

    def build(self, desc_for: Callable[[str], object], swapped: Callable[[nn.Module], nn.Module] = lambda m: m) -> None:
        """Make the quantizers (a descriptor per quantizer path) and the generated class. ``swapped(layer)``: the
        quantized module that will replace ``layer``; an operand stays tied to its input quantizer only where
        that quantizer quantizes per tensor and is enabled."""
        for s in self.sites:
            for i, path in list(s.tied.items()):
                if path.startswith(CHILD + "."):
                    continue  # tied to another site's quantizer of this forward (a pool's): made below
                if shared_input_quantizer(swapped(self.module.get_submodule(path.rsplit(".", 1)[0]))) is None:
                    del s.tied[i]
        # a site quantizing only its tied operands keeps those whose tie holds (lq.glue._join_ties)
        self.sites = [s for s in (s.tied_part() if s.tied_only else s for s in self.sites) if s is not None]
        self.quantizers = nn.ModuleDict({q: GlueQuantizer(desc_for(self.path(q)))
                                         for s in self.sites for q in s.quantizer_names()})
        if self.captured:
            self.table = call_table(self.sites, self.layer_calls, self._anchored)
        else:
            self.cls = glue_class(self.module, self.graph, self.sites, self.quantizers)

    @property
    def built(self) -> bool:
        return self.cls is not None or self.table is not None

    def _anchored(self, ref: str) -> str:
        """A quantizer reference of the call table, relative to where the table resolves it (the anchor)."""
        if self.anchor is None:
            return ref
        if ref.startswith(CHILD + "."):
            return f"{CHILD}.{self._key(ref[len(CHILD) + 1:])}"
        rel = self.name[len(self.anchor_name) + 1:] if self.anchor_name else self.name
        return f"{rel}.{ref}"

    def commit(self) -> None:
        if self.anchor is None:
            commit(self.module, self.cls, self.quantizers, self.table)
            return
        commit(self.anchor, None, nn.ModuleDict({self._key(q): m for q, m in self.quantizers.items()}), None)
        _at_calls.install(self.module, self.table, anchor=self.anchor)

    def site_quantizers(self, site: Site) -> list:
        """Every quantizer a site applies: its own, then the layers' input quantizers it is tied to."""
        return [self.quantizers[q] for q in site.quantizer_names()] + [self._tied(p) for p in site.tied.values()]

    def _tied(self, path: str):
        """The quantizer a tied operand uses: another site's of this forward (``lq_glue.pool_0``), or a layer's
        input quantizer (``conv1._input_quantizer``)."""
        if path.startswith(CHILD + "."):
            return self.quantizers[path[len(CHILD) + 1:]]
        return self.module.get_submodule(path)

    def label(self, site: Site) -> str:
        return _LABELS[site.rule.kind]


def is_glue_quantized(m: nn.Module) -> bool:
    return isinstance(m, GlueQuantized) or _at_calls.installed(m)


def _is_library(m: nn.Module) -> bool:
    mod = type(m).__module__ or ""
    return mod.startswith(_LIBRARY_PREFIXES) or mod in ("torch", "lq", "lightning")


def _may_have_glue(m: nn.Module) -> bool:
    try:
        src = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return True
    body = src.split(":", 1)[-1]
    return bool(_GLUE_TEXT.search(body))


def _plain_sequential(m: nn.Module) -> bool:
    """An ``nn.Sequential`` or a subclass keeping its forward (torchvision's ``Conv2dNormActivation``): its
    first child reads its input."""
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


#: modules whose output holds the values of their input (a shortcut written as ``nn.Identity``)
SAME_VALUE_MODULES = (nn.Identity, nn.Flatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def _tie(parent: nn.Module, graph: fx.Graph, will_be_quantized):
    """``tie(node)``: the input quantizer path of the first quantized conv/linear of ``parent`` that reads
    ``node`` as its input, directly or through grid-preserving ops (max pooling, reshapes), or None; a node that
    only passes its input's values on (an ``nn.Identity`` shortcut, a reshape) is tied as that input. A quantized
    max pool module (the first child of a stage ``nn.Sequential(nn.MaxPool2d(2), conv, ...)``) ties too: its input
    quantizer is the grid of the conv it feeds (:mod:`lq.glue._pool_grid`), so a U-Net's skip concatenated by the
    decoder shares it as the functional ``F.max_pool2d`` form does (bench.styles' U-Net style a exported its
    encoder conv twice, once per grid, when the two scales came out apart)."""

    def through(u: fx.Node) -> bool:  # a grid-preserving op (max pool, reshape ...) reading its first argument
        return ties_through(u, parent)

    def tie(node: fx.Node, depth: int = 0) -> str | None:
        for u in node.users:
            if not (u.args and u.args[0] is node):
                continue
            if u.op == "call_module":
                path, layer = u.target, parent.get_submodule(u.target)
                while _plain_sequential(layer) and len(layer):  # its first child reads the input
                    first = next(iter(layer._modules))
                    path, layer = f"{path}.{first}", layer._modules[first]
                if isinstance(layer, TIED_LAYERS + MAX_POOLS) and will_be_quantized(layer):
                    return f"{path}.{INPUT_QUANTIZER}"
        for u in node.users:
            if depth < 4 and u.args and u.args[0] is node and through(u):
                found = tie(u, depth + 1)
                if found:
                    return found
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) and same_values(node) else None
        if depth < 4 and src is not None:  # ``self.short(x)`` with an Identity shortcut is x: x's reader's grid
            return tie(src, depth + 1)
        return None

    def same_values(n: fx.Node) -> bool:  # its output is its first argument's values (an Identity, a reshape)
        if n.op == "call_module":
            return isinstance(parent.get_submodule(n.target), SAME_VALUE_MODULES)
        if n.op == "call_function":
            return n.target is torch.flatten
        return n.op == "call_method" and n.target in TIE_THROUGH_METHODS

    return tie


def shared_input_quantizer(layer: nn.Module):
    """``layer``'s input quantizer where another use of the same tensor may share it (per tensor and enabled: the
    file then holds one QuantizeLinear for the tensor), else None."""
    q = getattr(layer, INPUT_QUANTIZER, None)
    return q if isinstance(q, TensorQuantizer) and q.axis is None and q.is_enabled else None


def traced_calls(model: nn.Module, graphs: dict, will_be_quantized):
    """``(parent, call node, called module, tie)`` for every child that a traced forward (``graphs``, by module id)
    calls; ``tie`` is :func:`_tie` of that forward. Plain ``nn.Sequential`` parents are left out: their children
    are paired by position."""
    for _, parent in model.named_modules():
        graph = graphs.get(id(parent))
        if graph is None or _plain_sequential(parent):
            continue
        tie = _tie(parent, graph, will_be_quantized)
        for n in graph.nodes:
            if n.op == "call_module":
                yield parent, n, parent.get_submodule(n.target), tie


def tied_layer(parent: nn.Module, path: str) -> nn.Module:
    """The layer whose input quantizer ``path`` (a :func:`_tie` result, relative to ``parent``) names."""
    return parent.get_submodule(path[: -len(INPUT_QUANTIZER) - 1])


def unsigned_inputs(model: nn.Module, graphs: dict, plans: list[GluePlan], will_be_quantized) -> set[str]:
    """Paths of the input quantizers (layers' and glue's) that only ever see values >= 0 (after a ReLU):
    :mod:`lq.glue._nonneg`. Run on the traced graphs before :meth:`GluePlan.build` changes them."""
    from lq.glue._nonneg import NonNegative

    sites = {id(p.module): (p.full, p.sites) for p in plans}
    return NonNegative(model, graphs, sites, will_be_quantized).unsigned()


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def whole_graph(model: nn.Module, captured):
    """The captured forwards joined across module boundaries (:class:`lq.glue._whole.WholeGraph`); a module whose
    calls ran different ops is left out (nothing is known of where its values go). ``captured``: a capture, or
    (a model placed without a sample) the forwards torch.fx traced, by module id, as :func:`plan` fills them, with
    each plain ``nn.Sequential`` as the chain of its children, so both give one graph the rules walk alike."""
    from lq.glue._whole import WholeGraph, chain_graph

    if isinstance(captured, dict):  # torch.fx traces no plain nn.Sequential: its forward is the chain of its children
        chains = {id(m): chain_graph(m) for _, m in model.named_modules()
                  if _plain_sequential(m) and id(m) not in captured}
        return WholeGraph(model, {**chains, **captured})
    return WholeGraph(model, {k: g for k, g in captured.graphs.items() if k not in captured.varying})


def first_layer(m: nn.Module) -> nn.Module:
    """The module that reads ``m``'s input first: ``m`` itself, or the first child of a plain ``nn.Sequential``
    (nested ones too)."""
    while _plain_sequential(m) and len(m):
        m = m[0]
    return m


def _anchor(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """The nearest ancestor of the module ``name`` that is not a container (the model itself at the latest)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:i])
        m = model.get_submodule(path)
        if not isinstance(m, _CONTAINERS) or not path:
            return path, m
    return "", model


def _layer_calls(parent: nn.Module, graph: fx.Graph, will_be_quantized) -> dict:
    """``{(call key, ordinal): layer path}`` of a captured graph's layers called as functions on their weight
    (:data:`lq.capture.LAYER_FUNCTIONS`) that will be quantized."""
    from lq.capture import LAYER_FUNCTIONS

    out = {}
    for n in graph.nodes:
        call = n.meta.get("lq_call")
        if n.op == "call_module" and call is not None and call[0][1] in LAYER_FUNCTIONS \
                and will_be_quantized(parent.get_submodule(n.target)):
            out[call] = n.target
    return out


def plan(model: nn.Module, selected: Callable[[str], bool], skip: Callable[[nn.Module], bool],
         will_be_quantized: Callable[[nn.Module], bool], graphs: dict | None = None,
         optional: frozenset = frozenset(), captured=None):
    """``(plans, outputs, already, notes)``: modules whose forward has glue to quantize, layers whose output a
    float op reads (:mod:`lq.glue._outputs`), names of modules that already have glue quantizers, and one note per
    module that may hold glue but cannot be analysed. ``graphs``: filled with ``{id(module): its graph}`` for every
    module analysed. ``captured``: an :class:`lq.capture.Capture` of the model, whose graphs are used (a module that
    did not run has no glue); without it each forward is traced with torch.fx."""
    plans, already = [], []
    outputs: dict[int, OutputSite] = {}
    float_only = None
    if captured is not None:
        from lq.glue._float_only import FloatOnly

        float_only = FloatOnly(whole_graph(model, captured))

    def wants(layer):
        return _outputs.wants_output_quantizer(layer, will_be_quantized) and id(layer) not in outputs

    refused: dict[tuple[type, str], list[str]] = {}  # one note per class and reason, naming every module
    for name, m in model.named_modules():
        if is_glue_quantized(m):
            already.append(name)
            continue
        if type(m) is nn.Sequential and selected(name):
            outputs.update((id(o.layer), o) for o in _outputs.sites_in_sequential(
                m, name, wants, will_be_quantized, relu_norm=RELU_NORM in optional, sloped=SLOPED in optional))
            continue
        if skip(m) or _is_library(m) or not selected(name):
            continue
        if captured is not None:
            graph, why = captured.graphs.get(id(m)), captured.varying.get(id(m))
            if why is not None:
                graph = None
            elif graph is None:
                continue  # it never ran on the sample: nothing of it is placed
        else:
            graph, why = trace(m)
        if graph is not None and graphs is not None:
            graphs[id(m)] = graph
        if graph is None:
            if _may_have_glue(m):
                refused.setdefault((type(m), why), []).append(name or "the model")
            continue
        found = _outputs.sites_in_graph(m, name, graph, wants, will_be_quantized, relu_norm=RELU_NORM in optional,
                                        sloped=SLOPED in optional, act="act" in optional)
        outputs.update((id(o.layer), o) for o in found if o.node is None)
        sites = find_sites(graph, _tie(m, graph, will_be_quantized), m, optional, float_only)
        if captured is not None:  # the capture knows each tensor's shape: a SiLU on a large map gates in integers
            for s in sites:
                s.gated = s.node.target is torch.nn.functional.silu and ort_gates_silu(
                    s.operands[0].meta.get("lq_shape") if isinstance(s.operands[0], fx.Node) else None)
        sites += [Site(o.node, OUTPUT, [], f"output_{k}") for k, o in enumerate(o for o in found if o.node is not None)]
        layer_calls = _layer_calls(m, graph, will_be_quantized) if captured is not None else {}
        if sites or layer_calls:
            plans.append(GluePlan(name, m, graph, sites, captured=captured is not None, layer_calls=layer_calls))
            if captured is not None and isinstance(m, _CONTAINERS):
                plans[-1].anchor_name, plans[-1].anchor = _anchor(model, name)
    notes = [f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''} ({cls.__name__}"
             f"{f' x{len(names)}' if len(names) > 1 else ''}): {why}; any +, torch.cat or matmul in its forward "
             "stays float (lq.nn.QuantAdd / QuantCat quantize them explicitly)"
             for (cls, why), names in refused.items()]
    return plans, list(outputs.values()), already, notes
