"""Affine min/max calibrator (asymmetric activations, used with ``fake_affine_tensor_quant``)."""

from __future__ import annotations

import torch

from lq.calib.calibrator import _Calibrator, finite_minmax

__all__ = ["MinMaxCalibrator"]


class MinMaxCalibrator(_Calibrator):
    """Tracks the minimum and maximum finite values (like ``torch.ao``'s MinMaxObserver).

    ``compute_range()`` returns ``(min_range, max_range)`` with 0 always inside
    the range (so the zero point is an integer of the grid and exact zeros
    stay exact). A :class:`~lq.nn.TensorQuantizer` given this calibrator
    (``TensorQuantizer(desc, calibrator="minmax")``) becomes affine on
    ``load_calib_amax()``: it stores ``_min_range`` / ``_max_range`` buffers and
    quantizes with ``fake_affine_tensor_quant``. ``compute_amax()`` returns
    ``max(|min|, |max|)`` (what a symmetric quantizer would use).

    Args:
        averaging_constant: None for the running min/max; a value in (0, 1] for
            a moving average of the per-batch min/max (MovingAverageMinMaxObserver).
    """

    def __init__(self, num_bits=8, axis=None, unsigned=False, averaging_constant=None):
        super().__init__(num_bits, axis, unsigned)
        if averaging_constant is not None and not 0 < float(averaging_constant) <= 1:
            raise ValueError(f"averaging_constant must be None or in (0, 1], got {averaging_constant!r}")
        self._c = None if averaging_constant is None else float(averaging_constant)
        fx = "min" if self._c is None else "custom"
        self.add_state("_calib_min", None, fx)
        self.add_state("_calib_max", None, "max" if self._c is None else "custom")
        self.add_state("_num_batches", 0, "sum" if self._c is None else "custom")

    def _config(self) -> dict:
        cfg = super()._config()
        cfg["averaging_constant"] = self._c
        return cfg

    @property
    def has_data(self) -> bool:
        return self._calib_min is not None

    def _batch_minmax(self, x):
        dims, shape = self._reduce_dims(x)
        return finite_minmax(x, dims, shape)

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        x = self._input(x)
        if x.numel() == 0:
            return
        lo, hi, count = self._batch_minmax(x)
        self._note_nonfinite(count)
        if self._calib_min is None:
            self._calib_min, self._calib_max = lo, hi
        else:
            if lo.shape != self._calib_min.shape:
                raise RuntimeError(f"MinMaxCalibrator: shape changed from {tuple(self._calib_min.shape)} to "
                                   f"{tuple(lo.shape)} (axis={self._axis})")
            dev = self._calib_min.device
            lo, hi = lo.to(dev), hi.to(dev)
            if self._c is None:
                self._calib_min = torch.minimum(self._calib_min, lo)
                self._calib_max = torch.maximum(self._calib_max, hi)
            else:
                self._calib_min = self._calib_min + self._c * (lo - self._calib_min)
                self._calib_max = self._calib_max + self._c * (hi - self._calib_max)
        self._num_batches += 1

    def compute_range(self):
        """``(min_range, max_range)`` float32 tensors with ``min_range <= 0 <= max_range``; None without data."""
        if self._calib_min is None:
            return None
        lo = torch.minimum(self._calib_min, torch.zeros_like(self._calib_min))
        hi = torch.maximum(self._calib_max, torch.zeros_like(self._calib_max))
        return lo.clone(), hi.clone()

    def compute_amax(self, method=None, **kwargs):
        """``max(|min|, |max|)`` (method and kwargs ignored), None without data."""
        self._check_method(method, kwargs)
        r = self.compute_range()
        if r is None:
            return None
        return torch.maximum(-r[0], r[1])

    def _merge_custom(self, other: "MinMaxCalibrator") -> None:
        if self._c is None or other._calib_min is None:
            return
        if self._calib_min is None:
            self._calib_min = other._calib_min.clone()
            self._calib_max = other._calib_max.clone()
            self._num_batches = other._num_batches
            return
        n1, n2 = self._num_batches, other._num_batches
        dev = self._calib_min.device
        self._calib_min = (self._calib_min * n1 + other._calib_min.to(dev) * n2) / (n1 + n2)
        self._calib_max = (self._calib_max * n1 + other._calib_max.to(dev) * n2) / (n1 + n2)
        self._num_batches = n1 + n2

    def _sync_custom(self, process_group) -> None:
        if self._c is None:
            return
        from lq.calib.calibrator import _comm_device, _gather_objects

        dist = torch.distributed
        meta = None if self._calib_min is None else tuple(self._calib_min.shape)
        metas = [m for m in _gather_objects(meta, process_group) if m is not None]
        if not metas:
            return
        dev = _comm_device(self._calib_min, process_group)
        home = self._calib_min.device if self._calib_min is not None else torch.device("cpu")
        n = float(self._num_batches)
        zeros = torch.zeros(metas[0], dtype=torch.float64, device=dev)
        wlo = self._calib_min.double().to(dev) * n if self._calib_min is not None else zeros.clone()
        whi = self._calib_max.double().to(dev) * n if self._calib_max is not None else zeros.clone()
        count = torch.tensor([n], dtype=torch.float64, device=dev)
        for t in (wlo, whi, count):
            dist.all_reduce(t, group=process_group)
        self._calib_min = (wlo / count).float().to(home)
        self._calib_max = (whi / count).float().to(home)
        self._num_batches = int(count.item())
