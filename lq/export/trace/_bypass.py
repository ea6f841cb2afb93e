"""The traced graph with some quantizers off: the measured fallback's tries share the export's one trace.

The fallback (:mod:`lq.export.timing._fallback`) times copies of the model with groups of quantizers turned off.
A quantizer that is off passes its input on, so the trace of such a copy is the export's own trace with that
quantizer's placeholders passing their input on: no second ``torch.onnx.export`` per try (seconds each with the
current exporter, most of a try's cost). Every placeholder carries the module path of the quantizer that wrote it
(:func:`lq.export._ir.layer_name`, from the current exporter's module stack). The legacy exporter's scope names
leave out containers that are never called and number repeated calls, so its files are traced again per try (it
takes a tenth of a second where the current exporter takes seconds).

The copies are made from the export's own model, whose bias correction shifts are already part of the biases
(:func:`lq.nn.modules._bias_shift.fold_into_bias`). A layer sent to float gets its bias from before the fold back
in the copy (the shift corrects a quantization error that is gone), and :func:`with_biases` writes it into the
shared trace's initializer of that bias.

Where a placeholder cannot be told apart (no quantizer, or more than one, answers to its path) or what it hands on
besides its output is read (a ``Quant``'s scale), :func:`without` answers None and the caller traces the copy.
The copy's file is verified against the copy in PyTorch either way, so a wrong answer here cannot reach a file.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import onnx
import onnx.numpy_helper
from torch import nn

from lq.export._ir import _names_inside, all_nodes, layer_name, subgraphs
from lq.export.prepare._model_checks import _is_quantizer
from lq.export.trace._symbolic import DOMAIN


def _paths(model: nn.Module) -> dict[str, set[int]]:
    """Every module path of a quantizer (a shared one has several) -> the quantizer (its id)."""
    out: dict[str, set[int]] = defaultdict(set)
    for name, m in model.named_modules(remove_duplicate=False):
        if _is_quantizer(m):
            out[name].add(id(m))
    return out


def without(proto: onnx.ModelProto, model: nn.Module, off: Iterable[str]) -> onnx.ModelProto | None:
    """A copy of the traced ``proto`` (of ``model``) in which the placeholders of the quantizers ``off`` (module
    paths of ``model``) pass their input on; None where a placeholder cannot be told apart or its other outputs
    are read (the caller then traces the copy)."""
    off = list(off)
    off_ids = {id(model.get_submodule(name)) for name in off}
    paths = _paths(model)
    graph = proto.graph
    if any(n.domain == DOMAIN and paths.get(layer_name(n), set()) & off_ids
           for m in graph.node for sub in subgraphs(m) for n in all_nodes(sub)):
        return None  # a quantizer inside a loop body (a recurrent layer's step): traced again instead
    read_inside = _names_inside(graph.node)
    rename: dict[str, str] = {}  # the output of each placeholder passed on -> its input
    for n in graph.node:
        if n.domain != DOMAIN:
            continue
        owners = paths.get(layer_name(n), set())
        if len(owners) != 1:
            return None
        if owners & off_ids:
            if any(o for o in n.output[1:]) or n.output[0] in read_inside:
                return None
            rename[n.output[0]] = n.input[0]

    def source(name: str) -> str:
        while name in rename:
            name = rename[name]
        return name

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    nodes = [n for n in out.graph.node if not (n.domain == DOMAIN and n.output[0] in rename)]
    for n in nodes:
        for k, i in enumerate(n.input):
            n.input[k] = source(i)
    for o in out.graph.output:
        if o.name in rename:  # a graph output keeps its name
            nodes.append(onnx.helper.make_node("Identity", [source(o.name)], [o.name], name=f"{o.name}_passed_on"))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def with_biases(proto: onnx.ModelProto, biases: dict) -> onnx.ModelProto | None:
    """``proto`` (a copy the caller owns) with the initializer of each ``{layer path: bias}`` (the current exporter
    names a parameter's initializer by its path, ``<path>.bias``) holding that bias; None where one is not there
    with that shape (the caller then traces the copy)."""
    inits = {i.name: i for i in proto.graph.initializer}
    for path, bias in biases.items():
        init = inits.get(f"{path}.bias")
        value = bias.detach().cpu().float().numpy()
        if init is None or tuple(init.dims) != value.shape or init.data_type != onnx.TensorProto.FLOAT:
            return None
        init.CopyFrom(onnx.numpy_helper.from_array(value, init.name))
    return proto
