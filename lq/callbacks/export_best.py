"""ExportBest: after QAT, export whichever of the post-training and the QAT model scores better on validation data.

QAT can end worse than the calibrated model it started from (an LR too high for fine-tuning, too few steps, a
loss that does not match the metric); exporting it anyway ships the worse file without a word. ``lq-train``
guards against that with its own comparison (:mod:`lq.pipeline`); this is the same guard for
``Trainer(callbacks=[lq.QuantCallback()])``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lq.callbacks._val_score import Score, top1
from lq.callbacks.qat import QATSchedule, _calibrated

#: what the PTQ model's checkpoint is called, beside the run's other files (as lq-train names it)
PTQ_CHECKPOINT = "ptq.ckpt"


class ExportBest(L.Callback):
    """Keep the calibrated model's state at the first QAT step; at the export, score it and the trained model.

    The score is top-1 accuracy on the validation batches (:mod:`lq.callbacks._val_score`: ``(inputs, class
    targets)`` batches of a classifier; every rank scores its shard and the counts are summed, so every rank takes
    the same decision); the PTQ model's is the one :class:`QATSchedule` measured at the first step where it did. Where the QAT model scores
    lower, :meth:`selected` lends the export the module with the PTQ state loaded, gives the module its QAT state
    back afterwards, and writes the PTQ state as a checkpoint of its own (``ptq.ckpt`` in ``default_root_dir``,
    loadable with :func:`lq.load_quantized`); the QAT weights stay in the module and in the checkpoint the export
    saved first. Validation batches that are not ``(inputs, class targets)`` of a classifier: no comparison (said
    once), the QAT model is exported.

    The PTQ state is held in host memory (one copy of the module's state), not in checkpoints: a fit resumed
    from a checkpoint has no PTQ model to compare with, and exports QAT's.
    """

    def __init__(self, enabled: bool = True, schedule: Optional[QATSchedule] = None) -> None:
        self.enabled = enabled
        self.schedule = schedule  # its start_score: the PTQ model's, where ``lr_policy=auto`` measured it
        self.ptq_state: Optional[dict] = None
        self.scores: Optional[dict] = None  # {"ptq": accuracy, "qat": accuracy} once compared
        self.chosen: Optional[str] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled and trainer.global_step == 0 and _calibrated(pl_module):
            self.ptq_state = {k: v.detach().to("cpu", copy=True) for k, v in pl_module.state_dict().items()}

    @contextlib.contextmanager
    def selected(self, trainer: L.Trainer, pl_module: L.LightningModule,
                 ckpt: Optional[str] = None) -> Iterator[L.LightningModule]:
        """The module to export, holding the better of the two states; the QAT state is back in it on exit
        (error or not). ``ckpt``: the checkpoint of the QAT model the export saved, the PTQ one is written from."""
        if self.ptq_state is None:
            yield pl_module
            return
        ptq_state, self.ptq_state = self.ptq_state, None
        qat = top1(trainer, pl_module)
        if qat is None:
            rank_zero_info("lq: the QAT model is exported without comparing it with the post-training one: that "
                           "needs validation batches of (inputs, class targets) and a classifier's logits")
            self.chosen = "qat"
            yield pl_module
            return
        qat_state: Optional[dict] = None  # the module's QAT state, kept on the host while PTQ's is loaded

        def load_ptq() -> None:
            nonlocal qat_state
            if qat_state is None:
                qat_state = {k: v.detach().to("cpu", copy=True) for k, v in pl_module.state_dict().items()}
                pl_module.load_state_dict(ptq_state)

        try:
            ptq: Optional[Score] = getattr(self.schedule, "start_score", None)
            if ptq is None:  # not measured at the first step: the PTQ state scored now
                load_ptq()
                ptq = top1(trainer, pl_module)
            ptq, qat = ptq.top1, qat.top1
            self.scores = {"ptq": ptq, "qat": qat}
            said = f"QAT {100 * qat:.2f}% vs post-training {100 * ptq:.2f}% top-1 on the validation data"
            if qat >= ptq:
                self.chosen = "qat"
                if qat_state is not None:  # PTQ's state was loaded to score it
                    pl_module.load_state_dict(qat_state)
                    qat_state = None
                rank_zero_info(f"lq: {said}: the QAT model is exported")
            else:
                self.chosen = "ptq"
                load_ptq()
                where = self._save_ptq(trainer, ckpt, ptq_state)
                rank_zero_warn(f"lq: QAT ended less accurate than post-training ({said}): the post-training model is "
                               f"exported{f' (its checkpoint: {where})' if where else ''}; the QAT weights stay in "
                               "the module (export.export_best=false exports them)")
            yield pl_module
        finally:
            if qat_state is not None:  # the module keeps what QAT trained, whatever was exported
                pl_module.load_state_dict(qat_state)

    @staticmethod
    def _save_ptq(trainer: L.Trainer, ckpt: Optional[str], state: dict) -> Optional[str]:
        if not ckpt or not trainer.is_global_zero:
            return None
        from lq.checkpoint import save_with_weights

        path = os.path.join(trainer.default_root_dir, PTQ_CHECKPOINT)
        save_with_weights(ckpt, state, path)
        return path


__all__ = ["ExportBest", "PTQ_CHECKPOINT"]
