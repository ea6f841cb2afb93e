"""Bias correction: put back, per output channel, the mean shift that quantization adds to a layer's output.

Rounding a layer's weights and inputs moves the mean of its output a little in every channel, and the layers
after it read that shift as signal. The correction is the difference, per output channel, between the float
model's mean output and the quantized model's on calibration data. It is stored as the layer's bias shift
(:mod:`lq.nn.modules._bias_shift`), added to its bias only while the layer quantizes: the fake-quant model
computes with it, the exported file holds it in the layer's bias (no new node, so the file's speed is
unchanged), QAT starts from it, checkpoints carry it, and with quantizers off the model is still the user's
float model. A bias-less conv (one a BatchNorm follows) gets the shift as its bias; the BatchNorm folds onto it
in the file. Layers called more than once per forward (one bias for several inputs) and layers never called are
left alone and named in the result.

Layer by layer in forward order, each correction seeing the corrected layers before it, in ONE quantized pass:
the estimation batches are stacked into one batch, the float pass records every layer's mean output, and in
the quantized pass a forward hook on each layer measures its output, sets its shift, and hands the corrected
output on, so every later layer is measured behind corrected ones (correcting all layers at once from one
uncorrected pass counts the upstream shift twice: it made the bench's MobileNet worse with every repetition).
Batches that cannot be stacked (token batches padded to different lengths) estimate on the first batch alone.

A correction is kept per layer only where it lowers the squared error of that layer's mean output against float
on calibration batches it was not estimated from (the judging batches: the odd ones of those given), and kept
at all only where the model's output on them is closer to float with the corrections (output R2, as ``auto``
judges).

Under ``torch.distributed`` every per-channel sum is all-reduced inside the hook (each rank runs the same
layers in the same order, as SyncBatchNorm relies on) and the scores are averaged, so every rank applies the
same corrections. If anything fails, every layer keeps the shift it had.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lq import progress as lq_progress
from lq.calib._fidelity import fidelity_metric, quantization_disabled
from lq.glue._at_calls import outside
from lq.nn.modules import _bias_shift
from lq.nn.modules._utils import QuantMixin
from lq.nn.modules.tensor_quantizer import TensorQuantizer

__all__ = ["BiasCorrectionResult", "correct_biases", "squared_error_change", "stack_batches"]
#: the stacked estimation batch holds at most this many rows, and at most ELEMENTS input values in all
ROWS = 128
ELEMENTS = 1 << 22

_LAYERS = (nn.Linear, nn.modules.conv._ConvNd)


@dataclass
class BiasCorrectionResult:
    """What :func:`correct_biases` did: the layers corrected (module name -> the largest shift), those whose
    correction did not help on the judging batches, and those left alone with why."""

    corrected: dict[str, float] = field(default_factory=dict)
    not_helping: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    rows: int = 0
    #: the model's output against float on the judging batches (by ``judge``) with the corrections kept, and without
    score: float | None = None
    score_without: float | None = None
    #: the :func:`fidelity_metric` kind of ``score``: ``"r2"``, or ``"top1"`` where ``auto`` chose by it
    judge: str = "r2"
    #: the model's output was further from float with the corrections: none kept
    fell_back: bool = False

    def __str__(self) -> str:
        s = f"bias correction: {len(self.corrected)} layer(s) corrected on {self.rows} rows"
        if self.not_helping:
            s += f", {len(self.not_helping)} not (no gain on the judging batches)"
        if self.skipped:
            s += f", {len(self.skipped)} left alone"
        if self.score is not None:
            what = "output R2" if self.judge == "r2" else f"output {self.judge}"
            s += f"; {what} {self.score:.5f} with, {self.score_without:.5f} without"
            if self.fell_back:
                s += ": none kept"
        return s


@dataclass
class _Site:
    """One correctable layer, its float model's mean output on the estimation batch, and the shift it got."""

    name: str
    layer: nn.Module
    target: torch.Tensor | None = None
    shift: torch.Tensor | None = None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _all_reduce(t: torch.Tensor, process_group, op=None) -> torch.Tensor:
    """``t`` reduced over the ranks (a sum unless ``op``), on the device the process group talks on."""
    if not _distributed():
        return t
    from lq.calib.calibrator import _comm_device

    x = t.to(_comm_device(None, process_group))
    torch.distributed.all_reduce(x, op=op or torch.distributed.ReduceOp.SUM, group=process_group)
    return x.to(t.device)


