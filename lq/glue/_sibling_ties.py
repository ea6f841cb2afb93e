"""Quantized layers that read the same tensor quantize it on one grid.

Two score-map heads on one feature map (a U-Net's ``return self.region(d), self.link(d)``), branches of a block
that all start from its input: each layer has its own input quantizer, calibrated apart (auto calibration picks a
method per quantizer), so the file holds two QuantizeLinear on one tensor, and the export copies the tensor's
producer so that each copy fuses with one of them. The VGG-BN U-Net of ``bench.library`` ran its 40x40 refine
conv twice that way (batch 8, AVX-512 VNNI: 0.24 ms of 1.69). onnxruntime's own quantizer gives a tensor one
scale and zero point; lq does the same in the model: the later readers use the first reader's input quantizer
(one module under several names, as :mod:`lq.glue._pool_grid` does for a max pool), calibrated on every use.
"""

from __future__ import annotations

from torch import nn

from lq.glue._rules import TIED_LAYERS


def sibling_readers(model: nn.Module, graphs: dict, will_be_quantized) -> list[tuple[nn.Module, nn.Module]]:
    """``(layer, first layer)`` for every quantized conv/linear that reads, as its input, a tensor an earlier call
    of the same traced forward (``graphs``, by module id) also reads as its input (directly, or as the first child
    of a plain ``nn.Sequential`` block)."""
    from lq.glue import _plain_sequential, traced_calls

    def layer_starting(m: nn.Module):
        while _plain_sequential(m) and len(m):
            m = m[0]
        return m if isinstance(m, TIED_LAYERS) and will_be_quantized(m) else None

    first: dict = {}
    out = []
    for _, n, child, _tie in traced_calls(model, graphs, will_be_quantized):
        layer = layer_starting(child) if n.args else None
        if layer is None or not hasattr(n.args[0], "op"):
            continue
        earlier = first.setdefault(n.args[0], layer)
        if earlier is not layer:
            out.append((layer, earlier))
    return out


def share(pairs: list[tuple[nn.Module, nn.Module]], converted) -> None:
    """Give each later reader the first reader's input quantizer, where both may be shared (per tensor, enabled:
    :func:`lq.glue.shared_input_quantizer`); ``converted(m)``: the quantized module that replaces ``m``."""
    from lq.glue import INPUT_QUANTIZER, shared_input_quantizer

    for layer, earlier in pairs:
        mine, theirs = shared_input_quantizer(converted(layer)), shared_input_quantizer(converted(earlier))
        if mine is not None and theirs is not None:
            setattr(converted(layer), INPUT_QUANTIZER, theirs)
