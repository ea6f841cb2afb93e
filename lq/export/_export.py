"""``export_onnx``: the export as a short pipeline of named stages, each in its own folder of ``lq/export/``.

1. ``prepare/``  check the model and sample, deep-copy the model, compute PyTorch's outputs
2. ``trace/``    the copy through torch.onnx, lq quantizers as placeholders
3. ``passes/``   the rewrite passes, from the declared list in :mod:`lq.export.passes._pipeline`
4. ``finish/``   metadata, opset, checker
5. ``verify/``   onnxruntime against PyTorch, judged in output steps; the file is saved only when it passes
6. ``timing/``   the INT8 file against the user's plain FP32 export; where it is slower, layers back to float
                 until it is not (measured: ``_fallback``)
7. ``report/``   kernels, notes, :class:`ExportResult`

The options are one :class:`lq.config.ExportConfig` (the one the callback and Hydra use).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
import time
import warnings

import onnx
import torch

from lq import progress as lq_progress
from lq.config import EXPORT_TARGETS, EXPORTERS, WEIGHT_FORMATS, ExportConfig, coerce
from lq.export._files import atomic_save, short, unverified_path
from lq.export.passes import _pipeline
from lq.export.prepare import _prepare
from lq.export.prepare._model_checks import find_uncalibrated_quantizers  # noqa: F401  (public)
from lq.export.report import _report
from lq.export.report._result import ExportResult, VerificationError  # noqa: F401  (public)
from lq.export.timing import _fallback, _float_twin, _speed
from lq.export.trace import _bypass, _trace
from lq.export.finish import _finish
from lq.export.verify import _judge, _no_vnni, _openvino, _runtime_faults, _verify
from lq.nn.modules import _bias_shift

TARGETS = EXPORT_TARGETS
__all__ = ["export_onnx", "export_config", "EXPORTERS", "TARGETS", "WEIGHT_FORMATS"]

#: keyword arguments that name an ExportConfig field differently: ``dynamo=False`` is ``exporter="legacy"``,
#: ``atol`` is ``tolerance``
_ALIASES = {"dynamo": lambda v: ("exporter", "dynamo" if v else "legacy"), "atol": lambda v: ("tolerance", v)}
_OPTIONS = tuple(f.name for f in dataclasses.fields(ExportConfig) if f.name not in ("enabled", "path"))


def export_config(config=None, path=None, **options) -> ExportConfig:
    """``config`` (an :class:`ExportConfig`, a mapping of its fields, or None for the defaults) with ``path`` and
    single ``options`` set; validated by ExportConfig itself."""
    cfg = ExportConfig() if config is None else coerce(config, ExportConfig, "export_onnx(config=...)")
    if "tolerance" in options and "atol" in options and options["atol"] is not None \
            and options["tolerance"] is not None:
        raise ValueError("give either tolerance or atol (they are the same), not both")
    changes = {}
    for key, value in options.items():
        if key in _ALIASES:
            if key == "atol" and value is None:
                continue
            key, value = _ALIASES[key](value)
        elif key not in _OPTIONS:
            raise TypeError(f"export_onnx() got an unknown option {key!r}: allowed are the fields of ExportConfig "
                            f"({', '.join(_OPTIONS)}), dynamo and atol")
        changes[key] = value
    if path is not None:
        changes["path"] = os.fspath(path)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def export_onnx(model, sample_input, path=None, config: ExportConfig | None = None, *, progress=None,
                **options) -> ExportResult:
    """Export a fake-quantized model to ONNX with QuantizeLinear/DequantizeLinear, check and verify it.

    The model is never modified: the export works on a deep copy in eval mode (so training, checkpointing and
    testing can go on afterwards).

    Args:
        model: a ``torch.nn.Module`` (a LightningModule is fine) whose quantizers are calibrated.
        sample_input: a tensor (or tuple of tensors) to trace with and to verify on.
        path: the ``.onnx`` file to write (written only once the export succeeded); None: ``config.path``.
        config: the options, an :class:`lq.config.ExportConfig` (None: its defaults).
        progress: None: the stages are shown on a terminal (:mod:`lq.progress`); False: not shown; an
            ``lq.progress.Reporter``: reported to it. Each stage's seconds are in ``ExportResult.stage_seconds``.
        **options: single ExportConfig fields, e.g. ``opset=17``, ``target="tensorrt"``, ``dynamic_dims=(1,)``,
            ``speed_batch=32``; also ``dynamo=False`` (``exporter="legacy"``) and ``atol`` (``tolerance``).

    What is checked: ``verify`` runs the file in onnxruntime on ``sample_input`` (and on a sample twice as
    long along every dynamic axis not named "batch") and compares with the PyTorch fake-quant output, judged in
    output quantization steps (see :mod:`lq.export.verify._verify`): an output fails when more than 1% of its
    elements are over 6 steps off (rounding ties cascade through a deep network: a few steps are normal; a deep
    net is allowed what its own rounding noise gives), or, for (batch, classes) logits, when the top-1 class
    differs beyond a rounding tie on more than 1% of the rows. With ``tolerance``/``rtol`` the verdict is
    ``max|ort - torch| <= tolerance + rtol * max|torch|`` instead. The speed check (onnxruntime, verified,
    ``check_fusion`` and ``speed_check``) times the file against the plain FP32 export of the same model at
    ``speed_batch`` (the faster of the current and the legacy exporter's files). Where the file is slower (in at
    least three rounds of four), copies with groups of layers back in float
    are exported, verified against themselves and timed, for up to ``fallback_seconds``; the fastest one that
    timing says beats the first is saved instead, and ``ExportResult.fallback`` names its float layers
    (:mod:`lq.export.timing._fallback`). A ``QuantLSTM`` is exported as one ONNX ``Scan`` per layer and direction.

    Returns:
        :class:`ExportResult`.

    Raises:
        ValueError: an option outside what ExportConfig allows (named, with what is allowed).
        ExportError: uncalibrated quantizers (named), configurations ONNX cannot express (named, with what is
            allowed), checker failures. :class:`VerificationError` when onnxruntime disagrees with PyTorch (the
            model is then saved next to ``path`` as ``*.unverified.onnx`` and ``path`` is left alone).
    """
    t0 = time.perf_counter()
    cfg = export_config(config, path, **options)
    with lq_progress.choose(progress), lq_progress.step(
            f"Exporting {os.path.basename(cfg.path or '')}: preparing", len(_STAGES) if _timed(cfg) else 5) as shown:
        stages = _Stages(shown, t0)
        prep = _prepare.prepare(model, sample_input, cfg)
        stages.done("prepare")
        traced = _trace.trace(prep, cfg)
        stages.done("trace")
        return _from_trace(prep, traced, cfg, t0, stages)


def _timed(cfg: ExportConfig) -> bool:
    """Whether the export times its file against FP32 (and may fall back): a verified file for a CPU runtime
    (onnxruntime, OpenVINO), timed in that runtime."""
    return cfg.verify and cfg.check_fusion and cfg.target in ("onnxruntime", "openvino") and cfg.speed_check


#: the export's stages, in order, as ExportResult.stage_seconds names them
_STAGES = ("prepare", "trace", "rewrite", "verify", "report", "fp32 reference", "speed check", "fallback")


class _Stages:
    """Each stage's seconds (ExportResult.stage_seconds), and the progress shown as each one ends."""

    def __init__(self, shown: lq_progress.Step | None, t0: float):
        self.shown, self.seconds, self._t = shown, {}, t0

    def done(self, name: str, advance: bool = True) -> None:
        """``name`` ended (its seconds add up); ``advance=False``: a stage run again (batch 1) moves no bar."""
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t
        self._t = now
        if self.shown is not None and advance:
            k = _STAGES.index(name)
            self.shown.advance(description=f"Exporting: {_STAGES[k + 1]}" if k + 1 < len(_STAGES) else None)


