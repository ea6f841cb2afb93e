"""Stage 6: time the verified INT8 file against the user's plain FP32 export of the same model.

One measurement (:func:`lq.export.timing._timing.compare`), at the batch the user names or the sample's; when the
file is slower, a warning says so in those terms and names the layers that run in float.
"""

from __future__ import annotations

import onnx

from lq.config import ExportConfig
from lq.export._files import short
from lq.export.prepare._prepare import Prepared, batch_size
from lq.export.timing import _fp32_reference, _timing


def speed_check(int8_model: bytes, proto: onnx.ModelProto, prep: Prepared, cfg: ExportConfig, twin, providers,
                kernels: list, notes: list) -> _timing.SpeedCheck | None:
    """Time the INT8 file against the plain FP32 export of the same model (``twin``, the exported graph without
    its quantizers, where that export fails, said so in a note); below 1x, add a warning naming the float
    layers (and, when the file has Scan loops, what runs them fused)."""
    loops = sum(n.op_type == "Scan" for n in proto.graph.node)
    feeds = _timing.batch_feeds(prep.tensors, prep.dims, cfg.speed_batch)
    batch = cfg.speed_batch or batch_size(prep.tensors, prep.dims)
    reference = _timing.PLAIN
    try:  # the user's float model through torch.onnx.export, as they would export it
        fp32 = _fp32_reference.plain_export(prep.work, prep.args, cfg.dynamo, prep.opset, prep.input_names,
                                            prep.output_names, prep.dims).SerializeToString()
    except Exception as e:  # noqa: BLE001 - any failure of the user's own export: time against the twin instead
        reference = _timing.TWIN
        notes.append(f"the speed check could not export the float model with torch.onnx.export "
                     f"({type(e).__name__}: {short(e, 300)}), so it times the INT8 file against {_timing.TWIN}, "
                     "which can differ from the FP32 file a user would export")
        fp32 = twin.SerializeToString()
    try:
        check = _timing.compare(int8_model, fp32, feeds, providers, batch=batch, reference=reference)
    except Exception as e:  # diagnostics only: a failure to time never fails the export
        notes.append(f"could not time the INT8 file against {reference}: {short(e, 300)}")
        return None
    if check.slower:
        floats = [f"{k.layer} ({k.kernel}: {k.reason})" for k in kernels if not k.integer]
        notes.append(
            f"the INT8 file runs at {check.ratio:.2f}x the speed of {reference} in onnxruntime ({check.details()}): "
            + (f"{len(floats)} quantized layer(s) run in float between Q/DQ: " + "; ".join(floats) if floats else
               "every quantized layer runs an integer kernel; the Q/DQ conversions cost more than they save "
               "at this size")
            + (f"; its {loops} recurrent layer(s) run as loops of small ops per time step (the step quantizes "
               "h), the FP32 file's as onnxruntime's fused float LSTM kernel: recurrent='dynamic' (QuantConfig, "
               "or QuantLSTM.set_runtime_dynamic) runs them as onnxruntime's fused DynamicQuantizeLSTM"
               if loops else "")
            + (f". The measurement is noisy: {check.noise}" if check.noisy else ""))
    return check
