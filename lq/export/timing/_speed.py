"""Stage 6: time the verified INT8 file against the user's plain FP32 export of the same model.

One measurement (:func:`lq.export.timing._timing.compare`), at the batch the user names or the sample's, against
one FP32 file (:class:`Timer`): the faster of the user's two plain exports, ``torch.onnx.export`` with the current
exporter and with the legacy one (on a pretrained CREPE the current exporter's file ran at half the legacy one's
speed, so a check against it claimed 1.94x for a file at 0.99x the legacy one). The fallback
(:mod:`lq.export.timing._fallback`) times its candidate files against the same one. When the file the export keeps
is slower, :func:`slower_note` says so in those terms and names the layers that run in float.
"""

from __future__ import annotations

import dataclasses
import statistics

import onnx

from lq.config import ExportConfig
from lq.export._files import short
from lq.export.prepare._prepare import Prepared, batch_size
from lq.export.timing import _float_twin, _fp32_reference, _timing


@dataclasses.dataclass
class Timer:
    """The FP32 file, the feeds at the timed batch and the providers: what every timing of one export shares."""

    fp32: bytes
    reference: str  # what the FP32 file is (_timing.PLAIN, or _timing.TWIN where the user's export failed)
    feeds: list
    batch: int | None
    providers: list

    @classmethod
    def make(cls, prep: Prepared, cfg: ExportConfig, twin: onnx.ModelProto, providers, notes: list) -> "Timer":
        """Export the user's float model with torch.onnx.export, as they would, with both exporters, and keep the
        faster file (the FP32 twin of the exported graph where neither export works, said so in a note)."""
        feeds = _timing.batch_feeds(prep.tensors, prep.dims, cfg.speed_batch)
        files, failed = {}, []
        for dynamo, name in ((cfg.dynamo, _EXPORTERS[cfg.dynamo]), (not cfg.dynamo, _EXPORTERS[not cfg.dynamo])):
            same = _float_twin.plain_twin(twin, prep.work) if dynamo and cfg.dynamo else None
            if same is not None:  # the twin of the current exporter's own trace: that exporter's FP32 file
                files[name] = same.SerializeToString()
                continue
            try:
                files[name] = _fp32_reference.plain_export(prep.work, prep.args, dynamo, prep.opset, prep.input_names,
                                                           prep.output_names, prep.dims).SerializeToString()
            except Exception as e:  # noqa: BLE001 - the user's own export failed with that exporter
                failed.append(f"{name} exporter: {type(e).__name__}: {short(e, 200)}")
        if not files:
            notes.append(f"the speed check could not export the float model with torch.onnx.export ("
                         f"{'; '.join(failed)}), so it times the INT8 file against {_timing.TWIN}, which can differ "
                         "from the FP32 file a user would export")
            return cls(fp32=twin.SerializeToString(), reference=_timing.TWIN, feeds=feeds,
                       batch=cfg.speed_batch or batch_size(prep.tensors, prep.dims), providers=list(providers))
        name, fp32, reference = faster_plain(files, feeds, providers)
        return cls(fp32=fp32, reference=reference, feeds=feeds,
                   batch=cfg.speed_batch or batch_size(prep.tensors, prep.dims), providers=list(providers))

    def at_batch_one(self, prep: Prepared, cfg: ExportConfig) -> "Timer | None":
        """The same FP32 file timed at batch 1, where the check runs at a larger batch the user did not name and the
        file's batch axis is dynamic (batch 1 is where Q/DQ conversions cost most against the work they save: the
        export's batch-1 search, :func:`lq.export.timing._fallback.batch_guard`); None otherwise."""
        if cfg.speed_batch is not None or self.batch in (None, 1) or not any("batch" in d.values() for d in prep.dims):
            return None
        return dataclasses.replace(self, feeds=_timing.batch_feeds(prep.tensors, prep.dims, 1), batch=1)

    def measure(self, int8_model: bytes, below: float | None = None) -> _timing.SpeedCheck:
        """``int8_model`` against the FP32 file (:func:`lq.export.timing._timing.compare`); ``below``: stop early
        once the first rounds rule out a ratio above it (:func:`lq.export.timing._timing.hopeless`)."""
        return _timing.compare(int8_model, self.fp32, self.feeds, self.providers, batch=self.batch,
                               reference=self.reference, below=below)


_EXPORTERS = {True: "current", False: "legacy"}


