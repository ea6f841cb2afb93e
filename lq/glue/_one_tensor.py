"""One tensor, one quantizer, whichever forwards read it.

Two score-map heads on one feature map (a U-Net's ``return self.region(d), self.link(d)``), branches of a block
that all start from its input: each layer has its own input quantizer, calibrated apart (auto calibration picks a
method per quantizer), so the file held two QuantizeLinear on one tensor and the export copied the tensor's
producer so that each copy fused with one of them (bench.library's U-Net ran its 40x40 refine conv twice that way:
0.24 ms of 1.69 at batch 8). onnxruntime's own quantizer gives a tensor one scale and zero point. Library code
also splits the reads of one tensor across forwards: torchvision's DenseNet passes a block's growing list of features
to each ``_DenseLayer``, whose own forward concatenates it, so one feature is concatenated in every later layer's
forward and in the block's, and each of those quantizers was calibrated apart. Its producer then ends in several
QuantizeLinear on several grids and onnxruntime leaves that conv in float (bench.styles' DenseNet style c: 4 of 14
convs once the ranges differ at all).

Here every read is traced back to where the tensor was made (:meth:`lq.glue._whole.WholeGraph.origin`, through
the arguments and list elements each forward was passed), and all the quantizers that read one origin become one
module under several names: the first layer input quantizer that may be shared, else the first glue operand's.
Calibration then sees every use, PyTorch and the file quantize the tensor once. Only quantizers that quantize the
same way (bits, sign, range, per tensor, enabled) are joined.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from lq.glue._rules import JOIN_KINDS, TIED_LAYERS
from lq.nn.modules.tensor_quantizer import TensorQuantizer


@dataclasses.dataclass(frozen=True)
class GlueSlot:
    """A glue operand quantizer: ``plan.quantizers[name]``."""

    plan: object
    name: str


@dataclasses.dataclass(frozen=True)
class LayerSlot:
    """A conv/linear layer's input quantizer (the float module; its quantized replacement holds it)."""

    layer: nn.Module


def reader_groups(whole, plans: list, will_be_quantized) -> list[list]:
    """Groups (two or more, first read first) of the quantizer slots that read one tensor: glue operands of
    ``plans`` (adds, products, concats) and quantized conv/linear layers called on it, in any captured forward."""
    from lq.glue import first_layer

    groups: dict[tuple[int, object], list] = {}

    def add(module, node, slot) -> None:
        origin_module, origin = whole.origin(module, node)
        members = groups.setdefault((id(origin_module), origin), [])
        if slot not in members:
            members.append(slot)

    for plan in plans:
        for s in plan.sites:
            if s.rule.kind not in JOIN_KINDS | {"cat"} or s.rule.shared:
                continue
            for op, own in zip(dict.fromkeys(s.operands), s.operand_names()):
                if own is not None and hasattr(op, "op"):  # tied operands use a layer's quantizer already
                    add(plan.module, op, GlueSlot(plan, own))
    for mid, graph in whole.graphs.items():
        module = whole.module(mid)
        if module is None:
            continue
        for n in graph.nodes:
            if n.op != "call_module" or not n.args or not hasattr(n.args[0], "op"):
                continue
            try:
                layer = module.get_submodule(n.target)
            except AttributeError:
                continue
            layer = first_layer(layer)
            if isinstance(layer, TIED_LAYERS) and will_be_quantized(layer):
                add(module, n.args[0], LayerSlot(layer))
    return [g for g in groups.values() if len(g) > 1]


def _grid(q) -> tuple | None:
    """What decides the quantizer's grid apart from its range; None where it may not be shared (per channel,
    disabled, not a quantizer)."""
    if not isinstance(q, TensorQuantizer) or q.axis is not None or not q.is_enabled:
        return None
    return q.num_bits, q.unsigned, q.narrow_range, q._asymmetric, q.fake_quant, q._dynamic, q._block_sizes


def share(groups: list[list], converted) -> None:
    """Give every slot of a group one quantizer: the first shareable layer's input quantizer, else the first glue
    operand's; ``converted(m)``: the quantized module that replaces ``m``."""
    from lq.glue import INPUT_QUANTIZER

    def current(slot):
        if isinstance(slot, LayerSlot):
            return getattr(converted(slot.layer), INPUT_QUANTIZER, None)
        quantizers = slot.plan.quantizers
        return quantizers[slot.name] if quantizers is not None and slot.name in quantizers else None

    for group in groups:
        ordered = [s for s in group if isinstance(s, LayerSlot)] + [s for s in group if isinstance(s, GlueSlot)]
        owner = next((current(s) for s in ordered if _grid(current(s)) is not None), None)
        if owner is None:
            continue
        for slot in ordered:
            q = current(slot)
            if q is owner or _grid(q) != _grid(owner):
                continue
            if isinstance(slot, LayerSlot):
                setattr(converted(slot.layer), INPUT_QUANTIZER, owner)
            else:
                slot.plan.quantizers[slot.name] = owner
