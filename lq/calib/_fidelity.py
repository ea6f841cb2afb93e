"""What ``method="auto"`` and the sensitivity tools share: a model's quantized layers and their switches, how
close its output stays to float (:func:`fidelity_metric`), and the calibration method search per layer
group that uses it (:func:`calibration_method_search`).

These lived in :mod:`lq.sensitivity`, which calibrates through :mod:`lq.calibration`, which runs
:mod:`lq.auto_calib`, which needed them back: a circle. Here, below all three, the dependencies point one
way: ``lq.calib._forward`` <- this module <- ``lq.auto_calib`` <- ``lq.calibration`` <- ``lq.sensitivity``
(checked by ``tests/test_layering.py``). The public names stay importable from :mod:`lq.sensitivity`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lq.calib._forward import default_forward
from lq.calib.histogram import HistogramCalibrator
from lq.nn.modules._utils import QuantMixin
from lq.nn.modules.tensor_quantizer import TensorQuantizer

__all__ = [
    "FIDELITY_KINDS",
    "MethodSearchResult",
    "Metric",
    "agreement_rows",
    "calibration_method_search",
    "fidelity_metric",
    "group_members",
    "is_class_scores",
    "quantization_disabled",
    "quantized_layers",
]

#: what :func:`fidelity_metric` measures
FIDELITY_KINDS = ("cosine", "r2", "mse", "top1")

Metric = Callable[[nn.Module], float]


# =========================================================================== layers and switches
def quantized_layers(model: nn.Module) -> dict[str, list[TensorQuantizer]]:
    """``{layer name: its enabled quantizers}`` for every quantized layer of ``model``, in model order.

    A layer is an lq quantized module (``QuantLinear``, ``QuantConv2d``, ``QuantMultiheadAttention`` ...);
    quantized modules inside another one (the ``out_proj`` of attention) belong to the outer layer.
    Layers whose quantizers are all disabled are left out (there is nothing to switch).
    """
    out: dict[str, list[TensorQuantizer]] = {}
    for name, m in model.named_modules():
        if not isinstance(m, QuantMixin) or name in out:
            continue
        if any(name.startswith(p + ".") for p in out):
            continue  # a quantized module inside a quantized layer belongs to that layer
        qs: list[TensorQuantizer] = []
        for sub in m.modules():
            if isinstance(sub, TensorQuantizer) and sub.is_enabled and all(sub is not q for q in qs):
                qs.append(sub)
        out[name] = qs
    return {k: v for k, v in out.items() if v}


class quantization_disabled:
    """Context manager: the given quantizers (default: every quantizer of ``model``) pass inputs through
    unchanged; their enabled flags are restored on exit."""

    def __init__(self, model: nn.Module | None = None, quantizers: Iterable[TensorQuantizer] | None = None):
        if quantizers is None:
            if model is None:
                raise ValueError("quantization_disabled needs a model or a list of quantizers")
            quantizers = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
        self.quantizers = list(quantizers)

    def __enter__(self):
        self._saved = [(q, q._disabled) for q in self.quantizers]
        for q in self.quantizers:
            q.disable()
        return self

    def __exit__(self, *exc):
        for q, disabled in self._saved:
            q._disabled = disabled
        return False


def _glob_escape(name: str) -> str:
    """A module name as a glob that matches exactly it (``[`` would start a character class)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in name)


# =========================================================================== calibration method per layer group
@dataclass
class MethodSearchResult:
    """The outcome of :func:`calibration_method_search`.

    Attributes:
        methods: ``{group: chosen method}``.
        method_overrides: ``{layer glob: method}`` for :class:`lq.config.CalibConfig` ``method_overrides``
            (and :func:`lq.calibrate_model`); every glob of a group gets the group's method.
        percentile: the percentile the ``"percentile"`` candidate used (``CalibConfig.percentile``).
        metric: the metric with the chosen methods.
        trace: ``(group, method, metric)`` for every evaluation, in order.
    """

    methods: dict[str, str]
    method_overrides: dict[str, str]
    percentile: float
    metric: float
    trace: list[tuple[str, str, float]] = field(default_factory=list)

    def apply(self, calib=None):
        """A copy of ``calib`` (a :class:`lq.config.CalibConfig`, default the plain one) with these overrides."""
        from lq.config import CalibConfig

        calib = CalibConfig() if calib is None else calib
        return replace(calib, method_overrides={**calib.method_overrides, **self.method_overrides},
                       percentile=self.percentile)


