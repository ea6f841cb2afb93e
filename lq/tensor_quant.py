"""Quantization descriptors and functions (the API of ``pytorch_quantization.tensor_quant``).

``QuantDescriptor`` says how a tensor is quantized; the functions quantize.
Every function calls a ``torch.ops.lq`` op (C++/CUDA kernel, or the
pure-PyTorch reference), so they run in eager mode, under ``torch.compile``
and under ``torch.export`` alike; float64 inputs, which the kernels do not
take, run the reference arithmetic in float64 (:mod:`lq._float64`, picked by
``ops_for(x)``). The ``*Function`` classes are the
``torch.autograd.Function`` spellings of the same ops, kept for code written
against the reference toolkit.
"""

from __future__ import annotations

import copy
import numbers
from typing import Any

import numpy as np
import torch

from lq import _checks, _ops, _reference  # noqa: F401  (_ops registers torch.ops.lq)
from lq._float64 import ops_for

__all__ = [
    "QuantDescriptor",
    "ScaledQuantDescriptor",
    "QUANT_DESC_8BIT_PER_TENSOR",
    "QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR",
    "QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW",
    "QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL",
    "tensor_quant",
    "fake_tensor_quant",
    "fake_affine_tensor_quant",
    "scaled_e4m3",
    "fake_block_quant",
    "block_amax",
    "TensorQuantFunction",
    "FakeTensorQuantFunction",
    "LegacyFakeTensorQuantFunction",
    "FakeAffineTensorQuantFunction",
    "ScaledE4M3Function",
]

FP8_E4M3 = (4, 3)
_CALIB_METHODS = ("max", "histogram")
_BLOCK_TYPES = ("static", "dynamic")
_BLOCK_KEYS = ("type", "scale_bits", "scale_block_sizes")


# =========================================================================== descriptor
def _check_asymmetric(d) -> None:
    """An affine grid is one scale and zero point for a whole tensor, on integers, from calibration."""
    bad = [(d._axis is not None or d._block_sizes is not None, "axis=None and no block_sizes (per tensor)"),
           (d._num_bits == FP8_E4M3, "integer num_bits, not FP8"),
           (d._unsigned, "unsigned=False (the zero point already places the range)"),
           (d._learn_amax, "learn_amax=False (a learned range needs the symmetric grid)"),
           (d._dynamic, "dynamic=False (the range is calibrated)")]
    for wrong, allowed in bad:
        if wrong:
            raise ValueError(f"asymmetric=True is not allowed with this descriptor: it needs {allowed}")


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    return value


class DescriptorArgumentError(ValueError, TypeError):
    """Descriptor arguments that do not go together (a ValueError; the reference toolkit raises TypeError)."""


FloatFormatError = _checks.FloatFormatError  # a floating point num_bits other than (4, 3)


def _norm_num_bits(num_bits, unsigned: bool = False, what: str = "num_bits"):
    if isinstance(num_bits, (list, tuple)):
        if tuple(num_bits) != FP8_E4M3:
            raise FloatFormatError(f"{what}={tuple(num_bits)!r} is not supported: floating point quantization takes (4, 3) (FP8 E4M3)")
        return FP8_E4M3
    try:
        _checks.check_num_bits(num_bits, unsigned)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("num_bits", what, 1)) from None
    return num_bits


def _norm_axis(axis):
    if axis is None:
        return None
    if isinstance(axis, (list, tuple)):
        for a in axis:
            if isinstance(a, bool) or not isinstance(a, int):
                raise TypeError(f"axis must be None, an int or a tuple of ints, got {axis!r}")
        if len(set(axis)) != len(axis):
            raise ValueError(f"axis {axis!r} repeats an axis")
        return tuple(axis)
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis must be None, an int or a tuple of ints, got {axis!r}")
    return axis


