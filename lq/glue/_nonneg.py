"""Which activation quantizers only ever see values >= 0 (a ReLU's output, pooled or reshaped): ``unsigned``.

A quantizer after a ReLU spends half of a signed grid on values that never occur, and onnxruntime has to
keep the ReLU as an integer ``Max`` between its fused kernels. On the unsigned grid ``[0, 255]`` the same
range gets twice the steps, and the ReLU disappears in the export: a conv's output quantized to uint8 with
zero point 0 *is* its ReLU (onnxruntime's own ``quantize_static`` files look like that). TensorRT takes
int8 only, so this is part of the onnxruntime recipe (``QuantConfig.unsigned_after_relu``), not a default.

The analysis follows values through the module tree as the forwards call it, with the same per-module
fx graphs the glue uses: a module's output is non-negative when its forward returns a ReLU (ReLU6) of
something, or a pooling / reshape / concatenation / sum of non-negative values; a child called with a
non-negative argument sees a non-negative input there (each positional one: a decoder block's skip tensor). A quantizer becomes unsigned only when every call
that reaches it is non-negative; anything unknown (an untraceable module, a library forward) counts as
possibly negative. A tensor is quantized on one grid: when several quantizers read it and one of them stays
signed (``lq.nn.FloatAdd``'s shared quantizer over a ReLU output and a conv output), they all do, or the
export would have to compute the tensor's producer twice, once per grid.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from lq.glue._rules import INPUT_QUANTIZER, RELU_FUNCTIONS, RELU_METHODS, RELU_MODULES, TIED_LAYERS
from lq.nn.modules.quant_elementwise import FloatAdd, FloatCat

#: outputs >= 0 when the (first) input is
KEEP_MODULES = (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Flatten, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
                 nn.Dropout3d)
#: quantized by lq (an ``_input_quantizer``) and sign-keeping
POOL_MODULES = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                 nn.AdaptiveAvgPool3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
#: quantized by lq with one ``_input_quantizer`` on their (first) input
_INPUT_QUANTIZED = TIED_LAYERS + (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d) + POOL_MODULES
KEEP_FUNCTIONS = {F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d,
                   F.adaptive_max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
                   F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.dropout, torch.flatten, torch.reshape,
                   torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze, torch.mean,
                   operator.getitem}
KEEP_METHODS = {"flatten", "reshape", "view", "permute", "transpose", "contiguous", "squeeze", "unsqueeze",
                 "mean", "clone", "__getitem__"}
_SUMS = {operator.add, torch.add, torch.cat, torch.concat, torch.concatenate}

#: lq's explicit join modules: one shared input quantizer over all their operands
_JOINS = (FloatAdd, FloatCat)


class NonNegative:
    """Votes per quantizer path: was every value it quantized non-negative?"""

    def __init__(self, model: nn.Module, graphs: dict[int, fx.Graph], sites: dict[int, tuple],
                 will_be_quantized):
        self.model = model
        self.graphs = graphs  # id(module) -> its traced forward
        self.sites = sites  # id(module) -> (its plan's full(ref): a quantizer reference as a model path, its glue sites)
        self.will_be_quantized = will_be_quantized
        self.votes: dict[str, bool] = {}
        self._active: set[int] = set()

    def _vote(self, path: str, nonneg: bool) -> None:
        self.votes[path] = self.votes.get(path, True) and nonneg

    def unsigned(self) -> set[str]:
        """Quantizer paths every call of which was non-negative."""
        self.module(self.model, "", False)
        return {p for p, ok in self.votes.items() if ok}

    # ------------------------------------------------------------------ modules
    def module(self, m: nn.Module, path: str, nonneg_in: bool, more: tuple = ()) -> bool:
        """Whether ``m``'s output is non-negative, given whether its first input is (and, for a forward of
        several, whether each further positional input is: ``more``; a U-Net decoder block's skip tensor)."""
        if isinstance(m, RELU_MODULES):
            return True
        if isinstance(m, _INPUT_QUANTIZED) and self.will_be_quantized(m):
            self._vote(f"{path}.{INPUT_QUANTIZER}" if path else INPUT_QUANTIZER, nonneg_in)
            return nonneg_in and isinstance(m, POOL_MODULES)
        if isinstance(m, KEEP_MODULES + POOL_MODULES):
            return nonneg_in
        if type(m) is nn.Sequential:
            for name, child in m._modules.items():
                nonneg_in = self.module(child, f"{path}.{name}" if path else name, nonneg_in)
            return nonneg_in
        graph = self.graphs.get(id(m))
        if graph is None or id(m) in self._active:
            self._unreached(m, path)
            return False
        self._active.add(id(m))
        try:
            return self.graph(m, path, graph, (nonneg_in, *more))
        finally:
            self._active.discard(id(m))

    def _unreached(self, m: nn.Module, path: str) -> None:
        """A module whose forward lq cannot follow: the quantizers below it may see anything."""
        for name, sub in m.named_modules():
            if isinstance(sub, _INPUT_QUANTIZED):
                full = ".".join(p for p in (path, name) if p)
                self._vote(f"{full}.{INPUT_QUANTIZER}" if full else INPUT_QUANTIZER, False)

    # ------------------------------------------------------------------ one forward
    def graph(self, m: nn.Module, path: str, graph: fx.Graph, nonneg_args: tuple) -> bool:
        full, sites = self.sites.get(id(m), (lambda ref: f"{path}.{ref}" if path else ref, []))
        by_node = {s.node: s for s in sites}
        env: dict[fx.Node, bool] = {}
        readers: dict[fx.Node, list[str]] = {}  # tensor -> the quantizers that read it here
        k = 0  # positional inputs seen
        out = False
        for n in graph.nodes:
            if n.op == "placeholder":
                env[n] = k < len(nonneg_args) and nonneg_args[k]
                k += 1
                continue
            if n.op == "output":
                res = n.args[0]
                out = isinstance(res, fx.Node) and env.get(res, False)
                break
            a0 = n.args[0] if n.args else None
            arg_nonneg = isinstance(a0, fx.Node) and env.get(a0, False)
            site = by_node.get(n)
            if site is not None and site.rule.kind != "output":
                ops = list(dict.fromkeys(site.operands))
                for i, (op, own) in enumerate(zip(ops, site.operand_names())):
                    # own, or tied to a layer's input quantizer that quantizes this operand too
                    q = full(f"lq_glue.{own}") if own is not None else full(site.tied[i])
                    self._vote(q, env.get(op, False))
                    readers.setdefault(op, []).append(q)
            if n.op == "call_module":
                child = m.get_submodule(n.target)
                child_path = f"{path}.{n.target}" if path else n.target
                q = f"{child_path}.{INPUT_QUANTIZER}"
                if isinstance(child, _JOINS) and self.will_be_quantized(child):
                    tensors = [t for t in _flat(n.args) if isinstance(t, fx.Node)]
                    env[n] = bool(tensors) and all(env.get(t, False) for t in tensors)
                    self._vote(q, env[n])
                    for t in tensors:
                        readers.setdefault(t, []).append(q)
                    continue
                if isinstance(child, _INPUT_QUANTIZED) and self.will_be_quantized(child) and isinstance(a0, fx.Node):
                    readers.setdefault(a0, []).append(q)
                more = tuple(isinstance(a, fx.Node) and env.get(a, False) for a in n.args[1:])
                env[n] = self.module(child, child_path, arg_nonneg, more)
            elif n.op == "call_function" and n.target in RELU_FUNCTIONS or \
                    n.op == "call_method" and n.target in RELU_METHODS:
                env[n] = True
            elif n.op == "call_function" and n.target in KEEP_FUNCTIONS or \
                    n.op == "call_method" and n.target in KEEP_METHODS or _interpolates(n):
                env[n] = arg_nonneg
            elif n.op == "call_function" and n.target in _SUMS or n.op == "call_method" and n.target == "add":
                tensors = _tensor_args(n)
                env[n] = bool(tensors) and all(env.get(t, False) for t in tensors) and not n.kwargs.get("alpha")
            else:
                env[n] = False
            if site is not None and site.rule.kind == "output":  # the result's own quantizer
                q = full(f"lq_glue.{site.name}")
                self._vote(q, env[n])
                readers.setdefault(n, []).append(q)
        for qs in readers.values():  # one grid per tensor
            if any(not self.votes.get(q, True) for q in qs):
                for q in qs:
                    self._vote(q, False)
        return out


def _interpolates(n: fx.Node) -> bool:
    """``F.interpolate`` by a mode whose outputs are convex combinations of inputs (not bicubic: it overshoots)."""
    return n.op == "call_function" and n.target in (F.interpolate, F.upsample) and \
        n.kwargs.get("mode", "nearest") in ("nearest", "nearest-exact", "linear", "bilinear", "trilinear", "area")


def _flat(args) -> list:
    out = []
    for a in args:
        out.extend(_flat(a) if isinstance(a, (list, tuple)) else [a])
    return out


def _tensor_args(n: fx.Node) -> list[fx.Node]:
    if n.target in (torch.cat, torch.concat, torch.concatenate):
        seq = n.args[0] if n.args else n.kwargs.get("tensors", ())
        return [t for t in seq if isinstance(t, fx.Node)] if isinstance(seq, (list, tuple)) else []
    args = list(n.args[:2])
    if any(not isinstance(a, fx.Node) for a in args):
        return []  # x + 1.0 ... : the constant's sign is not tracked
    return args