def calibration_method_search(
    model: nn.Module,
    metric: Metric,
    *,
    groups: dict[str, str | Sequence[str]] | None = None,
    methods: Sequence[str] = ("max", "entropy", "percentile", "mse"),
    percentile: float = 99.99,
    start: str | None = None,
    higher_is_better: bool = True,
    progress: Callable[[str], None] | None = None,
) -> MethodSearchResult:
    """Pick the calibration method of each group of layers by the metric (coordinate descent, one pass).

    Activations differ by layer type (a transformer's LayerNorm outputs keep a few huge channels that
    must not be clipped; GELU outputs have a long thin tail that should be), so one method for the whole
    model is rarely the best. Every group starts at ``start`` (default the first method); then, group after
    group, each method is tried and the best kept: ``1 + len(groups) * (len(methods) - 1)`` evaluations.

    The model's input quantizers must hold histogram statistics (collect them with
    ``lq.calibration.collect`` and a histogram method, or ``calibrate_model(method="entropy")``); weight
    quantizers are left as they are. On return the model holds the chosen amax.

    Args:
        model: a quantized model whose input quantizers hold histogram statistics.
        metric: ``metric(model) -> float``.
        groups: ``{group name: layer glob or list of globs}`` (default: one group per quantized layer).
        methods: candidates among ``max``, ``entropy``, ``percentile``, ``mse``.
        percentile: for the ``percentile`` candidate.
        higher_is_better: direction of ``metric``.

    Returns:
        :class:`MethodSearchResult`; ``result.apply(calib)`` gives the :class:`lq.config.CalibConfig` to use.
    """
    allowed = ("max", "entropy", "percentile", "mse")
    bad = [m for m in methods if m not in allowed]
    if bad or not methods:
        raise ValueError(f"methods={list(methods)!r} is not allowed: choose from {list(allowed)}")
    start = start or methods[0]
    if groups is None:
        groups = {n: n for n in quantized_layers(model)}
    globs = {g: [v] if isinstance(v, str) else list(v) for g, v in groups.items()}
    members = group_members(model, globs)
    say = progress or (lambda msg: None)
    better = (lambda a, b: a > b) if higher_is_better else (lambda a, b: a < b)

    def load(g, method):
        kw = {"percentile": percentile} if method == "percentile" else {}
        for q in members[g]:
            q.load_calib_amax(method, **kw)

    chosen = {g: start for g in members}
    for g in members:
        load(g, start)
    say(f"all groups: {start}")
    best = float(metric(model))
    trace = [("*", start, best)]
    for g in members:
        for m in methods:
            if m == chosen[g]:
                continue
            load(g, m)
            say(f"{g}: {m}")
            v = float(metric(model))
            trace.append((g, m, v))
            if better(v, best):
                best, chosen[g] = v, m
        load(g, chosen[g])
    overrides = {p: chosen[g] for g, pats in globs.items() for p in pats}
    return MethodSearchResult(chosen, overrides, percentile, best, trace)


def group_members(model: nn.Module, globs: dict[str, Sequence[str]]) -> dict[str, list[TensorQuantizer]]:
    """``{group: the quantizers holding histogram statistics of the quantized layers its globs match}``."""
    layers = quantized_layers(model)
    members: dict[str, list[TensorQuantizer]] = {}
    for g, pats in globs.items():
        qs = []
        for layer, lqs in layers.items():
            if any(fnmatch.fnmatchcase(layer, p) for p in pats):
                for q in lqs:
                    if isinstance(q.calibrator, HistogramCalibrator) and q.calibrator.has_data:
                        qs.append(q)
        if not qs:
            raise ValueError(f"group {g!r} ({list(pats)}) matches no quantized layer whose input quantizer holds "
                             "histogram statistics (collect them with a histogram method first)")
        members[g] = qs
    return members


