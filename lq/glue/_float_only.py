"""Whether only float ops read a value, followed through the whole captured model.

An add (or a product) whose result only float ops read stays float: no integer kernel can take it, so operand
quantizers would only add Q/DQ pairs and rounding (:func:`lq.glue._sites.find_sites`). Decided inside one forward,
an add whose result leaves the forward has to be taken as read by an integer kernel, so the same pre-norm
residual stream got quantized adds when each block was a module (``x = x + self.attn(self.norm1(x))`` returned to
the next block's LayerNorm) and float adds when the blocks were written in one forward. On the captured model the
result is followed out of the forward to its callers and into the forwards it is passed to
(:class:`lq.glue._whole.WholeGraph`), so both are the same: every read is a float op (a normalization, a smooth
activation, a non-spatial ``mean``) or another such add.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch import nn

from lq.glue._rules import FLOAT_ONLY_REDUCERS_FUNCTIONS, FLOAT_ONLY_REDUCERS_METHODS, FUNCTIONS, JOIN_KINDS, METHODS
from lq.glue._whole import WholeGraph

_JOINS = {f for f, r in FUNCTIONS.items() if r.kind in JOIN_KINDS} | {operator.sub}
_JOIN_METHODS = {m for m, r in METHODS.items() if r.kind in JOIN_KINDS}


class FloatOnly:
    """``value(module, node)``: only float ops read ``node`` of ``module``'s forward, wherever its result goes."""

    def __init__(self, whole: WholeGraph):
        self.whole = whole
        self.memo: dict[tuple[int, fx.Node], bool] = {}

    def value(self, module: nn.Module, node: fx.Node) -> bool:
        key = (id(module), node)
        if key not in self.memo:
            self.memo[key] = False  # a cycle is not float-only
            reads = list(self.whole.readers(module, node))
            self.memo[key] = bool(reads) and all(self._reads_float(m, u, p) for m, u, p in reads)
        return self.memo[key]

    def _reads_float(self, module: nn.Module, u: fx.Node, position: int) -> bool:
        """``u``, an op of ``module``'s forward reading the value at ``position``, reads it as a float op."""
        from lq.glue._outputs import _float_reader, _reader
        from lq.glue._sites import spatial_mean

        if u.op == "output":  # the value leaves the model
            return False
        if (u.op == "call_function" and u.target in _JOINS) or (u.op == "call_method" and u.target in _JOIN_METHODS):
            return self.value(module, u)
        if (u.op == "call_function" and u.target in FLOAT_ONLY_REDUCERS_FUNCTIONS
                or u.op == "call_method" and u.target in FLOAT_ONLY_REDUCERS_METHODS):
            return not spatial_mean(u)
        if _reader(u, module) is not None:
            return True
        if u.op == "call_module":  # into a child's forward: where it reads that argument
            if _float_reader(module.get_submodule(u.target)):
                return True
            inner = self.whole.into(module, u, position)
            return inner is not None and self.value(*inner)
        return False
