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

from lq.glue._rules import INPUT_QUANTIZER, MAX_POOLS, TIED_LAYERS, ties_through


def pool_readers(whole, will_be_quantized) -> list[tuple[nn.Module, nn.Module]]:
    """``(max pool, quantized layer reading its output)`` on the model's joined forwards
    (:class:`lq.glue._whole.WholeGraph`, captured or fx-traced): the output followed out of the forward that calls
    the pool and into the forwards it is passed to, through grid-preserving ops, to the first quantized conv/linear
    that reads it as its input. torchvision's ResNet pools in the model's forward and the pool's reader is
    ``layer1.0.conv1``, inside a block inside an nn.Sequential: the two quantizers were calibrated apart (scales
    0.022175 and 0.022164) and onnxruntime ran the pool in float between DQ and Q."""
    out = []
    for mid, graph in whole.graphs.items():
        parent = whole.module(mid)
        if parent is None:
            continue
        for n in graph.nodes:
            if n.op != "call_module":
                continue
            pool = parent.get_submodule(n.target)
            if isinstance(pool, MAX_POOLS) and will_be_quantized(pool):
                layer = _first_layer(whole, parent, n, will_be_quantized, set())
                if layer is not None:
                    out.append((pool, layer))
    return out


def _first_layer(whole, module: nn.Module, node, will_be_quantized, seen: set):
    """The first quantized conv/linear that reads ``node`` as its input, through grid-preserving ops (max pools,
    reshapes) and across forwards; None."""
    if (id(module), node) in seen:
        return None
    seen.add((id(module), node))
    for m, u, pos in whole.readers(module, node):
        if u.op == "call_module" and pos == 0:
            child = m.get_submodule(u.target)
            if isinstance(child, TIED_LAYERS) and will_be_quantized(child):
                return child
            inner = whole.into(m, u, pos)
            found = _first_layer(whole, *inner, will_be_quantized, seen) if inner is not None else None
            if found is None and ties_through(u, m):
                found = _first_layer(whole, m, u, will_be_quantized, seen)
            if found is not None:
                return found
        elif pos == 0 and ties_through(u, m):
            found = _first_layer(whole, m, u, will_be_quantized, seen)
            if found is not None:
                return found
    return None


def share(pairs: list[tuple[nn.Module, nn.Module]], converted) -> None:
    """Give each pool the input quantizer of its reader; ``converted(m)``: the quantized module that replaces ``m``."""
    for pool, layer in pairs:
        p, q = converted(pool), converted(layer)
        if isinstance(getattr(p, INPUT_QUANTIZER, None), nn.Module) and isinstance(getattr(q, INPUT_QUANTIZER, None),
                                                                                 nn.Module):
            setattr(p, INPUT_QUANTIZER, getattr(q, INPUT_QUANTIZER))
