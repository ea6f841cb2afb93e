"""Stage 3: the rewrite passes, declared in order, and what they record.

Two lists. :data:`GRAPH_PASSES` run on the traced graph and, through the last of them, on every loop body (a
QuantLSTM's Scan): they lower lq's placeholders to Q/DQ, fold what the runtime would compute at load time, and
place the Q/DQ pairs where the target runtime fuses them (the per-operator rules in :mod:`lq.rules`).
:data:`SHAPE_PASSES` run once on the finished top graph, where they need the shapes of values.

A pass names the targets it serves; adding one is adding a row here (and its test file, tests/test_export_*.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import onnx

from lq.config import ExportConfig
from lq.export._ir import Graph, value_shapes
from lq.export.passes import (_channel_affine, _dynamic_lstm, _float_convs, _fold_bn, _fold_constants, _gelu_order, _int16,
                              _linear_gemm, _loops, _lower, _matmul_nbits, _mean_first, _pad_channels, _placement, _pool_first,
                              _quantize_first, _reshape_chains, _silu, _swap_last_axes, _upsample, _weight_layout)

ORT = ("onnxruntime",)
#: the passes every target runs (standard ONNX in, standard ONNX out)
ALL = ("onnxruntime", "tensorrt", "openvino")
#: onnxruntime's fused DynamicQuantizeLSTM is a com.microsoft op: not for OpenVINO, which reads standard ONNX
NOT_OPENVINO = ("onnxruntime", "tensorrt")
OPENVINO = ("openvino",)


@dataclasses.dataclass
class Rewrite:
    """The options the passes read and what they record for the report."""

    cfg: ExportConfig
    lower: _lower.LowerOptions
    infos: list = dataclasses.field(default_factory=list)  # QuantNodeInfo per lowered quantizer
    folds: list = dataclasses.field(default_factory=list)  # FoldRecord per BatchNorm
    u8_weights: list = dataclasses.field(default_factory=list)  # layers whose 8-bit weights run uint8 x uint8
    dynamic_lstms: list = dataclasses.field(default_factory=list)  # layer-directions as DynamicQuantizeLSTM
    notes: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    run: Callable
    targets: tuple = ALL
    when: Callable[[ExportConfig], bool] = lambda cfg: True

    def applies(self, cfg: ExportConfig) -> bool:
        return cfg.target in self.targets and self.when(cfg)


def _dynamic_lstms(g: Graph, r: Rewrite) -> None:
    for layer, unsigned in _dynamic_lstm.write_dynamic_lstms(g):
        r.dynamic_lstms.append(layer)
        if unsigned:
            r.u8_weights.append(layer)


#: per graph (loop bodies too), in this order
GRAPH_PASSES: tuple[Pass, ...] = (
    Pass("fold_constants", lambda g, r: _fold_constants.fold_constants(g)),
    Pass("lower_placeholders", lambda g, r: _lower.lower_placeholders(g, r.lower, r.infos)),
    Pass("fold_weight_quantize", lambda g, r: _lower.fold_weight_quantize(g)),
    # block-quantized Linear weights -> onnxruntime's MatMulNBits kernel
    Pass("matmul_nbits", lambda g, r: r.notes.extend(_matmul_nbits.write_matmul_nbits(g)), ORT),
    Pass("dedupe_scalings", lambda g, r: _placement.dedupe_scalings(g), ORT),
    Pass("dynamic_lstms", _dynamic_lstms, NOT_OPENVINO),
    Pass("fold_batchnorm", lambda g, r: r.folds.extend(_fold_bn.fold_batchnorm(g)), when=lambda cfg: cfg.fold_bn),
    Pass("split_weight_dq", lambda g, r: _weight_layout.split_weight_dq(g)),
    Pass("transpose_weight_dq", lambda g, r: _weight_layout.transpose_weight_dq(g)),
    Pass("pool_before_activations", lambda g, r: _pool_first.pool_before_activations(g), ORT),
    Pass("dedupe_quantizers_before_placement", lambda g, r: _placement.dedupe_quantizers(g), ORT),
    Pass("split_shared_producers", lambda g, r: _placement.split_shared_producers(g), ORT),
    Pass("hoist_quantizers", lambda g, r: _placement.hoist_quantizers(g), ORT),
    Pass("shapes_from_quantized", lambda g, r: _placement.shapes_from_quantized(g), ORT),
    Pass("clips_on_integers", lambda g, r: _placement.clips_on_integers(g), ORT),
    Pass("float_weights_for_float_convs", lambda g, r: _float_convs.float_weights_for_float_convs(g), ORT),
    Pass("linears_as_gemm", lambda g, r: _linear_gemm.linears_as_gemm(g), ORT),
    Pass("quantize_bias", lambda g, r: _placement.quantize_bias(g), ORT),
    # quantizers in front of reshapes, pools, concats and nearest upsamples, on the producer (before the dedupe)
    Pass("quantizers_first", lambda g, r: _quantize_first.quantizers_first(g), OPENVINO),
    Pass("dedupe_quantizers", lambda g, r: _placement.dedupe_quantizers(g)),
    Pass("encode_int16_safe", lambda g, r: r.u8_weights.extend(_int16.encode_int16_safe(g)), ORT),
    # an RGB stem's quantized input and filter padded to 4 channels: onnxruntime's fast symmetric conv kernel
    Pass("pad_conv_input_channels", lambda g, r: _pad_channels.pad_conv_input_channels(g), ORT),
    Pass("weights_to_qdq", lambda g, r: _weight_layout.weights_to_qdq(g), when=lambda cfg: cfg.resolved_weight_format() == "qdq"),
    Pass("loop_bodies", lambda g, r: _loops.rewrite_bodies(g, lambda body: run_graph_passes(body, r))),
)

#: once, on the top graph, with ``shapes`` (value name -> shape); each returns how many places it changed
SHAPE_PASSES: tuple[Pass, ...] = (
    Pass("global_pools", lambda g, shapes: _placement.global_pools(g, {k: len(v) for k, v in shapes.items()})),
    Pass("mean_before_pointwise_convs", lambda g, shapes: _mean_first.mean_before_pointwise_convs(g), ORT),
    Pass("affines_as_batchnorm", lambda g, shapes: _channel_affine.affines_as_batchnorm(g, shapes), ORT),
    Pass("nearest_upsamples_as_expand", lambda g, shapes: _upsample.nearest_upsamples_as_expand(g, shapes), ORT),
    Pass("reorder_gelus", lambda g, shapes: _gelu_order.reorder_gelus(g), ORT),
    Pass("silus_as_quick_gelu", lambda g, shapes: _silu.silus_as_quick_gelu(g), ORT),
    # the current exporter's key.transpose(-1, -2) (Reshape -> Transpose -> Reshape) as one Transpose
    Pass("swap_last_axes", lambda g, shapes: _swap_last_axes.swap_last_axes(g, shapes)),
    # a Gemm's unflatten shape as a constant where only the batch is unknown (lq.export.passes._linear_gemm)
    Pass("static_leading_shapes", lambda g, shapes: _linear_gemm.static_leading_shapes(g, shapes), ORT),
    # a Gemm's output kept 2-D through a GELU into the next Gemm; reshapes in a row as one (lq.export.passes._reshape_chains)
    Pass("rows_between_gemms", lambda g, shapes: _reshape_chains.rows_between_gemms(g), ORT),
    Pass("merge_reshape_chains", lambda g, shapes: _reshape_chains.merge_reshape_chains(g), ORT),
)


def run_graph_passes(g: Graph, r: Rewrite) -> None:
    for p in GRAPH_PASSES:
        if p.applies(r.cfg):
            p.run(g, r)


def rewrite(proto: onnx.ModelProto, cfg: ExportConfig, opset: int) -> tuple[onnx.ModelProto, Rewrite]:
    """The traced graph -> the Q/DQ graph for ``cfg.target``; what was done is in the :class:`Rewrite`."""
    r = Rewrite(cfg=cfg, lower=_lower.LowerOptions(
        opset=opset, weight_format=cfg.resolved_weight_format(),
        activation_dtype="uint8" if cfg.target == "onnxruntime" else "int8",
        narrow_clamp=cfg.target != "tensorrt"))
    proto = _loops.lower_recurrent(proto)  # recurrent placeholders -> Scan (bodies still hold lq placeholders)
    g = Graph(proto)
    run_graph_passes(g, r)
    for f in r.folds:
        if f.skipped:
            r.notes.append(f"BatchNorm '{f.bn}' not folded into '{f.layer}': {f.skipped}")
        if f.clipped:
            r.notes.append(f"folding '{f.bn}' flipped the sign of {f.clipped} weight(s) at -128, clipped to 127")
    proto = g.finalize()
    shapes = value_shapes(proto)
    g = Graph(proto)
    changed = sum(p.run(g, shapes) for p in SHAPE_PASSES if p.applies(cfg))
    if changed:
        proto = g.finalize()
    r.u8_weights = list(dict.fromkeys(r.u8_weights))  # a layer once, not once per weight (an LSTM has several)
    return proto, r
