"""AWQ's inverse input scales folded into the op before the Linear where that is exact: no Mul left in the file.

:func:`lq.calib._block_search.search_awq` leaves each activation-scaled Linear's ``1 / s`` as its input quantizer's
``pre_quant_scale`` (one per-channel Mul before its MatMulNBits). :func:`trace` records, on one calibration batch,
every torch call (a ``TorchFunctionMode``): which tensor each block Linear reads, which op made it and who else reads
it. :func:`fold` then moves ``1 / s`` out of the Linear, in the model (the fake-quant model and the file stay one):

* into a LayerNorm's (or RMSNorm's) weight and bias, when its output is read by nothing but Linears holding that
  same scale (the Linears reading one tensor get one shared scale from the search). Pre-LN transformers: Q/K/V
  and the FFN's first Linear. Post-LN BERT (MiniLM) reads every LayerNorm output again as the residual, so
  there the Mul stays: one Mul, shared by Q/K/V (the exporter writes equal Muls on one tensor once);
* into the output channels (weight rows, bias, block amax rows) of the Linear whose output reaches this one only
  through ops linear in it that keep its channels: view, reshape, transpose, ``probs @ V``, attention (as
  ``value``). Attention's output projection takes V's.

After GELU and the like no exact fold exists and the Mul stays. Every fold is checked on the traced batch with the
quantizers off: the Linear's new input must be its old input times ``1 / s`` (else the fold is undone), and the
model's output the same (else every fold is undone).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

#: torch calls that read a tensor's metadata, not its values (``__get__``: .shape, .dtype, .device ...)
_META = frozenset({"__get__", "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
                   "is_floating_point", "is_complex", "is_contiguous", "data_ptr", "element_size", "get_device",
                   "__len__", "__format__", "__repr__", "__hash__"})
#: ops linear in one tensor argument that keep its channels: name -> (position, keyword) of that argument
_CHANNEL_LINEAR = {**{n: (0, None) for n in ("view", "reshape", "transpose", "permute", "contiguous", "flatten",
                                              "unflatten", "clone", "dropout", "movedim", "swapaxes", "unsqueeze",
                                              "squeeze")},
                   "matmul": (1, None), "bmm": (1, None), "__matmul__": (1, None),
                   "scaled_dot_product_attention": (2, "value")}
#: normalizations whose output ends in ``* weight (+ bias)``
_NORMS = (nn.LayerNorm, nn.RMSNorm)
#: relative tolerance of the check that a fold changed the Linear's input by exactly ``1 / s``
CHECK_RTOL = 1e-4
#: and of the check that the model's output stayed the same (float rounding grows through the layers)
OUTPUT_RTOL = 1e-3


@dataclasses.dataclass
class Flow:
    """What :func:`trace` saw: the Linears reading one tensor (``groups``), the norm that made it and whether those
    Linears are its only readers (``norm_of``), and the Linear whose output alone reaches a Linear through
    channel-keeping linear ops (``source_of``)."""

    groups: list[list[str]]
    norm_of: dict[str, str]  # first name of a group -> the norm module whose output only that group reads
    source_of: dict[str, str]  # Linear -> the Linear whose output channels are its input channels


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _Record(TorchFunctionMode):
    """Every torch call's tensor inputs and outputs, and the watched module running it."""

    def __init__(self):
        super().__init__()
        self.keep: list = []  # every tensor seen, alive until the trace ends: ids stay unique
        self.readers: dict[int, list[str | None]] = {}  # id(tensor) -> the watched module of each read, or None
        self.made: dict[int, tuple[str, tuple, dict]] = {}  # id(output) -> (op name, args, kwargs)
        self.inside: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        outs = _tensors(out)
        if name not in _META or outs:  # x.T, x.data (``__get__``) make tensors: reads
            owner = self.inside[-1] if self.inside else None
            ins = _tensors((args, kwargs))
            for t in ins:
                if not any(o is t for o in outs):  # x.contiguous() of a contiguous x is x: no read, no new tensor
                    self.readers.setdefault(id(t), []).append(owner)
            for o in outs:
                if not any(o is t for t in ins):
                    self.made[id(o)] = (name, args, kwargs)
            self.keep.append((args, kwargs, outs))
        return out


