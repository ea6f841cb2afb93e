"""Max calibrator: amax = the largest finite ``|x|`` seen (per tensor, per channel or per block)."""

from __future__ import annotations

import torch

from lq.calib.calibrator import _Calibrator, finite_minmax

__all__ = ["MaxCalibrator"]


def finite_absmax(x: torch.Tensor, dims: tuple[int, ...], shape: list[int]):
    """``(absmax, nonfinite_count)`` of ``x`` over ``dims``, reshaped to ``shape`` (float32), NaN/Inf skipped
    (:func:`~lq.calib.calibrator.finite_minmax`: one reduction pass for finite data)."""
    if x.numel() == 0:
        return None, 0
    lo, hi, count = finite_minmax(x, dims, shape)
    return torch.maximum(hi, -lo), count


class MaxCalibrator(_Calibrator):
    """Max calibrator: tracks the maximum ``|x|`` over every collected tensor.

    Args:
        num_bits: bits of the quantization (an int or ``(4, 3)``).
        axis: None (per tensor) or the axis / axes that keep their own amax.
        unsigned: unsigned quantization.
        track_amax: also keep every batch's amax in ``amaxs`` (on the CPU).
        block_sizes: calibrate static block quantization: one amax per block
            (``tensor_quant.block_amax``); needs ``axis=None``.

    The amax has the broadcast shape of the quantization: ``()`` per tensor,
    the input's rank with size 1 on reduced dims per channel (e.g. ``(C, 1, 1, 1)``).
    NaN/Inf are skipped (warned once, counted in ``nonfinite_count``).
    """

    def __init__(self, num_bits=8, axis=None, unsigned=False, track_amax=False, block_sizes=None):
        super().__init__(num_bits, axis, unsigned)
        if block_sizes is not None and axis is not None:
            raise ValueError("MaxCalibrator: axis must be None when block_sizes is given")
        self._track_amax = bool(track_amax)
        self._block_sizes = block_sizes
        self.add_state("_calib_amax", None, "max")
        self.add_state("_amaxs", [], "cat")
        if self._axis is None and block_sizes is None:
            self._track_range()

    def _config(self) -> dict:
        cfg = super()._config()
        cfg["track_amax"] = self._track_amax
        if self._block_sizes is not None:
            cfg["block_sizes"] = self._block_sizes
        return cfg

    @property
    def has_data(self) -> bool:
        return self._calib_amax is not None

    @property
    def amaxs(self) -> list:
        """Per-batch amax (only with ``track_amax=True``)."""
        return self._amaxs

    def _batch_amax(self, x: torch.Tensor):
        if self._block_sizes is not None:
            from lq import tensor_quant

            amax = tensor_quant.block_amax(x, self._block_sizes)
            if bool(torch.isfinite(amax).all()):
                return amax, 0
            finite = torch.isfinite(x)
            xz = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
            return tensor_quant.block_amax(xz, self._block_sizes), int((~finite).sum())
        dims, shape = self._reduce_dims(x)
        if x.numel() == 0:
            return None, 0
        lo, hi, count = finite_minmax(x, dims, shape)
        if self._axis is None:
            self._note_range(lo, hi)
        return torch.maximum(hi, -lo), count

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Update the running max with ``x``'s absmax (one reduction pass)."""
        x = self._input(x)
        amax, nonfinite = self._batch_amax(x)
        self._note_nonfinite(nonfinite)
        if amax is None:
            return
        if self._calib_amax is None:
            self._calib_amax = amax
        else:
            if amax.shape != self._calib_amax.shape:
                raise RuntimeError(
                    f"MaxCalibrator: amax shape changed from {tuple(self._calib_amax.shape)} to {tuple(amax.shape)} "
                    f"(axis={self._axis}); per-channel calibration needs the same channel count in every batch"
                )
            self._calib_amax = torch.maximum(self._calib_amax, amax.to(self._calib_amax.device))
        if self._track_amax:
            self._amaxs.append(amax.cpu())

    def compute_amax(self, method=None, **kwargs):
        """The max collected so far (``method`` and its kwargs are ignored), None without data."""
        self._check_method(method, kwargs)
        if self._calib_amax is None:
            return None
        return self._calib_amax.detach().clone()

    def __repr__(self) -> str:
        s = super().__repr__()[:-1]
        if self._calib_amax is not None:
            a = self._calib_amax
            s += f", amax={float(a):.4g}" if a.numel() == 1 else f", amax=[{float(a.min()):.4g}, {float(a.max()):.4g}]"
        return s + ")"