def _norm_block_sizes(block_sizes):
    if block_sizes is None:
        return None
    if not isinstance(block_sizes, dict):
        raise TypeError(f"block_sizes must be None or a dict {{axis: size, 'type': ...}}, got {type(block_sizes).__name__}")
    out: dict = {}
    for k, v in block_sizes.items():
        if isinstance(k, str) and not k.lstrip("-").isdigit():
            if k not in _BLOCK_KEYS:
                raise ValueError(f"block_sizes key {k!r} is not allowed: integer axes or one of {_BLOCK_KEYS}")
            if k == "type":
                if v not in _BLOCK_TYPES:
                    raise ValueError(f"block_sizes['type']={v!r} is not allowed: one of {_BLOCK_TYPES}")
                out[k] = v
            elif k == "scale_bits":
                out[k] = _norm_num_bits(v, unsigned=True, what="block_sizes['scale_bits']")
            else:
                out[k] = _norm_block_sizes(v)
            continue
        axis = int(k)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"block size for axis {axis} must be a positive int, got {v!r}")
        out[axis] = v
    if not QuantDescriptor.get_block_quant_axes_and_sizes(out):
        raise ValueError(f"block_sizes {block_sizes!r} names no axis: give at least one {{axis: size}}")
    return out


def _norm_amax(amax):
    if amax is None:
        return None
    if isinstance(amax, torch.Tensor):
        amax = amax.detach().cpu().tolist()
    elif hasattr(amax, "tolist"):  # numpy
        amax = amax.tolist()
    if isinstance(amax, numbers.Real) and not isinstance(amax, bool):
        amax = float(amax)
        vals = [amax]
    elif isinstance(amax, (list, tuple)):
        amax = _nested_floats(amax)
        vals = _flatten(amax)
    else:
        raise TypeError(f"amax must be float, list or ndarray (or None), got {type(amax).__name__}")
    for v in vals:
        if not (v >= 0 and v != float("inf")):
            raise ValueError(f"amax must be finite and >= 0, got {v}")
    # amax is kept in float32 (the quantizer's buffer): the descriptor holds the same float32 values
    amax32 = torch.tensor(amax, dtype=torch.float32)
    if not bool(torch.isfinite(amax32).all()):
        raise ValueError(f"amax must fit float32 (at most {torch.finfo(torch.float32).max:.4g}), got {amax}")
    return amax32.tolist()


def _nested_floats(v):
    return [_nested_floats(e) for e in v] if isinstance(v, (list, tuple)) else float(v)


def _flatten(v):
    return [x for e in v for x in _flatten(e)] if isinstance(v, list) else [v]


