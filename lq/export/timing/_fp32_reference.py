"""The FP32 file a user compares an INT8 export with: ``torch.onnx.export`` of their float model.

The float model is the quantized one with every lq module turned back into the ``torch.nn`` module it was made
from (:func:`lq.convert.dequantize_model`: same parameters, quantizers and glue gone), not the quantized model
with its quantizers disabled: a disabled ``QuantLSTM`` still runs its own per-step loop, which no FP32 export
of ``nn.LSTM`` has (that is one ONNX ``LSTM`` op, one fused kernel in onnxruntime), and a
``QuantMultiheadAttention`` is not ``nn.MultiheadAttention``'s code. A quantizer the conversion leaves (a
hand-built lq module with no float class, a ``TensorQuantizer`` called in a forward) is disabled.

It is exported by the exporter the INT8 file came from (``dynamo`` or ``legacy``), with the same input and output
names and dynamic axes and nothing of lq's rewriting; BatchNorm is left to the exporter and onnxruntime, which
fold it into the convolutions as they do for any FP32 file.
"""

from __future__ import annotations

import copy

import onnx
import torch

from lq.export.finish import _finish

from lq.export.trace import _torch_onnx
from lq.export.prepare._model_checks import _is_quantizer


def float_model(model: torch.nn.Module) -> torch.nn.Module:
    """A float copy of ``model`` (eval mode, on the CPU): lq modules back to ``torch.nn``, leftover quantizers
    disabled. ``model`` is not touched."""
    from lq.convert import dequantize_model

    m = dequantize_model(copy.deepcopy(model)).cpu().float().eval()
    for q in m.modules():
        if _is_quantizer(q) and hasattr(q, "disable"):
            q.disable()
    return m


def plain_export(model: torch.nn.Module, args: tuple, dynamo: bool, opset: int, input_names, output_names,
                 dims) -> onnx.ModelProto:
    """``torch.onnx.export`` of :func:`float_model` of ``model`` on ``args``, as the user would write it."""
    m = float_model(model)
    with torch.no_grad():
        if dynamo:
            proto = _torch_onnx.export_dynamo(m, args, opset, input_names, output_names, dims)
        else:
            proto = _torch_onnx.export_legacy(m, args, opset, input_names, output_names, dims)
    _finish.remove_placeholder_opset(proto)  # the legacy exporter declares lq's (unused) domain
    return proto
