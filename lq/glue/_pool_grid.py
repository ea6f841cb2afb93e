"""A max pool and the quantized layer that reads its output quantize on one grid (onnxruntime's rule).

Max pooling maps a grid onto itself, so the tensor after the pool is already on the grid of the pool's input
quantizer. With two quantizers calibrated apart (an asymmetric recipe, or any method but max) the reader's grid
differs (the pool raises the minimum), and the file then holds Q -> DQ -> MaxPool -> Q -> DQ on two grids: the
pool cannot run on integers, cannot move in front of a PReLU (:mod:`lq.export.passes._pool_first` would leave two Q/DQ
pairs side by side, which onnxruntime merges into one rounding), and an O-Net-style net drops from 1.63x to 0.87x
FP32. onnxruntime's own quantizer gives a MaxPool's output its input's scale and zero point; lq does the same in
the model: the pool's input quantizer is the reader's (one module under two names), calibrated on both, so PyTorch
and the file compute ``Q(maxpool(Q(x))) == maxpool(Q(x))`` and every rewrite around the pool stays exact.
"""

from __future__ import annotations

from torch import nn

from lq.glue._rules import INPUT_QUANTIZER, MAX_POOLS, TIED_LAYERS


def pool_readers(model: nn.Module, graphs: dict, will_be_quantized) -> list[tuple[nn.Module, nn.Module]]:
    """``(max pool, quantized layer reading its output)`` pairs: consecutive children of an ``nn.Sequential`` (or a
    subclass keeping its forward), where the pool may end the one child and the layer begin the next inside nested
    ``nn.Sequential`` blocks (CREPE's ``Sequential(block, block)``), and pools in a traced forward (``graphs``, by
    module id), called directly or ending a block it calls, whose output a quantized layer reads directly or
    through grid-preserving ops (the glue's tie, :func:`lq.glue._tie`)."""
    from lq.glue import _plain_sequential, tied_layer, traced_calls

    def pool_ending(m: nn.Module):
        while _plain_sequential(m) and len(m):
            m = m[-1]
        return m if isinstance(m, MAX_POOLS) and will_be_quantized(m) else None

    def layer_starting(m: nn.Module):
        while _plain_sequential(m) and len(m):
            m = m[0]
        return m if isinstance(m, TIED_LAYERS) and will_be_quantized(m) else None

    out = []
    for _, m in model.named_modules():
        if _plain_sequential(m):
            items = list(m._modules.values())
            out += [(pool, layer) for pool, layer in ((pool_ending(a), layer_starting(b)) for a, b in zip(items, items[1:]))
                    if pool is not None and layer is not None]
    for parent, n, child, tie in traced_calls(model, graphs, will_be_quantized):
        pool = pool_ending(child)
        path = tie(n) if pool is not None else None
        if path:
            out.append((pool, tied_layer(parent, path)))
    return out


def share(pairs: list[tuple[nn.Module, nn.Module]], converted) -> None:
    """Give each pool the input quantizer of its reader; ``converted(m)``: the quantized module that replaces ``m``."""
    for pool, layer in pairs:
        p, q = converted(pool), converted(layer)
        if isinstance(getattr(p, INPUT_QUANTIZER, None), nn.Module) and isinstance(getattr(q, INPUT_QUANTIZER, None),
                                                                                 nn.Module):
            setattr(p, INPUT_QUANTIZER, getattr(q, INPUT_QUANTIZER))
