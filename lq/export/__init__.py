"""ONNX export of fake-quantized models: QuantizeLinear/DequantizeLinear that TensorRT and onnxruntime run in INT8.

``export_onnx(model, sample_input, "model.onnx")`` exports a deep copy of the
model (the model itself is not touched) with the current ``torch.onnx``
exporter (or the legacy one, ``dynamo=False``), lowers every lq quantizer to
Q/DQ with constant scales, folds BatchNorm into the convolutions, places the
Q/DQ pairs where onnxruntime fuses them into QLinearConv / QLinearMatMul /
QLinearAdd / QGemm, checks the model with ``onnx.checker`` and compares
onnxruntime's output with PyTorch's on the sample. See :func:`export_onnx`.
"""

from lq.export._export import (
    export_config,
    EXPORTERS,
    TARGETS,
    WEIGHT_FORMATS,
    ExportResult,
    SlowerThanFP32Warning,
    VerificationError,
    export_onnx,
    find_uncalibrated_quantizers,
)
from lq.export.passes._fold_bn import FoldRecord
from lq.export._ir import ExportError, QuantNodeInfo
from lq.export.report._kernel_report import LayerKernel
from lq.export.verify._verify import INT8_KERNELS, optimized_op_counts

__all__ = [
    "export_onnx",
    "export_config",
    "ExportResult",
    "ExportError",
    "VerificationError",
    "SlowerThanFP32Warning",
    "QuantNodeInfo",
    "LayerKernel",
    "FoldRecord",
    "find_uncalibrated_quantizers",
    "optimized_op_counts",
    "INT8_KERNELS",
    "EXPORTERS",
    "TARGETS",
    "WEIGHT_FORMATS",
]
