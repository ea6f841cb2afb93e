"""Stage 7: what the export tells the user: the layers' kernels in onnxruntime's optimized graph, the notes about
encodings and float layers, and the :class:`ExportResult`.

:func:`inspect` runs before the finish strips the exporter's metadata (it names the layers); the rest after the
file is verified and saved.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import onnx
from torch import nn

from lq.config import ExportConfig
from lq.export._files import short
from lq.export._ir import all_nodes, layer_name
from lq.export.passes import _int16
from lq.export.passes._pipeline import Rewrite
from lq.export.report import _kernel_report
from lq.export.report._result import ExportResult
from lq.export.verify import _verify
from lq.nn import QuantMixin, TensorQuantizer


@dataclasses.dataclass
class Inspected:
    """What the report reads from the rewritten graph while its nodes still carry the layers' names."""

    layer_of: dict  # node name -> PyTorch layer
    input_off: frozenset  # layers whose input quantizer the model turned off (the float region after a stem)
    unfused: list  # quantized layers onnxruntime cannot fuse, predicted from the file
    risks: list  # integer kernels that could saturate int16 without VNNI


def inspect(proto: onnx.ModelProto, cfg: ExportConfig, model: nn.Module) -> Inspected:
    """``model``: the exported (working) copy, whose layers the graph's names refer to."""
    layer_of = {n.name: layer_name(n) for n in all_nodes(proto.graph)}
    input_off = frozenset(name for name, m in model.named_modules() if isinstance(m, QuantMixin)
                          and isinstance(getattr(m, "_input_quantizer", None), TensorQuantizer)
                          and not m._input_quantizer.is_enabled)
    unfused = _kernel_report.unfused_layers(proto, layer_of, input_off) if cfg.target == "onnxruntime" else []
    return Inspected(layer_of=layer_of, input_off=input_off, unfused=unfused, risks=_int16.int16_risks(proto))


def encoding_notes(r: Rewrite, seen: Inspected, cfg: ExportConfig) -> list[str]:
    """Notes on how layers are encoded: uint8 x uint8 kernels, fused dynamic LSTMs, what TensorRT needs."""
    notes = []
    if r.u8_weights:
        shown = ", ".join(r.u8_weights[:6]) + (f" and {len(r.u8_weights) - 6} more" if len(r.u8_weights) > 6 else "")
        notes.append(f"{len(r.u8_weights)} layer(s) with 8-bit weights ({shown}) run on onnxruntime's uint8 x uint8 "
                     "kernels (their int8 x uint8 pair sums could saturate int16 on CPUs without VNNI; the stored values "
                     "are the same): the int8_reduce_range recipe (7-bit weights, used in calibration and QAT too) "
                     "keeps the faster uint8 x int8 kernels on every CPU")
    if r.dynamic_lstms:
        layers = ", ".join(dict.fromkeys(r.dynamic_lstms))
        notes.append(f"{len(r.dynamic_lstms)} LSTM layer-direction(s) ({layers}) run as "
                     "onnxruntime's fused DynamicQuantizeLSTM, which quantizes h at every step from h itself. On one "
                     "intra-op thread it computes what PyTorch does up to float rounding (now and then a rounding tie "
                     "of h falls the other way, and the steps after carry it; verified so); with more threads each "
                     "quantizes its share of the batch with its own scale, which moves results by a few steps of h "
                     "(bench.ordinary's LSTM: logits up to 0.06 apart at 2 threads, 0.013 at one; same predictions)")
    if cfg.target == "tensorrt":
        if seen.risks:
            notes.append(f"{len(seen.risks)} integer kernel(s) would saturate in onnxruntime's CPU kernels without VNNI "
                         "(TensorRT accumulates in int32, so the file is right for TensorRT; for onnxruntime "
                         "export with target='onnxruntime'): " + "; ".join(map(str, seen.risks)))
        u8 = sorted({q.layer for q in r.infos if q.dtype == "uint8" and q.kind == "activation"})
        if u8:
            notes.append(f"TensorRT supports only int8 Q/DQ; unsigned (uint8) quantizers: {', '.join(u8)}")
    return notes