def _from_trace(prep: _prepare.Prepared, traced: _trace.Traced, cfg: ExportConfig, t0: float,
                stages: _Stages | None = None, faults_left: int = _runtime_faults.MAX_FAULTS) -> ExportResult:
    """Stages 3-7 on a traced graph: rewrite, finish, verify, save, report, and (where timed) the speed check and
    the fallback. ``traced.proto`` is rewritten in place. ``faults_left``: how many more layers OpenVINO computes
    wrong may be sent to float (:func:`_around_fault`)."""
    stages = stages or _Stages(None, t0)
    notes = list(traced.notes)
    timed = _timed(cfg)
    twin = _float_twin.float_twin(traced.proto) if timed else None  # recurrent layers as ONNX LSTM, as in FP32
    # the fallback's tries start here, and for OpenVINO the export without a layer its plugin computes wrong
    keep = (timed and cfg.fallback_seconds > 0) or (cfg.target == "openvino" and cfg.verify and faults_left > 0)
    pristine = _copy(traced.proto) if keep else None

    proto, rewrite = _pipeline.rewrite(traced.proto, cfg, prep.opset)
    notes += rewrite.notes
    seen = _report.inspect(proto, cfg, prep.work)  # before the finish strips the metadata that names the layers
    notes += _report.encoding_notes(rewrite, seen, cfg)
    proto, opset = _finish.finish(proto, cfg, prep.opset, seen.risks, notes)
    export_seconds = time.perf_counter() - t0
    stages.done("rewrite")

    providers = list(cfg.providers) if cfg.providers else _verify.target_providers(cfg.target, prep.device_type)
    data = proto.SerializeToString()  # the file as it will be deployed: verified and timed from these bytes
    runs = [providers]  # where the file is verified: its runtime, and OpenVINO as a CPU without VNNI runs it too
    if cfg.verify and _openvino.is_openvino(providers) and not cfg.providers and _no_vnni.needed():
        runs.append([_no_vnni.PROVIDER])
    for where in runs:
        try:
            checked = _judge.verify(proto, data, prep, cfg, where, traced.unrolled, bool(rewrite.dynamic_lstms)) \
                if cfg.verify else None
        except VerificationError:
            if cfg.target != "openvino" or pristine is None or faults_left <= 0:
                raise
            kept = _around_fault(prep, dataclasses.replace(traced, proto=pristine), cfg, proto, seen, t0,
                                 faults_left, where)
            if kept is None:
                raise
            return kept
        if where is providers:
            verified = checked
        elif checked is not None:
            notes.append(f"verified in {_verify.runtime_name(where)} too: {checked.verdict}")
    stages.done("verify")
    atomic_save(proto, cfg.path)
    ort_ops, kernels = _report.kernels(proto, cfg, providers, seen, notes)
    stages.done("report")
    if twin is None:
        return _report.result(proto, cfg, opset, prep, rewrite, verified, providers, ort_ops, kernels, None, notes,
                              export_seconds, stages.seconds)
    timing_notes: list = []  # about the measurement itself: they hold for any file timed against this FP32 one
    timer = _speed.Timer.make(prep, cfg, twin, providers, timing_notes)
    stages.done("fp32 reference")
    speed = _speed.speed_check(data, timer, timing_notes)
    stages.done("speed check")
    notes += timing_notes
    fallback = kept = None
    unrewritten = dataclasses.replace(traced, proto=pristine) if pristine is not None else None  # the tries' base
    if speed is not None and speed.clearly_slower and unrewritten is not None:
        fallback, kept = _fall_back(prep, unrewritten, cfg, providers, timer, speed, kernels,
                                    time.perf_counter() - t0, stages.shown)
        stages.done("fallback")
    at_one = _batch_one(prep, unrewritten, cfg, providers, timer, speed, kernels, data, fallback, kept, t0, stages)
    if at_one is not None:
        check1, fallback1, kept1 = at_one
        kept = kept1 if kept1 is not None else kept
        if kept is not None:
            kept.batch1_check, kept.batch1_fallback = check1, fallback1
    if kept is not None:
        kept.warnings[:0] = timing_notes
        kept.stage_seconds = dict(stages.seconds)
        with open(kept.path, "rb") as f:
            _add_bf16_note(kept.warnings, f.read(), timer)
        if _speed.only_batch_one_slower(kept.speed_check, kept.batch1_check):
            kept.warnings.append(_speed.batch_one_note(kept.batch1_check, kept.batch1_fallback))
        return _warn_if_slower(kept)
    if speed is not None and speed.slower:
        notes.append(_speed.slower_note(speed, proto, kernels))
    if fallback is not None:
        notes.append(fallback.note())
    if speed is not None:
        _add_bf16_note(notes, data, timer)
    check1, fallback1 = (at_one[0], at_one[1]) if at_one is not None else (None, None)
    if _speed.only_batch_one_slower(speed, check1):
        notes.append(_speed.batch_one_note(check1, fallback1))
    res = _report.result(proto, cfg, opset, prep, rewrite, verified, providers, ort_ops, kernels, speed, notes,
                         export_seconds, stages.seconds)
    res.fallback, res.batch1_check, res.batch1_fallback = fallback, check1, fallback1
    return _warn_if_slower(res)


