"""One name per torch call, shared by the capture and by the code that applies quantizers at run time.

A ``TorchFunctionMode`` sees ``x + y`` as ``Tensor.add``, ``y += x`` as ``Tensor.add_`` and ``F.relu(x)`` as
``F.relu``. :func:`call_key` names each call the way torch.fx names the same code (``operator.add`` for the
tensor arithmetic, ``("call_method", "view")`` for other tensor methods, the function itself otherwise), so the
captured graphs read like fx graphs and the rules tables written for those serve unchanged. The capture numbers
the calls of one key inside one module's forward; the run-time quantizers count them the same way, so
``(key, ordinal)`` names the same op in both.
"""

from __future__ import annotations

import operator

import torch

Key = tuple  # ("call_function", target) | ("call_method", name)

#: tensor methods that fx records as an ``operator`` function (its Proxy implements the operators, not the methods)
_OPERATORS = {
    **dict.fromkeys(("add", "__add__", "__radd__", "__iadd__", "add_"), operator.add),
    **dict.fromkeys(("mul", "__mul__", "__rmul__", "__imul__", "mul_"), operator.mul),
    **dict.fromkeys(("sub", "__sub__", "__isub__", "sub_"), operator.sub),
    **dict.fromkeys(("div", "__truediv__", "__itruediv__", "div_"), operator.truediv),
    **dict.fromkeys(("matmul", "__matmul__"), operator.matmul),
    "__getitem__": operator.getitem,
}
#: the in-place forms among them: the result is the first operand, changed
IN_PLACE = frozenset({"__iadd__", "add_", "__imul__", "mul_", "__isub__", "sub_", "__itruediv__", "div_"})


def _tensor_method(func) -> str | None:
    name = getattr(func, "__name__", None)
    if name is not None and getattr(torch.Tensor, name, None) is func:
        return name
    return None


def call_key(func) -> Key:
    """How fx would name a call of ``func``: ``("call_function", f)`` or ``("call_method", name)``."""
    name = _tensor_method(func)
    if name is None:
        return ("call_function", func)
    op = _OPERATORS.get(name)
    return ("call_function", op) if op is not None else ("call_method", name)


def in_place(func) -> bool:
    """``func`` changes its first operand and returns it (``y += x``, ``y.add_(x)``)."""
    return _tensor_method(func) in IN_PLACE
