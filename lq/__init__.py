"""lq: quantization for PyTorch Lightning with a fast C++/CUDA fake-quantization core.

The numerics and API follow NVIDIA's pytorch-quantization toolkit
(``lq.tensor_quant``, ``lq.nn``, ``lq.calib``, ``lq.quant_modules``, ``lq.utils``,
``lq.optim``, and at the top ``initialize``/``deactivate``/``enable_onnx_export``
as the toolkit's package has them); the
Lightning side is :class:`lq.QuantCallback` and its parts in
:mod:`lq.callbacks`. Lightning-dependent names load on first use, and the C++
kernels load (building once) when the first op runs, so ``import lq`` stays
light.
"""

from importlib import import_module
from importlib.util import find_spec

from lq import _ext, tensor_quant  # noqa: F401  (tensor_quant defines torch.ops.lq; nothing is built here)

__version__ = "0.1.0"


def extension_loaded() -> bool:
    """Whether lq's ops run on the compiled C++/CUDA kernels (loading them, once, if no op has yet)."""
    return _ext.load()


_LAZY = {
    "nn": ("lq.nn", None),
    "calib": ("lq.calib", None),
    "quant_modules": ("lq.quant_modules", None),
    "utils": ("lq.utils", None),
    "optim": ("lq.optim", None),
    "initialize": ("lq.quant_modules", "initialize"),
    "deactivate": ("lq.quant_modules", "deactivate"),
    "enable_onnx_export": ("lq.quant_modules", "enable_onnx_export"),
    "config": ("lq.config", None),
    "QuantCallback": ("lq.callbacks", "QuantCallback"),
    "QuantSwap": ("lq.callbacks", "QuantSwap"),
    "QuantCalibrate": ("lq.callbacks", "QuantCalibrate"),
    "QATSchedule": ("lq.callbacks", "QATSchedule"),
    "QuantDistill": ("lq.callbacks", "QuantDistill"),
    "QuantExport": ("lq.callbacks", "QuantExport"),
    "quantize_model": ("lq.convert", "quantize_model"),
    "calibrate_model": ("lq.calibration", "calibrate_model"),
    "export_onnx": ("lq.export", "export_onnx"),
    "load_quantized": ("lq.checkpoint", "load_quantized"),
    "QuantConfig": ("lq.config", "QuantConfig"),
    "CalibConfig": ("lq.config", "CalibConfig"),
    "QATConfig": ("lq.config", "QATConfig"),
    "ExportConfig": ("lq.config", "ExportConfig"),
}

__all__ = ["tensor_quant", "extension_loaded", "__version__", *_LAZY]


def __getattr__(name: str):
    """The names above, and every subpackage/module of lq (``lq.callbacks``, ``lq.export``, ``lq.zoo`` ...), on
    first use: ``import lq`` then any dotted path the README shows resolves without a second import."""
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = import_module(module)
        value = getattr(value, attr) if attr else value
    elif not name.startswith("__") and find_spec(f"{__name__}.{name}") is not None:
        value = import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'lq' has no attribute {name!r}")
    globals()[name] = value
    return value