def _batch_one(prep, traced, cfg: ExportConfig, providers, timer: _speed.Timer, speed, kernels, data: bytes, fallback,
               kept, t0: float, stages: _Stages):
    """Where the speed check ran at a larger batch (the sample's), the file kept so far timed at batch 1 too, and
    where it is clearly slower there, the fallback's search again at batch 1 from that file, keeping only what is not
    slower at the check's own batch (:func:`lq.export.timing._fallback.batch_guard`), within what is left of
    ``fallback_seconds``. ``(check at batch 1 of the file kept, the search's record or None, the result of the file
    it kept or None)``; None where batch 1 is not timed."""
    timer1 = timer.at_batch_one(prep, cfg) if speed is not None else None
    if timer1 is None:
        return None
    at_sample = kept.speed_check if kept is not None else speed
    current = data
    if kept is not None:
        with open(kept.path, "rb") as f:
            current = f.read()
    check1 = _speed.speed_check(current, timer1, [])
    stages.done("speed check", advance=False)
    left = cfg.fallback_seconds - stages.seconds.get("fallback", 0.0)  # the budget is the fallback's, both searches
    if (check1 is None or not check1.clearly_slower or at_sample is None or at_sample.slower or traced is None
            or left <= 0):
        return check1, None, None
    guard = _fallback.batch_guard(at_sample, timer.measure)
    record, res = _fall_back(prep, traced, dataclasses.replace(cfg, fallback_seconds=left), providers, timer1,
                             check1, kernels, time.perf_counter() - t0, stages.shown,
                             base=fallback if kept is not None else None, guard=guard)
    stages.done("fallback", advance=False)
    if res is None:
        return check1, record, None
    res.speed_check, res.speedup = guard.best(), guard.best().ratio  # the check's own batch: as the user exported
    res.fallback = fallback  # the search at the check's batch (None: it did not run); this one is batch1_fallback
    if fallback is not None:
        res.warnings.insert(len(res.warnings) - 1, fallback.note())  # both searches' notes, in the order they ran
    return record.after, record, res


