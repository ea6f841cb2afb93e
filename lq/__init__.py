"""lq: quantization for PyTorch Lightning with a fast C++/CUDA fake-quantization core.

The numerics and API follow NVIDIA's pytorch-quantization toolkit
(``lq.tensor_quant``, ``lq.nn``, ``lq.calib``, ``lq.quant_modules``).
"""

from lq import tensor_quant
from lq._ext import is_loaded as extension_loaded

__version__ = "0.1.0"

__all__ = ["tensor_quant", "extension_loaded", "__version__"]
