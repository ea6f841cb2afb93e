"""For OpenVINO, whose recipe quantizes no glue of its own: where a join (``x + y``, ``x * y``) reads a tensor that a
quantized layer also reads, the join reads it through that layer's input quantizer, so the tensor is quantized once,
for every reader, and OpenVINO fuses the FakeQuantize into the op that writes it.

With only the layers' inputs quantized, a tensor that a float join also read kept a float copy, and OpenVINO ran
its FakeQuantize as a layer of its own:

* a squeeze-excite block pools the tensor it then scales (``gate(pool(x)) * x``); with the product's ``x`` on the
  pool's grid, the block's pool and product read the integers of the depthwise conv before it;
* a residual block's input ``x`` is read by its first conv and by the ``+`` at its end; with the add's ``x`` on the
  conv's grid, the conv that writes ``x`` ends in the FakeQuantize (EfficientNet-style net, 3 of its 4
  standalone FakeQuantize layers).

The other operand stays float: OpenVINO fuses the add into the conv before it, and a squeeze-excite gate is a
``(N, C, 1, 1)`` tensor whose FakeQuantize would be one more layer for nothing.

The glue plan (:func:`lq.glue.plan`) already finds both halves: each join as a site whose operand is tied to the
layer's input quantizer (:data:`lq.glue._rules.TIED_LAYERS`: convs, linears, a quantized ``nn.AdaptiveAvgPool2d``)
or to a pool site of the same forward (a pool written as ``F.adaptive_avg_pool2d`` or a spatial mean).
:func:`tied_joins` keeps of each plan only those: each join reduced to its tied operands, and the pool sites they
read. The pool modules that no join reads stay float (:func:`unread_pools` names them).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from lq.glue._rules import CHILD, INPUT_QUANTIZER, JOIN_KINDS

#: the pool modules a squeeze-excite block is written with (the recipe's types quantize them)
AVG_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)


def tied_joins(plans: list) -> list:
    """The plans reduced to their joins with an operand tied to an input quantizer (a layer's or a pool site's),
    each quantizing only those operands, and to the pool sites they read; plans left with no site are dropped."""
    kept = []
    for p in plans:
        joins = [s for s in (s.tied_part() for s in p.sites if s.rule.kind in JOIN_KINDS) if s is not None]
        read = {path[len(CHILD) + 1:] for s in joins for path in s.tied.values() if path.startswith(CHILD + ".")}
        pools = [s for s in p.sites if s.rule.kind == "pool" and s.name in read]
        if joins:
            kept.append(dataclasses.replace(p, sites=pools + joins))
    return kept


def unread_pools(targets, plans: list) -> list:
    """The pool modules among ``targets`` (conversion targets, ``.module`` each) whose input quantizer no join of
    :func:`tied_joins`' ``plans`` uses: they stay float."""
    read = set()
    for p in plans:
        for s in p.sites:
            read.update(id(p.module.get_submodule(path[: -len(INPUT_QUANTIZER) - 1]))
                        for path in s.tied.values() if not path.startswith(CHILD + "."))
    return [t for t in targets if isinstance(t.module, AVG_POOLS) and id(t.module) not in read]
