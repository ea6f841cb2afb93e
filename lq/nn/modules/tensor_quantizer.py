"""TensorQuantizer: the module that quantizes one tensor (API of ``pytorch_quantization.nn.TensorQuantizer``).

A quantizer runs in up to three stages, each switchable:

* **calib** (``enable_calib``): feed the input to the calibrator (statistics only);
* **clip** (``enable_clip``, learned amax only): clamp to ``[-amax, amax]``;
* **quant** (``enable_quant``): fake-quantize (or quantize) with amax.

Clip and quant together are one pass: a clipped input lies in ``[-amax, amax]``,
so quantizing it is quantizing the raw input on the narrow grid
``[-maxbound, maxbound]`` (same values, same gradients for the input and the
learned amax). ``pre_quant_scale`` (SmoothQuant-style per-channel activation
scaling), when set, multiplies the input before every stage, also while the
quantizer is disabled: the matching weights were divided by it.

amax comes from, in this order: dynamic computation when the descriptor says
``dynamic`` (or a dynamic block type); the ``_amax`` buffer (the descriptor's
``amax``, a calibrated value or one loaded from a checkpoint); and otherwise
(uncalibrated) it is computed from every input over the dims not in ``axis``.

``_amax`` is a float32 buffer in the state_dict (an ``nn.Parameter`` with
``learn_amax``). It is validated (finite, ``>= 0``, right shape) when it is
set, loaded or calibrated, never in ``forward``, so the forward path has no
data-dependent Python branch and ``torch.export`` / ``torch.compile`` trace it.

Affine (asymmetric) quantization: give the quantizer a
:class:`lq.calib.MinMaxCalibrator` (``calibrator="minmax"`` or assign
``quantizer.calibrator``); ``load_calib_amax`` then fills the ``_min_range``
and ``_max_range`` buffers, and while they are set ``forward`` uses
``fake_affine_tensor_quant(x, min_range, max_range, num_bits)`` (per tensor).
``_amax`` holds ``max(|min|, |max|)`` for reporting.
"""

from __future__ import annotations

import logging
import numbers

import torch
from torch import nn

from lq import _checks, _reference
from lq import tensor_quant as _tq
from lq.nn.modules import _export_mode
from lq._float64 import ops_for
from lq.nn.modules.clip import clip
from lq.tensor_quant import QuantDescriptor

__all__ = [
    "TensorQuantizer",
    "LearnedClip",
    "AmaxShapeError",
    "iter_quantizers",
    "name_quantizers",
    "uncalibrated_quantizers",
    "quantizers_without_data",
    "load_calib_amax",
]

logger = logging.getLogger(__name__)

#: float32 buffers, with the name their errors use: kept float32 by ``.half()``/``.to()``, created by a state_dict load
_FLOAT32_BUFFERS = {"_amax": "amax", "_min_range": "min_range", "_max_range": "max_range",
                    "_pre_quant_scale": "pre_quant_scale"}


class AmaxShapeError(ValueError, TypeError):
    """amax of the wrong shape (a ValueError; also a TypeError like the reference toolkit's)."""


