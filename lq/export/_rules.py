"""Per-operator Q/DQ placement rules, per runtime: the one table the placement passes read.

A row says, for one ONNX op:

* ``commutes``: ``fq(op(fq(x))) == fq(op(x))`` *exactly* for any per-tensor quantizer ``fq`` whose grid
  contains 0, so a quantizer that reads the op's output may be copied (hoisted) to its input, the one after
  the op staying. True for ops that map grid values to grid values and keep order (ReLU, MaxPool, pure data
  movement), and for Clip to any constant bounds: a rounding that keeps order distributes over ``min`` and
  ``max`` (``fq(min(a, c)) == min(fq(a), fq(c))``), so ``fq(clip(fq(x), lo, hi))`` and ``fq(clip(x, lo, hi))``
  are both ``clamp(fq(x), fq(lo), fq(hi))``. PReLU, LeakyReLU, GELU, SiLU, Hardswish, Sigmoid and averaging
  are NOT here: moving a quantizer across them changes the result.
* ``produces``: the op computes a new value that a quantizer right after it turns into the output of
  a fused integer kernel (``DQ -> op -> Q``). A quantizer hoisted through commuting ops stops here.
* ``onnxruntime`` / ``tensorrt``: the integer kernel the runtime runs for ``DQ -> op -> Q``
  (None: the op runs in float between Q/DQ pairs, or is folded away).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class OpRule:
    commutes: bool = False
    produces: bool = False
    onnxruntime: str | None = None
    tensorrt: str | None = None


RULES: dict[str, OpRule] = {
    # op                   commutes  produces  onnxruntime kernel            TensorRT
    "Conv":               OpRule(False, True,  "QLinearConv",                "int8 convolution"),
    "ConvTranspose":      OpRule(False, True,  None,                         "int8 deconvolution"),
    "Gemm":               OpRule(False, True,  "QGemm",                      "int8 GEMM"),
    # onnxruntime: a MatMul whose bias Add follows (a Linear on 3-D input) is written as Gemm (_linear_gemm.py)
    "MatMul":             OpRule(False, True,  "QLinearMatMul / MatMulIntegerToFloat", "int8 GEMM"),
    "Add":                OpRule(False, True,  "QLinearAdd",                 "fused into the producer"),
    "Concat":             OpRule(False, True,  "QLinearConcat",              "int8 concat"),
    "GlobalAveragePool":  OpRule(False, True,  "QLinearGlobalAveragePool",   "int8 pooling"),
    "AveragePool":        OpRule(False, True,  "QLinearAveragePool",         "int8 pooling"),
    "Relu":               OpRule(True,  False, "integer Max (or fused)",     "fused into the producer"),
    # ReLU6, Hardtanh, clamp: the bounds' codes on the integers (or nothing, when outside the grid's range)
    "Clip":               OpRule(True,  False, "integer Clip (or fused)",    "fused into the producer"),
    "MaxPool":            OpRule(True,  False, "MaxPool on uint8",           "int8 pooling"),
    "Reshape":            OpRule(True,  False, "on integers",                "on integers"),
    "Flatten":            OpRule(True,  False, "on integers",                "on integers"),
    "Transpose":          OpRule(True,  False, "on integers",                "on integers"),
    "Squeeze":            OpRule(True,  False, "on integers",                "on integers"),
    "Unsqueeze":          OpRule(True,  False, "on integers",                "on integers"),
    "Identity":           OpRule(True,  False, "on integers",                "on integers"),
    # mode="nearest" only (it picks existing values); linear/cubic interpolation does not commute
    # (onnxruntime: nearest by whole factors of a conv's output as an NHWC Expand instead, see _upsample.py)
    "Resize":             OpRule(True,  False, "on uint8",                   "int8 resize"),
    # not monotone-and-grid-preserving: quantizers are never moved across these
    "PRelu":              OpRule(False, False, None,                         "fused into the producer"),
    "LeakyRelu":          OpRule(False, False, "QLinearLeakyRelu",           "fused into the producer"),
    "Sigmoid":            OpRule(False, False, "QLinearSigmoid",             "fused into the producer"),
    "HardSwish":          OpRule(False, False, None,                         "fused into the producer"),
}


#: onnxruntime (x86 MLAS) runs a conv with fewer input channels per group than this (a depthwise conv, an RGB
#: or grayscale stem) slower as QLinearConv than as its float conv: measured by ``python -m bench.conv_kernels``
#: (AVX-512 VNNI, INT8 over FP32 kernel time: depthwise 3x3 / 7x7 0.52-1.04x, 1-3 input channels 0.24-0.64x,
#: 4 to 32 input channels 1.6-2.6x; docs/results/conv_kernels.md).
#: The export gives such a conv its dequantized weights as float (the same values), so onnxruntime runs the
#: faster float kernel, and lq.glue gives it no output quantizer of its own.
ORT_INT8_CONV_MIN_CHANNELS_PER_GROUP = 4
#: marks the float weights of such a conv in the exported file (the kernel report names the reason)
FLOAT_BY_CHOICE = "float_by_choice"
#: marks the float (dequantized) weights of a conv that onnxruntime runs in float anyway, because no quantizer
#: reads its output (a PReLU or a mean reads it): float initializers let it use its blocked (NCHWc) float conv
FLOAT_WEIGHTS = "dequantized_float"
FLOAT_MARKERS = (FLOAT_BY_CHOICE, FLOAT_WEIGHTS)

#: a nearest upsample (by whole factors) of a conv's quantized output is written as a channels-last Expand
#: (:mod:`lq.export.passes._upsample`) from this many channels on: onnxruntime resizes it in NHWC with an index per
#: element. Between two QLinearConvs (batch 32, 16x16 -> 32x32, AVX-512 VNNI), conv + upsample + conv took
#: 1.15 vs 1.18 ms (Resize vs Expand) at 4 channels, 1.50 vs 1.40 at 8, 1.39 vs 1.10 at 16, 10.1 vs 8.5 at 64.
ORT_NHWC_UPSAMPLE_MIN_CHANNELS = 8


def ort_prefers_float_conv(channels_per_group: int) -> bool:
    """Whether onnxruntime runs a conv with this many input channels per group faster in float."""
    return channels_per_group < ORT_INT8_CONV_MIN_CHANNELS_PER_GROUP


def rule(op_type: str) -> OpRule:
    """The row of ``op_type`` (an unlisted op neither commutes nor produces)."""
    return RULES.get(op_type, OpRule())


def commutes(op_type: str, node=None) -> bool:
    """Whether a quantizer may move across the op; ``node`` (the ONNX node) for ops whose attributes decide
    it (Resize: only ``mode="nearest"``)."""
    if op_type == "Resize":
        if node is None:
            return False
        mode = next((a.s for a in node.attribute if a.name == "mode"), b"nearest")
        return mode in (b"nearest", "nearest")
    return rule(op_type).commutes


def produces(op_type: str) -> bool:
    return rule(op_type).produces
