"""Quantizers applied at the torch calls the capture named, while a module's forward runs.

Placement decided on the captured graph names its ops by ``(call key, ordinal)`` inside one module's forward
(:mod:`lq.capture`). This module puts the decision into the user's model without changing any forward: the
module gets a table ``{(key, ordinal): Call}`` and a forward pre-hook that enters a ``TorchFunctionMode`` for the
length of its forward (an always-called forward hook leaves it, also when the forward raises). The mode counts
the torch calls made directly in that forward (calls inside child modules are told apart by module hooks that
are registered only while some such forward runs) and, at the calls in the table, quantizes their operands,
calls a layer whose weight a function used, or writes out an attention. Calibration, QAT and both ONNX exporters
run the same Python, so all of them see the same quantizers; nothing is traced ahead, so a forward with Python
control flow, helper methods or lists of tensors gets its quantizers like any other.

The quantizers are looked up by path from the module at call time, so a deep copy of the model quantizes with
its own copies.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks
from torch.overrides import TorchFunctionMode

from lq.capture import call_key, in_place

ATTR = "_lq_at_calls"
#: the module the table's paths are relative to, when not the module itself (a container's quantizers are kept by
#: its nearest non-container ancestor: lq.glue.GluePlan.anchor)
ANCHOR = "_lq_at_calls_anchor"


@dataclasses.dataclass(frozen=True)
class Slot:
    """One operand of a call and the quantizer (a path from the module) that quantizes it."""

    kwarg: str | None  # the keyword it is passed by, or None for a positional argument
    index: int  # positional index (when ``kwarg`` is None)
    item: int | None  # the index inside a list argument (``torch.cat``'s tensors), or None
    quantizer: str


@dataclasses.dataclass(frozen=True)
class Call:
    """What happens at one call: ``operands`` quantizes the slots; ``output`` quantizes the result with
    ``quantizers[0]``; ``layer`` calls the module at ``layer`` instead of the function
    (``F.linear(x, self.qkv.weight, self.qkv.bias)`` -> ``self.qkv(x)``); ``attention`` writes
    ``scaled_dot_product_attention`` out with the four ``quantizers`` (q, k, probabilities, v)."""

    kind: str
    slots: tuple[Slot, ...] = ()
    layer: str | None = None
    quantizers: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------- call depth
class _Depth(threading.local):
    def __init__(self):
        self.stack: list[int] = []  # ids of the modules being called, while any table is active
        self.active = 0
        self.handles: list = []


_depth = _Depth()


def _push(module, args):
    _depth.stack.append(id(module))


def _pop(module, args, output):
    if _depth.stack and _depth.stack[-1] == id(module):
        _depth.stack.pop()


def _activate() -> None:
    if _depth.active == 0:
        _depth.handles = [_module_hooks.register_module_forward_pre_hook(_push),
                          _module_hooks.register_module_forward_hook(_pop, always_call=True)]
    _depth.active += 1


def _deactivate() -> None:
    _depth.active -= 1
    if _depth.active == 0:
        for h in _depth.handles:
            h.remove()
        _depth.handles = []
        _depth.stack.clear()


# ---------------------------------------------------------------------------------- the mode
class _AtCalls(TorchFunctionMode):
    def __init__(self, module: nn.Module, table: dict):
        super().__init__()
        self.module = module.__dict__.get(ANCHOR) or module  # where the table's paths start
        self.table = table
        self.height = len(_depth.stack)
        self.counts: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if len(_depth.stack) != self.height:  # inside a child module's call
            return func(*args, **kwargs)
        key = call_key(func)
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        call = self.table.get((key, k))
        if call is None:
            return func(*args, **kwargs)
        return _run(call, self.module, func, args, kwargs)


def _run(call: Call, module: nn.Module, func, args, kwargs):
    if call.kind == "layer":
        layer = module.get_submodule(call.layer)
        x = args[0] if args else kwargs.get("input")
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if weight is getattr(layer, "weight", None):
            return layer(x)
        return func(*args, **kwargs)
    if call.kind == "output":
        return module.get_submodule(call.quantizers[0])(func(*args, **kwargs))
    if call.kind == "attention":
        from lq.glue._attention import quantized_sdpa

        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        a = dict(zip(names, args))
        a.update(kwargs)
        qs = [module.get_submodule(p) for p in call.quantizers]
        return quantized_sdpa(a["query"], a["key"], a["value"], *qs, attn_mask=a.get("attn_mask"),
                              dropout_p=a.get("dropout_p", 0.0), is_causal=a.get("is_causal", False),
                              scale=a.get("scale"))
    done: dict = {}

    def quantized(value, path: str):
        if not isinstance(value, torch.Tensor):
            return value
        key = (id(value), path)
        if key not in done:
            done[key] = module.get_submodule(path)(value)
        return done[key]

    new_args, new_kwargs = list(args), dict(kwargs)
    for s in call.slots:
        if s.kwarg is None:
            if s.index >= len(new_args):
                continue
            holder, where = new_args, s.index
        else:
            if s.kwarg not in new_kwargs:
                continue
            holder, where = new_kwargs, s.kwarg
        if s.item is None:
            holder[where] = quantized(holder[where], s.quantizer)
        elif isinstance(holder[where], (list, tuple)) and s.item < len(holder[where]):
            seq = list(holder[where])
            seq[s.item] = quantized(seq[s.item], s.quantizer)
            holder[where] = seq
    out = func(*new_args, **new_kwargs)
    if in_place(func) and args and out is not args[0] and not torch.jit.is_tracing():
        # y.add_(x): y itself holds the (quantized) sum. ``y += x`` rebinds y to what is returned anyway, and the
        # legacy exporter's trace would write the copy as an Expand the fused kernels cannot take: it is left out
        # there (the verification would catch a model that needs it)
        args[0].copy_(out)
        return args[0]
    return out


# ---------------------------------------------------------------------------------- hooks
def _enter(module: nn.Module, args):
    table = module.__dict__.get(ATTR)
    if not table:
        return None
    _activate()
    mode = _AtCalls(module, table)
    mode.__enter__()
    module.__dict__.setdefault("_lq_at_calls_modes", []).append(mode)
    return None


def _leave(module: nn.Module, args, output):
    modes = module.__dict__.get("_lq_at_calls_modes")
    if not modes:
        return None
    mode = modes.pop()
    try:
        mode.__exit__(None, None, None)
    finally:
        _deactivate()
    return None


def install(module: nn.Module, table: dict, anchor: nn.Module | None = None) -> None:
    """Give ``module`` its table and the two hooks (replacing a table it had); ``anchor``: the module the table's
    paths start from, when not ``module``."""
    uninstall(module)
    module.__dict__[ATTR] = dict(table)
    if anchor is not None and anchor is not module:
        module.__dict__[ANCHOR] = anchor
    module.register_forward_pre_hook(_enter)
    module.register_forward_hook(_leave, always_call=True)


def uninstall(module: nn.Module) -> None:
    """Take the table and the hooks off ``module`` (found by function, so a deep copy's too)."""
    module.__dict__.pop(ATTR, None)
    module.__dict__.pop(ANCHOR, None)
    module.__dict__.pop("_lq_at_calls_modes", None)
    for hooks, fn in ((module._forward_pre_hooks, _enter), (module._forward_hooks, _leave)):
        for k in [k for k, h in hooks.items() if h is _enter or h is _leave]:
            hooks.pop(k, None)
            module._forward_hooks_always_called.pop(k, None)


def installed(module: nn.Module) -> bool:
    return bool(module.__dict__.get(ATTR))