def _to_amax_tensor(value, device, what="amax") -> torch.Tensor:
    """A float32 tensor of ``value`` (number, list, numpy array or tensor), validated finite and >= 0."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to(device=device, dtype=torch.float32)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        t = torch.tensor(float(value), dtype=torch.float32, device=device)
    elif hasattr(value, "tolist") or isinstance(value, (list, tuple)):
        t = torch.tensor(value.tolist() if hasattr(value, "tolist") else value, dtype=torch.float32, device=device)
    else:
        raise TypeError(f"{what} must be a float, a list/ndarray of floats or a tensor, got {type(value).__name__}")
    if t.numel() == 0:
        raise ValueError(f"{what} must not be empty")
    return t.clone()


def _check_amax_values(t: torch.Tensor, name: str, what: str = "amax") -> None:
    if t.is_meta:
        return
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: {what} must be finite, got {_short(t)}")
    if bool((t < 0).any()):
        raise ValueError(f"{name}: {what} must be >= 0, got min {float(t.min()):g}")


def _valid_value(t: torch.Tensor, nonnegative: bool) -> bool:
    t = t.detach().float()
    return bool(torch.isfinite(t).all()) and not (nonnegative and bool((t < 0).any()))


def _short(t: torch.Tensor | None, fmt: str = ".4f") -> str:
    if t is None:
        return "dynamic"
    t = t.detach()
    if t.numel() == 0:
        return "None"
    if t.numel() == 1:
        return f"{float(t):{fmt}}"
    return f"[{float(t.min()):{fmt}}, {float(t.max()):{fmt}}]({t.numel()})"


class LearnedClip(nn.Module):
    """The clip stage of a learned-amax quantizer, shaped like the reference toolkit's ``Clip`` (``quantizer.clip``).

    lq learns ONE symmetric amax (the quantizer's ``_amax`` parameter, what the
    state_dict holds), so this is a view, not a second copy: ``clip_value_max``
    is that parameter (in-place updates and optimizers reach it) and
    ``clip_value_min`` is ``-amax``, computed (writing to it changes nothing).
    """

    def __init__(self, amax: nn.Parameter):
        super().__init__()
        self.clip_value_max = amax

    @property
    def clip_value_min(self) -> torch.Tensor:
        return -self.clip_value_max

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return clip(inputs, -self.clip_value_max, self.clip_value_max)


class TensorQuantizer(nn.Module):
    """Quantize a tensor as described by a :class:`~lq.tensor_quant.QuantDescriptor`.

    Args:
        quant_desc: the descriptor (bits, axis, block sizes, amax, learn_amax,
            scale_amax, calib_method, unsigned, narrow_range, dynamic, fake_quant).
        disabled: bypass entirely (``forward`` returns its input).
        if_quant: run the quantization stage.
        if_clip: run the clip stage (needs ``learn_amax``).
        if_calib: run the calibration stage.
        calibrator: override the descriptor's ``calib_method``: a name
            ("max", "histogram", "ema", "minmax") or a calibrator instance.

    Class attribute ``use_fb_fake_quant`` (export mode, set by ``lq.enable_onnx_export()``): fake
    quantization with stock PyTorch ops (``torch.fake_quantize_per_tensor_affine`` /
    ``..._per_channel_affine``, FP8 in elementwise ops) so a plain ``torch.onnx.export`` sees
    only standard ops (:mod:`lq.nn.modules._export_mode`).
    """

    use_fb_fake_quant = False

    def __init__(self, quant_desc=QuantDescriptor(), disabled=False, if_quant=True, if_clip=False, if_calib=False,
                 *, calibrator=None):
        super().__init__()
        if not isinstance(quant_desc, QuantDescriptor):
            raise TypeError(f"quant_desc must be a QuantDescriptor, got {type(quant_desc).__name__}")
        for flag, v in (("disabled", disabled), ("if_quant", if_quant), ("if_clip", if_clip), ("if_calib", if_calib)):
            if not isinstance(v, bool):
                raise TypeError(f"{flag} must be a bool, got {v!r}")
        self._quant_desc = quant_desc
        self._num_bits = quant_desc.num_bits
        self._fake_quant = quant_desc.fake_quant
        self._axis = quant_desc.axis
        self._block_sizes = quant_desc.block_sizes
        self._scale_amax = quant_desc.scale_amax
        self._learn_amax = quant_desc.learn_amax
        self._unsigned = quant_desc.unsigned
        self._narrow_range = quant_desc.narrow_range
        self._dynamic = quant_desc.dynamic
        self._asymmetric = quant_desc.asymmetric
        self._name = quant_desc.name

        if self._learn_amax and self._block_sizes is not None:
            raise ValueError("learn_amax=True is not supported with block_sizes: learned amax is per tensor")

        self._scale = None
        self._disabled = disabled
        self._if_quant = if_quant
        self._if_clip = False
        self._if_calib = if_calib
        self._device = torch.empty(0).device  # honours a ``with torch.device(...)`` context

        for key in _FLOAT32_BUFFERS:
            self.register_buffer(key, None)
        if self._learn_amax:
            init = quant_desc.amax if quant_desc.amax is not None else 1.0
            t = _to_amax_tensor(init, self._device)
            if t.numel() != 1:
                raise ValueError("learn_amax=True needs a scalar amax (learned amax is per tensor)")
            _check_amax_values(t, self.name)
            del self._buffers["_amax"]
            self._amax = nn.Parameter(t.reshape(()))
            self.enable_clip()
        elif quant_desc.amax is not None:
            t = _to_amax_tensor(quant_desc.amax, self._device)
            _check_amax_values(t, self.name)
            self._amax = t
        if if_clip:
            self.enable_clip()

        self._calibrator = None
        self.calibrator = calibrator if calibrator is not None else quant_desc.calib_method

    # ================================================================== properties
    @property
    def name(self) -> str:
        """The quantizer's name in its model (set by :func:`name_quantizers` or a state_dict load), else a placeholder."""
        return self._name if self._name else "<unnamed TensorQuantizer>"

    @name.setter
    def name(self, value: str) -> None:
        self._name = value

    @property
    def quant_desc(self) -> QuantDescriptor:
        return self._quant_desc

    @property
    def num_bits(self):
        return self._num_bits

    @num_bits.setter
    def num_bits(self, value) -> None:
        self._redescribe(num_bits=value)

    @property
    def is_fp8(self) -> bool:
        return self._num_bits == _tq.FP8_E4M3

    @property
    def maxbound(self):
        """Largest quantized magnitude: ``2^(num_bits - 1 + unsigned) - 1`` (448.0 for FP8 E4M3)."""
        if self.is_fp8:
            return _reference.E4M3_MAX
        return (1 << (self._num_bits - 1 + int(self._unsigned))) - 1

    @property
    def unsigned(self) -> bool:
        return self._unsigned

    @unsigned.setter
    def unsigned(self, value) -> None:
        self._redescribe(unsigned=value)

    @property
    def narrow_range(self) -> bool:
        return self._narrow_range

    @narrow_range.setter
    def narrow_range(self, value) -> None:
        self._redescribe(narrow_range=value)

    def _redescribe(self, **changes) -> None:
        """Change descriptor fields after construction: the descriptor validates them (one set of rules) and
        stays the quantizer's description; a calibrator this quantizer made by name is remade to match (one that
        already saw data is remade too, with a warning: its statistics were for the old grid)."""
        desc = QuantDescriptor(**{**self._quant_desc.dict(), **changes})
        self._quant_desc = desc
        self._num_bits = desc.num_bits
        self._unsigned = desc.unsigned
        self._narrow_range = desc.narrow_range
        if self._calibrator is not None and self._calibrator_from_name:
            if self._calibrator.has_data:
                logger.warning("%s: %s changed after calibration data was collected; the calibrator starts over",
                               self.name, ", ".join(sorted(changes)))
            self._calibrator = self._make_calibrator(self._calibrator_method)

    @property
    def axis(self):
        return self._axis

    @property
    def block_sizes(self):
        return self._block_sizes

    @property
    def fake_quant(self) -> bool:
        return self._fake_quant

    @property
    def learn_amax(self) -> bool:
        return self._learn_amax

    @property
    def scale_amax(self):
        return self._scale_amax

    @property
    def dynamic(self) -> bool:
        """True when amax is computed from every input (descriptor ``dynamic`` or dynamic blocks)."""
        return bool(self._dynamic or (self._block_sizes and self._block_sizes.get("type") == "dynamic"))

    @property
    def is_enabled(self) -> bool:
        return not self._disabled

    @property
    def asymmetric(self) -> bool:
        """True when calibration gives this quantizer an affine range (descriptor ``asymmetric``): the signed
        range its calibrator saw, clipped on both sides by the method's amax."""
        return self._asymmetric

    @property
    def is_affine(self) -> bool:
        """True when the quantizer holds an affine range (``_min_range`` / ``_max_range``)."""
        return self._min_range is not None

    @property
    def calibrator(self):
        return self._calibrator

    @calibrator.setter
    def calibrator(self, value) -> None:
        from lq import calib

        from_name = isinstance(value, str)
        if value is None or isinstance(value, calib._Calibrator):
            calibrator = value
        elif from_name:
            calibrator = self._make_calibrator(value)
        else:
            raise TypeError(f"calibrator must be None, a calibrator or one of {_CALIBRATOR_NAMES}, got {value!r}")
        if isinstance(calibrator, calib.MinMaxCalibrator) and (self._axis is not None or self._block_sizes):
            raise ValueError(f"{self.name}: affine (min/max) calibration is per tensor: the descriptor needs axis=None "
                             "and no block_sizes")
        self._calibrator = calibrator
        self._calibrator_from_name = from_name
        self._calibrator_method = value if from_name else None

    def _make_calibrator(self, method: str):
        from lq import calib

        if method not in _CALIBRATOR_NAMES:
            raise ValueError(f"calibrator {method!r} is not allowed: one of {_CALIBRATOR_NAMES}")
        static_blocks = self._block_sizes is not None and not self.dynamic
        if static_blocks and method != "max":
            raise ValueError(f"{self.name}: static block quantization calibrates with 'max' only, got {method!r}")
        if method == "max":
            blocks = self._block_sizes if static_blocks else None
            return calib.MaxCalibrator(self._num_bits, None if blocks else self._axis, self._unsigned,
                                       block_sizes=blocks)
        if method == "histogram":
            return calib.HistogramCalibrator(self._num_bits, self._axis, self._unsigned,
                                             signed_range=self._asymmetric)
        if method == "ema":
            return calib.EMAMaxCalibrator(self._num_bits, self._axis, self._unsigned)
        return calib.MinMaxCalibrator(self._num_bits, self._axis, self._unsigned)

    @property
    def amax(self):
        """The static amax (float32 tensor), or None when amax is dynamic (uncalibrated)."""
        return self._amax

    @amax.setter
    def amax(self, value) -> None:
        if value is None:  # back to uncalibrated (dynamic amax)
            if self._learn_amax:
                raise ValueError(f"{self.name}: a learned amax cannot be removed")
            self._amax = None
            self._min_range = None
            self._max_range = None
            return
        self._set_amax(value, allow_reshape=False)
        if self._asymmetric:
            self._range_from_amax()

    def _range_from_amax(self) -> None:
        """The affine range of an asymmetric quantizer: the calibrator's signed range (``[-amax, amax]`` when
        it kept none) clipped to ``[-amax, amax]``; amax then holds the larger end, as for any affine range."""
        amax = self._amax.detach().reshape(())
        seen = self._calibrator.compute_range() if self._calibrator is not None else None
        lo, hi = (-amax, amax) if seen is None else (torch.maximum(seen[0].to(amax.device), -amax),
                                                     torch.minimum(seen[1].to(amax.device), amax))
        self.set_range(lo, hi)

    def _set_amax(self, value, allow_reshape: bool) -> None:
        t = _to_amax_tensor(value, self._amax.device if self._amax is not None else self._device)
        _check_amax_values(t, self.name)
        if self._amax is None:
            self._amax = t
            return
        if t.shape != self._amax.shape:
            if t.numel() == 1 and self._amax.numel() == 1:
                t = t.reshape(self._amax.shape)
            elif allow_reshape and not isinstance(self._amax, nn.Parameter):
                self._amax = t
                return
            else:
                raise AmaxShapeError(
                    f"{self.name}: cannot change amax shape from {tuple(self._amax.shape)} to {tuple(t.shape)} "
                    "(set quantizer.amax = None first to recalibrate with another granularity)"
                )
        with torch.no_grad():
            self._amax.copy_(t)

    @property
    def pre_quant_scale(self):
        """Per-channel (or scalar) factor the input is multiplied by before quantization (SmoothQuant), or None.

        Set it to a number, list, array or tensor that broadcasts against the
        input (float32 buffer in the state_dict; its shape is fixed once set);
        None removes it.
        """
        return self._pre_quant_scale

    @pre_quant_scale.setter
    def pre_quant_scale(self, value) -> None:
        if value is None:
            self._pre_quant_scale = None
            return
        current = self._pre_quant_scale
        t = _to_amax_tensor(value, current.device if current is not None else self._device, "pre_quant_scale")
        if not t.is_meta and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{self.name}: pre_quant_scale must be finite, got {_short(t)}")
        if current is None:
            self._pre_quant_scale = t
            return
        if t.shape != current.shape:
            raise AmaxShapeError(f"{self.name}: cannot change pre_quant_scale shape from {tuple(current.shape)} to "
                                 f"{tuple(t.shape)} (set it to None first)")
        current.copy_(t)

    @property
    def clip(self):
        """The clip stage of a learned-amax quantizer, as the reference toolkit's ``quantizer.clip`` (a
        :class:`LearnedClip` view: ``clip_value_max`` IS the learned amax parameter, ``clip_value_min`` is
        ``-amax``). Quantizers without ``learn_amax`` have no clip stage and no ``clip`` attribute."""
        if not self._learn_amax:
            raise AttributeError(f"{self.name}: 'clip' exists only with learn_amax=True (the clip stage learns amax)")
        return LearnedClip(self._amax)

    @property
    def min_range(self):
        """Lower end of the affine range (None unless affine)."""
        return self._min_range

    @property
    def max_range(self):
        """Upper end of the affine range (None unless affine)."""
        return self._max_range

    def set_range(self, min_range, max_range) -> None:
        """Make the quantizer affine with ``[min_range, max_range]`` (per tensor, ``min_range <= 0 <= max_range``
        is widened to include 0)."""
        if self._axis is not None or self._block_sizes is not None:
            raise ValueError(f"{self.name}: affine quantization is per tensor (axis=None, no block_sizes)")
        if self.is_fp8:
            raise ValueError(f"{self.name}: affine quantization needs integer num_bits, not FP8")
        lo = _to_amax_tensor(min_range, self._device, "min_range") if not isinstance(min_range, torch.Tensor) else \
            min_range.detach().float().clone().to(self._device)
        hi = _to_amax_tensor(max_range, self._device, "max_range") if not isinstance(max_range, torch.Tensor) else \
            max_range.detach().float().clone().to(self._device)
        if lo.numel() != 1 or hi.numel() != 1:
            raise ValueError(f"{self.name}: min_range and max_range must be scalars (affine quantization is per tensor)")
        if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
            raise ValueError(f"{self.name}: min_range / max_range must be finite, got {float(lo)}, {float(hi)}")
        lo = torch.minimum(lo.reshape(()), torch.zeros(()))
        hi = torch.maximum(hi.reshape(()), torch.zeros(()))
        if not float(hi) > float(lo):  # all-zero data: any tiny range quantizes 0 exactly
            hi = lo + _reference.AMAX_EPSILON
        self._min_range = lo
        self._max_range = hi
        if not self._learn_amax:
            self._amax = torch.maximum(-lo, hi).clone()

    @property
    def step_size(self):
        """``amax / maxbound`` (None while amax is dynamic)."""
        if self._amax is None:
            logger.error("%s: step_size is undefined under dynamic amax", self.name)
            return None
        return self._amax.detach() / float(self.maxbound)

    @property
    def scale(self):
        """Quantization scale ``maxbound / amax`` for a static amax; with ``fake_quant=False`` and
        dynamic amax the scale of the last quantized tensor; None otherwise."""
        if self._amax is not None and not self.dynamic and not self._block_sizes:
            return float(self.maxbound) / self._amax.detach()
        return self._scale

    # ================================================================== switches
    def enable(self) -> None:
        self._disabled = False

    def disable(self) -> None:
        self._disabled = True

    def enable_quant(self) -> None:
        self._if_quant = True

    def disable_quant(self) -> None:
        self._if_quant = False

    def enable_calib(self) -> None:
        if self._calibrator is None:
            raise ValueError(f"{self.name}: no calibrator was created, cannot enable calibration")
        self._if_calib = True

    def disable_calib(self) -> None:
        self._if_calib = False

    def enable_clip(self) -> None:
        """Enable the clip stage (learned amax: amax gets gradients and is trainable)."""
        if not self._learn_amax:
            raise ValueError(f"{self.name}: learn_amax is False, cannot enable clip (clipping learns amax)")
        self._amax.requires_grad_(True)
        self._if_clip = True

    def disable_clip(self) -> None:
        """Disable the clip stage (a learned amax is frozen: no gradient)."""
        self._if_clip = False
        if isinstance(self._amax, nn.Parameter):
            self._amax.requires_grad_(False)

    # ================================================================== calibration
    def load_calib_amax(self, method=None, *, strict=True, **kwargs) -> None:
        """Set amax from the calibrator: ``compute_amax(method, **kwargs)``.

        The same call works for every calibrator (max-style calibrators ignore
        ``method``; histogram takes "entropy", "mse" or "percentile" and
        ``stride``, ``start_bin``, ``percentile``). A calibrator that saw no
        data raises a RuntimeError naming this quantizer, or with
        ``strict=False`` logs a warning and leaves amax as it was. A disabled
        quantizer that saw no data (a recipe turned it off, e.g. the input of
        a stem that runs in float) has nothing to load: amax stays as it was,
        so pytorch-quantization's calibration loop over every quantizer works.
        """
        from lq import calib

        if self._calibrator is None:
            raise RuntimeError(f"{self.name}: no calibrator was created")
        if self._disabled and not self._calibrator.has_data:
            return
        if not self._calibrator.has_data:
            msg = (f"{self.name}: Calibrator returned None: the {type(self._calibrator).__name__} saw no data "
                   "during calibration (was calibration enabled and did the calibration batches reach it?)")
            if strict:
                raise RuntimeError(msg)
            logger.warning("%s; amax left %s", msg, _short(self._amax))
            return
        if isinstance(self._calibrator, calib.MinMaxCalibrator):
            lo, hi = self._calibrator.compute_range()
            self.set_range(lo, hi)
            return
        amax = self._calibrator.compute_amax(method, **kwargs)
        if amax is None:  # pragma: no cover - has_data said otherwise
            raise RuntimeError(f"{self.name}: calibrator returned no amax")
        self._set_amax(amax, allow_reshape=True)
        if self._asymmetric:
            self._range_from_amax()

    def init_learn_amax(self) -> None:
        """Start amax learning from the current (calibrated) amax."""
        if not self._learn_amax:
            raise RuntimeError(f"{self.name}: init_learn_amax called with learn_amax=False")
        if self._calibrator is not None and self._calibrator.has_data:
            amax = self._calibrator.compute_amax()
            if amax is not None:
                with torch.no_grad():
                    self._amax.copy_(amax.detach().float().max().to(self._amax.device))
        self.enable_clip()

    # ================================================================== forward
    def _reduce_dims(self, x: torch.Tensor):
        if self._axis is None:
            return None
        axes = self._axis if isinstance(self._axis, tuple) else (self._axis,)
        keep = {_checks.normalize_axis(a, x.dim()) for a in axes}
        return tuple(d for d in range(x.dim()) if d not in keep)

    def _get_amax(self, inputs: torch.Tensor) -> torch.Tensor:
        """Static amax from the buffer, or dynamic amax over the non-``axis`` dims."""
        if self._amax is not None and not self._dynamic:
            amax = self._amax
            if not self._learn_amax:
                amax = amax.detach()
        else:
            dims = self._reduce_dims(inputs)
            ct = _reference.compute_dtype(inputs)  # float64 inputs keep a float64 amax
            # over the finite values, as calibration counts them: one stray Inf/NaN in the data must not make
            # the scale of the whole tensor infinite (it still passes through as NaN / the largest step)
            mag = torch.nan_to_num(inputs.detach().abs(), nan=0.0, posinf=0.0)
            if dims is None:
                amax = mag.amax().to(ct)
            elif len(dims) == 0:
                amax = mag.to(ct)
            else:
                amax = mag.amax(dim=dims, keepdim=True).to(ct)
        amax = self._broadcast_amax(amax, inputs)
        if self._scale_amax is not None:
            amax = amax * self._scale_amax
        return amax

    def _broadcast_amax(self, amax: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """A 1-D per-channel amax (e.g. from a descriptor list) viewed along ``axis`` (shape logic only)."""
        if amax.dim() == 1 and amax.numel() > 1 and isinstance(self._axis, int) and inputs.dim() > 1:
            axis = _checks.normalize_axis(self._axis, inputs.dim())
            if amax.shape[0] == inputs.shape[axis]:
                return amax.reshape([-1 if d == axis else 1 for d in range(inputs.dim())])
        return amax

    def _fb_fake_quant(self, inputs: torch.Tensor, amax: torch.Tensor, narrow_range: bool) -> torch.Tensor:
        """Export mode (``use_fb_fake_quant``, ``lq.enable_onnx_export()``): stock PyTorch ops that
        ``torch.onnx.export`` translates without lq's translation table (see :mod:`lq.nn.modules._export_mode`)."""
        if self._amax is None and not self.dynamic:
            raise RuntimeError(f"{self.name}: no amax to export (uncalibrated): calibrate and load_calib_amax() before "
                               "exporting, or give the descriptor dynamic=True for amax computed from each input")
        if self.is_fp8:
            return _export_mode.scaled_e4m3(inputs, amax)
        axis = None if amax.numel() == 1 else self._channel_axis(amax, inputs)
        return _export_mode.fake_int_quant(inputs, amax, self._num_bits, self._unsigned, narrow_range, axis)

    def _channel_axis(self, amax: torch.Tensor, inputs: torch.Tensor) -> int:
        if self._axis is not None:
            axes = self._axis if isinstance(self._axis, tuple) else (self._axis,)
            if len(axes) != 1:
                raise TypeError(f"{self.name}: export-mode fake quantization supports one axis, got {self._axis}")
            return _checks.normalize_axis(axes[0], inputs.dim())
        lead = inputs.dim() - amax.dim()
        big = [lead + i for i, s in enumerate(amax.shape) if s != 1]
        if len(big) != 1:
            raise TypeError(f"{self.name}: amax of shape {tuple(amax.shape)} is not per channel along one axis")
        return big[0]

    def _affine_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        lo, hi = self._min_range, self._max_range
        if TensorQuantizer.use_fb_fake_quant:
            step, zp, qmin, qmax = _reference.affine_params(lo, hi, self._num_bits)
            x = inputs.float()
            out = torch.fake_quantize_per_tensor_affine(
                x, step.reshape(()), (-zp).reshape(()).to(torch.int32), int(qmin), int(qmax))
            return out.to(inputs.dtype)
        # the op directly: min < max was validated by set_range, no data-dependent check while tracing; float64
        # inputs run the reference arithmetic in float64, as the symmetric grid's do
        _checks.check_input(inputs, allow_float64=True)
        lo, hi = (lo.double(), hi.double()) if inputs.dtype == torch.float64 else (lo, hi)
        return ops_for(inputs).fake_affine_quant(inputs, lo, hi, self._num_bits)

    def _quant_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self._min_range is not None:
            return self._affine_forward(inputs)
        if self._block_sizes is not None:
            static = self._amax is not None and not self.dynamic
            return _tq.fake_block_quant(inputs, self._block_sizes, self._num_bits,
                                        amax=self._amax.detach() if static else None,
                                        unsigned=self._unsigned, narrow_range=self._narrow_range)
        amax = self._get_amax(inputs)
        # With the clip stage on, the input is first clipped to [-amax, amax]: quantizing that is quantizing on the
        # narrow grid (one pass instead of clamp + quantize; same values and gradients).
        narrow_range = self._narrow_range or self._if_clip
        if self._fake_quant and TensorQuantizer.use_fb_fake_quant:
            return self._fb_fake_quant(inputs, amax, narrow_range)
        if self.is_fp8:
            return _tq.scaled_e4m3(inputs, amax)
        if self._fake_quant:
            return _tq._fake_tensor_quant(inputs, amax, self._num_bits, self._unsigned, narrow_range)
        outputs, self._scale = _tq._tensor_quant(inputs, amax, self._num_bits, self._unsigned, narrow_range)
        return outputs

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self._pre_quant_scale is not None:
            inputs = inputs * self._pre_quant_scale.to(inputs.dtype)
        if self._disabled:
            return inputs
        outputs = inputs
        if self._if_calib:
            if self._calibrator is None:
                raise RuntimeError(f"{self.name}: calibration is enabled but there is no calibrator")
            self._calibrator.collect(inputs)
        if self._if_clip and not self._if_quant:
            outputs = clip(inputs, -self._amax, self._amax)
        if self._if_quant:
            outputs = self._quant_forward(inputs)
        return outputs

    # ================================================================== device / dtype / state_dict
    def _apply(self, fn, recurse=True):
        # Learn the target device from a probe; keep amax and the other float32 buffers float32 whatever fn does.
        probe = fn(torch.zeros((), dtype=torch.float32, device=self._device))
        saved = {}
        for k in _FLOAT32_BUFFERS:
            t = getattr(self, k)
            if t is not None:
                saved[k] = t.detach().clone()
        out = super()._apply(fn, recurse)
        self._device = probe.device
        for k, orig in saved.items():
            t = getattr(self, k)
            if t is None or t.dtype == torch.float32:
                continue
            if k in self._buffers:
                self._buffers[k] = orig.to(t.device)
            else:
                t.data = orig.to(t.device)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if not self._name and prefix:
            self._name = prefix[:-1]
        name = prefix[:-1] or self.name
        for key, what in _FLOAT32_BUFFERS.items():
            src = state_dict.get(prefix + key)
            dst = getattr(self, key)
            if src is None:
                # a calibrated amax missing from the checkpoint is reported by the base class as a missing
                # key, which load_state_dict(strict=False) accepts (torch passes strict=True down here always)
                continue
            if not isinstance(src, torch.Tensor):
                error_msgs.append(f"{name}: {what} in the checkpoint is a {type(src).__name__}, expected a tensor")
                continue
            if src.numel() and not src.is_meta and not _valid_value(src, nonnegative=key == "_amax"):
                rule = "finite and >= 0" if key == "_amax" else "finite"
                error_msgs.append(f"{name}: {what} in the checkpoint must be {rule}, got {_short(src)}")
                state_dict = dict(state_dict)  # nothing of it is loaded: the quantizer keeps what it had
                if dst is None:
                    del state_dict[prefix + key]
                else:
                    state_dict[prefix + key] = dst.detach()
                continue
            if dst is None:
                # Uncalibrated quantizer (or no pre_quant_scale yet): create the buffer on this quantizer's device.
                self._buffers[key] = torch.empty(src.shape, dtype=torch.float32, device=self._device)
            elif src.shape != dst.shape and not (src.numel() == 1 and dst.numel() == 1):
                error_msgs.append(
                    f"{name}: {what} in the checkpoint has shape {tuple(src.shape)} but this quantizer's {what} has "
                    f"shape {tuple(dst.shape)} (axis={self._axis}); per-tensor/per-channel settings differ")
                state_dict = dict(state_dict)
                state_dict[prefix + key] = dst.detach()
            elif src.shape != dst.shape:
                state_dict = dict(state_dict)
                state_dict[prefix + key] = src.reshape(dst.shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    # ================================================================== repr
    def extra_repr(self) -> str:
        if self._disabled:
            return "disabled"
        if self.is_fp8:
            s = "fp8 e4m3"
        else:
            s = f"{'unsigned ' if self._unsigned else ''}{self._num_bits}bit"
            s += " narrow" if self._narrow_range else ""
        s += " fake" if self._fake_quant else " real"
        if self._block_sizes is not None:
            blocks = {k: v for k, v in self._block_sizes.items() if k != "type"}
            s += f" blocks={blocks}"
        else:
            s += f" axis={self._axis}" if self._axis is not None else " per-tensor"
        if self._min_range is not None:
            s += f" affine=[{float(self._min_range):.4f}, {float(self._max_range):.4f}]"
        elif self.dynamic:
            s += " amax=dynamic"
        else:
            s += f" amax={_short(self._amax)}"
        s += f" *{self._scale_amax}" if self._scale_amax else ""
        if self._pre_quant_scale is not None:
            s += f" pre_quant_scale={_short(self._pre_quant_scale)}"
        s += " learned" if self._learn_amax else ""
        if self._calibrator is not None:
            s += f" calibrator={type(self._calibrator).__name__}"
        modes = [m for m, on in (("quant", self._if_quant), ("clip", self._if_clip), ("calib", self._if_calib)) if on]
        s += " " + ("+".join(modes) if modes else "off")
        return s


_CALIBRATOR_NAMES = ("max", "histogram", "ema", "minmax")


# ====================================================================== model-level helpers
def iter_quantizers(model: nn.Module):
    """Yield ``(name, quantizer)`` for every TensorQuantizer in ``model``."""
    for name, m in model.named_modules():
        if isinstance(m, TensorQuantizer):
            yield name, m


def name_quantizers(model: nn.Module, overwrite: bool = False) -> None:
    """Give every quantizer its module name (used in error messages and reports)."""
    for name, q in iter_quantizers(model):
        if overwrite or not q._name:
            q._name = name


def uncalibrated_quantizers(model: nn.Module) -> list[str]:
    """Names of enabled, quantizing, non-dynamic quantizers that have no amax (they fall back to dynamic amax)."""
    return [
        name for name, q in iter_quantizers(model)
        if q.is_enabled and q._if_quant and not q.dynamic and q._amax is None and q._min_range is None
    ]


def quantizers_without_data(model: nn.Module) -> list[str]:
    """Names of quantizers whose calibrator has collected nothing."""
    return [name for name, q in iter_quantizers(model) if q._calibrator is not None and not q._calibrator.has_data]


def load_calib_amax(model: nn.Module, method=None, *, strict=True, **kwargs) -> dict:
    """``load_calib_amax`` on every quantizer of ``model`` that has a calibrator.

    Returns ``{name: amax}``. Quantizers whose calibrator saw no data are
    listed together in one RuntimeError when ``strict`` (nothing is changed
    then), or skipped with one warning naming them.
    """
    name_quantizers(model)
    quantizers = [(n, q) for n, q in iter_quantizers(model) if q._calibrator is not None and q.is_enabled]
    empty = [n for n, q in quantizers if not q._calibrator.has_data]
    if empty and strict:
        raise RuntimeError(f"{len(empty)} quantizer(s) saw no data during calibration: {', '.join(empty)}")
    if empty:
        logger.warning("%d quantizer(s) saw no data during calibration and keep their amax: %s", len(empty),
                       ", ".join(empty))
    out = {}
    for n, q in quantizers:
        if q._calibrator.has_data:
            q.load_calib_amax(method, strict=strict, **kwargs)
            out[n] = q.amax
    return out

