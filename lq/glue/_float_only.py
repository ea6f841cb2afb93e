"""Whether only float ops read a value, followed through the whole captured model.

An add (or a product) whose result only float ops read stays float: no integer kernel can take it, so operand
quantizers would only add Q/DQ pairs and rounding (:func:`lq.glue._sites.find_sites`). Decided inside one forward,
an add whose result leaves the forward has to be taken as read by an integer kernel, so the same pre-norm
residual stream got quantized adds when each block was a module (``x = x + self.attn(self.norm1(x))`` returned to
the next block's LayerNorm) and float adds when the blocks were written in one forward. On the captured model the
result is followed out of the forward to its callers, into the next child of an ``nn.Sequential`` and into the
forwards of the modules it is passed to, so both are the same: every read is a float op (a normalization, a
smooth activation, a non-spatial ``mean``) or another such add.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch import nn

from lq.glue._rules import FLOAT_ONLY_REDUCERS_FUNCTIONS, FLOAT_ONLY_REDUCERS_METHODS, FUNCTIONS, JOIN_KINDS, METHODS

_JOINS = {f for f, r in FUNCTIONS.items() if r.kind in JOIN_KINDS} | {operator.sub}
_JOIN_METHODS = {m for m, r in METHODS.items() if r.kind in JOIN_KINDS}


class FloatOnly:
    """``value(module, node)``: only float ops read ``node`` of ``module``'s forward, wherever its result goes."""

    def __init__(self, model: nn.Module, graphs: dict[int, fx.Graph]):
        from lq.glue import _plain_sequential

        self.graphs = graphs  # id(module) -> its captured forward
        self.callers: dict[int, list[tuple[nn.Module, fx.Node]]] = {}
        self.in_sequence: dict[int, tuple[nn.Module, int]] = {}  # id(child) -> (plain Sequential, index)
        self.module_of: dict[int, nn.Module] = {}
        self.memo: dict[tuple[int, fx.Node], bool] = {}
        self.root = model
        for _, m in model.named_modules():
            self.module_of[id(m)] = m
            if _plain_sequential(m):
                for i, child in enumerate(m._modules.values()):
                    self.in_sequence.setdefault(id(child), (m, i))
        for mid, graph in graphs.items():
            parent = self.module_of.get(mid)
            if parent is None:
                continue
            for n in graph.nodes:
                if n.op == "call_module":
                    try:
                        child = parent.get_submodule(n.target)
                    except AttributeError:
                        continue
                    self.callers.setdefault(id(child), []).append((parent, n))

    def value(self, module: nn.Module, node: fx.Node) -> bool:
        key = (id(module), node)
        if key not in self.memo:
            self.memo[key] = False  # a cycle is not float-only
            self.memo[key] = bool(node.users) and all(self._reads_float(module, node, u) for u in node.users)
        return self.memo[key]

    def output(self, module: nn.Module) -> bool:
        """Only float ops read ``module``'s output, at every place it is called."""
        if module is self.root:
            return False
        callers = self.callers.get(id(module))
        if callers:
            return all(self.value(p, n) for p, n in callers)
        seq = self.in_sequence.get(id(module))  # called by an nn.Sequential whose run was not recorded
        if seq is not None:
            parent, i = seq
            items = list(parent._modules.values())
            return self.input(items[i + 1], 0) if i + 1 < len(items) else self.output(parent)
        return False

    def input(self, module: nn.Module, index: int) -> bool:
        """Only float ops read ``module``'s input number ``index``."""
        from lq.glue import _plain_sequential
        from lq.glue._outputs import _float_reader

        if _float_reader(module):
            return True
        if _plain_sequential(module):
            return index == 0 and len(module) > 0 and self.input(next(iter(module._modules.values())), 0)
        graph = self.graphs.get(id(module))
        if graph is None:
            return False
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        return index < len(inputs) and self.value(module, inputs[index])

    def _reads_float(self, module: nn.Module, node: fx.Node, u: fx.Node) -> bool:
        """``u`` (a reader of ``node`` in ``module``'s forward) reads it as a float op."""
        from lq.glue._outputs import _reader
        from lq.glue._sites import spatial_mean

        if u.op == "output":
            return self.output(module)
        if (u.op == "call_function" and u.target in _JOINS) or (u.op == "call_method" and u.target in _JOIN_METHODS):
            return self.value(module, u)
        if (u.op == "call_function" and u.target in FLOAT_ONLY_REDUCERS_FUNCTIONS
                or u.op == "call_method" and u.target in FLOAT_ONLY_REDUCERS_METHODS):
            return not spatial_mean(u)
        if _reader(u, module) is not None:
            return True
        if u.op == "call_module":  # into a child's forward: where it reads that argument
            positions = [i for i, a in enumerate(u.args) if a is node]
            return bool(positions) and all(self.input(module.get_submodule(u.target), i) for i in positions)
        return False
