"""Layers a runtime computes wrong: where OpenVINO's output of a file is not the fake-quant model's, find the first
conv/gemm/matmul whose output OpenVINO computes far from onnxruntime's on the same file and the same inputs.

Two runtimes running one Q/DQ file differ by rounding: a step of the next quantizer here and there. A kernel that
is wrong differs by the size of the output itself. Measured: OpenVINO 2026.4's CPU plugin on an AMX Xeon runs an
int8 1-D conv with 16 input channels and a 16-tap kernel (CREPE's shape) about 100% off, the same layer with 32 or
128 channels, a 3-tap kernel, or the AVX-512 VNNI code path (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI``) right; its
float conv is right. onnxruntime is the reference implementation of the file's ops here: the export already checks
the quantized model against PyTorch there for ``target="onnxruntime"``.

:func:`first_fault` exposes every compute op's output, runs both runtimes on the verification inputs and returns the
first op (in graph order, so its inputs agreed) whose output differs by more than :data:`FAULT_FRACTION` of its
largest magnitude. The export then keeps that layer in float and exports again (``lq.export._export``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx

from lq.export._ir import COMPUTE

#: an op whose output one runtime computes this far (a fraction of max|output|) from the other's is wrong: rounding
#: differences stay within a few output steps (a few percent at most); the fault measured was ~100%
FAULT_FRACTION = 0.25
#: at most this many layers are sent to float for runtime faults before the export gives up and raises
MAX_FAULTS = 4


@dataclasses.dataclass(frozen=True)
class Fault:
    node: str  # the ONNX node
    layer: str  # the PyTorch layer it belongs to
    off: float  # max|openvino - onnxruntime| / max|onnxruntime| on its output
    where: str = "on this CPU"  # the OpenVINO run that computes it so: this CPU's, or a CPU without VNNI

    def text(self) -> str:
        return (f"OpenVINO's CPU plugin computes {self.layer} ({self.node}) {self.off:.0%} of its output's largest "
                f"magnitude away from onnxruntime on the same file and inputs (a wrong kernel {self.where}, not "
                "rounding)")


def _probe(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, list[onnx.NodeProto]]:
    """A copy of ``proto`` with the output of every compute op of the top graph as a graph output too."""
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    outputs = {o.name for o in probe.graph.output}
    nodes = [n for n in probe.graph.node if n.op_type in COMPUTE and n.output[0] not in outputs]
    for n in nodes:
        probe.graph.output.append(onnx.ValueInfoProto(name=n.output[0]))
    return probe, nodes


def first_fault(proto: onnx.ModelProto, feeds: list[np.ndarray], layer_of: dict[str, str],
                providers=None) -> Fault | None:
    """The first compute op whose output OpenVINO computes wrong (see the module docstring), or None.
    ``providers``: the OpenVINO run to search (default the plugin as this CPU runs it; or as a CPU without VNNI:
    :data:`lq.export.verify._no_vnni.PROVIDER`)."""
    from lq.export.verify import _openvino, _verify

    probe, nodes = _probe(proto)
    if not nodes:
        return None
    data = probe.SerializeToString()
    ref = _verify.run(_verify.make_session(data, ["CPUExecutionProvider"]), feeds)
    where = list(providers or [_openvino.OPENVINO])
    got = _verify.run(_verify.make_session(data, where), feeds)
    first = len(proto.graph.output)
    for k, n in enumerate(nodes):
        want, have = np.asarray(ref[first + k], np.float64), np.asarray(got[first + k], np.float64)
        scale = float(np.abs(want).max()) if want.size else 0.0
        if want.shape != have.shape or scale == 0.0:
            continue
        off = float(np.abs(have - want).max()) / scale
        if off > FAULT_FRACTION:
            return Fault(n.name, layer_of.get(n.name) or n.name, off, _where(where))
    return None


def _where(providers) -> str:
    from lq.export.verify import _no_vnni

    if providers[0] == _no_vnni.PROVIDER:
        return f"on a CPU without VNNI (OpenVINO's kernels capped at {_no_vnni.ISA})"
    return "on this CPU"