# =========================================================================== a label-free metric
def fidelity_metric(
    model: nn.Module,
    batches: Sequence,
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    output: Callable[[Any, Any], torch.Tensor] | None = None,
    kind: str = "cosine",
    reference: Sequence[torch.Tensor] | None = None,
    state: Callable[[nn.Module], Any] | None = None,
    memo: dict | None = None,
) -> Metric:
    """A metric that needs no labels: how close the quantized model's outputs stay to the floating point ones.

    The floating point reference is computed now, on ``batches``, with every quantizer of ``model``
    switched off (``model`` may already be quantized), unless it is given. ``kind``:

    * ``"cosine"``: mean cosine similarity of the flattened per-sample outputs (higher is better). Blind to
      scale: a score map at half its amplitude, or shifted, keeps a cosine near 1 while every threshold
      on it moves;
    * ``"r2"``: ``1 - sum((out - float)**2) / sum((float - mean(float))**2)`` over all the batches, the
      squared error relative to the float output's variance (higher is better): 1 is exact, 0 is no
      closer than a constant output at the float output's mean (what a collapsed dense output such as a
      segmentation score map gives), below 0 is worse than that. It sees scale, offset and shape errors;
    * ``"mse"``: mean squared error (lower is better);
    * ``"top1"``: fraction of samples whose argmax agrees (higher is better).

    Args:
        model: the model whose reference outputs are recorded.
        batches: a list of batches (iterated once per evaluation).
        forward: ``forward(model, batch)`` (default :func:`lq.calibration.default_forward`).
        output: ``output(result_of_forward, batch) -> tensor (batch, ...)``, e.g. pooled embeddings
            (default: the forward result itself, or its first element / ``last_hidden_state``).
        reference: the float outputs on ``batches`` already at hand, one per batch as :func:`output_rows` makes
            them (a calibration pass that ran the model in float has them); None (or a None entry): computed now.
        state: ``state(model) -> a hashable key`` of the model's quantization as it stands. With it each batch's
            score is kept per state in ``memo`` (a dict; metrics on overlapping batches may share one), so a
            state scored before costs no forward again: a search that comes back to a state, or a check that
            scores on more batches what a search scored on some.

    The metric's ``reference`` attribute holds the float outputs it compares with.
    """
    if kind not in FIDELITY_KINDS:
        raise ValueError(f"kind={kind!r} is not allowed: choose one of {list(FIDELITY_KINDS)}")
    batches = list(batches)
    fwd = forward or default_forward
    out_fn = output or _default_output
    memo = {} if memo is None else memo

    info: dict = {}

    @torch.no_grad()
    def run(m, b):
        was = m.training
        m.eval()
        try:
            result = fwd(m, b)
            if "class_scores" not in info:
                info["class_scores"] = is_class_scores(result, b, out_fn)
            return output_rows(result, b, out_fn)
        finally:
            m.train(was)

    ref = [None] * len(batches) if reference is None else list(reference)
    if len(ref) != len(batches):
        raise ValueError(f"reference has {len(ref)} output(s) for {len(batches)} batch(es)")
    if any(r is None for r in ref):
        with quantization_disabled(model):
            ref = [run(model, b) if r is None else r for b, r in zip(batches, ref)]
    if kind == "r2":
        mean = sum(float(r.double().sum()) for r in ref) / max(1, sum(r.numel() for r in ref))
        variance = sum(float(((r.double() - mean) ** 2).sum()) for r in ref)

    def batch_score(m, b, r) -> float:
        """The batch's share of the metric's sum (squared error, summed cosine, agreeing rows)."""
        key = None if state is None else (state(m), id(b), kind)
        if key is not None and key in memo:
            return memo[key]
        agree = None if key is None else memo.get((key[0], id(b), "agree"))
        if kind == "top1" and agree is not None:  # a forward of another kind in this state left the rows
            memo[key] = float(agree.sum())
            return memo[key]
        o = run(m, b)
        if key is not None:  # which rows agree in top-1 with float, whatever the kind (a paired test reads them)
            memo[(key[0], id(b), "agree")] = o.argmax(1) == r.argmax(1)
        if kind == "cosine":
            v = float(torch.nn.functional.cosine_similarity(o, r, dim=1).sum())
        elif kind in ("mse", "r2"):
            v = float(((o.double() - r.double()) ** 2).sum())
        else:
            v = float((o.argmax(1) == r.argmax(1)).sum())
        if key is not None:
            memo[key] = v
        return v

    def metric(m: nn.Module) -> float:
        total = sum(batch_score(m, b, r) for b, r in zip(batches, ref, strict=True))
        if kind == "mse":
            return total / sum(r.numel() for r in ref)
        if kind == "r2":
            return 1.0 - total / variance if variance > 0 else (1.0 if total == 0 else -math.inf)
        return total / sum(len(r) for r in ref)

    metric.higher_is_better = kind != "mse"  # type: ignore[attr-defined]
    metric.__name__ = f"output {kind} vs float"
    metric.reference = ref  # type: ignore[attr-defined]
    #: ``info["class_scores"]``: whether the output is one row of class scores per sample (:func:`is_class_scores`),
    #: known once the metric ran the model
    metric.info = info  # type: ignore[attr-defined]
    return metric


def agreement_rows(metric: Metric, model: nn.Module, batches: Sequence, state: Callable[[nn.Module], Any],
                   memo: dict) -> torch.Tensor:
    """Per row of ``batches``, whether ``model``'s top-1 agrees with float's, as ``metric`` (a
    :func:`fidelity_metric` made with ``state`` and ``memo`` on these batches) scores the model as it stands:
    one forward per batch not scored in this state before."""
    if not batches:
        return torch.zeros(0, dtype=torch.bool)
    metric(model)
    s = state(model)
    return torch.cat([memo[(s, id(b), "agree")] for b in batches])


def is_class_scores(result, batch, output: Callable[[Any, Any], torch.Tensor] | None = None) -> bool:
    """Whether a forward's ``result`` is a classifier's: one row of at least two float scores per sample (2-D
    logits, not a score map, a sequence of hidden states or a single regressed value)."""
    try:
        o = (output or _default_output)(result, batch)
    except TypeError:
        return False
    return isinstance(o, torch.Tensor) and o.is_floating_point() and o.dim() == 2 and o.shape[1] >= 2


def output_rows(result, batch, output: Callable[[Any, Any], torch.Tensor] | None = None) -> torch.Tensor:
    """A forward's result as :func:`fidelity_metric` compares it: the output tensor (``output(result, batch)``,
    default the result itself or its first element / ``last_hidden_state``), one float row per sample."""
    return (output or _default_output)(result, batch).detach().float().flatten(1)


def _default_output(result, batch):
    if isinstance(result, torch.Tensor):
        return result
    hidden = getattr(result, "last_hidden_state", None)
    if hidden is not None:
        return hidden
    if isinstance(result, (tuple, list)):
        return result[0]
    if isinstance(result, dict):
        return next(iter(result.values()))
    raise TypeError(f"cannot take a tensor from a forward result of type {type(result).__name__}: pass output=")
