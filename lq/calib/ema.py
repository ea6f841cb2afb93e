"""Moving-average max calibrator (like ``torch.ao``'s MovingAverageMinMaxObserver, symmetric)."""

from __future__ import annotations

import torch

from lq.calib.calibrator import _Calibrator, _comm_device, _gather_objects
from lq.calib.max import finite_absmax

__all__ = ["EMAMaxCalibrator"]


class EMAMaxCalibrator(_Calibrator):
    """amax = exponential moving average of the per-batch absmax.

    ``amax <- amax + averaging_constant * (batch_amax - amax)``; the first batch
    sets amax. Robust to rare outlier batches (max calibration keeps them
    forever). Per tensor or per channel (``axis``); NaN/Inf are skipped.

    Merging (``merge`` / ``sync``) averages the calibrators' amax weighted by
    how many batches each saw (an EMA has no exact merge; this is the EMA of
    the combined stream when the ranks saw statistically similar data).
    """

    def __init__(self, num_bits=8, axis=None, unsigned=False, averaging_constant=0.01):
        super().__init__(num_bits, axis, unsigned)
        if not 0 < float(averaging_constant) <= 1:
            raise ValueError(f"averaging_constant must be in (0, 1], got {averaging_constant!r}")
        self._c = float(averaging_constant)
        self.add_state("_calib_amax", None, "custom")
        self.add_state("_num_batches", 0, "custom")

    def _config(self) -> dict:
        cfg = super()._config()
        cfg["averaging_constant"] = self._c
        return cfg

    @property
    def has_data(self) -> bool:
        return self._calib_amax is not None

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        x = self._input(x)
        dims, shape = self._reduce_dims(x)
        amax, nonfinite = finite_absmax(x.detach(), dims, shape)
        self._note_nonfinite(nonfinite)
        if amax is None:
            return
        if self._calib_amax is None:
            self._calib_amax = amax
        else:
            if amax.shape != self._calib_amax.shape:
                raise RuntimeError(f"EMAMaxCalibrator: amax shape changed from {tuple(self._calib_amax.shape)} to "
                                   f"{tuple(amax.shape)} (axis={self._axis})")
            self._calib_amax = self._calib_amax + self._c * (amax.to(self._calib_amax.device) - self._calib_amax)
        self._num_batches += 1

    def compute_amax(self, method=None, **kwargs):
        """The moving average (``method`` and kwargs ignored), None without data."""
        self._check_method(method, kwargs)
        return None if self._calib_amax is None else self._calib_amax.detach().clone()

    def _merge_custom(self, other: "EMAMaxCalibrator") -> None:
        if other._calib_amax is None:
            return
        if self._calib_amax is None:
            self._calib_amax = other._calib_amax.detach().clone()
            self._num_batches = other._num_batches
            return
        if self._calib_amax.shape != other._calib_amax.shape:
            raise ValueError(f"cannot merge amax of shapes {tuple(self._calib_amax.shape)} and "
                             f"{tuple(other._calib_amax.shape)}")
        n1, n2 = self._num_batches, other._num_batches
        self._calib_amax = (self._calib_amax * n1 + other._calib_amax.to(self._calib_amax.device) * n2) / (n1 + n2)
        self._num_batches = n1 + n2

    def _sync_custom(self, process_group) -> None:
        dist = torch.distributed
        meta = None if self._calib_amax is None else tuple(self._calib_amax.shape)
        metas = [m for m in _gather_objects(meta, process_group) if m is not None]
        if not metas:
            return
        if len(set(metas)) != 1:
            raise ValueError(f"cannot sync EMA amax across ranks: shapes differ {metas}")
        dev = _comm_device(self._calib_amax, process_group)
        home = self._calib_amax.device if self._calib_amax is not None else torch.device("cpu")
        n = float(self._num_batches)
        weighted = (self._calib_amax.double().to(dev) * n if self._calib_amax is not None
                    else torch.zeros(metas[0], dtype=torch.float64, device=dev))
        count = torch.tensor([n], dtype=torch.float64, device=dev)
        dist.all_reduce(weighted, group=process_group)
        dist.all_reduce(count, group=process_group)
        self._calib_amax = (weighted / count).float().to(home)
        self._num_batches = int(count.item())
