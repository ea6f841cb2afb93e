"""onnxruntime's table (x86 CPU, its QDQ fusions and QLinear* kernels): one entry per operator family, plus the
measured thresholds where its float kernel beats its integer one."""

from __future__ import annotations

import math

from lq.rules import OpRule

RULES: tuple[OpRule, ...] = (
    OpRule("conv", ("Conv",), produces=True, kernels=("QLinearConv",)),
    OpRule("conv_transpose", ("ConvTranspose",), produces=True,
           note="no CPU integer kernel: runs in float between Q/DQ"),
    OpRule("gemm", ("Gemm",), produces=True, kernels=("QGemm",)),
    # a MatMul whose bias Add follows (a Linear on 3-D input) is written as Gemm (lq.export.passes._linear_gemm)
    OpRule("matmul", ("MatMul",), produces=True, kernels=("QLinearMatMul", "MatMulIntegerToFloat")),
    OpRule("add", ("Add",), produces=True, kernels=("QLinearAdd",)),
    OpRule("concat", ("Concat",), produces=True, kernels=("QLinearConcat",)),
    OpRule("average_pool", ("GlobalAveragePool", "AveragePool"), produces=True,
           kernels=("QLinearGlobalAveragePool", "QLinearAveragePool")),
    OpRule("relu", ("Relu",), note="fused into the producer's kernel, or an integer Max"),
    # ReLU6, Hardtanh, clamp: the bounds' codes on the integers (or nothing, when outside the grid's range)
    OpRule("clip", ("Clip",), note="the bounds' codes on the integers, or fused"),
    # moved in front of a PReLU/LeakyReLU/BatchNorm it commutes with (lq.export.passes._pool_first), so it reads the
    # integers of the conv before it (NhwcMaxPool) instead of the float op's requantized output (a slow NCHW pool)
    OpRule("max_pool", ("MaxPool",), note="MaxPool on uint8"),
    OpRule("data_movement", ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity"),
           note="on the integers"),
    # nearest by whole factors of a conv's output: an NHWC Expand instead (lq.export.passes._upsample)
    OpRule("resize", ("Resize",), note="nearest on uint8; linear does not commute"),
    # float between Q/DQ, the conv before it integer (lq.glue._rules.SLOPED; a max pool behind it moves onto the conv's
    # integers). pytorch-quantization's symmetric descriptors keep that conv float: slope ties (lq.glue._rules)
    OpRule("prelu", ("PRelu",), note="float between Q/DQ"),
    OpRule("leaky_relu", ("LeakyRelu",), note="float between Q/DQ"),
    OpRule("sigmoid", ("Sigmoid",), kernels=("QLinearSigmoid",)),  # between quantizers: a squeeze-excite gate
    OpRule("hardswish", ("HardSwish",), note="float between Q/DQ"),
)

#: onnxruntime (x86 MLAS) runs a conv with fewer input channels per group than this (a depthwise conv, an RGB
#: or grayscale stem) slower as QLinearConv than as its float conv, unless each output sums many products (below):
#: measured by ``python -m bench.conv_kernels`` (docs/results/conv_kernels.md, AVX-512 VNNI, batch 32, INT8 over
#: FP32 kernel time: depthwise 3x3 / 7x7 0.50-0.95x, 1-3 input channels with 3x3 or 5x5 kernels 0.15-0.80x, 4 to
#: 32 input channels 1.06-2.26x).
#: The export gives such a conv its dequantized weights as float (the same values), so onnxruntime runs the
#: faster float kernel, and lq.glue gives it no output quantizer of its own.
ORT_INT8_CONV_MIN_CHANNELS_PER_GROUP = 4
#: ... unless each output sums at least this many products (input channels per group x kernel elements), where the
#: integer kernel wins again: ResNet's 7x7 RGB stem (147 products) 1.07x, a 1-D stem of 128 taps on one channel
#: 2.71x, CREPE's 512 taps 2.44x (same run). Conservative for 1-D convs: 32 taps on one channel already ran 1.42x
#: there, where 2-D kernels of 27 to 75 products run 0.39-0.80x.
ORT_INT8_CONV_MIN_REDUCTION = 128
#: onnxruntime's x86 integer conv (MLAS, AVX2 and every later ISA) has two paths for a dense conv with int8
#: weights of zero zero point: an indirect "symmetric" kernel, taken only when the conv's input channels are a
#: multiple of this, its output channels at least ORT_SYM_CONV_MIN_OUT_CHANNELS and a multiple of
#: ORT_SYM_CONV_OUT_CHANNEL_ALIGN (AVX2's alignment; AVX-512's is 4), and im2col + integer GEMM otherwise. An RGB or
#: grayscale 2-D stem misses the fast one by its 1-3 channels; zero channels padded onto its quantized input (and
#: zero weights onto its filter: the same sums) put it there. Measured (kernel times, batch 32, AVX-512 VNNI + AMX;
#: ``python -m bench.conv_kernels`` times both sides): 3x3 convs with 1, 2, 3, 6, 7, 10, 15 input channels
#: 0.99 / 0.95 / 0.96 / 0.92 / 1.02 / 0.51 / 1.16 ms -> 0.49 / 0.50 / 0.50 / 0.62 / 0.66 / 0.33 / 0.88 ms padded,
#: 5x5 with 3 channels 1.61 -> 1.21 ms. Not everywhere: 3x3 with 30 channels 1.17 -> 1.33 ms, 5x5 with 10 channels
#: 1.76 -> 1.81, 7x7 RGB stems 1.96 -> 2.41 and 2.58 -> 3.42 ms, 7x7 with 10 channels 2.50 -> 3.82; 1-D convs
#: of 9 and 32 taps on one channel 0.29 -> 0.39 and 0.80 -> 1.11 ms. So lq pads 2-D kernels of at most
#: ORT_SYM_CONV_MAX_KERNEL_ELEMENTS with fewer products per output than ORT_INT8_CONV_MIN_REDUCTION. The bench's
#: ResNet-style net (3 -> 16 3x3 stem, max pool): 0.87 / 1.00 / 1.04x FP32 at batch 1 / 8 / 32 before, 1.04 / 1.22 /
#: 1.29x padded.
ORT_SYM_CONV_CHANNEL_ALIGN = 4
ORT_SYM_CONV_MIN_OUT_CHANNELS = 16
ORT_SYM_CONV_OUT_CHANNEL_ALIGN = 8
ORT_SYM_CONV_MAX_KERNEL_ELEMENTS = 25
#: a conv that writes a model output (lq leaves model outputs float; onnxruntime's own quantizer puts a Q/DQ pair
#: there to run QLinearConv) with fewer output channels than this runs faster as its float conv, even before the
#: DequantizeLinear the integer kernel would need: ``python -m bench.conv_kernels``, the "model output" cases
ORT_INT8_HEAD_MIN_OUT_CHANNELS = 4

