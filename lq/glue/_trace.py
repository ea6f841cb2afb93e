"""Trace one module's own ``forward`` with torch.fx, every child module a leaf.

Each module is analysed at its own level (its children are traced when their turn comes), so a model is
handled block by block and one block fx cannot follow (data-dependent control flow, ...) only leaves
that block's glue float. Two things would make the traced graph wrong rather than fail, and are refused
up front: optional arguments (fx would bake in the branch of a default value) and a ``forward`` that
differs between training and evaluation (fx bakes in ``self.training``).
"""

from __future__ import annotations

import inspect

import torch.fx as fx
from torch import nn


class _OwnForwardTracer(fx.Tracer):
    """Every submodule is a leaf: only the traced module's own code is recorded."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def signature_problem(module: nn.Module) -> str | None:
    """Why ``module.forward``'s signature cannot be traced faithfully (None: it can)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return "its forward has no inspectable signature"
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return f"its forward takes *{p.name}" if p.kind == p.VAR_POSITIONAL else f"its forward takes **{p.name}"
        if p.default is not p.empty:
            return f"its forward has an optional argument ({p.name}={p.default!r})"
    return None


def trace(module: nn.Module) -> tuple[fx.Graph | None, str | None]:
    """(graph, None), or (None, why it cannot be traced)."""
    why = signature_problem(module)
    if why:
        return None, why
    graphs = []
    was_training = module.training
    try:
        for mode in (True, False):
            module.training = mode  # this module only: its children are leaves
            try:
                graphs.append(_OwnForwardTracer().trace(module))
            except Exception as e:  # noqa: BLE001 - any tracing failure leaves the module float
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                return None, f"torch.fx cannot trace its forward ({type(e).__name__}: {msg[:160]})"
    finally:
        module.training = was_training
    if _code(graphs[0]) != _code(graphs[1]):
        return None, "its forward differs between training and evaluation (it reads self.training)"
    return graphs[1], None


def _code(graph: fx.Graph) -> str:
    return graph.python_code("self").src
