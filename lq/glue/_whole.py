"""The captured forwards joined into one graph: where a value goes, across module boundaries.

Each captured forward is a graph of its own (:mod:`lq.capture`); a value that leaves one (its output) goes on in
every caller's graph at the call node, and a value passed to a child goes on in the child's graph at its
placeholder. :class:`WholeGraph` knows those joins, so a rule asks one question (who reads this tensor?) however
the model's code splits its forwards: into the next block of an ``nn.Sequential``, out of a block and into the
next one, through a module that only reorders calls.
"""

from __future__ import annotations

from typing import Iterator

import operator

import torch.fx as fx
from torch import nn


class WholeGraph:
    """The captured forwards (``graphs``: ``{id(module): graph}``) of ``model`` and who calls whom."""

    def __init__(self, model: nn.Module, graphs: dict[int, fx.Graph]):
        self.root = model
        self.graphs = graphs
        self.callers: dict[int, list[tuple[nn.Module, fx.Node]]] = {}
        self._modules = modules = {id(m): m for _, m in model.named_modules()}
        for mid, graph in graphs.items():
            parent = modules.get(mid)
            if parent is None:
                continue
            for n in graph.nodes:
                if n.op == "call_module":
                    try:
                        child = parent.get_submodule(n.target)
                    except AttributeError:
                        continue
                    self.callers.setdefault(id(child), []).append((parent, n))

    def module(self, mid: int) -> nn.Module | None:
        """The module of the model whose id is ``mid`` (the keys of :attr:`graphs`); None when it is not one."""
        return self._modules.get(mid)

    def inputs(self, module: nn.Module) -> list[fx.Node]:
        """The placeholders of ``module``'s captured forward (none when it has none)."""
        graph = self.graphs.get(id(module))
        return [] if graph is None else [n for n in graph.nodes if n.op == "placeholder"]

    def callers_of(self, module: nn.Module) -> list[tuple[nn.Module, fx.Node]] | None:
        """``(caller, call node)`` for each call of ``module``: where its output goes on. None where that is not
        known (the model itself, whose output leaves it, or a module no captured forward calls)."""
        if module is self.root:
            return None
        return self.callers.get(id(module)) or None

    def readers(self, module: nn.Module, node: fx.Node) -> Iterator[tuple[nn.Module, fx.Node, int]]:
        """``(module, reader, position)`` for every op that reads ``node`` (a value of ``module``'s forward),
        followed out of the forward to its callers; ``position`` is the argument index of the read (-1: a keyword
        or inside a list). Where the value leaves the model, or goes where nothing is known, the ``output`` node
        itself is yielded."""
        for u in node.users:
            if u.op == "output":
                where = self.callers_of(module)
                if where is None:
                    yield module, u, 0
                    continue
                for parent, call in where:
                    yield from self.readers(parent, call)
                continue
            positions = [i for i, a in enumerate(u.args) if a is node]
            for p in positions or [-1]:
                yield module, u, p

    def into(self, module: nn.Module, reader: fx.Node, position: int) -> tuple[nn.Module, fx.Node] | None:
        """Where a ``call_module`` reader takes the value: the child and its placeholder at ``position``, when the
        child has a captured forward; else None."""
        if reader.op != "call_module" or position < 0:
            return None
        child = module.get_submodule(reader.target)
        inputs = self.inputs(child)
        return (child, inputs[position]) if position < len(inputs) else None

    def origin(self, module: nn.Module, node: fx.Node) -> tuple[nn.Module, fx.Node]:
        """Where the value ``node`` of ``module``'s forward was made: a placeholder (or an element of a list or tuple
        passed in, ``inputs[1]``) is followed into the forward's one caller, to the value passed there, until a
        forward computed it. Two reads of one tensor in different forwards (a DenseNet layer concatenating the
        list of earlier features its block passes it) then have one origin."""
        index = []
        n = node
        while (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node)
               and n.args[0].op in ("placeholder", "call_function")):
            index.append(n.args[1])
            n = n.args[0]
        if n.op != "placeholder" or n.target.startswith("*"):
            return module, node
        callers = self.callers_of(module)
        if not callers or len(callers) != 1:
            return module, node  # the model's own input, or a forward called from several places
        parent, call = callers[0]
        position = self.inputs(module).index(n)
        value = call.args[position] if position < len(call.args) else call.kwargs.get(n.target)
        for i in reversed(index):  # the element of the list or tuple the caller passed
            if not isinstance(value, (list, tuple)) or not isinstance(i, int) or not -len(value) <= i < len(value):
                return module, node  # indexing a tensor argument, not a list of them: a value of this forward
            value = value[i]
        if not isinstance(value, fx.Node):
            return module, node
        return self.origin(parent, value)


def chain_graph(sequential: nn.Sequential) -> fx.Graph:
    """The graph of a plain ``nn.Sequential``'s forward: each child called on the previous one's output."""
    graph = fx.Graph()
    value = graph.placeholder("input")
    for name, child in sequential._modules.items():
        if child is not None:
            value = graph.call_module(name, (value,))
    graph.output(value)
    return graph
