"""Per-operator Q/DQ placement rules, per runtime: the one table the placement passes read.

A row says, for one ONNX op:

* ``commutes``: ``op(fq(x)) == fq(op(x))`` *exactly* for any per-tensor quantizer ``fq`` whose grid
  contains 0. True only for ops that are monotone non-decreasing and map grid values to grid values
  (ReLU, MaxPool, pure data movement). A quantizer may then be moved (hoisted) across the op. PReLU,
  LeakyReLU, GELU, SiLU, Hardswish, Sigmoid, Clip to arbitrary bounds and averaging are NOT here:
  moving a quantizer across them changes the result.
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
    "MatMul":             OpRule(False, True,  "QLinearMatMul / MatMulIntegerToFloat", "int8 GEMM"),
    "Add":                OpRule(False, True,  "QLinearAdd",                 "fused into the producer"),
    "Concat":             OpRule(False, True,  "QLinearConcat",              "int8 concat"),
    "GlobalAveragePool":  OpRule(False, True,  "QLinearGlobalAveragePool",   "int8 pooling"),
    "AveragePool":        OpRule(False, True,  "QLinearAveragePool",         "int8 pooling"),
    "Relu":               OpRule(True,  False, "integer Max (or fused)",     "fused into the producer"),
    "MaxPool":            OpRule(True,  False, "MaxPool on uint8",           "int8 pooling"),
    "Reshape":            OpRule(True,  False, "on integers",                "on integers"),
    "Flatten":            OpRule(True,  False, "on integers",                "on integers"),
    "Transpose":          OpRule(True,  False, "on integers",                "on integers"),
    "Squeeze":            OpRule(True,  False, "on integers",                "on integers"),
    "Unsqueeze":          OpRule(True,  False, "on integers",                "on integers"),
    "Identity":           OpRule(True,  False, "on integers",                "on integers"),
    # not monotone-and-grid-preserving: quantizers are never moved across these
    "PRelu":              OpRule(False, False, None,                         "fused into the producer"),
    "LeakyRelu":          OpRule(False, False, "QLinearLeakyRelu",           "fused into the producer"),
    "Sigmoid":            OpRule(False, False, "QLinearSigmoid",             "fused into the producer"),
    "HardSwish":          OpRule(False, False, None,                         "fused into the producer"),
    "Clip":               OpRule(False, False, None,                         "fused into the producer"),
}


def rule(op_type: str) -> OpRule:
    """The row of ``op_type`` (an unlisted op neither commutes nor produces)."""
    return RULES.get(op_type, OpRule())


def commutes(op_type: str) -> bool:
    return rule(op_type).commutes


def produces(op_type: str) -> bool:
    return rule(op_type).produces
