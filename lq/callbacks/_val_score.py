"""Top-1 accuracy of the LightningModule on the validation batches: what QAT's LR policy and the PTQ-vs-QAT export
choice are decided by.

Only classifiers are scored: ``(inputs, class targets)`` batches and ``(batch, classes)`` logits. Anything else
scores None and the callers keep their safe default. Every rank scores its shard and the counts are summed, so
every rank takes the same decision. The batches are those Lightning's validation loop runs (``limit_val_batches``
counts).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional

import lightning as L
import torch

#: top-1 this far above the most frequent class's share: the model has learned something (is trained)
LEARNED_MARGIN = 0.1


@dataclass(frozen=True)
class Score:
    top1: float
    chance: float  # the most frequent class's share of the targets: what a model that learned nothing scores

    @property
    def learned(self) -> bool:
        """Whether the model does better than predicting the most frequent class (by :data:`LEARNED_MARGIN`)."""
        return self.top1 >= self.chance + LEARNED_MARGIN


def val_batches(trainer: L.Trainer):
    """The validation loader and how many of its batches the validation loop runs (None: no loader, or none run)."""
    loop = trainer.fit_loop.epoch_loop.val_loop
    try:
        if trainer.val_dataloaders is None:
            loop.setup_data()
        loader = trainer.val_dataloaders
    except Exception:  # noqa: BLE001 - no val loader configured
        return None, 0
    if isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    counts = getattr(trainer, "num_val_batches", None) or []
    limit = counts[0] if counts else math.inf
    return (loader, limit) if loader is not None and limit > 0 else (None, 0)


@torch.no_grad()
def top1(trainer: L.Trainer, module: L.LightningModule) -> Optional[Score]:
    """``module``'s top-1 accuracy on the validation batches in eval mode (its mode restored); None where there are
    none or they are not a classifier's."""
    loader, limit = val_batches(trainer)
    if loader is None:
        return None
    plugin = trainer.strategy.precision_plugin
    was = module.training
    module.eval()
    correct = torch.zeros((), dtype=torch.float64, device=module.device)
    per_class: Optional[torch.Tensor] = None
    try:
        for batch in itertools.islice(loader, None if math.isinf(limit) else int(limit)):
            if not (isinstance(batch, (list, tuple)) and len(batch) >= 2):
                return None
            batch = plugin.convert_input(trainer.strategy.batch_to_device(batch))
            x, y = batch[0], batch[1]
            if not (isinstance(y, torch.Tensor) and y.dim() == 1 and not y.is_floating_point()):
                return None
            with plugin.forward_context():
                out = module(x)
            if not (isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == y.shape[0] and out.shape[1] > 1):
                return None  # not one row of class logits per target
            correct += (out.argmax(1) == y).sum()
            seen = torch.bincount(y.long().clamp(0, out.shape[1] - 1), minlength=out.shape[1]).double()
            per_class = seen if per_class is None else per_class + seen
    finally:
        module.train(was)
    if per_class is None:
        return None
    counts = trainer.strategy.reduce(torch.cat([correct.reshape(1), per_class]), reduce_op="sum")
    total = float(counts[1:].sum())
    return Score(float(counts[0]) / total, float(counts[1:].max()) / total) if total > 0 else None


__all__ = ["Score", "top1", "val_batches", "LEARNED_MARGIN"]
