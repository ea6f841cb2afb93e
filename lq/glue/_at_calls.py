"""Quantizers applied at the torch calls the capture named, while a module's forward runs.

Placement decided on the captured graph names its ops by ``(call key, ordinal)`` inside one module's forward
(:mod:`lq.capture`). This module puts the decision into the user's model without changing any forward: the
module gets a table ``{(key, ordinal): Call}`` and a forward pre-hook that enters a ``TorchFunctionMode`` for the
length of its forward (an always-called forward hook leaves it, also when the forward raises). The mode counts
the torch calls made directly in that forward: a global module pre-hook and post-hook (registered once per
process by the first such call; they look up one attribute of any other module call) take the mode off torch's
stack while a child module runs (the ops inside children pay nothing for it) and put it back after. At the calls in the table it quantizes their operands, calls a layer whose weight a function used,
or writes out an attention. Calibration, QAT and both ONNX exporters
run the same Python, so all of them see the same quantizers; nothing is traced ahead, so a forward with Python
control flow, helper methods or lists of tensors gets its quantizers like any other.

The quantizers are looked up by path from the module at call time, so a deep copy of the model quantizes with
its own copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks
from torch.overrides import TorchFunctionMode

from lq.capture import call_key, in_place
from lq.nn.modules.quant_activation import gated_silu

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
    """What happens at one call: ``operands`` quantizes the slots (``gated``: and computes ``F.silu`` with its
    gate quantized by ``quantizers[0]``); ``output`` quantizes the result with
    ``quantizers[0]``; ``layer`` calls the module at ``layer`` instead of the function
    (``F.linear(x, self.qkv.weight, self.qkv.bias)`` -> ``self.qkv(x)``); ``attention`` writes
    ``scaled_dot_product_attention`` out with the four ``quantizers`` (q, k, probabilities, v)."""

    kind: str
    slots: tuple[Slot, ...] = ()
    layer: str | None = None
    quantizers: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------- module calls
#: a frame's mode: on torch's mode stack, taken off by lq while a child module runs, or taken off by torch while the
#: mode's own ``__torch_function__`` runs (modules called from there must not put it back)
_RUNNING, _SUSPENDED, _HANDLING = 0, 1, 2


class _Frame:
    __slots__ = ("module_id", "mode", "state")

    def __init__(self, module_id: int, mode):
        self.module_id = module_id
        self.mode = mode
        self.state = _RUNNING


class _Calls(threading.local):
    def __init__(self):
        self.frames: list[_Frame] = []  # one per module call in progress inside an lq forward


_calls = _Calls()
#: the global module hooks (process-wide; the frames are per thread)
_global = {"on": False, "handles": []}


def _begin(module: nn.Module, args=None):
    """A module call starts: the calling frame's mode steps aside (what a child runs is not that frame's), and a
    module with a table gets its own mode for the call. Outside an lq forward, a module without a table costs one
    dictionary lookup."""
    frames = _calls.frames
    table = module.__dict__.get(ATTR)
    if not frames and not table:
        return None
    if frames:
        top = frames[-1]
        if top.mode is not None and top.state == _RUNNING:
            top.mode.__exit__(None, None, None)
            top.state = _SUSPENDED
    frame = _Frame(id(module), _AtCalls(module, table) if table else None)
    frames.append(frame)
    if frame.mode is not None:
        frame.mode.frame = frame
        frame.mode.__enter__()
    return None


def _end(module: nn.Module, args=None, output=None):
    """A module call ends (also by an exception): its mode leaves, the calling frame's comes back."""
    frames = _calls.frames
    if not frames or frames[-1].module_id != id(module):
        return None  # not a call of an lq forward (or one that started before the hooks were on)
    frame = frames.pop()
    if frame.mode is not None and frame.state == _RUNNING:
        frame.mode.__exit__(None, None, None)
    if frames:
        top = frames[-1]
        if top.mode is not None and top.state == _SUSPENDED:
            top.mode.__enter__()
            top.state = _RUNNING
    return None


@contextlib.contextmanager
def outside():
    """Torch calls made inside are no calls of the lq forward that is running: a forward hook's own arithmetic
    (calibration's statistics, a correction added to a layer's output) runs after torch's global hooks have put the
    calling module's mode back, and would otherwise be counted among that module's calls and shift the ordinals its
    quantizers are placed by."""
    frames = _calls.frames
    top = frames[-1] if frames else None
    if top is None or top.mode is None or top.state != _RUNNING:
        yield
        return
    top.mode.__exit__(None, None, None)
    top.state = _SUSPENDED
    try:
        yield
    finally:
        top.mode.__enter__()
        top.state = _RUNNING


def _ensure_hooks() -> None:
    """The global module pre-hook and always-called post-hook, registered once per process by the first call of a
    module with a table (a model unpickled in a new process registers them on its first call). They do nothing
    for a module called outside an lq forward but look up one attribute."""
    if not _global["on"]:
        _global["on"] = True
        _global["handles"] = [_module_hooks.register_module_forward_pre_hook(_begin),
                              _module_hooks.register_module_forward_hook(_end, always_call=True)]


# ---------------------------------------------------------------------------------- the mode
class _AtCalls(TorchFunctionMode):
    """The torch calls made directly in one forward of a module with a table: only this frame's calls reach it
    (its mode steps aside while a child module runs)."""

    def __init__(self, module: nn.Module, table: dict):
        super().__init__()
        self.module = module.__dict__.get(ANCHOR) or module  # where the table's paths start
        self.table = table
        self.counts: dict = {}
        self.frame: _Frame | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = _KEYS.get(func)
        if key is None:
            key = _KEYS[func] = call_key(func)
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        call = self.table.get((key, k))
        if call is None:
            return func(*args, **kwargs)
        frame, was = self.frame, self.frame.state
        frame.state = _HANDLING  # torch has taken this mode off its stack while it handles the call
        try:
            return _run(call, self.module, func, args, kwargs)
        finally:
            frame.state = was


#: call keys by function, computed once (call_key reads attributes of torch.Tensor)
_KEYS: dict = {}


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
    if call.kind == "gated":  # F.silu(x) -> x * q(sigmoid(x)) on the quantized x
        x = new_args[0] if new_args else new_kwargs["input"]
        return gated_silu(x, module.get_submodule(call.quantizers[0]))
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
    """The pre-hook of a module with a table: registers the global hooks on the first call in a process, and starts
    the call's frame where the global pre-hook did not (it ran before it was registered)."""
    _ensure_hooks()
    frames = _calls.frames
    if not frames or frames[-1].module_id != id(module):
        _begin(module)
    return None


def _leave(module: nn.Module, args, output):
    """The always-called post-hook: ends the call's frame where the global post-hook did not."""
    _end(module)
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
    for hooks, fn in ((module._forward_pre_hooks, _enter), (module._forward_hooks, _leave)):
        for k in [k for k, h in hooks.items() if h is _enter or h is _leave]:
            hooks.pop(k, None)
            module._forward_hooks_always_called.pop(k, None)


def installed(module: nn.Module) -> bool:
    return bool(module.__dict__.get(ATTR))
