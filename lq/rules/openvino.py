"""OpenVINO's table (CPU plugin, its low-precision transformations): what it runs for ``DQ -> op -> Q``.

OpenVINO reads a Q/DQ file as FakeQuantize ops and moves them itself: into the convolution or matmul that reads
them (an ``i8``/``u8`` kernel in its compiled graph, ``python -m bench.openvino`` reports which), across max
pools and data movement, and as post-ops into the layer before them. Its zero points cost: a non-zero activation
zero point ran a third to half slower than zero (depthwise convs most; ``bench.openvino``), so the recipe
(:class:`lq.config.Int8OpenvinoConfig`) is symmetric. The export adds no Q/DQ beyond the model's own
quantizers for it; it only moves a per-tensor pair in front of the data movement, nearest Resize, Concat and
MaxPool it reads (:mod:`lq.export.passes._quantize_first`), so that the plugin fuses it into the producer and
runs the op on the integers, as it does with NNCF's files. The table documents what the plugin runs and is
read for ``commutes``/``produces``. Kernel names are the compiled graph's layer types.
"""

from __future__ import annotations

from lq.rules import OpRule

RULES: tuple[OpRule, ...] = (
    OpRule("conv", ("Conv",), produces=True, kernels=("Convolution", "GroupConvolution")),
    OpRule("conv_transpose", ("ConvTranspose",), produces=True, kernels=("Deconvolution",)),
    OpRule("gemm", ("Gemm",), produces=True, kernels=("FullyConnected",)),
    OpRule("matmul", ("MatMul",), produces=True, kernels=("FullyConnected", "MatMul")),
    OpRule("add", ("Add",), produces=True,
           note="fused as a post-op into the conv before it; an operand a quantized layer also reads is read "
                "through that layer's quantizer (lq.glue._join_ties), so no float copy of it is kept"),
    OpRule("concat", ("Concat",), produces=True,
           note="on the integers when its inputs share one grid (lq.glue._tensor_ties gives them one)"),
    OpRule("average_pool", ("GlobalAveragePool", "AveragePool"), produces=True,
           note="float; a squeeze-excite's pool on the integers its product also reads (lq.glue._join_ties), "
                "other pools' input quantizers ran as a separate FakeQuantize (bench.openvino)"),
    OpRule("relu", ("Relu",), note="fused into the producer"),
    OpRule("clip", ("Clip",), note="fused into the producer"),
    OpRule("max_pool", ("MaxPool",), note="on the integers (the quantizer moves across it)"),
    OpRule("data_movement", ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity"),
           note="on the integers"),
    OpRule("resize", ("Resize",), note="nearest on the integers"),
    OpRule("prelu", ("PRelu",), note="fused into the producer as a post-op"),
    OpRule("leaky_relu", ("LeakyRelu",), note="fused into the producer as a post-op"),
    OpRule("sigmoid", ("Sigmoid",), note="fused into the producer as a post-op"),
    OpRule("hardswish", ("HardSwish",), note="fused into the producer as a post-op"),
)