def _channel_axis(module: nn.Module) -> int:
    return -1 if isinstance(module, nn.Linear) else 1


def _channel_sums(output: torch.Tensor, axis: int) -> tuple[torch.Tensor, float]:
    """Per-channel sums of ``output`` (float64) and the number of values each sums."""
    x = output.detach().movedim(axis, 0)
    c = x.shape[0]
    return x.reshape(c, -1).sum(1, dtype=torch.float64), x.numel() / max(c, 1)


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Quantized convs / linears with at least one quantizer on, in model order."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin) and isinstance(m, _LAYERS):
            if any(isinstance(q, TensorQuantizer) and q.is_enabled for q in m.modules()):
                out.append((name, m))
    return out


# ------------------------------------------------------------------------------------ the estimation batch
def stack_batches(batches: Sequence, rows: int = ROWS, elements: int = ELEMENTS) -> Any:
    """The batches concatenated along their first dimension into one batch of at most ``rows`` rows (and
    ``elements`` values in its largest tensor), the structure kept (tensors, tuples, lists, dicts); the first
    batch alone where they cannot be concatenated."""
    if not batches:
        raise ValueError("bias correction needs at least one batch")
    try:
        stacked = _cat(list(batches))
    except (TypeError, RuntimeError, ValueError):
        stacked = batches[0]
    n = _rows(stacked)
    if n is None:
        return stacked
    per_row = max(1, _largest(stacked) // max(n, 1))
    keep = max(1, min(rows, elements // per_row, n))
    return _head(stacked, keep) if keep < n else stacked


def _cat(items: list) -> Any:
    first = items[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return first
        return torch.cat(items, 0)
    if isinstance(first, Mapping):
        if any(set(b) != set(first) for b in items):
            raise ValueError("batches with different keys")
        return {k: _cat([b[k] for b in items]) for k in first}
    if isinstance(first, (list, tuple)):
        if any(len(b) != len(first) for b in items):
            raise ValueError("batches of different lengths")
        parts = [_cat([b[i] for b in items]) for i in range(len(first))]
        return type(first)(parts) if type(first) in (list, tuple) else tuple(parts)
    if all(b == first for b in items):
        return first
    raise TypeError(f"cannot stack {type(first).__name__} batches")


def _tensors(batch: Any):
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)


def _rows(batch: Any) -> int | None:
    sizes = {t.shape[0] for t in _tensors(batch) if t.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _largest(batch: Any) -> int:
    return max((t.numel() for t in _tensors(batch)), default=1)


def _head(batch: Any, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:n] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        return {k: _head(v, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_head(v, n) for v in batch) if type(batch) in (list, tuple) else \
            tuple(_head(v, n) for v in batch)
    return batch


# ------------------------------------------------------------------------------------ the passes
def _float_pass(model, candidates, batch, forward, result: BiasCorrectionResult, process_group) -> list[_Site]:
    """Float model on the estimation batch: each candidate's mean output and how often it is called; returns
    the sites, each with its target."""
    layers = [m for _, m in candidates]
    means: list = []
    with torch.no_grad(), quantization_disabled(model), _measuring(layers, means, process_group) as seen, \
            lq_progress.step("Bias correction: float pass", 1) as shown:
        forward(model, batch)
        shown.advance()
    calls = _all_reduce(seen.calls, process_group, torch.distributed.ReduceOp.MAX if _distributed() else None)
    sites = []
    for i, (name, m) in enumerate(candidates):
        if calls[i] == 0:
            result.skipped[name] = "never called in the calibration forward"
        elif calls[i] > 1:
            result.skipped[name] = f"called {int(calls[i])} times per forward: one bias serves several inputs"
        else:
            sites.append(_Site(name, m, target=means[i]))
    return sites


def _channels(m: nn.Module) -> int:
    if isinstance(m, nn.Linear):
        return m.out_features
    return m.out_channels


def _corrected_pass(model, sites: list[_Site], batch, forward, process_group) -> None:
    """The quantized model on the estimation batch, each site corrected as its output goes by."""

    def correct(site: _Site):
        def hook(module, args, output):
            with outside():
                axis = _channel_axis(module)
                s, n = _channel_sums(output, axis)
                s = _all_reduce(torch.cat([s, torch.tensor([n], dtype=torch.float64)]), process_group)
                step = site.target - s[:-1] / s[-1]
                if not torch.isfinite(step).all():
                    return None
                site.shift = step
                _bias_shift.set_bias_shift(module, step)
                shape = [1] * output.dim()
                shape[axis] = -1
                return output + step.to(output).reshape(shape)
        return hook

    handles = [s.layer.register_forward_hook(correct(s), prepend=True) for s in sites]
    try:
        with torch.no_grad(), lq_progress.step("Bias correction: quantized pass", 1) as shown:
            forward(model, batch)
            shown.advance()
    finally:
        for h in handles:
            h.remove()


def _judge(model, sites: list[_Site], batches: Sequence, forward, result, process_group, judge: str) -> None:
    """On the judging ``batches``: keep a site's correction only where it lowers that layer's squared mean error,
    then keep the corrections at all only where the model's output is closer to float with them (by ``judge``,
    a :func:`fidelity_metric` kind: output R2, or ``"top1"``, agreement in top-1 where the output is a classifier's
    class scores and output R2 where it is not)."""
    fp_means: list = []
    result.judge = judge
    try:
        with _measuring([s.layer for s in sites], fp_means, process_group):
            metric = fidelity_metric(model, batches, forward=forward, kind=judge)
        if judge == "top1" and not metric.info.get("class_scores"):  # agreement in top-1 means nothing there
            result.judge = "r2"
            metric = fidelity_metric(model, batches, forward=forward, kind="r2", reference=metric.reference)
    except Exception:  # noqa: BLE001 - an output with nothing per sample to compare: the per-layer verdict alone
        # (an error of the model itself comes back from the float pass below)
        metric = None
        with quantization_disabled(model), _measuring([s.layer for s in sites], fp_means, process_group):
            _run(model, batches, forward)
    q_means: list = []
    with _measuring([s.layer for s in sites], q_means, process_group):
        score = _score(metric, model, batches, forward, process_group)
    reverted = False
    for s, t, g in zip(sites, fp_means, q_means):
        if s.shift is None:
            continue
        if t is not None and g is not None:
            gain = squared_error_change(s.shift, (t - g) + s.shift)  # (t - g) + shift: the error without it
            if not (math.isfinite(gain) and gain < 0.0):
                _bias_shift.set_bias_shift(s.layer, None)
                s.shift = None
                result.not_helping.append(s.name)
                reverted = True
    kept = [s for s in sites if s.shift is not None]
    if metric is not None and kept:
        if reverted:
            score = _score(metric, model, batches, forward, process_group)
        for s in kept:
            _bias_shift.set_bias_shift(s.layer, None)
        without = _score(metric, model, batches, forward, process_group)
        result.score, result.score_without = score, without
        if without > score:
            result.fell_back = True
            return
        for s in kept:
            _bias_shift.set_bias_shift(s.layer, s.shift)
    for s in kept:
        result.corrected[s.name] = float(s.shift.abs().max())


def squared_error_change(shift: torch.Tensor, error: torch.Tensor) -> float:
    """How much a layer's squared mean error (summed over channels) changes when ``shift`` is added to an output
    whose mean error against float is ``error``: ``|error - shift|^2 - |error|^2``; negative where it helps."""
    return float((shift * shift - 2 * shift * error).sum())


def _score(metric, model, batches, forward, process_group) -> float:
    """The metric (output R2 or top-1 agreement against float), averaged over the ranks (the quantized pass alone
    without a metric)."""
    if metric is None:
        _run(model, batches, forward)
        return 0.0
    v = float(metric(model))
    if _distributed():
        v = float(_all_reduce(torch.tensor([v], dtype=torch.float64), process_group)[0]) / \
            torch.distributed.get_world_size(process_group)
    return v


def _run(model, batches, forward) -> None:
    with torch.no_grad():
        for b in batches:
            forward(model, b)


class _measuring:
    """Context manager: the per-channel mean output of each of ``layers`` over the forwards run inside it, appended
    to ``out`` on exit (reduced over the ranks; None for a layer no rank saw), and ``calls``: how often each ran."""

    def __init__(self, layers, out: list, process_group):
        self.layers, self.out, self.group = list(layers), out, process_group
        self.sums: list = [None] * len(self.layers)
        self.counts = torch.zeros(len(self.layers), dtype=torch.float64)
        self.calls = torch.zeros(len(self.layers), dtype=torch.int64)

    def _hook(self, i):
        def hook(module, args, output):
            if not isinstance(output, torch.Tensor) or output.dim() == 0:
                return
            with outside():
                s, n = _channel_sums(output, _channel_axis(module))
                self.sums[i] = s if self.sums[i] is None else self.sums[i] + s
                self.counts[i] += n
                self.calls[i] += 1
        return hook

    def __enter__(self):
        # first among the layer's hooks: its output before an output quantizer's hook rounds it
        self.handles = [m.register_forward_hook(self._hook(i), prepend=True) for i, m in enumerate(self.layers)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        if exc[0] is None:
            self.out.extend(_reduced_means(self.sums, self.counts, [_channels(m) for m in self.layers], self.group))
        return False


def _reduced_means(sums, counts, channels, process_group) -> list:
    flat = _all_reduce(torch.cat([torch.zeros(c, dtype=torch.float64) if t is None else t
                                  for t, c in zip(sums, channels)] + [counts]), process_group)
    out, i = [], 0
    for c, n in zip(channels, flat[-len(channels):].tolist()):
        out.append(flat[i:i + c] / n if n > 0 else None)
        i += c
    return out


def correct_biases(model: nn.Module, batches: Sequence, forward: Callable[[nn.Module, Any], Any], *,
                   process_group=None, judge: str = "r2") -> BiasCorrectionResult:
    """Set the bias shift of every quantized conv / linear of a calibrated ``model`` to the mean output shift
    quantization causes: estimated on the even ``batches`` stacked into one, judged on the odd ones (see the
    module docstring); earlier shifts are replaced. Returns what was done. Every rank of a process group must
    call it, with batches. ``judge``: how the model's output is compared with float's to keep the corrections at
    all (a :func:`fidelity_metric` kind: ``"top1"`` behind per-sample ranges, whose clipping output R2 cannot
    judge, where the output is class scores; see :func:`_judge`)."""
    result = BiasCorrectionResult()
    candidates = _candidates(model)
    if not candidates or not batches:
        return result
    saved = [(m, _bias_shift.bias_shift(m)) for _, m in candidates]
    was_training = model.training
    try:
        model.eval()
        for m, _ in saved:
            _bias_shift.set_bias_shift(m, None)
        batch = stack_batches(list(batches)[::2])
        result.rows = _rows(batch) or 0
        sites = _float_pass(model, candidates, batch, forward, result, process_group)
        if sites:
            _corrected_pass(model, sites, batch, forward, process_group)
            _judge(model, sites, list(batches)[1::2], forward, result, process_group, judge)
    except BaseException:
        for m, shift in saved:
            _bias_shift.set_bias_shift(m, shift)
        raise
    finally:
        model.train(was_training)
    return result