def faster_plain(files: dict[str, bytes], feeds, providers) -> tuple[str, bytes, str]:
    """``(exporter, file, reference text)``: the faster of the plain FP32 files (``{exporter: bytes}``), timed
    against each other in interleaved rounds; the text names it and says by how much it won."""
    if len(files) == 1:
        (name, data), = files.items()
        return name, data, f"{_timing.PLAIN} ({name} exporter; the other exporter failed)"
    (a, fa), (b, fb) = files.items()
    ta, tb, _ = _timing.time_rounds(fa, fb, feeds, providers, rounds=7, budget_s=1.0)
    ratio = statistics.median(tb) / statistics.median(ta)  # > 1: a is faster
    name, data, by = (a, fa, ratio) if ratio >= 1 else (b, fb, 1 / ratio)
    return name, data, f"{_timing.PLAIN} ({name} exporter's file, the faster of the two exporters' by {by:.2f}x)"


def speed_check(int8_model: bytes, timer: Timer, notes: list) -> _timing.SpeedCheck | None:
    """The INT8 file against the FP32 one; a failure to time never fails the export (a note says it)."""
    try:
        return timer.measure(int8_model)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        notes.append(f"could not time the INT8 file against {timer.reference}: {short(e, 300)}")
        return None


def bf16_note(int8_model: bytes, timer: Timer) -> str | None:
    """Where OpenVINO runs "FP32" models in bf16 by default (a CPU with AMX or AVX-512 BF16), both files timed so
    (the INT8 file's float layers then run in bf16 too): a user learns whether bf16 alone would have served. None
    for onnxruntime, or a CPU without native bf16."""
    from lq.export.verify import _openvino

    if not _openvino.is_openvino(timer.providers) or not _openvino.has_bf16():
        return None
    try:
        check = _timing.compare(int8_model, timer.fp32, timer.feeds, [_openvino.OPENVINO_BF16], batch=timer.batch,
                                reference=timer.reference)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return f"could not time the files with OpenVINO's bf16 hint: {short(e, 200)}"
    verdict = ("the INT8 file is still the faster" if check.ratio >= 1 else
               "bf16 alone (OpenVINO's default for an FP32 model on this CPU) runs faster than the INT8 file")
    return (f"this CPU runs bf16 natively, and OpenVINO runs an FP32 model in bf16 here unless told f32: with the bf16 "
            f"hint the INT8 file runs at {check.ratio:.2f}x ({check.details()}): {verdict}")


def slower_note(check: _timing.SpeedCheck, proto: onnx.ModelProto, kernels: list) -> str:
    """The warning for a file slower than FP32: the measurement, the layers that run in float between Q/DQ
    (and, when the file has Scan loops, what runs them fused)."""
    loops = sum(n.op_type == "Scan" for n in proto.graph.node)
    floats = [f"{k.layer} ({k.kernel}: {k.reason})" for k in kernels if not k.integer]
    return (f"the INT8 file runs at {check.ratio:.2f}x the speed of {check.reference} in {check.runtime} "
            f"({check.details()}): "
            + (f"{len(floats)} quantized layer(s) run in float between Q/DQ: " + "; ".join(floats) if floats else
               "every quantized layer runs an integer kernel; the Q/DQ conversions cost more than they save "
               "at this size")
            + (f"; its {loops} recurrent layer(s) run as loops of small ops per time step (the step quantizes "
               "h), the FP32 file's as onnxruntime's fused float LSTM kernel: recurrent='dynamic' (QuantConfig, "
               "or QuantLSTM.set_runtime_dynamic) runs them as onnxruntime's fused DynamicQuantizeLSTM"
               if loops else "")
            + (f". The measurement is noisy: {check.noise}" if check.noisy else ""))


#: how the note on a file slower at batch 1 begins (the callback warns on it)
BATCH_ONE_SLOWER = "at batch 1 the file runs at"


def only_batch_one_slower(at_sample: _timing.SpeedCheck | None, at_one: _timing.SpeedCheck | None) -> bool:
    """Whether the file is slower than FP32 at batch 1 but not at the speed check's batch (slower there too, the
    slower-than-FP32 warning says it already)."""
    return at_one is not None and at_one.slower and at_sample is not None and not at_sample.slower


def batch_one_note(check: _timing.SpeedCheck, fallback) -> str:
    """The note for a file slower than FP32 at batch 1 though not at the speed check's batch: the measurement, and
    what the batch-1 search (``fallback``, None where it did not run) did."""
    if fallback is not None:
        why = "the fallback's search at batch 1 kept nothing faster there that was not slower at the check's batch"
    elif not check.clearly_slower:
        why = "in too few rounds to search (the upper quartile of the rounds reaches 1.0)"
    else:
        why = "the fallback did not search at batch 1 (fallback_seconds spent, or 0)"
    return (f"{BATCH_ONE_SLOWER} {check.ratio:.2f}x the speed of {check.reference} ({check.details()}): "
            f"{why}; export with speed_batch=1 to make batch 1 the batch the file must not be slower at")