def kernels(proto: onnx.ModelProto, cfg: ExportConfig, providers: list, seen: Inspected, notes: list
            ) -> tuple[Counter, list]:
    """onnxruntime's optimized graph of the saved file: its op counts and, for onnxruntime, each quantized
    layer's kernel (:class:`LayerKernel`); a note for quantized layers that run in float."""
    ort_ops: Counter = Counter()
    found: list = []
    if not cfg.check_fusion:
        return ort_ops, found
    if cfg.target == "openvino":
        return ort_ops, _openvino_kernels(proto, cfg, seen, notes)
    try:
        optimized = _verify.optimized_model(cfg.path, providers)
        ort_ops = Counter(n.op_type for n in all_nodes(optimized.graph))  # loop bodies too
        if cfg.target == "onnxruntime":
            found = _kernel_report.layer_kernels(proto, optimized, seen.layer_of, seen.input_off)
    except Exception as e:  # pragma: no cover - diagnostics only
        notes.append(f"could not inspect onnxruntime's optimized graph: {short(e)}")
    if cfg.target == "onnxruntime" and ort_ops:
        unfused = seen.unfused
        n_float = sum(ort_ops.get(k, 0) for k in ("Conv", "FusedConv", "Gemm", "MatMul", "FusedGemm", "FusedMatMul"))
        n_chosen = len({k.layer for k in found if k.by_choice})  # float by choice: faster, and said so per layer
        if found:  # what onnxruntime really runs, not the prediction from the file (it fuses a Gemm/MatMul
            # whose float output an Add or GELU reads: QGemm, MatMulIntegerToFloat)
            unfused = list(dict.fromkeys(f"{k.layer}: {k.reason}" for k in found if k.op in _kernel_report.COMPUTE
                                         and not k.integer and not k.by_choice))
        if unfused:
            notes.append(f"onnxruntime runs {len(unfused)} quantized conv/gemm/matmul in float: {'; '.join(unfused)}")
        elif n_float > n_chosen:
            notes.append(f"onnxruntime runs {n_float - n_chosen} conv/gemm/matmul in float (not quantized, or not "
                         "fused by onnxruntime): see its optimized graph")
    return ort_ops, found


def _openvino_kernels(proto: onnx.ModelProto, cfg: ExportConfig, seen: Inspected, notes: list) -> list:
    """The precision OpenVINO's compiled graph runs each quantized layer at; a note for those it runs in float."""
    from lq.export.report import _openvino_kernels

    try:
        with open(cfg.path, "rb") as f:
            found = _openvino_kernels.layer_kernels(proto, f.read(), seen.layer_of)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        notes.append(f"could not inspect OpenVINO's compiled graph: {short(e)}")
        return []
    floats = list(dict.fromkeys(f"{k.layer}: {k.kernel}, {k.reason}" for k in found if not k.integer))
    if floats:
        notes.append(f"OpenVINO runs {len(floats)} quantized conv/gemm/matmul in float: {'; '.join(floats)}")
    return found


def qdq_counts(model: onnx.ModelProto) -> dict[str, int]:
    c = Counter(n.op_type for n in all_nodes(model.graph))
    return {"QuantizeLinear": c.get("QuantizeLinear", 0), "DequantizeLinear": c.get("DequantizeLinear", 0)}


def result(proto: onnx.ModelProto, cfg: ExportConfig, opset: int, prep, r: Rewrite, verified, providers: list,
           ort_ops: Counter, found: list, speed, notes: list, export_seconds: float,
           stage_seconds: dict | None = None) -> ExportResult:
    return ExportResult(
        path=cfg.path, opset=opset, exporter=cfg.exporter,
        max_abs_diff=None if verified is None else verified.max_abs_diff,
        tolerance=None if verified is None else verified.tolerance, providers=providers,
        output_checks=[] if verified is None else verified.checks,
        verdict=None if verified is None else verified.verdict,
        file_size=os.path.getsize(cfg.path), quantized=r.infos, folded_bn=r.folds, ort_ops=ort_ops,
        qdq_nodes=qdq_counts(proto), input_names=prep.input_names, output_names=prep.output_names, warnings=notes,
        export_seconds=export_seconds, uint8_weights=r.u8_weights, layer_kernels=found,
        speedup=None if speed is None else speed.ratio, speed_check=speed, stage_seconds=dict(stage_seconds or {}))
