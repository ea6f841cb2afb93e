"""Argument validation shared by every path into the ops.

Two kinds of checks:

* *static* checks look only at types, shapes, dtypes and Python scalars. They
  run in the public functions and in the ops' fake (meta) implementations,
  so they also fire while ``torch.compile`` / ``torch.export`` trace.
* *value* checks look at tensor data (negative inputs for unsigned
  quantization, negative or non-finite amax). They run inside the op
  implementations, never in traced Python code, so that tracing never meets
  a data-dependent branch. The C++ kernels raise the same messages.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_BITS, MAX_BITS = 2, 16


def check_input(x, what: str = "inputs", allow_float64: bool = False) -> None:
    """``allow_float64``: the integer quantization functions also take float64 (computed by the reference
    arithmetic in float64, as the reference toolkit does); the other ops take what the kernels take."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES and not (allow_float64 and x.dtype == torch.float64):
        allowed = "float32, float16, bfloat16 or float64" if allow_float64 else "float32, float16 or bfloat16"
        raise TypeError(f"{what} must be {allowed}, got {x.dtype}")


def check_num_bits(num_bits, unsigned: bool = False) -> None:
    if isinstance(num_bits, bool) or not isinstance(num_bits, int):
        raise TypeError(f"num_bits must be an int in [{MIN_BITS}, {MAX_BITS}], got {num_bits!r}")
    low = 1 if unsigned else MIN_BITS
    if not low <= num_bits <= MAX_BITS:
        raise ValueError(
            f"num_bits={num_bits} is not supported: integer quantization takes {low} to {MAX_BITS} bits"
            + ("" if unsigned else " (signed)")
            + "; use num_bits=(4, 3) for FP8 E4M3"
        )


def check_amax_shape(x: torch.Tensor, amax, what: str = "amax") -> None:
    if not isinstance(amax, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(amax).__name__}")
    if not amax.is_floating_point():
        raise TypeError(f"{what} must be a floating point tensor, got {amax.dtype}")
    if amax.dim() > x.dim() and amax.numel() != 1:
        raise ValueError(f"{what} of shape {tuple(amax.shape)} has more dims than inputs {tuple(x.shape)}")
    if amax.numel() != 1:
        lead = x.dim() - amax.dim()
        for i, s in enumerate(amax.shape):
            if s != 1 and s != x.shape[lead + i]:
                raise ValueError(
                    f"{what} of shape {tuple(amax.shape)} does not broadcast to inputs of shape "
                    f"{tuple(x.shape)}: dim {lead + i} has size {x.shape[lead + i]} but amax has {s} "
                    f"(allowed: 1 or {x.shape[lead + i]})"
                )


def check_amax_values(amax: torch.Tensor, what: str = "amax") -> None:
    """Negative or non-finite amax is an error (0 is allowed: it quantizes to 0)."""
    if amax.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # no host sync while a CUDA graph is being captured
    if amax.numel() and not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{what} must be finite, got non-finite values in {what}")
    if amax.numel() and bool((amax < 0).any()):
        raise ValueError(f"{what} must be >= 0, got min {float(amax.min())}")


class UnsignedInputError(ValueError, TypeError):
    """Negative input to unsigned quantization (a ValueError; also the reference toolkit's TypeError)."""


def eager(x: torch.Tensor) -> bool:
    """True when ``x`` holds real data in plain eager execution (not traced, compiled or exported), where a
    check may look at the values without putting a data-dependent branch into a graph."""
    from torch._subclasses.fake_tensor import FakeTensor

    compiler = torch.compiler
    tracing = compiler.is_compiling() or (hasattr(compiler, "is_exporting") and compiler.is_exporting())
    return not tracing and not isinstance(x, FakeTensor) and not torch.jit.is_tracing()


def check_unsigned_input(x: torch.Tensor, unsigned: bool) -> None:
    if not unsigned or x.numel() == 0:
        return
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if bool((x < 0).any()):
        raise UnsignedInputError(
            "Negative values encountered in unsigned quantization: inputs must be >= 0 "
            "when unsigned=True (use signed quantization for data that can be negative)"
        )


#: Largest finite float16 value.
FP16_MAX = 65504.0


class ScaleOverflowError(ValueError):
    """Real quantization of float16 inputs whose scale does not fit float16 (as the reference toolkit refuses)."""


def check_fp16_scale(x: torch.Tensor, scale: torch.Tensor) -> None:
    """float16 inputs to real quantization: the scale ``max_bound / amax`` must be a float16 number.

    lq returns the scale in float32, where it fits, but an FP16 pipeline that dequantizes with it
    (``outputs / scale.half()``) would divide by Inf; the reference toolkit raises here, and so does lq.
    A value check: the callers run it in eager mode only (see :func:`eager`).
    """
    if x.dtype != torch.float16 or scale.numel() == 0:
        return
    if scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    top = float(scale.max())
    if top > FP16_MAX:
        raise ScaleOverflowError(
            f"scale is too large for FP16: max_bound / amax = {top:.6g} exceeds {FP16_MAX:g}, the largest "
            "float16; use a larger amax (at least max_bound / 65504) or quantize float32 inputs"
        )


def normalize_axis(axis: int, ndim: int, what: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{what} must be an int, got {axis!r}")
    if not -ndim <= axis < max(ndim, 1):
        raise ValueError(f"{what}={axis} is out of range for a tensor of rank {ndim}: allowed [{-ndim}, {ndim})")
    return axis % ndim if ndim else 0


def check_block(x: torch.Tensor, axis: int, block_size: int) -> int:
    axis = normalize_axis(axis, x.dim(), "block axis")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block size must be a positive int, got {block_size!r}")
    n = x.shape[axis] if x.dim() else 1
    if n % block_size:
        raise ValueError(
            f"block size {block_size} does not divide dim {axis} of size {n}: "
            f"allowed block sizes are divisors of {n}"
        )
    return axis


class FloatFormatError(ValueError, TypeError):
    """A floating point format other than (4, 3) (a ValueError; also the reference toolkit's TypeError)."""


def check_e4m3(E, M) -> None:
    if (E, M) != (4, 3):
        raise FloatFormatError(f"Only FP8 E4M3 is supported for floating point quantization: got E={E}, M={M}, allowed (4, 3)")
