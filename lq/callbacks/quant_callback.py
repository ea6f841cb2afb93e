"""QuantCallback: the whole quantization pipeline in one Lightning callback."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from lq import report
from lq.callbacks.calibrate import QuantCalibrate
from lq.callbacks.distill import QuantDistill
from lq.callbacks.export import QuantExport
from lq.callbacks.export_best import ExportBest
from lq.callbacks.qat import QATSchedule
from lq.callbacks.swap import QuantSwap
from lq.config import CalibConfig, ExportConfig, QATConfig, QuantConfig, coerce
from lq.recipe import default_recipe

CHECKPOINT_KEY = "lq"
FORMAT_VERSION = 1


class QuantCallback(L.Callback):
    """Swap -> calibrate -> quantization-aware training -> ONNX export, configured by four dataclasses.

    ``Trainer(callbacks=[lq.QuantCallback()])`` quantizes any LightningModule:

    0. :class:`QuantDistill` at ``setup``, when ``qat.distill_weight > 0``:
       a frozen FP32 copy of the model becomes the teacher of QAT;
    1. :class:`QuantSwap` at ``setup`` (before checkpoint restore and
       ``configure_optimizers``);
    2. :class:`QuantCalibrate` at ``on_train_start`` (skipped when amax was
       restored), or on the first ``trainer.validate`` for PTQ alone;
    3. :class:`QATSchedule` during training (frozen amax by default, optional
       learned amax, BN/amax freezing, the fine-tuning LR recipe when QAT
       starts from the calibrated model);
    4. :class:`QuantExport` at ``on_fit_end`` on rank zero, of the better of
       the post-training and the QAT model on the validation data
       (:class:`ExportBest`, ``export.export_best``).

    Each part is a callback of its own and can be used alone. Checkpoints get
    an ``"lq"`` entry with the configs, so :func:`lq.load_quantized` rebuilds
    the quantized model without this callback. After calibration, a per-layer
    table goes to the console and the loggers, and calibration histograms go to
    loggers that take images.

    Args:
        quant: which layers and how (:class:`lq.config.QuantConfig` or a recipe subclass); None: the recipe for
            ``export.target`` (``int8_onnxruntime`` for onnxruntime, ``int8_per_channel`` for tensorrt,
            ``int8_openvino`` for openvino;
            ``int8_reduce_range`` for onnxruntime with ``qat.learn_amax``: learned ranges are symmetric).
        calib: calibration (:class:`lq.config.CalibConfig`).
        qat: fine-tuning policy (:class:`lq.config.QATConfig`).
        export: ONNX export (:class:`lq.config.ExportConfig`).
        log_histograms: log calibration histogram figures where a logger takes images.
        verbose: print the per-layer table after calibration.
    """

    def __init__(
        self,
        quant: Optional[QuantConfig] = None,
        calib: Optional[CalibConfig] = None,
        qat: Optional[QATConfig] = None,
        export: Optional[ExportConfig] = None,
        log_histograms: bool = True,
        verbose: bool = True,
    ) -> None:
        self.export = coerce(export, ExportConfig, "QuantCallback.export")
        self.qat = coerce(qat, QATConfig, "QuantCallback.qat")
        # no recipe: the one for where the file will run (lq.recipe.TARGET_RECIPES), symmetric with learned ranges
        self.quant = coerce(quant, QuantConfig, "QuantCallback.quant") if quant is not None else \
            default_recipe(self.export.target, learn_amax=self.qat.learn_amax)
        self.calib = coerce(calib, CalibConfig, "QuantCallback.calib")
        self.log_histograms = log_histograms
        self.verbose = verbose
        self.distill = QuantDistill(self.qat)
        self.swap = QuantSwap(self.quant, learn_amax=self.qat.learn_amax)
        self.calibrate = QuantCalibrate(self.calib)
        self.schedule = QATSchedule(self.qat)
        self.best = ExportBest(self.export.enabled and self.export.export_best and self.qat.enabled,
                               schedule=self.schedule)  # the PTQ score, where the schedule measured it
        self.exporter = QuantExport(self.export, select=self.best.selected)
        self._reported = False

    @property
    def parts(self) -> tuple[L.Callback, ...]:
        return (self.distill, self.swap, self.calibrate, self.schedule, self.best, self.exporter)

    @property
    def state_key(self) -> str:
        return f"QuantCallback[{type(self.quant).__name__}]"

    # ------------------------------------------------------------------ forwarding
    def _each(self, hook: str, *args, **kwargs) -> None:
        for part in self.parts:
            getattr(part, hook)(*args, **kwargs)

    def setup(self, trainer, pl_module, stage):
        self._each("setup", trainer, pl_module, stage)

    def on_train_start(self, trainer, pl_module):
        calibrating = self.calibrate.needs_calibration(pl_module)
        self._each("on_train_start", trainer, pl_module)
        if calibrating:
            self._report(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module):
        self._each("on_train_epoch_start", trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._each("on_train_batch_start", trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._each("on_train_batch_end", trainer, pl_module, outputs, batch, batch_idx)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._each("on_before_optimizer_step", trainer, pl_module, optimizer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._each("on_train_epoch_end", trainer, pl_module)

    def on_validation_start(self, trainer, pl_module):
        self._each("on_validation_start", trainer, pl_module)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._each("on_validation_batch_end", trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_validation_end(self, trainer, pl_module):
        was = self.calibrate._ptq_state is not None
        self._each("on_validation_end", trainer, pl_module)
        if was:
            self._report(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._each("on_train_end", trainer, pl_module)

    def on_fit_end(self, trainer, pl_module):
        self._each("on_fit_end", trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception):
        self._each("on_exception", trainer, pl_module, exception)

    def teardown(self, trainer, pl_module, stage):
        self._each("teardown", trainer, pl_module, stage)

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = self.describe()

    def describe(self) -> dict:
        """What :func:`lq.load_quantized` needs to rebuild the model: the configs."""
        return {
            "version": FORMAT_VERSION,
            "quant": asdict(self.quant),
            "quant_class": type(self.quant).__name__,
            "learn_amax": self.qat.learn_amax,
            "calib": asdict(self.calib),
            "qat": asdict(self.qat),
            "export": asdict(self.export),
            "sample": self.swap.template,
        }

    def state_dict(self) -> dict[str, Any]:
        return {type(p).__name__: p.state_dict() for p in self.parts}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for p in self.parts:
            if type(p).__name__ in state_dict:
                p.load_state_dict(state_dict[type(p).__name__])

    # ------------------------------------------------------------------ reporting
    def _report(self, trainer, pl_module) -> None:
        methods = {}
        from lq import calibration

        qs = calibration.select_quantizers(pl_module)
        try:
            methods = calibration.methods_for(qs, self.calib.method, self.calib.weight_method,
                                              self.calib.method_overrides)
        except ValueError:
            pass
        rows = report.quantizer_rows(pl_module, methods)
        self.summary_rows = rows
        self._print(rows)
        report.log_table(trainer.loggers, rows, step=trainer.global_step)
        if self.log_histograms and any(
            hasattr(getattr(lg, "experiment", None), "add_figure") or hasattr(lg, "log_image")
            for lg in trainer.loggers
        ):
            figs = report.histogram_figures(pl_module, percentile=self.calib.percentile)
            report.log_figures(trainer.loggers, figs, step=trainer.global_step)
            import matplotlib.pyplot as plt

            for _, fig in figs:
                plt.close(fig)

    @rank_zero_only
    def _print(self, rows) -> None:
        if self.verbose:
            report.print_table(rows)
