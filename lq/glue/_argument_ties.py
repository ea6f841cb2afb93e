"""A tensor that a module passes to a child's forward and also feeds a quantized layer of its own: one grid.

Within one forward the glue ties a join's operand to the input quantizer of a layer reading the same tensor
(:func:`lq.glue._tie`). A U-Net written as library code splits that across two forwards: the model max-pools
the skip tensor into the next encoder conv, and a decoder block (``UpConv.forward(deep, skip)``) concatenates
the same tensor, which the block's own glue quantizes. Two quantizers on one tensor give its producer two
QuantizeLinear readers on two grids, and onnxruntime then runs that conv in float (a VGG-BN U-Net kept 4 of
17 convs float this way). The block's operand quantizer is replaced by the caller's layer input quantizer (one
module under two names, as :mod:`lq.glue._pool_grid` does for a max pool), so PyTorch and the file quantize
the tensor once, and calibration sees both uses.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from lq.glue._rules import JOIN_KINDS


def argument_readers(model: nn.Module, graphs: dict, plans: list, will_be_quantized) -> list[tuple]:
    """``(plan, quantizer name, layer)``: a glue quantizer of ``plan`` (a child's forward) whose operand is one of
    the child's arguments, and the caller's quantized layer that reads the same tensor (directly or through
    grid-preserving ops). ``graphs``: the traced forwards by module id, as :func:`lq.glue.plan` fills them."""
    from lq.glue import tied_layer, traced_calls

    by_module = {id(p.module): p for p in plans}
    out = []
    for parent, n, child, tie in traced_calls(model, graphs, will_be_quantized):
        plan = by_module.get(id(child))
        if plan is None:
            continue
        for ph, arg in _arguments(plan.graph, n):
            path = tie(arg)
            if path is not None:
                out += [(plan, name, tied_layer(parent, path)) for name in _operand_quantizers(plan, ph)]
    return out


def _arguments(graph: fx.Graph, call: fx.Node):
    """``(placeholder of the child's forward, the caller's node passed to it)`` for every tensor argument."""
    for i, ph in enumerate(n for n in graph.nodes if n.op == "placeholder"):
        if ph.target.startswith("*"):
            return  # *args / **kwargs: positions no longer line up
        arg = call.args[i] if i < len(call.args) else call.kwargs.get(ph.target)
        if isinstance(arg, fx.Node):
            yield ph, arg


def _operand_quantizers(plan, ph: fx.Node) -> list[str]:
    """The names of ``plan``'s own per-operand quantizers (add, mul, cat) that quantize the argument ``ph``."""
    names = []
    for s in plan.sites:
        if s.rule.kind not in JOIN_KINDS | {"cat"} or s.rule.shared:
            continue
        for op, own in zip(dict.fromkeys(s.operands), s.operand_names()):
            if op is ph and own is not None:
                names.append(own)
    return names


def share(pairs: list[tuple], converted) -> None:
    """Give each listed glue quantizer the caller's layer input quantizer, where that one may be shared (as a tie
    within one forward requires: :func:`lq.glue.shared_input_quantizer`); ``converted(m)``: the quantized module
    replacing ``m``."""
    from lq.glue import shared_input_quantizer

    for plan, name, layer in pairs:
        if plan.quantizers is None or name not in plan.quantizers:
            continue  # the plan was dropped (its rewrite failed) or excluded
        q = shared_input_quantizer(converted(layer))
        if q is not None:
            plan.quantizers[name] = q
