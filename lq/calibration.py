"""Calibrate a whole model: collect statistics over batches, reduce them across processes, set amax.

This is the engine behind :class:`lq.callbacks.QuantCalibrate` and the
plain-PyTorch entry point :func:`calibrate_model`. It knows nothing about
Lightning: it takes an iterable of batches and a function that runs the
model on one batch.

Every quantizer gets the calibrator its method needs (``max`` for the max
method, a histogram for entropy / percentile / mse); the model runs in eval
mode under ``no_grad`` with quantization off and collection on. Histogram
methods take two passes over the same batches, as TensorRT's calibrator does:
a range pass (max, reduced across processes) fixes every histogram's range to
the global absmax, then the histogram pass bins all the data on ``[0, absmax]``
— the grid the reference algorithms are written for, independent of the batch
order. Under ``torch.distributed`` each calibrator's state is then reduced
across ranks (max: all-reduce MAX; histograms: the same grid everywhere, summed
counts) so every rank ends with the same amax. Switches and train/eval mode are restored in
``finally`` whatever happens, and amax is only written once every quantizer
has data, so an error never leaves a model half-calibrated.

``method="auto"`` is delegated to :mod:`lq.auto_calib` after the histograms are collected. How a batch
becomes a model call (:func:`model_inputs`, :func:`default_forward`) is defined in :mod:`lq.calib._forward`
and importable from here; the modules below this one (:mod:`lq.auto_calib`, :mod:`lq.calib`) never import it
(``tests/test_layering.py``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from lq import auto_calib
from lq import progress as lq_progress
from lq.calib import _fidelity
from lq.calib import bias_correction as _bias
from lq.calib._forward import default_forward, model_inputs
from lq.nn.modules.tensor_quantizer import TensorQuantizer, iter_quantizers, name_quantizers

HISTOGRAM_METHODS = ("entropy", "percentile", "mse", "sample_mean")
#: ``auto`` collects histograms and then picks one of the others per layer group (:mod:`lq.auto_calib`)
METHODS = ("max",) + HISTOGRAM_METHODS + ("auto",)


class CalibrationError(RuntimeError):
    """Calibration could not produce amax (no batches, or quantizers that saw no data)."""


def sample_inputs(model: nn.Module, batch: Any) -> Any:
    """The example input an export traces with, from one ``batch`` by :func:`model_inputs`: a tensor, or a
    tuple of the positional inputs (a dict batch is put in ``forward``'s parameter order)."""
    args, kwargs = model_inputs(model, batch)
    if kwargs:
        try:
            bound = inspect.signature(model.forward).bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise TypeError(f"the batch's inputs do not fit {type(model).__name__}.forward ({e}): give the export "
                            "a sample_input") from e
        if bound.kwargs:
            raise TypeError(f"{type(model).__name__}.forward takes {sorted(bound.kwargs)} by keyword only or "
                            "after a parameter the batch leaves out; the export traces positional inputs: give "
                            "it a sample_input")
        args = bound.args
    return args[0] if len(args) == 1 else tuple(args)


def is_weight_quantizer(name: str) -> bool:
    """Weight quantizers are named ``*weight*quantizer`` (``_weight_quantizer``, ``_in_proj_weight_quantizer``
    ...), or are items of a list named ``*weight*quantizers`` (QuantLSTM's ``_weight_quantizers.0``)."""
    parts = name.split(".")
    last = parts[-1]
    if last.isdigit() and len(parts) > 1:
        last = parts[-2]
        return "weight" in last and last.endswith("quantizers")
    return "weight" in last and last.endswith("quantizer")


def calibrator_kind(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"calibration method {method!r} is not allowed: choose one of {list(METHODS)}")
    return "max" if method == "max" else "histogram"


def _has_kind(q: TensorQuantizer, kind: str) -> bool:
    from lq import calib

    cal = q.calibrator
    if kind == "max":
        return isinstance(cal, calib.MaxCalibrator)
    return isinstance(cal, calib.HistogramCalibrator)


def select_quantizers(model: nn.Module, include_calibrated: bool = True) -> list[tuple[str, TensorQuantizer]]:
    """Quantizers that calibration serves: enabled, static amax (not dynamic)."""
    name_quantizers(model)
    out = []
    for name, q in iter_quantizers(model):
        if not q.is_enabled or q.dynamic:
            continue
        if not include_calibrated and q.amax is not None and not q.learn_amax:
            continue  # a learned amax holds its initial value until calibrated: keep it in
        out.append((name, q))
    return out


def methods_for(quantizers, method: str, weight_method: str = "max", overrides: Mapping[str, str] | None = None):
    """``{name: method}``: inputs use ``method``, weights ``weight_method``, then glob overrides."""
    out = {}
    for name, q in quantizers:
        m = weight_method if is_weight_quantizer(name) else method
        if m == "auto" and getattr(q, "is_fp8", False):
            m = "max"  # the histogram methods are for integer grids; FP8 takes its max
        layer = name.rsplit(".", 1)[0]
        for glob, o in (overrides or {}).items():
            if fnmatch.fnmatchcase(layer, glob) or fnmatch.fnmatchcase(name, glob):
                m = o
        calibrator_kind(m)
        out[name] = m
    return out


def collect(
    model: nn.Module,
    batches: Iterable,
    quantizers: list[tuple[str, TensorQuantizer]],
    methods: Mapping[str, str],
    *,
    num_batches: int | None = None,
    forward: Callable[[nn.Module, Any], Any] = default_forward,
    num_bins: int = 2048,
    progress: Callable[[Iterable, int | None], Iterable] | None = None,
    process_group=None,
    outputs: Callable[[int, Any], None] | None = None,
) -> int:
    """Run ``model`` over up to ``num_batches`` batches with collection on; return how many ran.

    Without histogram methods that is one pass. With them, a range pass first
    (every quantizer on a max calibrator; the histogram quantizers' ranges are
    reduced over ``process_group``), then a histogram pass over the same batches
    with each histogram started on its global range (only the histogram
    quantizers collect). A one-shot iterator is read into a list first.

    ``outputs(i, result)`` is given the forward's result on each batch of the first pass: where every quantizer
    the model has on is among ``quantizers``, that is the float model's output (:func:`float_outputs_known`).
    """
    from lq import calib

    hist = []  # (name, quantizer, its histogram calibrator for the second pass)
    for name, q in quantizers:
        if calibrator_kind(methods[name]) == "histogram":
            keep = (_has_kind(q, "histogram") and q.calibrator.num_bins == num_bins  # a user's settings stay
                    and (q.calibrator._signed_range or not q.asymmetric))  # an asymmetric one needs the range
            cal = q.calibrator if keep else calib.HistogramCalibrator(q.num_bits, q.axis, q.unsigned,
                                                                       num_bins=num_bins, signed_range=q.asymmetric)
            if methods[name] == "sample_mean" or (methods[name] == "auto" and q.axis is None
                                                  and not is_weight_quantizer(name)):
                cal.track_samples()  # auto tries a classifier's choice against these ranges (lq.auto_calib)
            hist.append((name, q, cal))
            q.calibrator = "max"  # the range pass
        elif not _has_kind(q, "max"):
            q.calibrator = "max"
        q.calibrator.reset()
    if hist:
        batches = _replayable(batches, num_batches)
    seen = _run(model, batches, quantizers, num_batches, forward, progress, outputs=outputs)
    if not hist:
        return seen
    ranges = []
    for _, q, _ in hist:
        q.calibrator.sync(process_group)
        ranges.append(q.calibrator.compute_amax())
    for (_, q, cal), rng in zip(hist, ranges):
        cal.reset()
        if rng is not None:  # else no rank saw data: left empty (load_amax names it)
            cal.set_range(rng)
        q.calibrator = cal
    _run(model, batches, quantizers, num_batches, forward, progress, collecting={id(q) for _, q, _ in hist})
    return seen


def _replayable(batches: Iterable, num_batches: int | None) -> Iterable:
    """``batches`` itself when it can be iterated again (a list, a DataLoader), else its first batches as a list."""
    if not isinstance(batches, Iterator):
        return batches
    return list(batches) if num_batches is None else [b for _, b in zip(range(num_batches), batches)]


def float_outputs_known(model: nn.Module, quantizers) -> bool:
    """Whether a collection pass over ``quantizers`` runs ``model`` in float: every quantizer that would quantize
    is among them (collection switches their quantization off), so the pass's outputs are the float model's."""
    calibrating = {id(q) for _, q in quantizers}
    return all(id(q) in calibrating for q in model.modules()
               if isinstance(q, TensorQuantizer) and not q._disabled and q._if_quant)


def _run(model, batches, quantizers, num_batches, forward, progress, collecting=None, outputs=None) -> int:
    """One pass over the batches with ``quantizers`` not quantizing and collecting (only the ids in
    ``collecting`` when given, the others pass their input through); switches restored after. ``outputs(i, result)``
    is given each forward's result."""
    saved = [(q, q._if_quant, q._if_calib) for _, q in quantizers]
    was_training = model.training
    seen = 0
    try:
        model.eval()
        for _, q in quantizers:
            q.disable_quant()
            if collecting is None or id(q) in collecting:
                q.enable_calib()
            else:
                q.disable_calib()
        custom = _wraps_batches(progress)
        it = progress(batches, num_batches) if custom else batches
        total = num_batches if num_batches is not None else (len(batches) if hasattr(batches, "__len__") else None)
        what = "Calibrating: histograms" if collecting is not None else "Calibrating"
        with torch.no_grad(), (lq_progress.off() if custom else contextlib.nullcontext()), \
                lq_progress.step(what, total) as shown:
            for batch in it:
                if num_batches is not None and seen >= num_batches:
                    break
                result = forward(model, batch)
                if outputs is not None:
                    outputs(seen, result)
                seen += 1
                shown.advance()
    finally:
        for q, if_quant, if_calib in saved:
            q._if_quant = if_quant
            q._if_calib = if_calib
        model.train(was_training)
    return seen


def _wraps_batches(progress) -> bool:
    """A ``progress`` that is a callable ``(batches, total) -> batches`` (it draws its own bar), not a setting."""
    return callable(progress) and not isinstance(progress, lq_progress.Reporter)


def global_count(n: int, process_group=None) -> int:
    """``n`` summed over the processes of ``process_group`` (``n`` itself without torch.distributed)."""
    from lq.calib.calibrator import summed_over_ranks

    return summed_over_ranks([n], process_group)[0]


def sync(quantizers: list[tuple[str, TensorQuantizer]], process_group=None) -> None:
    """Reduce every calibrator's statistics across processes (no-op without torch.distributed)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    for _, q in quantizers:
        q.calibrator.sync(process_group)


def load_amax(quantizers, methods: Mapping[str, str], *, percentile: float = 99.99, strict: bool = True) -> dict:
    """Compute and set amax for every quantizer; quantizers without data are named in one error."""
    empty = [name for name, q in quantizers if not q.calibrator.has_data]
    if empty and strict:
        raise CalibrationError(
            f"{len(empty)} quantizer(s) saw no data during calibration: {', '.join(empty)}. "
            "Their layers never ran in the calibration forward: check calibration_step/forward, "
            "or exclude those layers from quantization"
        )
    out = {}
    for name, q in quantizers:
        if name in empty:
            continue
        m = methods[name]
        if m == "auto":  # the search's starting point (lq.auto_calib chooses afterwards)
            m = "max"
            q.load_calib_amax("max" if _has_kind(q, "histogram") else None, strict=strict)
            out[name] = q.amax
            continue
        kwargs = {"percentile": percentile} if m == "percentile" else {}
        q.load_calib_amax(m if m != "max" else None, strict=strict, **kwargs)
        out[name] = q.amax
    warn_heavy_clipping(quantizers, methods)
    return out


#: a histogram method choosing amax below this fraction of the observed max gets a warning
CLIP_WARN_FRACTION = 0.2


def warn_heavy_clipping(quantizers, methods: Mapping[str, str], fraction: float = CLIP_WARN_FRACTION) -> list[str]:
    """Warn once about quantizers whose histogram method clipped far below the data's max.

    TensorRT's entropy method in particular can pick a tiny amax on spiky activations
    (seen on an MNIST CNN: 0.5 of a 6.6 range, and the accuracy collapsed); a warning
    naming the layers points at ``method_overrides`` before anyone debugs the training.
    """
    import warnings

    flagged = []
    for name, q in quantizers:
        cal = q.calibrator
        top = getattr(cal, "_absmax", None)
        if methods.get(name, "max") in ("max", "sample_mean") or q.amax is None or top is None:  # clips by design
            continue
        amax, top = float(q.amax.detach().max()), float(top.max())
        if top > 0 and amax < fraction * top:
            flagged.append(f"{name} (amax {amax:.3g} of max {top:.3g}, {methods[name]})")
    if flagged:
        warnings.warn(
            f"calibration clipped {len(flagged)} quantizer(s) below {fraction:.0%} of their observed max: "
            + "; ".join(flagged)
            + ". If accuracy drops, give those layers another method (CalibConfig.method_overrides, "
            "e.g. 'percentile' or 'mse').",
            RuntimeWarning,
            stacklevel=3,
        )
    return flagged


def calibrate_model(
    model: nn.Module,
    batches: Iterable,
    *,
    method: str = "auto",
    weight_method: str = "max",
    method_overrides: Mapping[str, str] | None = None,
    num_batches: int | None = None,
    percentile: float = 99.99,
    num_bins: int = 2048,
    forward: Callable[[nn.Module, Any], Any] = default_forward,
    only_uncalibrated: bool = False,
    strict: bool = True,
    process_group=None,
    progress=None,
    bias_correction: bool | None = None,
    block_method: str = "auto",
) -> dict:
    """Post-training calibration of every static quantizer in ``model``; returns ``{name: amax}``.

    Args:
        model: a model with TensorQuantizers (see :func:`lq.convert.quantize_model`).
        batches: an iterable of batches (a DataLoader).
        method: activation method: ``auto`` (default: per layer group the one of max, percentile, mse and
            entropy that keeps the model's output closest to float on the first calibration batches, kept
            only when the model's output over up to 8 of the calibration batches is at least as close to
            float as with ``max`` everywhere, else ``max``; see :mod:`lq.auto_calib`), or max, entropy,
            percentile, mse for every layer.
        weight_method: weight method (max per channel is exact for weights).
        method_overrides: ``{layer glob: method}``.
        num_batches: stop after this many batches (None: all).
        forward: how to run the model on a batch (default :func:`default_forward`: a dict batch is
            ``model(**batch)``, ``(inputs, target)`` is ``model(inputs)``, a tuple of a multi-input
            ``forward``'s inputs is ``model(*batch)``; see :func:`model_inputs`).
        only_uncalibrated: leave quantizers that already hold amax alone.
        progress: None: shown on a terminal (:mod:`lq.progress`); False: not shown; an ``lq.progress.Reporter``:
            reported to it; a callable ``(batches, total) -> batches`` wraps the batches (the callback's bar).
        strict: raise when no quantizer saw data (quantizers that saw none while others did are turned off, their
            layers float, with a warning naming them); ``False``: warn and keep those without data dynamic.
        bias_correction: once amax is set, give each quantized conv / linear a per-channel shift that puts its mean
            output back on float's, layer by layer, estimated on half of up to 8 calibration batches and kept per
            layer where it lowers the error on the other half, and at all only where the model's output gets
            closer to float (:mod:`lq.calib.bias_correction`); the file holds it in the layer's bias. None (the
            default): on where ``auto`` chooses a method and there are at least two calibration batches (one to
            estimate on, one to judge by); off for a method the caller names.
        block_method: block-quantized Linear weights (``int4_block_weight``), once amax is set and before the bias
            correction: ``auto`` (the best the batches support: AWQ's scaling where it folds, then GPTQ's rounding on
            layers that saw enough rows), ``max``, ``mse``, ``awq`` or ``gptq`` (:class:`lq.config.CalibConfig`);
            nothing where the model has no block-quantized layer.

    Returns:
        :class:`CalibrationResult`: ``{name: amax}``, with ``.auto`` (the ``auto`` choice per role and what it
        gained against ``max``), ``.block_choices`` (what the block search chose per block-quantized layer) and
        ``.bias_correction`` (what the correction did, None when off).

    Raises:
        CalibrationError: the batches were empty, or no quantizer saw data (named).
        TypeError: a tuple batch that does not fit the model's ``forward`` (see :func:`model_inputs`).
    """
    with lq_progress.choose(None if _wraps_batches(progress) else progress):
        return _calibrate(model, batches, method, weight_method, method_overrides, num_batches, percentile,
                          num_bins, forward, only_uncalibrated, strict, process_group, progress, bias_correction,
                          block_method)


def _calibrate(model, batches, method, weight_method, method_overrides, num_batches, percentile, num_bins, forward,
               only_uncalibrated, strict, process_group, progress, bias_correction, block_method) -> dict:
    from lq.calib import _block_search, _stamp

    if block_method not in _block_search.BLOCK_METHODS:
        raise ValueError(f"block_method={block_method!r} is not allowed: choose one of {list(_block_search.BLOCK_METHODS)}")
    quantizers = select_quantizers(model, include_calibrated=not only_uncalibrated)
    if not quantizers:
        return CalibrationResult()
    methods = methods_for(quantizers, method, weight_method, method_overrides)
    auto = "auto" in methods.values()
    blocks = block_method != "max" and bool(_block_search.block_layers(model, calibrated=False))
    if auto or bias_correction or blocks:  # the searches and the correction run the model on the batches again
        batches = _replayable(batches, num_batches)
    keeper = _ReferenceKeeper(model, quantizers, batches, num_batches) if auto else None
    seen = collect(model, batches, quantizers, methods, num_batches=num_batches, forward=forward,
                   num_bins=num_bins, progress=progress, process_group=process_group, outputs=keeper)
    # a rank whose shard is empty still joins the reduction below (an empty contribution): deciding on the
    # global count keeps every rank on the same path, where a local raise would leave the others hanging
    if global_count(seen, process_group) == 0:
        raise CalibrationError(
            "the calibration dataloader produced no batches: give a non-empty dataloader "
            "(or calib.dataloader='train'/'val' pointing at one that has data)"
        )
    sync(quantizers, process_group)
    quantizers = without_unused_layers(quantizers, strict)
    amax = load_amax(quantizers, methods, percentile=percentile, strict=strict)
    result = CalibrationResult(amax)
    check = auto_calib.check_batches(batches, seen) if auto or bias_correction else []
    if bias_correction is None:  # the default: part of what ``auto`` decides, where it can be judged
        # (every process decides alike: no process may lack a batch to judge by)
        bias_correction = auto and global_count(int(len(check) < 2), process_group) == 0
    if auto:
        selection = check[:auto_calib.SELECTION_BATCHES]
        result.auto = auto_calib.choose(model, quantizers, methods, selection, forward, process_group, check=check,
                                        reference=keeper.outputs(seen))
        result.update({name: q.amax for name, q in quantizers if name in amax})
    if blocks:  # moves weights (AWQ's scaling, GPTQ's rounding): before the correction, which measures the outputs
        result.block_choices = _block_search.search_block_scales(model, block_method, batches, forward, num_batches)
    if bias_correction:
        # per-sample ranges clip by design, so output R2 cannot judge what follows them: a classifier's top-1 can
        top1 = "sample_mean" in methods.values() or (result.auto is not None and result.auto.judged_by == "top1")
        judge = "top1" if top1 else "r2"
        result.bias_correction = correct_biases(model, check, forward, process_group=process_group, judge=judge)
    _stamp.stamp(model)  # the weights as calibrated: the export's fallback may turn quantizers off freely
    return result


class _ReferenceKeeper:
    """Keeps the float model's outputs on the batches ``auto`` checks its choice on, as the range pass makes them
    (where that pass runs the model in float and the batch count is known before it): the check then needs no
    float forward of its own."""

    def __init__(self, model, quantizers, batches, num_batches):
        n = len(batches) if hasattr(batches, "__len__") else None
        if num_batches is not None:
            n = num_batches if n is None else min(n, num_batches)
        self.expected = n if n is not None and float_outputs_known(model, quantizers) else None
        self.keep = auto_calib.check_indices(self.expected) if self.expected is not None else set()
        self.kept: dict = {}

    def __call__(self, i: int, result) -> None:
        if i in self.keep and self.expected is not None:
            try:
                self.kept[i] = _fidelity.output_rows(result, None)
            except Exception:  # noqa: BLE001 - no tensor to keep: the check makes its own reference (and says why)
                self.expected = None

    def outputs(self, seen: int) -> list | None:
        """The kept outputs in check-batch order, None unless every check batch's is there."""
        if self.expected != seen or set(self.kept) != self.keep:
            return None
        return [self.kept[i] for i in sorted(self.keep)]


def correct_biases(model: nn.Module, batches: Iterable, forward: Callable[[nn.Module, Any], Any] = default_forward, *,
                   num_batches: int | None = None, process_group=None, judge: str = "r2"):
    """Bias correction of a calibrated ``model`` (:mod:`lq.calib.bias_correction`) on up to
    :data:`lq.auto_calib.CHECK_BATCHES` of ``batches`` (the first ``num_batches``), as :func:`calibrate_model`
    does it: for a step that changes weights after calibration (the block-weight searches), run after it.
    Returns what was done, or None where a process has no batch (every process then skips it, with a warning)."""
    if not isinstance(batches, list):
        n = num_batches if num_batches is not None else len(batches) if hasattr(batches, "__len__") else None
        batches = auto_calib.check_batches(batches, n) if n is not None else \
            [b for _, b in zip(range(auto_calib.CHECK_BATCHES), batches)]
    if global_count(0 if batches else 1, process_group) > 0:
        import warnings

        warnings.warn("lq calibration: bias correction skipped: a process had no calibration batch to estimate "
                      "it on", RuntimeWarning, stacklevel=2)
        return None
    res = _bias.correct_biases(model, batches, forward, process_group=process_group, judge=judge)
    logging.getLogger("lq").info("%s", res)
    return res


def without_unused_layers(quantizers, strict: bool):
    """A layer whose forward never ran in calibration is no error by itself (a swapped Linear whose weight a
    function uses instead, a branch the data never takes): where other quantizers saw data, those that saw none
    are turned off (their layers run in float) and named in one warning. Where none saw data, calibration itself
    did not reach the model: :func:`load_amax` raises, naming them."""
    empty = [(name, q) for name, q in quantizers if not q.calibrator.has_data]
    if not empty or len(empty) == len(quantizers) or not strict:
        return quantizers
    import warnings

    for _, q in empty:
        q.disable()
    warnings.warn(f"lq calibration: {len(empty)} quantizer(s) saw no data (their layers never ran in the calibration "
                  f"forward), so they are turned off and those layers run in float: {', '.join(n for n, _ in empty)}. "
                  "If they should run, check calibration_step/forward", stacklevel=3)
    done = {id(q) for _, q in empty}
    return [(n, q) for n, q in quantizers if id(q) not in done]


class CalibrationResult(dict):
    """``{quantizer name: amax}``; ``.auto`` holds what ``method="auto"`` did (:class:`lq.auto_calib.AutoResult`:
    the method per layer role and its score against ``max``), None for the other methods; ``.bias_correction``
    what the bias correction did (:class:`lq.calib.bias_correction.BiasCorrectionResult`), None when off."""

    auto = None
    bias_correction = None
    block_choices: tuple = ()
