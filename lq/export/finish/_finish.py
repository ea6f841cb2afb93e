"""Stage 4: the file's finish: metadata, the placeholder domain, the opset, the checker."""

from __future__ import annotations

import onnx

from lq.config import ExportConfig
from lq.export._files import short
from lq.export._ir import ExportError, all_nodes
from lq.export.trace import _symbolic, _torch_onnx
from lq.export.trace._symbolic import DOMAIN


def remove_placeholder_opset(model: onnx.ModelProto) -> None:
    keep = [o for o in model.opset_import if o.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    for f in list(model.functions):
        if f.domain == DOMAIN:
            model.functions.remove(f)


def strip_metadata(model: onnx.ModelProto) -> None:
    """Drop the exporter's per-node metadata (stack traces, FX node text): it can outweigh int8 weights."""
    for n in all_nodes(model.graph):  # loop bodies too
        del n.metadata_props[:]


def finish(proto: onnx.ModelProto, cfg: ExportConfig, opset: int, risks: list, notes: list
           ) -> tuple[onnx.ModelProto, int]:
    """The rewritten graph -> the file: metadata stripped (unless kept), lq's placeholder domain gone, the opset
    converted where another was asked for, ``onnx.checker`` run. ``risks`` (integer kernels that can saturate
    int16, :func:`lq.export.passes._int16.int16_risks`) are an internal error for onnxruntime (the passes leave
    none) and a note for TensorRT."""
    if not cfg.keep_metadata:
        strip_metadata(proto)
    remove_placeholder_opset(proto)
    proto, opset = _torch_onnx.set_opset(proto, opset, notes)
    if any(n.domain == _symbolic.DOMAIN for n in proto.graph.node):  # pragma: no cover - defensive
        raise ExportError("internal error: an lq placeholder was left in the graph")
    if cfg.target == "onnxruntime" and risks:  # pragma: no cover - encode_int16_safe leaves none
        raise ExportError("internal error: integer kernels that can saturate int16 remain: " + "; ".join(map(str, risks)))
    proto.producer_name = "lq.export"
    if cfg.check:
        try:
            onnx.checker.check_model(proto, full_check=True)
        except Exception as e:
            raise ExportError(f"onnx.checker rejected the exported model: {short(e)}") from e
    return proto, opset
