"""Lightning callbacks: the full pipeline (:class:`QuantCallback`) and its parts, each usable alone."""

from lq.callbacks.calibrate import QuantCalibrate
from lq.callbacks.distill import QuantDistill
from lq.callbacks.export import ExportFailed, QuantExport
from lq.callbacks.export_best import ExportBest
from lq.callbacks.qat import QATSchedule
from lq.callbacks.quant_callback import QuantCallback
from lq.callbacks.swap import QuantSwap

__all__ = ["QuantCallback", "QuantSwap", "QuantCalibrate", "QATSchedule", "QuantDistill", "QuantExport", "ExportBest", "ExportFailed"]