def _linear_weight(m: nn.Module) -> torch.Tensor | None:
    w = getattr(m, "weight", None) if isinstance(m, nn.Linear) else None
    return w if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def trace(model: nn.Module, layers: list[str], batch: Any, forward: Callable[[nn.Module, Any], Any]) -> Flow:
    """Run ``batch`` once and record how ``layers`` (names of Linears in ``model``) get their input."""
    mods = dict(model.named_modules())
    rec, inputs, outputs, calls, hooks = _Record(), {}, {}, {}, []

    def pre(name):
        def hook(module, args):
            calls[name] = calls.get(name, 0) + 1
            if name in layers:
                rec.inside.append(name)
                inputs[name] = args[0] if args else None
        return hook

    def post(name):
        def hook(module, args, out):
            if name in layers:
                rec.inside.pop()
            if isinstance(out, torch.Tensor):
                outputs[id(out)] = name
        return hook

    for name, m in mods.items():
        if name in layers or isinstance(m, _NORMS) or _linear_weight(m) is not None:
            hooks += [m.register_forward_pre_hook(pre(name)), m.register_forward_hook(post(name))]
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), rec:
            result = forward(model, batch)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    returned = {id(t) for t in _tensors(result)}
    once = [n for n in layers if calls.get(n) == 1 and isinstance(inputs.get(n), torch.Tensor)]
    by_input: dict[int, list[str]] = {}
    for n in once:
        by_input.setdefault(id(inputs[n]), []).append(n)
    groups = list(by_input.values()) + [[n] for n in layers if n not in once]
    norm_of = {}
    for x, group in by_input.items():
        norm = outputs.get(x)
        if (norm is not None and isinstance(mods[norm], _NORMS) and calls.get(norm) == 1 and x not in returned
                and all(r in group for r in rec.readers.get(x, []))):
            norm_of[group[0]] = norm
    source_of = {}
    for n in once:
        src = _source(rec, outputs, inputs[n], returned, n)
        if src is not None and src != n and calls.get(src) == 1 and _linear_weight(mods[src]) is not None:
            source_of[n] = src
    return Flow(groups, norm_of, source_of)


def _source(rec: _Record, outputs: dict[int, str], x: torch.Tensor, returned: set[int], reader: str) -> str | None:
    """The module whose output reaches ``reader``'s input ``x`` through channel-keeping linear ops, every tensor on
    the way read by nothing but the next op (``x`` by nothing but ``reader``) and none returned; else None."""
    for _ in range(64):
        reads = rec.readers.get(id(x), [])
        alone = all(r == reader for r in reads) if reader is not None else reads == [None]
        if id(x) in returned or not reads or not alone:
            return None
        if id(x) in outputs:
            return outputs[id(x)]
        name, args, kwargs = rec.made.get(id(x), ("", (), {}))
        if name not in _CHANNEL_LINEAR:
            return None
        pos, key = _CHANNEL_LINEAR[name]
        x = kwargs[key] if key in kwargs else (args[pos] if len(args) > pos else None)
        if not isinstance(x, torch.Tensor) or sum(t is x for t in _tensors((args, kwargs))) != 1:
            return None
        reader = None
    return None


@contextlib.contextmanager
def _quantizers_off(model: nn.Module):
    """Every TensorQuantizer of ``model`` disabled (``pre_quant_scale`` still applied): the float function."""
    from lq.nn.modules.tensor_quantizer import TensorQuantizer

    qs = [q for q in model.modules() if isinstance(q, TensorQuantizer)]
    was = [q._disabled for q in qs]
    for q in qs:
        q.disable()
    try:
        yield
    finally:
        for q, d in zip(qs, was):
            q._disabled = d


