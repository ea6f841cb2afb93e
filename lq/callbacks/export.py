"""QuantExport: write the INT8 (Q/DQ) ONNX model at the end of ``fit`` and check it in onnxruntime."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, ContextManager, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from lq.config import ExportConfig, coerce
from lq.export.timing._speed import BATCH_ONE_SLOWER


class ExportFailed(RuntimeError):
    """ONNX export or its verification failed; the message says what to fix and where the weights are."""


def first_input(batch: Any) -> Any:
    """The model input of a batch: the first element of a tuple/list batch, else the batch."""
    return batch[0] if isinstance(batch, (list, tuple)) else batch


class QuantExport(L.Callback):
    """Export the quantized model to ONNX with QuantizeLinear/DequantizeLinear at ``on_fit_end``.

    On rank zero only, on a deep copy (the trained module is not touched, so
    ``trainer.test(ckpt_path=...)`` and further training still work): BatchNorm
    folded, Q/DQ placed for onnxruntime/TensorRT INT8 kernels, ``onnx.checker``,
    then onnxruntime on a sample batch, judged against PyTorch in output
    quantization steps and top-1 agreement (or ``tolerance``, when set). Before exporting, the weights are
    saved to a checkpoint unless a ModelCheckpoint already holds them, so an
    export error never loses training; the error names that checkpoint.

    Args:
        export: :class:`lq.config.ExportConfig`.
        sample_input: ``(trainer, pl_module) -> tensor`` giving the example input;
            default: the first batch of the val (else train) dataloader.
        select: ``(trainer, pl_module, checkpoint path) -> context manager`` giving the module to export, entered
            on every rank after the weights are saved (:meth:`lq.callbacks.export_best.ExportBest.selected`);
            default: ``pl_module``.
    """

    def __init__(self, export: Optional[ExportConfig] = None,
                 sample_input: Optional[Callable[[L.Trainer, L.LightningModule], Any]] = None,
                 select: Optional[Callable[..., ContextManager[L.LightningModule]]] = None) -> None:
        self.export = coerce(export, ExportConfig, "QuantExport.export")
        self.sample_input = sample_input
        self.select = select
        self.result: Any = None
        self.path: Optional[str] = None

    def resolve_path(self, trainer: L.Trainer) -> str:
        p = self.export.path
        return p if os.path.isabs(p) else os.path.join(trainer.default_root_dir, p)

    def _sample(self, trainer: L.Trainer, pl_module: L.LightningModule):
        if self.sample_input is not None:
            return self.sample_input(trainer, pl_module)
        loaders = []
        try:
            val = trainer.val_dataloaders
            loaders += list(val) if isinstance(val, (list, tuple)) else [val]
        except Exception:  # noqa: BLE001 - no val loader configured
            pass
        loaders.append(trainer.train_dataloader)
        for loader in loaders:
            if loader is None:
                continue
            for batch in loader:
                from lq.calibration import sample_inputs

                return sample_inputs(pl_module, batch)  # the batch-to-call rule calibration uses
        raise ExportFailed("no dataloader batch to trace the export with: pass QuantExport(sample_input=...)")

    def _safe_checkpoint(self, trainer: L.Trainer) -> Optional[str]:
        ckpt = trainer.checkpoint_callback
        for attr in ("last_model_path", "best_model_path"):
            p = getattr(ckpt, attr, "") if ckpt is not None else ""
            if p and os.path.exists(p):
                return p
        path = os.path.join(trainer.default_root_dir, "lq_before_export.ckpt")
        trainer.save_checkpoint(path)
        return path

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.export.enabled:
            return
        ckpt = self._safe_checkpoint(trainer)  # collective under DDP: every rank calls it
        with (self.select(trainer, pl_module, ckpt) if self.select else contextlib.nullcontext(pl_module)) as module:
            if trainer.is_global_zero:
                self.result = self.run(trainer, module, ckpt)
            trainer.strategy.barrier("lq_export")

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule, ckpt: Optional[str] = None):
        from lq import progress
        from lq.export import SlowerThanFP32Warning, export_onnx

        path = self.resolve_path(trainer)
        e = self.export
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            sample = self._sample(trainer, pl_module)
            sample = sample.to(pl_module.device) if isinstance(sample, torch.Tensor) else sample
            with warnings.catch_warnings():  # a slower file is said once, below, as a Lightning warning
                warnings.simplefilter("ignore", SlowerThanFP32Warning)
                result = export_onnx(pl_module, sample, path, config=e,
                                     progress=progress.lightning_reporter(trainer) or False)
        except Exception as err:
            where = f" The trained weights are safe in {ckpt}." if ckpt else ""
            raise ExportFailed(f"ONNX export to {path} failed: {str(err).rstrip('. ')}.{where}") from err
        self.path = path
        self._report(result)
        return result

    @rank_zero_only
    def _report(self, result) -> None:
        diff = getattr(result, "max_abs_diff", None)
        msg = f"lq: exported {self.path}"
        if diff is not None:
            tol = getattr(result, "tolerance", self.export.tolerance)
            steps = "; ".join(c.text() for c in getattr(result, "output_checks", []))
            runtime = getattr(result, "runtime", "onnxruntime")
            msg += f" ({runtime} vs PyTorch max |diff| = {diff:.3g}" + (
                f", tolerance {tol:.3g})" if tol is not None else f"; {steps})" if steps else ")")
        speed = getattr(result, "speedup", None)
        if getattr(result, "speed_check", None) is not None:  # the ratio, the two times, and any noise
            msg += f"; {result.speed_check}"
        rank_zero_info(msg)
        if getattr(result, "layer_kernels", None):
            from lq import report

            report.print_rich(report.kernel_table(result))
        for w in getattr(result, "warnings", []):  # layers left float, re-encoded weights, opset ...
            slower = (speed is not None and speed < 1.0 and w.startswith("the INT8 file runs at")) or \
                w.startswith(BATCH_ONE_SLOWER)
            notes = [r.note() for r in (getattr(result, "fallback", None), getattr(result, "batch1_fallback", None))
                     if r is not None]
            if slower or w in notes:
                # the INT8 file is slower than FP32, or layers went back to float in it: nobody should miss that
                rank_zero_warn(f"lq export: {w}")
            else:
                rank_zero_info(f"lq export: {w}")

    def state_dict(self) -> dict:
        return {"path": self.path}

    def load_state_dict(self, state_dict: dict) -> None:
        self.path = state_dict.get("path")