def _export_without(prep: _prepare.Prepared, traced: _trace.Traced, cfg: ExportConfig, off, t0: float,
                    faults_left: int = 0, fidelity: bool = False) -> ExportResult:
    """The export of a copy of the model with the quantizers ``off`` turned off, saved at ``cfg.path`` once it
    verifies: the export's own trace with those quantizers passing their input on (:mod:`lq.export.trace._bypass`)
    where the trace names them, else a trace of the copy. ``fidelity``: refuse a copy whose outputs move more than
    the fallback allows (:func:`lq.export.timing._fallback.check_fidelity`)."""
    candidate = copy.deepcopy(prep.work)
    _fallback.disable(candidate, sorted(off))
    restored = _bias_shift.unfold_where_float(candidate, prep.folded_biases)  # float layers: the user's bias
    cand = _prepare.prepare(candidate, prep.args, cfg)
    if fidelity and not prep.calibrated_as_is:  # a model trained since calibration: its float self may differ
        _fallback.check_fidelity(cand.cases[0][1], prep.cases[0][1])
    shared = _bypass.without(traced.proto, prep.work, off) if cfg.dynamo else None
    if shared is not None and restored:
        shared = _bypass.with_biases(shared, restored)
    if shared is not None:
        try:
            return _from_trace(cand, dataclasses.replace(traced, proto=shared), cfg, t0, faults_left=faults_left)
        except VerificationError:  # the shared trace was not the copy's after all: trace the copy
            pass
    return _from_trace(cand, _trace.trace(cand, cfg), cfg, t0, faults_left=faults_left)