class ScaledQuantDescriptor:
    """How a tensor is quantized: bits, granularity, range, calibration.

    Args:
        num_bits: an int (integer quantization) or ``(4, 3)`` for FP8 E4M3. Default 8.
        name: a name, shown in reprs.

    Keyword Args:
        fake_quant: quantize-dequantize (True) or return integers (False). Default True.
        axis: None (per-tensor), an int or a tuple of ints: the axes that KEEP
            their own amax (``axis=0`` on a KCRS weight is per output channel).
        block_sizes: None or ``{axis: size, "type": "static"|"dynamic",
            "scale_bits": int|(4, 3), "scale_block_sizes": {...}}``; needs axis None.
        amax: a float or list of floats, fixed amax (skips calibration).
        learn_amax: learn amax (initialized from ``amax``).
        scale_amax: multiply amax by this (quick experiments).
        calib_method: "max" or "histogram".
        unsigned: unsigned integer range ``[0, 2^num_bits - 1]``.
        narrow_range: signed range ``[-(2^(b-1) - 1), 2^(b-1) - 1]`` instead of ``[-2^(b-1), ...]``.
        dynamic: compute amax from every input instead of calibrating.
        asymmetric: (lq) calibrate an affine range ``[min, max]`` with a zero point from the data, on the full
            ``2^num_bits``-level grid (onnxruntime's uint8 activations); per tensor, integer, not learned.
            The calibration method's amax clips the observed range on both sides.

    Raises:
        TypeError / ValueError naming the argument and the allowed values.
    """

    _DEFAULTS: dict[str, Any] = {
        "num_bits": 8,
        "name": None,
        "fake_quant": True,
        "axis": None,
        "block_sizes": None,
        "amax": None,
        "learn_amax": False,
        "scale_amax": None,
        "calib_method": "max",
        "unsigned": False,
        "narrow_range": False,
        "dynamic": False,
        "asymmetric": False,
    }

    def __init__(self, num_bits=8, name=None, **kwargs):
        unknown = set(kwargs) - set(self._DEFAULTS)
        if unknown:
            raise TypeError(
                f"Unrecognized QuantDescriptor argument(s) {sorted(unknown)}; allowed: {sorted(self._DEFAULTS)}"
            )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be None or a str, got {type(name).__name__}")
        self._name = name
        self._unsigned = _check_bool("unsigned", kwargs.get("unsigned", False))
        self._num_bits = _norm_num_bits(num_bits, self._unsigned)
        self._fake_quant = _check_bool("fake_quant", kwargs.get("fake_quant", True))
        self._axis = _norm_axis(kwargs.get("axis"))
        self._block_sizes = _norm_block_sizes(kwargs.get("block_sizes"))
        if self._block_sizes is not None and self._axis is not None:
            raise ValueError("axis must be None when block_sizes is given (blocks already define the granularity)")
        self._amax = _norm_amax(kwargs.get("amax"))
        self._learn_amax = _check_bool("learn_amax", kwargs.get("learn_amax", False))
        if self._learn_amax and self._axis is not None:
            raise DescriptorArgumentError("learn_amax=True supports per-tensor amax only: axis is ignored and must "
                                          "be None")
        scale_amax = kwargs.get("scale_amax")
        if scale_amax is not None:
            if isinstance(scale_amax, bool) or not isinstance(scale_amax, numbers.Real) or not scale_amax > 0:
                raise ValueError(f"scale_amax must be None or a positive float, got {scale_amax!r}")
            scale_amax = float(scale_amax)
        self._scale_amax = scale_amax
        calib_method = kwargs.get("calib_method", "max")
        if calib_method not in _CALIB_METHODS:
            raise ValueError(f"calib_method={calib_method!r} is not allowed: one of {_CALIB_METHODS}")
        self._calib_method = calib_method
        self._narrow_range = _check_bool("narrow_range", kwargs.get("narrow_range", False))
        self._dynamic = _check_bool("dynamic", kwargs.get("dynamic", False))
        self._asymmetric = _check_bool("asymmetric", kwargs.get("asymmetric", False))
        if self._asymmetric:
            _check_asymmetric(self)
        if self._unsigned and self._num_bits == FP8_E4M3:
            raise ValueError("unsigned=True is not allowed with FP8 num_bits=(4, 3)")
        if self._fake_quant is False and self._num_bits == FP8_E4M3:
            raise ValueError("fake_quant=False is not allowed with FP8 num_bits=(4, 3): FP8 is fake-quantized only")

    # --- read-only properties
    num_bits = property(lambda self: self._num_bits, doc="Bits: an int, or (E, M) for FP8.")
    name = property(lambda self: self._name)
    fake_quant = property(lambda self: self._fake_quant)
    axis = property(lambda self: self._axis, doc="Axes that keep their own amax (None: per-tensor).")
    block_sizes = property(lambda self: copy.deepcopy(self._block_sizes))
    amax = property(lambda self: None if self._amax is None else np.array(self._amax, dtype=np.float32),
                    doc="amax as a float32 numpy array (a 0-d array for one value), or None.")
    learn_amax = property(lambda self: self._learn_amax)
    scale_amax = property(lambda self: self._scale_amax)
    calib_method = property(lambda self: self._calib_method)
    unsigned = property(lambda self: self._unsigned)
    narrow_range = property(lambda self: self._narrow_range)
    asymmetric = property(lambda self: self._asymmetric, doc="Affine range calibrated from the data (lq).")

    @property
    def dynamic(self) -> bool:
        """True when amax is computed from every input (also dynamic block quantization)."""
        return self._dynamic or bool(self._block_sizes and self._block_sizes.get("type") == "dynamic")

    @property
    def is_fp8(self) -> bool:
        return self._num_bits == FP8_E4M3

    @staticmethod
    def get_block_quant_axes_and_sizes(block_sizes) -> dict[int, int]:
        """``{axis: size}`` of ``block_sizes`` without the special string keys."""
        if block_sizes is None:
            return {}
        return {k: v for k, v in block_sizes.items() if not isinstance(k, str)}

    # --- serialization
    def dict(self) -> dict:
        """Fields whose value differs from the default; ``QuantDescriptor(**d.dict()) == d``."""
        out = {}
        for key, default in self._DEFAULTS.items():
            value = getattr(self, "_" + key)
            if value != default:
                out[key] = copy.deepcopy(value)
        return out

    def to_yaml(self) -> str:
        """YAML text of :meth:`dict` (tuples written as lists)."""
        import yaml

        return yaml.safe_dump(_to_plain(self.dict()), sort_keys=True)

    @classmethod
    def from_yaml(cls, yaml_str: str) -> "ScaledQuantDescriptor":
        """Inverse of :meth:`to_yaml`."""
        import yaml

        d = yaml.safe_load(yaml_str) or {}
        if not isinstance(d, dict):
            raise ValueError(f"QuantDescriptor YAML must be a mapping, got {type(d).__name__}")
        if isinstance(d.get("num_bits"), list):
            d["num_bits"] = tuple(d["num_bits"])
        if isinstance(d.get("axis"), list):
            d["axis"] = tuple(d["axis"])
        bs = d.get("block_sizes")
        if isinstance(bs, dict) and isinstance(bs.get("scale_bits"), list):
            bs["scale_bits"] = tuple(bs["scale_bits"])
        return cls(**d)

    def __eq__(self, other) -> bool:
        if not isinstance(other, ScaledQuantDescriptor):
            return NotImplemented
        return all(getattr(self, "_" + k) == getattr(other, "_" + k) for k in self._DEFAULTS)

    def __hash__(self):
        return hash(self.to_yaml())

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.dict().items())
        return f"QuantDescriptor({body})"


