"""Per-layer quantization sensitivity: which layers cost accuracy, and an exclude-list to fix it.

Two sweeps over the quantized layers of a calibrated model, each one metric
evaluation per layer; no re-calibration and no copies (quantizers are only
switched on and off, and every switch is restored afterwards):

* **only** -- quantize one layer at a time (every other layer floating point):
  the damage a layer does on its own;
* **leave-out** -- quantize every layer but one: what leaving that layer in
  floating point gives back. This is the sweep that ranks exclusions, since
  layers interact (a layer's error is amplified by the quantized layers after it).

::

    from lq.sensitivity import sensitivity_analysis

    def metric(model):                      # any float, higher is better by default
        return accuracy(model, val_loader)

    res = sensitivity_analysis(model, calib_loader, metric, quant=Int8PerChannelConfig())
    print(res)                              # table, most sensitive layer first
    res.figure().savefig("sensitivity.png")
    quant = res.apply(Int8PerChannelConfig(), top_k=2)   # QuantConfig with exclude=[worst two]
    trainer = L.Trainer(callbacks=[lq.QuantCallback(quant=quant)])

:func:`layer_sensitivity` runs the sweeps on a model that is already quantized
and calibrated (by :func:`lq.convert.quantize_model` + :func:`lq.calibrate_model`,
or by the callback); :func:`sensitivity_analysis` does the quantization and
calibration on a copy first. :func:`greedy_exclude` leaves layers out in rank
order until a target is met. When the model has no labels, :func:`fidelity_metric`
scores a model by how close its outputs stay to the floating point ones.

:func:`quantized_layers`, :class:`quantization_disabled`, :func:`fidelity_metric` and
:func:`calibration_method_search` are defined in :mod:`lq.calib._fidelity`, below :mod:`lq.auto_calib`
(which searches with them) and :mod:`lq.calibration` (which runs ``auto``), and are importable from here;
this module sits on top: :func:`sensitivity_analysis` calibrates through :func:`lq.calibration.calibrate_model`.
"""

from __future__ import annotations

import copy
import fnmatch
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

# the layer helpers, the fidelity metric and the method search live below lq.calibration and lq.auto_calib
# (which use them too); re-exported here, where they are documented and imported from
from lq.calib._fidelity import (  # noqa: F401
    FIDELITY_KINDS,
    MethodSearchResult,
    Metric,
    _glob_escape,
    calibration_method_search,
    fidelity_metric,
    group_members,
    quantization_disabled,
    quantized_layers,
)

__all__ = [
    "LayerSensitivity",
    "MethodSearchResult",
    "SensitivityResult",
    "calibration_method_search",
    "fidelity_metric",
    "greedy_exclude",
    "layer_sensitivity",
    "quantization_disabled",
    "quantized_layers",
    "sensitivity_analysis",
]

MODES = ("only", "leave_out")
RANK_BY = ("leave_out", "only", "combined")


# =========================================================================== results
@dataclass
class LayerSensitivity:
    """One layer's numbers.

    Attributes:
        layer: module name (usable as an exclude glob as is).
        type: quantized module class.
        only: the metric with only this layer quantized (None when that sweep did not run).
        leave_out: the metric with every quantized layer but this one (None when that sweep did not run).
        only_drop: how much worse than floating point ``only`` is (positive = worse).
        leave_out_gain: how much better than the fully quantized model ``leave_out`` is (positive = better).
    """

    layer: str
    type: str
    only: float | None = None
    leave_out: float | None = None
    only_drop: float | None = None
    leave_out_gain: float | None = None

    def score(self, by: str) -> float:
        if by == "only":
            return _nan_low(self.only_drop)
        if by == "leave_out":
            return _nan_low(self.leave_out_gain)
        return _nan_low(self.only_drop) + _nan_low(self.leave_out_gain)


def _nan_low(v) -> float:
    return -math.inf if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


