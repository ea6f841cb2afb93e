"""Stage 2: the model copy through ``torch.onnx`` (the current exporter, or the legacy one).

lq's quantizers trace as placeholder ops (:mod:`lq.export.trace._symbolic`) that the rewrite passes lower to
Q/DQ; a QuantLSTM traces as one placeholder per layer and direction with the current exporter (the legacy one
has no translation for it and keeps the unrolled steps, which fixes the sequence length: said in a note).
"""

from __future__ import annotations

import contextlib
import dataclasses

import onnx
import torch

from lq.config import ExportConfig
from lq.export._files import short
from lq.export._ir import ExportError
from lq.export.prepare import _model_checks
from lq.export.prepare._prepare import Prepared
from lq.export.trace import _loop_ops, _torch_onnx


@dataclasses.dataclass
class Traced:
    proto: onnx.ModelProto
    notes: list  # what the user should know about how the model was traced
    unrolled: list  # QuantLSTMs written one step per time step (fixed sequence length)


def trace(prep: Prepared, cfg: ExportConfig) -> Traced:
    dynamic = _loop_ops.runtime_dynamic_layers(prep.work)
    if dynamic and (cfg.target != "onnxruntime" or not cfg.dynamo):
        raise ExportError(f"QuantLSTM {', '.join(dynamic)} quantize(s) activations as onnxruntime's "
                          "DynamicQuantizeLSTM (runtime_dynamic), an onnxruntime op written by the current exporter "
                          "only: export with target='onnxruntime' and dynamo=True, or call set_runtime_dynamic(False) "
                          "and calibrate")
    try:
        loops = _loop_ops.loop_mode(prep.work) if cfg.dynamo else contextlib.nullcontext(
            _loop_ops.legacy_notes(prep.work))
        with torch.no_grad(), _model_checks.export_mode(prep.work), loops as loop_notes:
            notes = list(loop_notes)
            export = _torch_onnx.export_dynamo if cfg.dynamo else _torch_onnx.export_legacy
            proto = export(prep.work, prep.args, prep.opset, prep.input_names, prep.output_names, prep.dims)
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"torch.onnx export ({cfg.exporter}) failed: {type(e).__name__}: {short(e)}") from e
    return Traced(proto=proto, notes=notes, unrolled=list(notes))