def _to_plain(v):
    if isinstance(v, tuple):
        return [_to_plain(e) for e in v]
    if isinstance(v, list):
        return [_to_plain(e) for e in v]
    if isinstance(v, dict):
        return {k: _to_plain(e) for k, e in v.items()}
    return v


QuantDescriptor = ScaledQuantDescriptor

QUANT_DESC_8BIT_PER_TENSOR = QuantDescriptor(num_bits=8)
QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR = QuantDescriptor(num_bits=8, unsigned=True)
QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=(0))
QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=(0))
QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=(0))
QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW = QuantDescriptor(num_bits=8, axis=(0))
# ConvTranspose weights are (in, out // groups, k...): output channels live on axis 1.
QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=(1))
QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=(1))
QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=(1))


# =========================================================================== functions
def _as_amax(amax, inputs: torch.Tensor, what: str = "amax") -> torch.Tensor:
    if isinstance(amax, numbers.Real) and not isinstance(amax, bool):
        return torch.tensor(float(amax), dtype=torch.float32, device=inputs.device)
    _checks.check_amax_shape(inputs, amax, what)
    return amax


def _prepare(inputs, amax, num_bits, unsigned):
    _checks.check_input(inputs, allow_float64=True)
    _checks.check_num_bits(num_bits, unsigned)
    _check_bool("unsigned", unsigned)
    if unsigned and _checks.eager(inputs):  # in eager mode the error is UnsignedInputError on every device
        _checks.check_unsigned_input(inputs, True)
    return _as_amax(amax, inputs)