def _inputs_of(model: nn.Module, names: list[str], batch, forward) -> tuple[dict[str, torch.Tensor], list]:
    """The inputs of the modules ``names`` and the model's output tensors on ``batch``, quantizers off."""
    mods, got, hooks = dict(model.named_modules()), {}, []
    for n in names:
        hooks.append(mods[n].register_forward_pre_hook(lambda m, a, n=n: got.__setitem__(n, a[0].detach().clone())))
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), _quantizers_off(model):
            out = _tensors(forward(model, batch))
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    return got, out


def _scale_rows(m: nn.Module, d: torch.Tensor) -> None:
    """Output channel ``n`` of Linear ``m`` times ``d[n]``: weight rows, bias and the weight quantizer's amax rows."""
    with torch.no_grad():
        m.weight.mul_(d.to(m.weight)[:, None])
        if getattr(m, "bias", None) is not None:
            m.bias.mul_(d.to(m.bias))
        tq = getattr(m, "_weight_quantizer", None)
        if tq is not None and tq.amax is not None and tq.amax.numel() > 1:
            amax = tq.amax.reshape(d.numel(), -1) * d.to(tq.amax)[:, None]
            tq.amax = amax.reshape(tq.amax.shape)


def _quantized(m: nn.Module) -> bool:
    """Whether a quantizer of ``m`` is on (it would see a folded scale)."""
    from lq.nn.modules.tensor_quantizer import TensorQuantizer

    return any(isinstance(q, TensorQuantizer) and q.is_enabled for q in m.modules())


def _rows_scalable(m: nn.Module) -> bool:
    """Whether ``m``'s output channels can be scaled exactly: a Linear whose weight quantizer (if on) has one amax
    per output row or per block of a row, and no other quantizer on (an output quantizer would see the change)."""
    from lq.nn.modules.tensor_quantizer import TensorQuantizer

    w = _linear_weight(m)
    if w is None:
        return False
    for name, q in m.named_children():
        if not isinstance(q, TensorQuantizer) or not q.is_enabled or name == "_input_quantizer":
            continue
        if name != "_weight_quantizer" or q.amax is None or q.dynamic or q.amax.dim() == 0 \
                or q.amax.shape[0] != w.shape[0] or q.amax.numel() % w.shape[0]:
            return False
        blocks = q.block_sizes or {}
        if any(isinstance(a, int) and a % 2 == 0 for a in blocks) or (not blocks and q.axis not in (0, -2, (0,))):
            return False
    return True


def _values(m: nn.Module) -> dict[str, torch.Tensor]:
    """What a fold changes in ``m``: weight, bias and the weight quantizer's amax."""
    tq = getattr(m, "_weight_quantizer", None)
    got = {"weight": m.weight, "bias": getattr(m, "bias", None), "amax": None if tq is None else tq.amax}
    return {k: v.detach().clone() for k, v in got.items() if isinstance(v, torch.Tensor)}


