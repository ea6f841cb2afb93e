"""TensorRT's table: int8 Q/DQ with zero point 0; TensorRT fuses pointwise ops into the producer's kernel and
keeps data movement on int8. The export places no Q/DQ beyond the model's own quantizers for it (its builder
does the placement), so the table documents what it runs and is read for ``commutes``/``produces``."""

from __future__ import annotations

from lq.rules import OpRule

RULES: tuple[OpRule, ...] = (
    OpRule("conv", ("Conv",), produces=True, kernels=("int8 convolution",)),
    OpRule("conv_transpose", ("ConvTranspose",), produces=True, kernels=("int8 deconvolution",)),
    OpRule("gemm", ("Gemm",), produces=True, kernels=("int8 GEMM",)),
    OpRule("matmul", ("MatMul",), produces=True, kernels=("int8 GEMM",)),
    OpRule("add", ("Add",), produces=True, note="fused into the producer"),
    OpRule("concat", ("Concat",), produces=True, kernels=("int8 concat",)),
    OpRule("average_pool", ("GlobalAveragePool", "AveragePool"), produces=True, kernels=("int8 pooling",)),
    OpRule("relu", ("Relu",), note="fused into the producer"),
    OpRule("clip", ("Clip",), note="fused into the producer"),
    OpRule("max_pool", ("MaxPool",), kernels=("int8 pooling",)),
    OpRule("data_movement", ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity"),
           note="on int8"),
    OpRule("resize", ("Resize",), kernels=("int8 resize",)),
    OpRule("prelu", ("PRelu",), note="fused into the producer"),
    OpRule("leaky_relu", ("LeakyRelu",), note="fused into the producer"),
    OpRule("sigmoid", ("Sigmoid",), note="fused into the producer"),
    OpRule("hardswish", ("HardSwish",), note="fused into the producer"),
)