def tensor_quant(inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
    """Quantize ``inputs`` to integers (kept in the input dtype); return ``(outputs, scale)``.

    ``scale = max_bound / amax`` (float32, amax's shape); ``outputs / scale``
    dequantizes. Rounding is half to even; gradients are the clipped STE, for the input only (amax gets
    none, as in the reference toolkit; a learned amax is :class:`lq.nn.TensorQuantizer`'s job).
    float16 inputs whose scale exceeds 65504 (amax too small to dequantize in FP16) raise
    :class:`lq._checks.ScaleOverflowError` (a ValueError) in eager mode.
    """
    return _tensor_quant(inputs, _detached(amax), num_bits, unsigned, narrow_range)


def _detached(amax):
    return amax.detach() if isinstance(amax, torch.Tensor) else amax


def _tensor_quant(inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
    """:func:`tensor_quant` with the PACT gradient for amax (what a learned amax trains with)."""
    amax = _prepare(inputs, amax, num_bits, unsigned)
    outputs, scale = ops_for(inputs).quant(inputs, amax, num_bits, unsigned, narrow_range)
    if _checks.eager(inputs):
        _checks.check_fp16_scale(inputs, scale)
    return outputs, scale


def fake_tensor_quant(inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
    """Quantize and dequantize ``inputs`` (same dtype and shape); amax broadcasts. The gradient is the clipped
    STE for the input; amax gets none, as in the reference toolkit (an amax computed from the input, e.g.
    ``x.abs().max()``, would otherwise send gradient back into the input)."""
    return _fake_tensor_quant(inputs, _detached(amax), num_bits, unsigned, narrow_range)


def _fake_tensor_quant(inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
    """:func:`fake_tensor_quant` with the PACT gradient for amax: what :class:`lq.nn.TensorQuantizer`'s learned
    amax trains with (``sign(x)`` summed where ``|x| > amax``)."""
    amax = _prepare(inputs, amax, num_bits, unsigned)
    return ops_for(inputs).fake_quant(inputs, amax, num_bits, unsigned, narrow_range)


def fake_affine_tensor_quant(inputs, min_range, max_range, num_bits=8):
    """gemmlowp-style affine (scale + zero point) fake quantization, per tensor.

    ``min_range`` and ``max_range`` are floats or scalar tensors with
    ``min_range < max_range``.
    """
    _checks.check_input(inputs, allow_float64=True)
    _checks.check_num_bits(num_bits)
    lo = _as_amax(min_range, inputs, "min_range")
    hi = _as_amax(max_range, inputs, "max_range")
    if lo.numel() != 1 or hi.numel() != 1:
        raise ValueError("fake_affine_tensor_quant is per tensor: min_range and max_range must be scalars")
    if lo.device.type == "cpu" and hi.device.type == "cpu" and _checks.eager(lo) and _checks.eager(hi):
        if not float(lo) < float(hi):
            raise ValueError(f"min_range must be < max_range, got min_range={float(lo)}, max_range={float(hi)}")
    return ops_for(inputs).fake_affine_quant(inputs, lo, hi, num_bits)


E4M3_MAX = 448.0  # largest finite E4M3 value


def scaled_e4m3(inputs, amax, E=4, M=3):
    """FP8 E4M3 fake quantization: scale by ``448 / amax``, round to E4M3 (half to even,
    saturating at ±448, subnormals kept), scale back."""
    _checks.check_input(inputs, allow_float64=True)
    _checks.check_e4m3(E, M)
    if amax is None:  # no scaling: round to the E4M3 grid as is (scale 448 / 448)
        amax = E4M3_MAX
    return ops_for(inputs).scaled_e4m3(inputs, _as_amax(amax, inputs))


def _block_items(block_sizes: dict, ndim: int) -> list[tuple[int, int]]:
    axes = QuantDescriptor.get_block_quant_axes_and_sizes(block_sizes)
    items = sorted((_checks.normalize_axis(a, ndim, "block axis"), b) for a, b in axes.items())
    if len({a for a, _ in items}) != len(items):
        raise ValueError(f"block_sizes {block_sizes!r} names the same axis twice")
    return items


def _blocked_shape(shape, items) -> list[int]:
    """``shape`` with every block axis ``a`` split into ``(n_a // b_a, b_a)``."""
    sizes = dict(items)
    out: list[int] = []
    for i, n in enumerate(shape):
        if i in sizes:
            out += [n // sizes[i], sizes[i]]
        else:
            out.append(n)
    return out


def block_amax(inputs: torch.Tensor, block_sizes: dict) -> torch.Tensor:
    """Per-block ``abs().amax()`` (float32; float64 for float64 inputs): ``inputs.shape`` with each block axis
    divided by its block size."""
    items = _block_items(block_sizes, inputs.dim())
    for a, b in items:
        _checks.check_block(inputs, a, b)
    xb = inputs.reshape(_blocked_shape(inputs.shape, items))
    red = [a + k + 1 for k, (a, _) in enumerate(items)]
    return xb.to(_reference.compute_dtype(inputs)).abs().amax(dim=red)


def _quantize_block_scales(amax: torch.Tensor, scale_bits, scale_block_sizes) -> torch.Tensor:
    """Double quantization: fake-quantize the per-block amax itself (unsigned int or FP8),
    per tensor or in blocks of ``scale_block_sizes`` (dynamic: from the amax values)."""
    fp8 = scale_bits == FP8_E4M3
    if scale_block_sizes:
        return fake_block_quant(amax, dict(scale_block_sizes, type="dynamic"), scale_bits, unsigned=not fp8,
                                narrow_range=False)
    if fp8:
        return ops_for(amax).scaled_e4m3(amax, amax.amax())
    return ops_for(amax).fake_quant(amax, amax.amax(), scale_bits, True, False)


def fake_block_quant(inputs, block_sizes: dict, num_bits=8, amax=None, unsigned=False, narrow_range=True):
    """Block quantization: every block of ``block_sizes`` gets its own amax.

    With ``amax=None`` (or ``block_sizes["type"] == "dynamic"``) the block amax
    is computed from ``inputs`` in the same call (one fused kernel for a single
    block axis); otherwise ``amax`` holds calibrated block amax shaped like
    :func:`block_amax`'s result. ``block_sizes["scale_bits"]`` quantizes the
    block amax too (double quantization). ``num_bits=(4, 3)`` gives FP8 blocks.
    """
    _checks.check_input(inputs, allow_float64=True)
    if not isinstance(block_sizes, dict):
        raise TypeError(f"block_sizes must be a dict {{axis: size}}, got {type(block_sizes).__name__}")
    block_sizes = _norm_block_sizes(block_sizes)
    fp8 = isinstance(num_bits, (tuple, list))
    num_bits = _norm_num_bits(num_bits, unsigned)
    items = _block_items(block_sizes, inputs.dim())
    for a, b in items:
        _checks.check_block(inputs, a, b)
    dynamic = amax is None or block_sizes.get("type") == "dynamic"
    scale_bits = block_sizes.get("scale_bits")
    if dynamic and len(items) == 1 and scale_bits is None and not fp8:
        a, b = items[0]
        return ops_for(inputs).fake_dynamic_block_quant(inputs, a, b, num_bits, unsigned, narrow_range)
    if dynamic:
        amax = block_amax(inputs, block_sizes)
    else:
        if not isinstance(amax, torch.Tensor):
            raise TypeError(f"block amax must be a torch.Tensor, got {type(amax).__name__}")
        expected = [n // dict(items).get(i, 1) for i, n in enumerate(inputs.shape)]
        if list(amax.shape) != expected:
            raise ValueError(
                f"block amax has shape {tuple(amax.shape)}, expected {tuple(expected)} for inputs "
                f"{tuple(inputs.shape)} with block_sizes {block_sizes}"
            )
    if scale_bits is not None:
        amax = _quantize_block_scales(amax, scale_bits, block_sizes.get("scale_block_sizes"))
    shape = _blocked_shape(inputs.shape, items)
    amax_b = amax.reshape([1 if k in [a + j + 1 for j, (a, _) in enumerate(items)] else s for k, s in enumerate(shape)])
    xb = inputs.reshape(shape)
    if fp8:
        out = ops_for(xb).scaled_e4m3(xb, amax_b)
    else:
        out = ops_for(xb).fake_quant(xb, amax_b, num_bits, unsigned, narrow_range)
    return out.reshape(inputs.shape)


# =========================================================================== autograd.Function spellings
class TensorQuantFunction(torch.autograd.Function):
    """A universal tensor quantization function: returns ``(outputs, scale)``.

    Backward is the straight-through estimator with clipping: the gradient
    passes where ``-amax <= input <= amax`` and is zero elsewhere.
    """

    @staticmethod
    def forward(ctx, inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
        amax = _prepare(inputs, amax, num_bits, unsigned)
        ctx.save_for_backward(inputs, amax)
        outputs, scale = ops_for(inputs).quant(inputs, amax, num_bits, unsigned, narrow_range)
        if _checks.eager(inputs):
            _checks.check_fp16_scale(inputs, scale)
        ctx.mark_non_differentiable(scale)
        return outputs, scale

    @staticmethod
    def backward(ctx, grad_outputs, grad_scale):
        inputs, amax = ctx.saved_tensors
        return ops_for(inputs).fake_quant_backward(grad_outputs, inputs, amax), None, None, None, None


class FakeTensorQuantFunction(torch.autograd.Function):
    """Fake (quantize-dequantize) version of :class:`TensorQuantFunction`, on lq's kernels."""

    @staticmethod
    def forward(ctx, inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
        amax = _prepare(inputs, amax, num_bits, unsigned)
        ctx.save_for_backward(inputs, amax)
        return ops_for(inputs).fake_quant(inputs, amax, num_bits, unsigned, narrow_range)

    @staticmethod
    def backward(ctx, grad_outputs):
        inputs, amax = ctx.saved_tensors
        return ops_for(inputs).fake_quant_backward(grad_outputs, inputs, amax), None, None, None, None


class LegacyFakeTensorQuantFunction(torch.autograd.Function):
    """Fake quantization computed with plain PyTorch ops (the reference formula, no kernel)."""

    @staticmethod
    def forward(ctx, inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
        amax = _prepare(inputs, amax, num_bits, unsigned)
        if _checks.eager(inputs):  # value checks; traced code gets no data-dependent branch
            _checks.check_amax_values(amax)
        ctx.save_for_backward(inputs, amax)
        return _reference.fake_quant(inputs, amax, num_bits, unsigned, narrow_range)

    @staticmethod
    def backward(ctx, grad_outputs):
        inputs, amax = ctx.saved_tensors
        return _reference.fake_quant_backward(grad_outputs, inputs, amax), None, None, None, None


class FakeAffineTensorQuantFunction(torch.autograd.Function):
    """Fake version of affine (scale + zero point) quantization, per tensor."""

    @staticmethod
    def forward(ctx, inputs, min_range, max_range, num_bits=8):
        out = fake_affine_tensor_quant(inputs, min_range, max_range, num_bits)
        ctx.save_for_backward(inputs, _as_amax(min_range, inputs), _as_amax(max_range, inputs))
        return out

    @staticmethod
    def backward(ctx, grad_outputs):
        inputs, lo, hi = ctx.saved_tensors
        return ops_for(inputs).fake_affine_quant_backward(grad_outputs, inputs, lo, hi), None, None, None


class ScaledE4M3Function(torch.autograd.Function):
    """E4M3-fy the input with scale ``448 / amax``; clipped STE backward."""

    @staticmethod
    def forward(ctx, inputs, amax, E=4, M=3):
        out = scaled_e4m3(inputs, amax, E, M)
        ctx.save_for_backward(inputs, _as_amax(E4M3_MAX if amax is None else amax, inputs))
        return out

    @staticmethod
    def backward(ctx, grad_outputs):
        inputs, amax = ctx.saved_tensors
        return ops_for(inputs).fake_quant_backward(grad_outputs, inputs, amax), None, None, None


#: the reference toolkit's name for the plain-PyTorch fake quantization (no compiled kernel)
legacy_fake_tensor_quant = LegacyFakeTensorQuantFunction.apply
