"""OpenVINO's CPU plugin as the runtime of ``target="openvino"``: a session to verify and time a file in, and the
precision each layer of its compiled graph runs at.

OpenVINO is an optional dependency (``pip install lq[openvino]``), imported only here and only for that target.
The plugin runs "FP32" layers in bf16 on CPUs with AMX or AVX-512 BF16 unless told otherwise, which would make
both the verdict (bf16 is not what PyTorch computes) and the speed check (FP32 at bf16's speed) wrong: every
session here states its precision hint, ``f32`` unless asked.

:class:`Session` has the two methods of an onnxruntime ``InferenceSession`` that verification and timing call
(``get_inputs`` and ``run``), so the judge and the timer serve both runtimes unchanged;
:data:`OPENVINO` is the name it goes by in ``providers``.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

#: the "provider" that stands for OpenVINO's CPU plugin in lq's providers lists (ExportResult.providers), f32 hint
OPENVINO = "OpenVINO CPU"
#: the same plugin with the bf16 hint: what it runs an "FP32" model at by default on a CPU with AMX / AVX-512 BF16
OPENVINO_BF16 = "OpenVINO CPU bf16"
#: the compiled graph's layer types that compute with weights (convolutions, matmuls): the kernel report's rows
COMPUTE_TYPES = ("Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul")
INTEGER_PRECISIONS = ("i8", "u8")


def require():
    """The ``openvino`` module, or an ImportError that says how to install it."""
    try:
        import openvino
    except ImportError as e:
        raise ImportError("target='openvino' runs the file in OpenVINO, which is not installed: "
                          "pip install 'lq[openvino]' (or pip install openvino)") from e
    return openvino


def is_openvino(providers) -> bool:
    return bool(providers) and providers[0] in (OPENVINO, OPENVINO_BF16)


def precision_of(providers) -> str:
    return "bf16" if providers and providers[0] == OPENVINO_BF16 else "f32"


def _core():
    ov = require()
    return ov.Core()


def compile_model(path_or_bytes, threads: int | None = None, precision: str = "f32"):
    """The file compiled for the CPU plugin with this precision hint (``f32``, or ``bf16`` where the CPU has it)
    and ``threads`` inference threads (None: the plugin's default)."""
    core = _core()
    config = {"INFERENCE_PRECISION_HINT": precision}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    # a path is read as a path: a file with external data (the current exporter's, for large models) beside it
    model = core.read_model(os.fspath(path_or_bytes) if isinstance(path_or_bytes, (str, os.PathLike)) else path_or_bytes)
    return core.compile_model(model, "CPU", config)


def has_bf16() -> bool:
    """Whether the CPU plugin runs bf16 natively on this CPU (AMX or AVX-512 BF16): then an "FP32" model left to
    the plugin's defaults runs in bf16, a figure worth showing beside the f32 one."""
    try:
        return "BF16" in _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except Exception:  # noqa: BLE001 - a plugin without the property
        return False


@dataclasses.dataclass(frozen=True)
class _Input:
    name: str


class Session:
    """A compiled model with the calls verification and timing make of an onnxruntime session."""

    def __init__(self, path_or_bytes, threads: int | None = None, precision: str = "f32"):
        self.compiled = compile_model(path_or_bytes, threads, precision)
        self.request = self.compiled.create_infer_request()
        self.precision = precision

    def get_inputs(self) -> list[_Input]:
        return [_Input(i.get_any_name()) for i in self.compiled.inputs]

    def run(self, output_names, feed: dict) -> list[np.ndarray]:
        if output_names is not None:
            raise ValueError("lq's OpenVINO session returns every output (output_names=None)")
        self.request.infer({k: np.ascontiguousarray(v) for k, v in feed.items()})
        return [np.array(self.request.get_output_tensor(i).data) for i in range(len(self.compiled.outputs))]


@dataclasses.dataclass(frozen=True)
class CompiledLayer:
    """One compute layer of OpenVINO's compiled (runtime) graph."""

    names: tuple[str, ...]  # the ONNX nodes it was made from (OpenVINO's originalLayersNames)
    layer_type: str  # Convolution, GroupConvolution, FullyConnected ...
    precision: str  # the precision it runs at: i8, u8, f32, bf16 ...
    primitive: str  # the kernel OpenVINO chose (brgconv_avx512_amx_1x1_i8 ...)

    @property
    def integer(self) -> bool:
        return self.precision.lower() in INTEGER_PRECISIONS


def compiled_layers(path_or_bytes) -> list[CompiledLayer]:
    """The convolutions and matmuls of the compiled graph, with the precision each runs at."""
    out = []
    for op in compile_model(path_or_bytes, threads=1).get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        info = {k: rt[k].astype(str) for k in ("layerType", "runtimePrecision", "primitiveType", "originalLayersNames")
                if k in rt}
        if info.get("layerType") in COMPUTE_TYPES:
            out.append(CompiledLayer(tuple(n for n in info.get("originalLayersNames", "").split(",") if n),
                                     info["layerType"], info.get("runtimePrecision", "?"),
                                     info.get("primitiveType", "?")))
    return out
