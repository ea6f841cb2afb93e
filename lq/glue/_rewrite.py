"""Put the glue quantizers into a module: a ``lq_glue`` child holding them, and what applies them.

Placed on a captured graph (:mod:`lq.capture`, the default), the module keeps its class and forward: it gets a
table of the calls to quantize (:func:`call_table`), applied while its forward runs (:mod:`lq.glue._at_calls`).
Placed on a graph torch.fx traced (no sample to capture with), the module's class changes to a subclass of its
own (``isinstance`` and every method still work) whose ``forward`` is the fx-generated code of the rewritten
graph (:func:`glue_class`). :func:`remove` undoes either and drops the quantizers.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from lq.glue import _at_calls
from lq.glue._rules import CHILD
from lq.glue._sites import Site
from lq.nn.modules.tensor_quantizer import TensorQuantizer


class GlueQuantizer(TensorQuantizer):
    """A TensorQuantizer for an operand of a glue op; passes anything that is not a float tensor through
    (fx cannot always tell a shape arithmetic ``+`` from a tensor one before the model runs)."""

    def forward(self, inputs):
        if not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point():
            return inputs
        return super().forward(inputs)


class GlueQuantized:
    """Marker base of the generated classes: a module whose own forward quantizes its glue ops."""

    _lq_float_class: type


_CLASSES: dict[tuple[type, str], type] = {}


def glue_class(module: nn.Module, graph: fx.Graph, sites: list[Site], quantizers: nn.ModuleDict) -> type:
    """Insert the quantizer calls into ``graph`` (a private copy) and return the class to give ``module``.

    Nothing is changed on ``module`` (the model is still untouched when this runs); :func:`commit` does it.
    """
    tied_paths = set()
    for s in sites:
        if s.rule.kind == "attention":
            _write_out_attention(graph, s, s.quantizer_names())
            continue
        if s.rule.kind == "output":
            with graph.inserting_after(s.node):
                q = graph.call_module(f"{CHILD}.{s.name}", (s.node,))
            s.node.replace_all_uses_with(q, delete_user_cb=lambda u, q=q: u is not q)
            continue
        with graph.inserting_before(s.node):
            # the same tensor twice is quantized once; a tied operand by the layer's own input quantizer
            for i, (op, own) in enumerate(zip(dict.fromkeys(s.operands), s.operand_names())):
                if own is None:
                    target = s.tied[i]
                    tied_paths.add(target)
                else:
                    target = f"{CHILD}.{own}"
                q = graph.call_module(target, (op,))
                s.node.replace_input_with(op, q)
    owners: dict[str, object] = {}
    for n in graph.nodes:
        if n.op in ("call_module", "get_attr"):
            if n.target.startswith(CHILD + "."):
                owners[n.target] = quantizers[n.target[len(CHILD) + 1:]]
            elif n.target in tied_paths:
                # the layer's input quantizer exists once the layer is swapped (after this runs); the code
                # generated here only names it, so a stand-in serves
                owners[n.target] = nn.Identity()
            else:
                owners[n.target] = _resolve(module, n.target)
    gm = fx.GraphModule(owners, graph, class_name=type(module).__name__)
    gm.graph.lint()
    cls = type(module)
    key = (cls, gm.code)
    if key not in _CLASSES:
        _CLASSES[key] = type(cls.__name__, (GlueQuantized, cls), {
            "forward": type(gm).forward, "_lq_float_class": cls, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return _CLASSES[key]


def call_table(sites: list[Site], layer_calls: dict, where=lambda ref: ref) -> dict:
    """``{(call key, ordinal): Call}`` for the sites of a captured graph and the layers called as functions there
    (``layer_calls``: ``{(key, ordinal): layer path}``); ``where(ref)``: a reference relative to the module as the
    table resolves it (relative to the module that holds the quantizers)."""
    table = {k: _at_calls.Call("layer", layer=where(path)) for k, path in layer_calls.items()}
    for s in sites:
        key = s.node.meta["lq_call"]
        if s.rule.kind in ("attention", "output"):
            table[key] = _at_calls.Call(s.rule.kind, quantizers=tuple(where(f"{CHILD}.{q}") for q in s.quantizer_names()))
            continue
        ref = {}
        for i, (op, own) in enumerate(zip(dict.fromkeys(s.operands), s.operand_names())):
            ref[op] = where(s.tied[i] if own is None else f"{CHILD}.{own}")
        slots = []
        for kwarg, values in [(None, list(enumerate(s.node.args)))] + [(k, [(0, v)]) for k, v in s.node.kwargs.items()]:
            for index, v in values:
                if isinstance(v, fx.Node) and v in ref:
                    slots.append(_at_calls.Slot(kwarg, index, None, ref[v]))
                elif isinstance(v, (list, tuple)):
                    slots += [_at_calls.Slot(kwarg, index, j, ref[e]) for j, e in enumerate(v)
                              if isinstance(e, fx.Node) and e in ref]
        gate = (where(f"{CHILD}.{s.quantizer_names()[-1]}"),) if s.gated else ()
        table[key] = _at_calls.Call("gated" if s.gated else "operands", slots=tuple(slots), quantizers=gate)
    return table


def _write_out_attention(graph: fx.Graph, s: Site, names: list[str]) -> None:
    """Replace a ``scaled_dot_product_attention`` node by :func:`lq.glue._attention.quantized_sdpa` with the
    site's four quantizers."""
    from lq.glue._attention import quantized_sdpa
    from lq.glue._sites import sdpa_arguments

    a = sdpa_arguments(s.node)
    with graph.inserting_before(s.node):
        quantizers = [graph.get_attr(f"{CHILD}.{n}") for n in names]
        new = graph.call_function(
            quantized_sdpa, (a["query"], a["key"], a["value"], *quantizers),
            {"attn_mask": a.get("attn_mask"), "dropout_p": a.get("dropout_p", 0.0),
             "is_causal": a.get("is_causal", False), "scale": a.get("scale")})
    s.node.replace_all_uses_with(new)
    graph.erase_node(s.node)


def _resolve(module: nn.Module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def commit(module: nn.Module, cls: type | None, quantizers: nn.ModuleDict, table: dict | None = None) -> None:
    """Give ``module`` its glue quantizers and either the generated class (fx) or its call table (captured)."""
    if len(quantizers):
        held = module._modules.get(CHILD)
        if isinstance(held, nn.ModuleDict) and table is None and cls is None:  # an anchor: add to what it holds
            held.update(quantizers)
        else:
            module._modules[CHILD] = quantizers
    if table is not None:
        _at_calls.install(module, table)
    elif cls is not None:
        module.__class__ = cls


def remove(module: nn.Module) -> None:
    """Undo :func:`commit`: the original class or no call table, no ``lq_glue`` child."""
    if isinstance(module, GlueQuantized):
        module.__class__ = module._lq_float_class
        module._modules.pop(CHILD, None)
    if _at_calls.installed(module):
        _at_calls.uninstall(module)
        module._modules.pop(CHILD, None)