def _around_fault(prep: _prepare.Prepared, traced: _trace.Traced, cfg: ExportConfig, proto: onnx.ModelProto,
                  seen, t0: float, faults_left: int, providers=None) -> ExportResult | None:
    """A file OpenVINO's output failed verification on: where OpenVINO computes one layer of it wrong
    (:func:`lq.export.verify._runtime_faults.first_fault`, onnxruntime as the reference on the same file), the
    export of the model with that layer in float, verified in OpenVINO in turn (another such layer: again, up to
    ``MAX_FAULTS``), said in its warnings. None where no layer is at fault (the verification error stands)."""
    feeds = [a.numpy() for a in prep.cases[0][0] if isinstance(a, torch.Tensor)]
    try:
        fault = _runtime_faults.first_fault(proto, feeds, seen.layer_of, providers)
        off = [q for q in _fallback.call_order(prep.work, prep.args) if _fallback.owner(q) == fault.layer] \
            if fault is not None else []
    except Exception:  # noqa: BLE001 - the diagnosis failed: the verification error stands
        return None
    if not off:
        return None
    res = _export_without(prep, traced, cfg, off, t0, faults_left=faults_left - 1)
    res.warnings.insert(0, f"{fault.text()}: that layer stays float in the saved file ({', '.join(off)} off; "
                           "verified in OpenVINO)")
    unverified = unverified_path(cfg.path)
    if os.path.exists(unverified):  # the first file's: the saved file replaces it
        os.remove(unverified)
    return res


def _add_bf16_note(notes: list, data: bytes, timer: _speed.Timer) -> None:
    """For OpenVINO on a CPU with native bf16: the saved file and the FP32 one timed with the bf16 hint too."""
    note = _speed.bf16_note(data, timer)
    if note:
        notes.append(note)


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    return out


class SlowerThanFP32Warning(UserWarning):
    """The saved INT8 file runs slower than the plain FP32 export of the same model (``ExportResult.speed_check``)."""


def _warn_if_slower(res: ExportResult) -> ExportResult:
    """A Python warning, not only ``result.warnings``, when the file the export saved is slower than FP32."""
    check = res.speed_check
    if check is not None and check.slower:
        warnings.warn(SlowerThanFP32Warning(
            f"lq.export_onnx: {res.path} runs at {check.ratio:.2f}x the speed of {check.reference} "
            f"({check.details()}); result.warnings and result.kernel_of(layer) say why"), stacklevel=3)
    return res


def _fall_back(prep, traced, cfg: ExportConfig, providers: list, timer: _speed.Timer, first, kernels: list,
               try_s: float, shown: lq_progress.Step | None = None, base: _fallback.Fallback | None = None,
               guard=None) -> tuple[_fallback.Fallback, ExportResult | None]:
    """The measured fallback (:mod:`lq.export.timing._fallback`): copies of the model with groups of quantizers
    off, each exported, verified against itself and timed against the same FP32 file. Returns the search's
    record and the result of the copy kept, its file saved at ``cfg.path`` (None: the first file stays).

    A copy's graph is the export's own trace with those quantizers passing their input on
    (:mod:`lq.export.trace._bypass`) where the trace names them, else a trace of the copy."""
    try:
        order = _fallback.call_order(prep.work, prep.args)
    except Exception as e:  # noqa: BLE001 - the model ran in prepare; if it cannot run again, keep the first file
        return _fallback.Fallback([], [], first, first, [], f"could not run the model to order its quantizers "
                                  f"({type(e).__name__}: {short(e, 200)})"), None
    groups = _fallback.groups(order, [k.layer for k in kernels if not k.integer and not k.by_choice])
    inner = dataclasses.replace(cfg, speed_check=False, providers=providers)
    with tempfile.TemporaryDirectory(prefix="lq-fallback-") as tmp:
        tries = iter(range(1, 10 ** 6))

        def export(off):
            t0, k = time.perf_counter(), next(tries)
            if shown is not None:
                shown.advance(0, description=f"Exporting: fallback, try {k} ({len(off)} quantizer(s) off)")
            cfg_try = dataclasses.replace(inner, path=os.path.join(tmp, f"try{k}.onnx"))
            res = _export_without(prep, traced, cfg_try, off, t0, fidelity=True)
            with open(res.path, "rb") as f:
                return f.read(), res

        record, kept = _fallback.search(first, groups, export, timer.measure, cfg.fallback_seconds, try_s, base=base,
                                        guard=guard)
        if kept is None:
            return record, None
        res = kept
        atomic_save(onnx.load(res.path), cfg.path)
    res.path, res.speed_check, res.speedup, res.fallback = cfg.path, record.after, record.after.ratio, record
    res.warnings.append(record.note())
    return record, res
