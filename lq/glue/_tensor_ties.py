"""For OpenVINO: every quantized layer that reads one tensor, through grid-preserving ops and ``torch.cat``, quantizes
it on one grid (NNCF's unified scales).

A U-Net's skip tensor ``e1`` is max-pooled into the next encoder stage (``stage2(F.max_pool2d(e1, 2))``) and
concatenated with the upsampled decoder map for a later conv (``conv(torch.cat([up(d), e1], 1))``). The two convs'
input quantizers were calibrated apart, so the file quantized ``e1`` twice on two grids: OpenVINO then ran the
max pool and the concat in float and a FakeQuantize of its own on each branch, where NNCF's file quantizes ``e1``
once at its producer (fused into the conv that writes it) and runs the pool and the concat on the integers.

Here the layers reading a tensor are found on the captured model (:class:`lq.glue._whole.WholeGraph`), across
forwards, through the ops that map a grid onto itself (:func:`lq.glue._rules.ties_through`: max pools, reshapes,
zero padding, nearest upsampling) and through ``torch.cat``, whose output grid is then every member's: the readers
of the concatenation and the readers of each member form one group, and the group shares the first layer's input
quantizer (one module under several names, calibrated on every use, as :mod:`lq.glue._one_tensor` does). The
PyTorch model then computes what the file computes once :mod:`lq.export.passes._quantize_first` has moved the
quantizers in front of those ops: ``Q(maxpool(x)) == maxpool(Q(x))`` and ``Q(cat(a, b)) == cat(Q(a), Q(b))`` for a
per-tensor grid. onnxruntime's recipe quantizes each concat input itself (:mod:`lq.glue`), so this is OpenVINO's.
"""

from __future__ import annotations

from torch import nn

from lq.glue._rules import CAT, FUNCTIONS, TIED_LAYERS, ties_through, upsamples_nearest


def tensor_groups(whole, will_be_quantized) -> list[list[nn.Module]]:
    """Groups (two layers or more, in graph order) of quantized conv/linear layers that read one tensor as their
    input, directly or through grid-preserving ops, ``torch.cat`` and calls of other forwards."""
    memo: dict = {}
    parent: dict[int, int] = {}
    layers: dict[int, nn.Module] = {}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for mid, graph in whole.graphs.items():
        module = whole.module(mid)
        if module is None:
            continue
        for n in graph.nodes:
            if n.op == "output" or len(n.users) < 2 and not _is_cat(n):
                continue
            found = _readers(whole, module, n, will_be_quantized, memo)
            for layer in found:
                layers.setdefault(id(layer), layer)
                parent.setdefault(id(layer), id(layer))
            for a, b in zip(found, found[1:]):
                ra, rb = find(id(a)), find(id(b))
                if ra != rb:
                    parent[rb] = ra
    groups: dict[int, list[nn.Module]] = {}
    for i, layer in layers.items():
        groups.setdefault(find(i), []).append(layer)
    return [g for g in groups.values() if len(g) > 1]


def share(groups: list[list[nn.Module]], converted) -> None:
    """Give every layer of a group the first shareable layer's input quantizer (per tensor and enabled:
    :func:`lq.glue.shared_input_quantizer`); ``converted(m)``: the quantized module that replaces ``m``."""
    from lq.glue import INPUT_QUANTIZER, shared_input_quantizer

    for group in groups:
        shareable = [converted(m) for m in group if shared_input_quantizer(converted(m)) is not None]
        for layer in shareable[1:]:
            setattr(layer, INPUT_QUANTIZER, shared_input_quantizer(shareable[0]))


def _is_cat(node) -> bool:
    return node.op == "call_function" and FUNCTIONS.get(node.target) is CAT


def _passes_grid(node, module: nn.Module, position: int) -> bool:
    """``node`` reads a value at ``position`` and writes it on the same grid: a grid-preserving op's first argument,
    a nearest upsampling's input, or any member of a ``torch.cat``."""
    if _is_cat(node):
        return True
    return position == 0 and (upsamples_nearest(node, module) or ties_through(node, module))


def _readers(whole, module: nn.Module, node, will_be_quantized, memo: dict) -> list[nn.Module]:
    """The quantized conv/linear layers that read ``node``'s value (of ``module``'s forward) as their input, through
    grid-preserving ops and across forwards. A forward called from more than one place is not entered (its output
    would lead to every caller's readers)."""
    key = (id(module), node)
    if key in memo:
        return memo[key]
    memo[key] = []  # a value reached again while its readers are being found adds nothing
    out: list[nn.Module] = []
    for m, u, pos in whole.readers(module, node):
        if u.op == "call_module" and pos >= 0:
            child = m.get_submodule(u.target)
            if isinstance(child, TIED_LAYERS) and will_be_quantized(child):
                if pos == 0:
                    out.append(child)
                continue
            inner = whole.into(m, u, pos)
            if inner is not None and len(whole.callers_of(child) or ()) == 1:
                out += _readers(whole, *inner, will_be_quantized, memo)
                continue
        if u.op != "output" and _passes_grid(u, m, pos):
            out += _readers(whole, m, u, will_be_quantized, memo)
    memo[key] = list(dict.fromkeys(out))
    return memo[key]