@dataclass
class SensitivityResult:
    """The outcome of :func:`layer_sensitivity`.

    Attributes:
        metric_name: what the metric measures (for tables and figures).
        higher_is_better: direction of the metric.
        float_metric: every quantizer off.
        quant_metric: every quantizer on.
        layers: one :class:`LayerSensitivity` per quantized layer, in model order.
        rank_by: default ordering: ``leave_out`` (gain from leaving the layer float), ``only``
            (drop from quantizing the layer alone) or ``combined`` (their sum).
    """

    metric_name: str
    higher_is_better: bool
    float_metric: float
    quant_metric: float
    layers: list[LayerSensitivity] = field(default_factory=list)
    rank_by: str = "leave_out"

    # ------------------------------------------------------------------ ranking and exclusion
    def _by(self, by: str | None) -> str:
        by = by or self.rank_by
        if by not in RANK_BY:
            raise ValueError(f"rank by {by!r} is not allowed: choose one of {list(RANK_BY)}")
        if by in ("leave_out", "combined") and all(r.leave_out_gain is None for r in self.layers):
            by = "only"
        if by in ("only", "combined") and all(r.only_drop is None for r in self.layers):
            by = "leave_out"
        return by

    def ranked(self, by: str | None = None) -> list[LayerSensitivity]:
        """Layers, most sensitive first (ties keep model order)."""
        by = self._by(by)
        return sorted(self.layers, key=lambda r: -r.score(by))

    def exclude(self, top_k: int | None = None, threshold: float | None = None, by: str | None = None) -> list[str]:
        """Layer names to leave in floating point: the ``top_k`` most sensitive, and/or every layer
        whose score (metric units, in the "worse" direction) is above ``threshold``.

        The names are exact module names, which :class:`lq.config.QuantConfig` ``exclude`` (and
        :func:`lq.convert.quantize_model`) take as globs.
        """
        if top_k is None and threshold is None:
            raise ValueError("exclude() needs top_k and/or threshold")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"top_k={top_k!r} is not allowed: expected an int >= 0")
        by = self._by(by)
        ranked = self.ranked(by)
        if threshold is not None:
            ranked = [r for r in ranked if r.score(by) > threshold]
        if top_k is not None:
            ranked = ranked[:top_k]
        return [_glob_escape(r.layer) for r in ranked]

    def apply(self, quant=None, top_k: int | None = None, threshold: float | None = None,
              by: str | None = None, layers: Sequence[str] | None = None):
        """A copy of ``quant`` (a :class:`lq.config.QuantConfig`, default the plain one) whose ``exclude``
        also holds the chosen layers (``layers`` as given, or :meth:`exclude` with the other arguments)."""
        from lq.config import QuantConfig

        quant = QuantConfig() if quant is None else quant
        if not isinstance(quant, QuantConfig):
            raise TypeError(f"quant must be a QuantConfig (or a recipe subclass), got {type(quant).__name__}")
        names = list(layers) if layers is not None else self.exclude(top_k=top_k, threshold=threshold, by=by)
        extra = [n for n in names if n not in quant.exclude]
        return replace(quant, exclude=list(quant.exclude) + extra)

    # ------------------------------------------------------------------ output
    def rows(self, by: str | None = None) -> list[dict]:
        """Plain dicts, most sensitive first, with the rank (for loggers, CSV, JSON)."""
        return [{"rank": i + 1, **asdict(r)} for i, r in enumerate(self.ranked(by))]

    def to_dict(self) -> dict:
        return {
            "metric_name": self.metric_name,
            "higher_is_better": self.higher_is_better,
            "float_metric": self.float_metric,
            "quant_metric": self.quant_metric,
            "rank_by": self.rank_by,
            "layers": [asdict(r) for r in self.layers],
        }

    @classmethod
    def from_dict(cls, d: dict) -> SensitivityResult:
        d = dict(d)
        d["layers"] = [LayerSensitivity(**r) for r in d.get("layers", [])]
        return cls(**d)

    def markdown(self, top: int | None = None, digits: int = 4, by: str | None = None) -> str:
        """The table as GitHub markdown (most sensitive first; ``top`` rows at most)."""
        rows = self.rows(by)[:top] if top else self.rows(by)
        f = _fmt(digits)
        lines = [
            f"Metric: {self.metric_name} ({'higher' if self.higher_is_better else 'lower'} is better); "
            f"floating point {f(self.float_metric)}, every layer quantized {f(self.quant_metric)}.",
            "",
            "| rank | layer | type | only this layer quantized | change vs float | all but this layer "
            "quantized | gain vs all quantized |",
            "|---:|---|---|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['rank']} | `{r['layer']}` | {r['type']} | {f(r['only'])} | {f(_neg(r['only_drop']))} "
                f"| {f(r['leave_out'])} | {f(r['leave_out_gain'])} |"
            )
        return "\n".join(lines)

    def __rich__(self):
        from rich.table import Table

        f = _fmt(4)
        t = Table(title=f"lq sensitivity: {self.metric_name} (float {f(self.float_metric)}, "
                        f"all quantized {f(self.quant_metric)})")
        for c in ("rank", "layer", "type", "only", "change vs float", "all but this", "gain vs all quantized"):
            t.add_column(c, justify="left" if c in ("layer", "type") else "right")
        for r in self.rows():
            t.add_row(str(r["rank"]), r["layer"], r["type"], f(r["only"]), f(_neg(r["only_drop"])),
                      f(r["leave_out"]), f(r["leave_out_gain"]))
        return t

    def __str__(self) -> str:
        import io

        from rich.console import Console

        buf = io.StringIO()
        Console(file=buf, width=140, color_system=None, force_terminal=False).print(self.__rich__())
        return buf.getvalue().rstrip("\n")

    def figure(self, top: int = 20, by: str | None = None, title: str | None = None):
        """A matplotlib figure: per layer (most sensitive at the top), the metric change when only that layer
        is quantized and the gain when only that layer is left floating point."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        ranked = self.ranked(by)[:top]
        n = len(ranked)
        fig, ax = plt.subplots(figsize=(8.5, 0.32 * n + 1.6))
        ys = list(range(n))[::-1]
        h = 0.4
        drop = [-(r.only_drop or 0.0) for r in ranked]
        gain = [(r.leave_out_gain or 0.0) for r in ranked]
        if any(r.only_drop is not None for r in ranked):
            ax.barh([y + h / 2 for y in ys], drop, height=h, color="tab:red",
                    label="only this layer quantized: change vs float")
        if any(r.leave_out_gain is not None for r in ranked):
            ax.barh([y - h / 2 for y in ys], gain, height=h, color="tab:blue",
                    label="all but this layer quantized: gain vs all quantized")
        ax.set_yticks(ys)
        ax.set_yticklabels([r.layer for r in ranked], fontsize=7)
        ax.axvline(0, color="black", linewidth=0.6)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, symmetric=True))
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
        ax.set_xlabel(f"{self.metric_name} change ({'higher' if self.higher_is_better else 'lower'} is better"
                      f", sign: + = better)")
        ax.set_title(title or f"Per-layer sensitivity (float {self.float_metric:.4g}, "
                              f"all quantized {self.quant_metric:.4g})", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        return fig


def _neg(v):
    return None if v is None else -v


def _fmt(digits: int):
    def f(v):
        return "-" if v is None else f"{v:.{digits}f}"

    return f


# =========================================================================== the sweeps
def layer_sensitivity(
    model: nn.Module,
    metric: Metric,
    *,
    layers: Sequence[str] | None = None,
    modes: Sequence[str] = MODES,
    higher_is_better: bool = True,
    metric_name: str = "metric",
    rank_by: str = "leave_out",
    progress: Callable[[str], None] | None = None,
) -> SensitivityResult:
    """Run the per-layer sweeps on an already quantized and calibrated ``model``.

    Args:
        model: a model with calibrated lq quantizers (its switches are restored on return, even on error).
        metric: ``metric(model) -> float``, e.g. validation accuracy; called ``2 + len(layers) * len(modes)`` times.
        layers: names (or globs) of the quantized layers to sweep (default: every quantized layer).
            Layers not swept keep their quantizers on in ``leave_out`` and off in ``only``.
        modes: any of ``"only"`` (quantize one layer at a time) and ``"leave_out"`` (all but one).
        higher_is_better: direction of ``metric`` (False for a loss or an error).
        metric_name: label for the table and figure.
        rank_by: default ordering of the result (``leave_out``, ``only``, ``combined``).
        progress: called with a short message before each evaluation.

    Returns:
        :class:`SensitivityResult`.
    """
    modes = tuple(modes)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes={list(modes)!r} is not allowed: choose from {list(MODES)}")
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by={rank_by!r} is not allowed: choose one of {list(RANK_BY)}")
    if not callable(metric):
        raise TypeError(f"metric must be a callable model -> float, got {type(metric).__name__}")
    all_layers = quantized_layers(model)
    if not all_layers:
        raise ValueError("the model has no enabled lq quantizers: quantize it (lq.convert.quantize_model or "
                         "QuantSwap) and calibrate it first, or use sensitivity_analysis()")
    if layers is None:
        names = list(all_layers)
    else:
        names = [n for n in all_layers if any(fnmatch.fnmatchcase(n, g) for g in layers)]
        unmatched = [g for g in layers if not any(fnmatch.fnmatchcase(n, g) for n in all_layers)]
        if unmatched:
            sample = ", ".join(list(all_layers)[:8]) + (" ..." if len(all_layers) > 8 else "")
            raise ValueError(f"layers {unmatched} match no quantized layer (quantized layers: {sample})")
    modules = dict(model.named_modules())
    everything = [q for qs in all_layers.values() for q in qs]
    sign = 1.0 if higher_is_better else -1.0
    say = progress or (lambda msg: None)

    def evaluate(label: str) -> float:
        say(label)
        v = metric(model)
        v = float(v.item() if isinstance(v, torch.Tensor) else v)
        return v

    with quantization_disabled(quantizers=everything):  # restores every flag on exit, whatever happens
        float_metric = evaluate("floating point")
        for q in everything:
            q.enable()
        quant_metric = evaluate("all quantized")
        rows = {n: LayerSensitivity(n, type(modules[n]).__name__) for n in names}
        if "only" in modes:
            for q in everything:
                q.disable()
            for i, n in enumerate(names):
                for q in all_layers[n]:
                    q.enable()
                v = evaluate(f"only {n} quantized ({i + 1}/{len(names)})")
                for q in all_layers[n]:
                    q.disable()
                rows[n].only = v
                rows[n].only_drop = sign * (float_metric - v)
        if "leave_out" in modes:
            for q in everything:
                q.enable()
            for i, n in enumerate(names):
                for q in all_layers[n]:
                    q.disable()
                v = evaluate(f"all but {n} quantized ({i + 1}/{len(names)})")
                for q in all_layers[n]:
                    q.enable()
                rows[n].leave_out = v
                rows[n].leave_out_gain = sign * (v - quant_metric)
    return SensitivityResult(metric_name, higher_is_better, float_metric, quant_metric,
                             [rows[n] for n in names], rank_by)


def sensitivity_analysis(
    model: nn.Module,
    calib_batches: Iterable,
    metric: Metric,
    *,
    quant=None,
    calib=None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    inplace: bool = False,
    **kwargs,
) -> SensitivityResult:
    """Quantize a copy of a floating point ``model`` by a recipe, calibrate it, and run :func:`layer_sensitivity`.

    Args:
        model: the floating point model (not modified unless ``inplace``).
        calib_batches: batches to calibrate on (a DataLoader).
        metric: ``metric(model) -> float``.
        quant: :class:`lq.config.QuantConfig` (or a recipe; default INT8 per-channel weights) -- the same
            object the callback takes, so ``result.apply(quant, top_k=...)`` is what to train with.
        calib: :class:`lq.config.CalibConfig` (method, num_batches, percentile ...).
        forward: how to run a batch (default :func:`lq.calibration.default_forward`).
        inplace: quantize ``model`` itself instead of a deep copy.
        **kwargs: passed on to :func:`layer_sensitivity` (``modes``, ``higher_is_better``, ``metric_name`` ...).
    """
    from lq.calibration import calibrate_model, default_forward
    from lq.callbacks.swap import QuantSwap
    from lq.config import CalibConfig, QuantConfig, coerce

    quant = coerce(quant, QuantConfig, "sensitivity_analysis.quant")
    calib = coerce(calib, CalibConfig, "sensitivity_analysis.calib")
    m = model if inplace else copy.deepcopy(model)
    QuantSwap(quant).swap(m)
    # no bias correction: a layer switched off to measure it would keep its corrected bias, no longer float
    calibrate_model(m, calib_batches, forward=forward or default_forward,
                    **dict(calib.calibrate_kwargs(), bias_correction=False, block_method="max"))
    return layer_sensitivity(m, metric, **kwargs)


def greedy_exclude(
    model: nn.Module,
    metric: Metric,
    result: SensitivityResult,
    *,
    target: float,
    max_layers: int | None = None,
    by: str | None = None,
) -> tuple[list[str], list[float]]:
    """Leave layers in floating point in the order of ``result`` until ``metric`` reaches ``target``.

    Returns ``(excluded layer names, metric after each step)`` (the first value is the fully quantized
    model's). Stops after ``max_layers`` exclusions even when the target is not met. The model's
    switches are restored on return.
    """
    better = (lambda v: v >= target) if result.higher_is_better else (lambda v: v <= target)
    layers = quantized_layers(model)
    order = [r.layer for r in result.ranked(by) if r.layer in layers]
    limit = len(order) if max_layers is None else min(max_layers, len(order))
    excluded: list[str] = []
    everything = [q for qs in layers.values() for q in qs]
    with quantization_disabled(quantizers=everything):
        for q in everything:
            q.enable()
        values = [float(metric(model))]
        for name in order[:limit]:
            if better(values[-1]):
                break
            for q in layers[name]:
                q.disable()
            excluded.append(name)
            values.append(float(metric(model)))
    return excluded, values
