"""The reference toolkit's compiled-extension functions (``pytorch_quantization.cuda_ext``) on lq's kernels.

Code written against the reference calls these directly; here they run lq's op on whatever device the
tensors are on (the CPU kernels on a CPU, CUDA on a GPU), with the same arguments and defaults.
"""

from __future__ import annotations

import torch

from lq import _checks, tensor_quant
from lq._float64 import ops_for

__all__ = ["fake_tensor_quant", "fake_tensor_quant_", "fake_tensor_quant_with_axis", "fake_e4m3fy"]


def fake_tensor_quant(inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
    """Fake-quantize ``inputs`` with one amax (or an amax that broadcasts)."""
    return tensor_quant.fake_tensor_quant(inputs, amax, num_bits, unsigned, narrow_range)


def fake_tensor_quant_(inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
    """In place: ``inputs`` is overwritten with its fake-quantized values and returned."""
    amax = tensor_quant._prepare(inputs, amax, num_bits, unsigned)
    with torch.no_grad():
        ops_for(inputs).fake_quant_out(inputs, amax, num_bits, unsigned, narrow_range, inputs)
    return inputs


def fake_tensor_quant_with_axis(inputs, amax, axis, num_bits=8, unsigned=False, narrow_range=True):
    """One amax per index of ``axis`` (``amax`` holds ``inputs.shape[axis]`` values, in any shape)."""
    axis = _checks.normalize_axis(axis, inputs.dim())
    if amax.numel() != inputs.shape[axis]:
        raise ValueError(f"amax holds {amax.numel()} values, but inputs has {inputs.shape[axis]} along axis {axis}")
    shape = [1] * inputs.dim()
    shape[axis] = -1
    return tensor_quant.fake_tensor_quant(inputs, amax.reshape(shape), num_bits, unsigned, narrow_range)


def fake_e4m3fy(inputs):
    """Round to the FP8 E4M3 grid without scaling (amax = 448, the largest E4M3 value)."""
    return tensor_quant.scaled_e4m3(inputs, torch.tensor(448.0, device=inputs.device))
