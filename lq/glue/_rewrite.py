"""Put the glue quantizers into a module: a ``lq_glue`` child holding them, and a forward that calls them.

The module keeps its identity, its Parameters and its children; only its class changes, to a subclass of
its own class (``isinstance`` and every method still work) whose ``forward`` is the fx-generated code of
the rewritten graph. That code reads ``self.<child>`` and ``self.lq_glue.<quantizer>``, so it runs on the
module itself. :func:`remove` restores the original class and drops the quantizers.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

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


def commit(module: nn.Module, cls: type, quantizers: nn.ModuleDict) -> None:
    """Give ``module`` its glue quantizers and the generated class (two assignments: cannot fail half way)."""
    module._modules[CHILD] = quantizers
    module.__class__ = cls


def remove(module: nn.Module) -> None:
    """Undo :func:`rewrite`: the original class, no ``lq_glue`` child."""
    if isinstance(module, GlueQuantized):
        module.__class__ = module._lq_float_class
        module._modules.pop(CHILD, None)