#: a nearest upsample (by whole factors) of a conv's quantized output is written as a channels-last Expand
#: (:mod:`lq.export.passes._upsample`) from this many channels on: onnxruntime resizes it in NHWC with an index per
#: element. Between two QLinearConvs (batch 32, 16x16 -> 32x32, AVX-512 VNNI), conv + upsample + conv took
#: 1.15 vs 1.18 ms (Resize vs Expand) at 4 channels, 1.50 vs 1.40 at 8, 1.39 vs 1.10 at 16, 10.1 vs 8.5 at 64.
ORT_NHWC_UPSAMPLE_MIN_CHANNELS = 8

#: a SiLU whose input has at least this many elements per sample (a large activation map: 56x56 and more at 16+
#: channels) also quantizes its gate (:class:`lq.nn.QuantSiLU`, the ``F.silu`` glue sites): onnxruntime then runs it
#: as ``QLinearSigmoid`` + ``QLinearMul`` on the codes instead of DequantizeLinear + QuickGelu + QuantizeLinear on
#: floats. bench.styles' EfficientNet-style net, every SiLU after an integer conv gated against none (AMX Xeon, 1
#: thread, vs the faster plain FP32 file, batch 1 / 8 / 32): at 224x224 (maps of 200K-600K elements) 0.82 / 0.79 /
#: 0.92x -> 0.97 / 1.13 / 1.53x (quantize_static 0.91 / 1.11 / 1.49x); at 64x64 (12K-49K) 0.67 / 0.79 / 0.87 ->
#: 0.72 / 0.89 / 1.07x; at 32x32 (4K-16K) 0.68 / 0.70 / 0.80 -> 0.72 / 0.77 / 0.90x. On a Zen 5 (AVX-512 VNNI) at
#: 32x32 the gated SiLUs ran slower (bench.library's EfficientNet-style net, batch 8: 1.91 ms gated, 1.46 ms
#: as QuickGelu), so small maps keep the float kernel.
ORT_INT8_SILU_GATE_MIN_ELEMENTS = 32768


def ort_prefers_float_head(out_channels: int) -> bool:
    """Whether a conv writing a model output with this many output channels runs faster in float than as
    QLinearConv (score-map heads of a segmentation net)."""
    return out_channels < ORT_INT8_HEAD_MIN_OUT_CHANNELS


def ort_prefers_float_conv(channels_per_group: int, kernel_size=(1,)) -> bool:
    """Whether onnxruntime runs a conv with this many input channels per group and this kernel faster in float."""
    products = channels_per_group * math.prod(kernel_size)
    return channels_per_group < ORT_INT8_CONV_MIN_CHANNELS_PER_GROUP and products < ORT_INT8_CONV_MIN_REDUCTION


def ort_gates_silu(shape) -> bool:
    """Whether a SiLU reading a tensor of ``shape`` (batch first) quantizes its gate for onnxruntime (None: the
    shape is unknown, the float kernel is kept)."""
    return shape is not None and len(shape) >= 2 and math.prod(shape[1:]) >= ORT_INT8_SILU_GATE_MIN_ELEMENTS


def ort_padded_input_channels(in_channels: int, out_channels: int, groups: int, kernel_size) -> int | None:
    """The input channel count a quantized conv is padded to so that onnxruntime runs its symmetric conv kernel
    (:data:`ORT_SYM_CONV_CHANNEL_ALIGN`), or None where it runs that kernel already or padding does not pay."""
    align = ORT_SYM_CONV_CHANNEL_ALIGN
    if groups != 1 or len(kernel_size) != 2 or in_channels % align == 0:
        return None
    if not 1 < math.prod(kernel_size) <= ORT_SYM_CONV_MAX_KERNEL_ELEMENTS:  # a 1x1 conv needs no im2col
        return None
    if out_channels < ORT_SYM_CONV_MIN_OUT_CHANNELS or out_channels % ORT_SYM_CONV_OUT_CHANNEL_ALIGN:
        return None
    if in_channels * math.prod(kernel_size) >= ORT_INT8_CONV_MIN_REDUCTION:
        return None
    return -(-in_channels // align) * align
