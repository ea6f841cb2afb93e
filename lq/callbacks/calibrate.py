"""QuantCalibrate: choose activation amax from data before the first training step (or for PTQ alone)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lq import calibration
from lq.config import CalibConfig, coerce


class QuantCalibrate(L.Callback):
    """Calibrate every static quantizer on ``num_batches`` batches of a dataloader.

    * During ``fit``: at ``on_train_start`` (after a checkpoint restore, before
      the first training step), on the train (default) or val dataloader, in
      eval mode under ``no_grad``, with a progress bar on rank zero. Skipped
      when every quantizer already holds amax (e.g. restored from a QAT
      checkpoint) and ``skip_if_calibrated``.
    * Post-training quantization with no training: ``trainer.validate(model,
      datamodule)`` calibrates on the validation batches when the model is not
      calibrated yet (that run's metrics are floating point); a second
      ``validate``/``test`` evaluates the quantized model.
    * Under DDP every rank collects its own shard and the statistics are
      reduced across ranks, so every rank ends with the same amax.

    Args:
        calib: :class:`lq.config.CalibConfig` (method, num_batches, dataloader, ...).
        forward: ``forward(module, batch)`` used to run a batch; default:
            the module's ``calibration_step(batch)`` if it has one, else
            ``module(batch[0])`` for tuple batches (see :func:`lq.calibration.default_forward`).
    """

    def __init__(self, calib: Optional[CalibConfig] = None,
                 forward: Optional[Callable[[torch.nn.Module, Any], Any]] = None) -> None:
        self.calib = coerce(calib, CalibConfig, "QuantCalibrate.calib")
        self.forward = forward or calibration.default_forward
        self.calibrated = False
        self.last_amax: dict = {}
        self.block_choices: list = []  # what calib.block_method chose per block-quantized layer
        self._ptq_state: Optional[dict] = None

    # ------------------------------------------------------------------ fit
    def needs_calibration(self, pl_module) -> bool:
        if not self.calib.enabled or self.calibrated:
            return False
        todo = calibration.select_quantizers(pl_module, include_calibrated=False)
        if not todo:
            return False  # restored from a checkpoint, or already calibrated in an earlier fit
        return True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.needs_calibration(pl_module):
            if self.calib.enabled and self.calib.skip_if_calibrated:
                rank_zero_info("lq: every quantizer already holds amax (restored or calibrated): calibration skipped")
            return
        loader = self._dataloader(trainer)
        self.run(trainer, pl_module, loader)

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule, loader) -> dict:
        """Calibrate ``pl_module`` on ``loader`` now (batches moved with the strategy's device hooks)."""
        c = self.calib

        plugin = trainer.strategy.precision_plugin

        def fwd(module, batch):
            # the same device move, input conversion (bf16-true, 16-true ...) and autocast as a training step
            batch = plugin.convert_input(trainer.strategy.batch_to_device(batch))
            with plugin.forward_context():
                return self.forward(module, batch)

        self.last_amax = calibration.calibrate_model(
            pl_module, loader, forward=fwd, only_uncalibrated=c.skip_if_calibrated, progress=self._progress(trainer),
            **c.calibrate_kwargs())
        self.block_choices = list(self.last_amax.block_choices)
        self.calibrated = True
        rank_zero_info(f"lq: calibrated {len(self.last_amax)} quantizer(s) with method={c.method}")
        return self.last_amax

    def _dataloader(self, trainer: L.Trainer):
        if self.calib.dataloader == "train":
            loader = trainer.train_dataloader
            if loader is None:
                trainer.fit_loop.setup_data()
                loader = trainer.train_dataloader
        else:
            val_loop = trainer.fit_loop.epoch_loop.val_loop
            val_loop.setup_data()
            loader = trainer.val_dataloaders
            if isinstance(loader, (list, tuple)):
                loader = loader[0] if loader else None
        if loader is None:
            raise calibration.CalibrationError(
                f"no {self.calib.dataloader} dataloader to calibrate on: give the Trainer/datamodule one, "
                f"or set calib.dataloader to {'val' if self.calib.dataloader == 'train' else 'train'}"
            )
        return loader

    @staticmethod
    def _progress(trainer: L.Trainer):
        """Lightning's own bar on rank zero (:func:`lq.progress.lightning_reporter`); nothing where it shows none."""
        from lq import progress

        return progress.lightning_reporter(trainer) or False

    # ------------------------------------------------------------------ PTQ through trainer.validate
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != "validate" or not self.needs_calibration(pl_module):
            return
        quantizers = calibration.select_quantizers(pl_module, include_calibrated=not self.calib.skip_if_calibrated)
        methods = calibration.methods_for(quantizers, self.calib.method, self.calib.weight_method,
                                          self.calib.method_overrides)
        from lq import calib as calib_mod

        for name, q in quantizers:
            kind = calibration.calibrator_kind(methods[name])
            q.calibrator = (calib_mod.HistogramCalibrator(q.num_bits, q.axis, q.unsigned, num_bins=self.calib.num_bins,
                                                          signed_range=q.asymmetric)
                            if kind == "histogram" else "max")
            q.calibrator.reset()
            q.disable_quant()
            q.enable_calib()
        self._ptq_state = {"quantizers": quantizers, "methods": methods, "seen": 0, "selection": []}
        rank_zero_info("lq: calibrating on this validation run (its metrics are floating point); "
                       "validate again for the quantized metrics")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        st = self._ptq_state
        if st is None:
            return
        st["seen"] += 1
        from lq import auto_calib

        if "auto" in st["methods"].values() and len(st["selection"]) < auto_calib.CHECK_BATCHES:
            st["selection"].append(batch)  # what method "auto" compares the model on afterwards (and checks)
        if st["seen"] >= self.calib.num_batches:
            for _, q in st["quantizers"]:
                q.disable_calib()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        st, self._ptq_state = self._ptq_state, None
        if st is None:
            return
        for _, q in st["quantizers"]:
            q.disable_calib()
            q.enable_quant()
        if calibration.global_count(st["seen"]) == 0:
            raise calibration.CalibrationError("the validation dataloader produced no batches to calibrate on")
        calibration.sync(st["quantizers"])
        st["quantizers"] = calibration.without_unused_layers(st["quantizers"], strict=True)
        # validate() runs under inference_mode: amax made there could never be saved for backward
        # later (QAT, a learned amax), so it is computed as ordinary tensors.
        with torch.inference_mode(False), torch.no_grad():
            self.last_amax = calibration.load_amax(st["quantizers"], st["methods"], percentile=self.calib.percentile)
            if st["selection"]:
                from lq import auto_calib

                selection = [trainer.strategy.batch_to_device(_clone(b)) for b in st["selection"]]
                auto_calib.choose(pl_module, st["quantizers"], st["methods"], selection[:auto_calib.SELECTION_BATCHES],
                                  self.forward, check=selection)
                self.last_amax = {n: q.amax for n, q in st["quantizers"] if n in self.last_amax}
        self.calibrated = True
        rank_zero_info(f"lq: calibrated {len(self.last_amax)} quantizer(s) with method={self.calib.method}")

    def on_exception(self, trainer, pl_module, exception) -> None:
        st, self._ptq_state = self._ptq_state, None
        if st is not None:
            for _, q in st["quantizers"]:
                q.disable_calib()
                q.enable_quant()
            rank_zero_warn("lq: calibration interrupted; quantizers left uncalibrated")

    def state_dict(self) -> dict:
        return {"calibrated": self.calibrated, "method": self.calib.method}

    def load_state_dict(self, state_dict: dict) -> None:
        self.calibrated = bool(state_dict.get("calibrated", False))


def _clone(batch):
    """A batch made under inference mode, as ordinary tensors (the ``auto`` search runs outside it)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, (list, tuple)):
        return type(batch)(_clone(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _clone(v) for k, v in batch.items()}
    return batch
