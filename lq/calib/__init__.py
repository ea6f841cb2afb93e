"""Calibrators (the API of ``pytorch_quantization.calib``) and calibration helpers.

* :class:`MaxCalibrator` — global max of ``|x|`` (per tensor / channel / block).
* :class:`HistogramCalibrator` — histogram of ``|x|`` on the reference toolkit's grid; amax by
  "entropy" (TensorRT KL divergence), "mse" or "percentile", vectorized.
* :class:`EMAMaxCalibrator` — moving average of the per-batch max.
* :class:`MinMaxCalibrator` — min and max for affine (asymmetric) quantization.
* :func:`calibrate_weights` — set weight quantizers' amax from the weights.

Every calibrator has ``collect(x)``, ``reset()``, ``compute_amax(method=None, **kwargs)``,
``merge(other)``, ``sync(process_group=None)``, ``state_dict()`` / ``load_state_dict()``;
``HistogramCalibrator.set_range(amax)`` starts its grid on a range known in advance.
"""

from lq.calib.calibrator import _Calibrator
from lq.calib.ema import EMAMaxCalibrator
from lq.calib.histogram import (
    HistogramCalibrator,
    calibrate_weights,
    compute_amax_entropy,
    compute_amax_mse,
    compute_amax_percentile,
)
from lq.calib.max import MaxCalibrator
from lq.calib.minmax import MinMaxCalibrator

__all__ = [
    "_Calibrator",
    "MaxCalibrator",
    "HistogramCalibrator",
    "EMAMaxCalibrator",
    "MinMaxCalibrator",
    "calibrate_weights",
    "compute_amax_entropy",
    "compute_amax_mse",
    "compute_amax_percentile",
]