def _restore(m: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        m.weight.copy_(saved["weight"])
        if "bias" in saved:
            m.bias.copy_(saved["bias"])
    if "amax" in saved:
        m._weight_quantizer.amax = saved["amax"]


def _scaled_by(after: torch.Tensor, before: torch.Tensor, inv: torch.Tensor, rtol: float = CHECK_RTOL) -> bool:
    """Whether ``after`` is ``before * inv`` up to float rounding."""
    want = before * inv.to(before)
    if after.shape != want.shape or not want.numel():
        return after.shape == want.shape
    return torch.allclose(after, want, rtol=rtol, atol=rtol * float(want.abs().max()))


def _target(mods: dict[str, nn.Module], flow: Flow, group: list[str], channels: int) -> tuple[str, str] | None:
    """``("norm" | "rows", module name)``: where the ``1 / s`` of ``group`` (``channels`` input channels, one
    shared scale) would go, or None where no exact fold exists."""
    norm = flow.norm_of.get(group[0])
    src = flow.source_of.get(group[0]) if len(group) == 1 else None
    if (norm is not None and getattr(mods[norm], "weight", None) is not None
            and tuple(mods[norm].weight.shape) == (channels,) and not _quantized(mods[norm])):
        return "norm", norm
    if src is not None and _rows_scalable(mods[src]) and mods[src].weight.shape[0] == channels:
        return "rows", src
    return None


def foldable(model: nn.Module, flow: Flow) -> set[str]:
    """The first Linear of every group in ``flow`` whose shared ``1 / s`` has an exact place in the op before (a
    norm only they read, or another Linear's output rows that it alone takes): scaling it costs no Mul."""
    mods = dict(model.named_modules())
    found = {g[0]: _target(mods, flow, g, _linear_weight(mods[g[0]]).shape[1]) for g in flow.groups}
    targets = [t[1] for t in found.values() if t is not None]
    return {first for first, t in found.items() if t is not None and targets.count(t[1]) == 1}


def fold(model: nn.Module, flow: Flow, batch: Any, forward: Callable[[nn.Module, Any], Any]) -> dict[str, str]:
    """Move the ``pre_quant_scale`` of the Linears in ``flow`` into the op before them where exact (module
    docstring); returns ``{layer: where its 1 / s went}`` for the folded ones."""
    mods = dict(model.named_modules())

    def scale(n):
        iq = getattr(mods[n], "_input_quantizer", None)
        return None if iq is None or iq.is_enabled else iq.pre_quant_scale

    plans = []  # (readers, "norm"|"rows", target module name, 1/s)
    for group in flow.groups:
        inv = scale(group[0])
        if inv is None or any(scale(n) is None or not torch.equal(scale(n), inv) for n in group[1:]):
            continue
        where = _target(mods, flow, group, inv.numel())
        if where is not None:
            plans.append((group, *where, inv.detach().clone()))
    if not plans:
        return {}
    targets = [p[2] for p in plans]
    plans = [p for p in plans if targets.count(p[2]) == 1]
    readers = [n for p in plans for n in p[0]]
    before, out_before = _inputs_of(model, readers, batch, forward)
    saved = {}
    for group, kind, target, inv in plans:
        t = mods[target]
        saved[target] = _values(t)
        if kind == "norm":
            with torch.no_grad():
                t.weight.mul_(inv.to(t.weight))
                if getattr(t, "bias", None) is not None:
                    t.bias.mul_(inv.to(t.bias))
        else:
            _scale_rows(t, inv)
        for n in group:
            mods[n]._input_quantizer.pre_quant_scale = None
    after, out_after = _inputs_of(model, readers, batch, forward)
    # the model's output too (a reader of a folded tensor that the trace missed would change it): else undo all
    same_out = all(_scaled_by(a.float(), b.float(), torch.ones((), device=b.device), OUTPUT_RTOL)
                   for a, b in zip(out_after, out_before) if b.is_floating_point())
    done = {}
    for group, kind, target, inv in plans:
        if same_out and all(_scaled_by(after[n], before[n], inv) for n in group):
            what = f"{type(mods[target]).__name__} '{target}'" + (" output rows" if kind == "rows" else "")
            done.update({n: what for n in group})
        else:
            _restore(mods[target], saved[target])
            for n in group:
                mods[n]._input_quantizer.pre_quant_scale = inv
    return done


def fold_awq_scales(model: nn.Module, batch: Any, forward: Callable[[nn.Module, Any], Any] | None = None,
                    layers: list[str] | None = None) -> dict[str, str]:
    """Trace ``batch`` through ``model`` and fold the ``pre_quant_scale`` of its block Linears (or of ``layers``)
    where exact; returns ``{layer: where its 1 / s went}``."""
    from lq.calib._block_search import block_layers

    if forward is None:
        from lq.calib._forward import default_forward as forward
    names = layers if layers is not None else [n for n, _ in block_layers(model)]
    return fold(model, trace(model, names, batch, forward), batch, forward)
