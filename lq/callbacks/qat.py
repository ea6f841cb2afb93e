"""QATSchedule: the quantization-aware fine-tuning policy (frozen/learned amax, BN freezing, LR recipe)."""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import lightning as L
from torch import nn

from lq.config import QATConfig, coerce
from lq.nn.modules.tensor_quantizer import iter_quantizers

EpochRule = Union[int, Callable[[int], bool], None]


def _due(rule: EpochRule, epoch: int) -> bool:
    """An int means "from this epoch on"; a callable decides per epoch (like ModelPruning's ``amount``)."""
    if rule is None:
        return False
    if callable(rule):
        return bool(rule(epoch))
    return epoch >= rule


def _calibrated(module: nn.Module) -> bool:
    """Every enabled static quantizer that does not learn its amax holds one (and there is one): the model was
    calibrated before this fit, so QAT fine-tunes it."""
    fixed = [q for _, q in iter_quantizers(module) if q.is_enabled and not q.dynamic and not q.learn_amax]
    return bool(fixed) and all(q.amax is not None for q in fixed)


def _bn_modules(module: nn.Module):
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class QATSchedule(L.Callback):
    """Quantization-aware training policy.

    * amax stays frozen (a buffer: the scale must not drift every step) unless
      inputs were swapped with learned amax (``QuantSwap(learn_amax=True)``);
      learned amax stops changing once ``freeze_amax_epoch`` is due.
    * BatchNorm statistics are frozen (BN layers kept in eval mode) once
      ``freeze_bn_epoch`` is due.
    * ``lr_policy="cosine"``: the reference toolkit's fine-tuning recipe: every
      param group of every optimizer starts at ``lr_start_fraction`` of its
      configured LR and follows half a cosine down to ``lr_end_fraction`` of
      that over the remaining steps of the fit. It sets the LR directly at each
      step, so it works with any optimizer the module configures (and overrides
      the module's own schedulers while active).
    * ``lr_policy="auto"`` (the default) takes that recipe when the fit starts
      from a calibrated, trained model: every static, not learned, quantizer
      holds an amax at the first step, and the model's top-1 on the validation
      batches beats the most frequent class by 10 points
      (:mod:`lq.callbacks._val_score`). QAT then fine-tunes trained weights
      with an LR that was chosen to train them from scratch: at full LR it
      undoes what training did. Uncalibrated quantizers or a model at chance
      (training from scratch with quantizers on) keep the module's own
      schedule. Where the batches are not a classifier's, the recipe too (QAT
      usually starts from a trained model; ``none`` says otherwise). The choice
      is said once and kept by checkpoints, so a resumed fit goes on with it.
    * Logs ``lq/amax_drift/<quantizer>``: relative change of every static amax
      since training started.
    * A step whose gradients are not finite (a NaN/Inf batch, an overflow) is
      skipped rather than written into the weights and learned amax: its
      gradients are zeroed, the step runs with LR 0, the BatchNorm statistics
      it changed are put back, and one warning names the step and the
      quantizers whose amax gradient was not finite. Without this a single bad
      batch made a learned amax NaN and ended the run with nothing saved.

    Args:
        qat: :class:`lq.config.QATConfig`.
        freeze_bn_epoch / freeze_amax_epoch: override the config with an int or
            a callable ``epoch -> bool`` (Python API only).
    """

    def __init__(self, qat: Optional[QATConfig] = None, freeze_bn_epoch: EpochRule = None,
                 freeze_amax_epoch: EpochRule = None) -> None:
        self.qat = coerce(qat, QATConfig, "QATSchedule.qat")
        self.freeze_bn_rule: EpochRule = freeze_bn_epoch if freeze_bn_epoch is not None else self.qat.freeze_bn_epoch
        self.freeze_amax_rule: EpochRule = (
            freeze_amax_epoch if freeze_amax_epoch is not None else self.qat.freeze_amax_epoch
        )
        self.base_lrs: Optional[list] = None
        self.policy: Optional[str] = None  # the LR policy this fit runs (``auto`` resolved at its first step)
        self.start_score = None  # auto: the calibrated model's validation score at the first step (lq.callbacks._val_score)
        self.amax_start: dict = {}
        self._bn_frozen = False
        self._amax_frozen = False

    # ------------------------------------------------------------------ start
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.qat.enabled:
            for _, q in iter_quantizers(pl_module):
                q.disable_quant()
            return
        if self.policy is None:
            self.policy = self.resolve_policy(trainer, pl_module)
        else:  # kept from a checkpoint or an earlier fit: no score of this fit's starting model
            self.start_score = None
        if self.policy == "cosine":
            if self.base_lrs is None:
                self.base_lrs = [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers]
            # The recipe owns the LR while it runs: the module's own schedulers are set aside
            # (and given back at on_train_end) so they cannot step over it.
            self._set_aside = list(trainer.strategy.lr_scheduler_configs)
            trainer.strategy.lr_scheduler_configs = []
        if not self.amax_start:
            self.amax_start = {n: q.amax.detach().clone() for n, q in iter_quantizers(pl_module) if q.amax is not None}

    def resolve_policy(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        """``lr_policy``, with ``auto`` decided (see the class docstring) and said once."""
        if self.qat.lr_policy != "auto":
            return self.qat.lr_policy
        if self.base_lrs is not None:  # a checkpoint of a fit that ran the recipe, written before policies were kept
            return "cosine"
        from lightning.pytorch.utilities import rank_zero_info

        own = "qat.lr_policy=auto; 'cosine' fine-tunes at a fraction of it"
        if trainer.global_step > 0 or not _calibrated(pl_module):
            rank_zero_info(f"lq: QAT starts from uncalibrated quantizers: it trains with the module's own LR ({own})")
            return "none"
        from lq.callbacks._val_score import top1

        self.start_score = score = top1(trainer, pl_module)
        if score is None:  # QAT's usual start is a trained model: fine-tuning it at full LR undoes the training
            rank_zero_info(
                "lq: QAT fine-tunes the calibrated model at {:g} of the configured LR, cosine-annealed: whether it was "
                "trained could not be told (no validation batches of (inputs, class targets)); qat.lr_policy=none "
                "keeps the module's own schedule (training from scratch)".format(self.qat.lr_start_fraction))
            return "cosine"
        said = f"{100 * score.top1:.1f}% top-1 on the validation data, the most frequent class {100 * score.chance:.1f}%"
        if score.learned:
            rank_zero_info(f"lq: QAT fine-tunes the trained, calibrated model ({said}): its LR starts at "
                           f"{self.qat.lr_start_fraction:g} of the configured one and cosine-anneals "
                           "(qat.lr_policy=auto; 'none' keeps the module's own schedule)")
            return "cosine"
        rank_zero_info(f"lq: QAT trains the model from scratch ({said}) with the module's own LR ({own})")
        return "none"

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch
        self._bn_frozen = _due(self.freeze_bn_rule, epoch)
        if _due(self.freeze_amax_rule, epoch) and not self._amax_frozen:
            for _, q in iter_quantizers(pl_module):
                if q.learn_amax:
                    q.disable_clip()  # learned amax: requires_grad off, value kept
            self._amax_frozen = True
        self._apply_bn(pl_module)

    def _apply_bn(self, pl_module) -> None:
        if self._bn_frozen:
            for bn in _bn_modules(pl_module):
                bn.eval()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(self, "_set_aside", None) is not None:
            trainer.strategy.lr_scheduler_configs = self._set_aside
            self._set_aside = None

    # ------------------------------------------------------------------ every step
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._apply_bn(pl_module)  # Lightning may have put the module back in train mode after validation
        self._remember_bn(pl_module)
        if self.base_lrs is not None:
            total = max(1, trainer.estimated_stepping_batches)
            progress = min(1.0, trainer.global_step / total)
            for opt, lrs in zip(trainer.optimizers, self.base_lrs):
                for group, lr in zip(opt.param_groups, lrs):
                    group["lr"] = self.lr_at(lr, progress)

    def lr_at(self, base_lr: float, progress: float) -> float:
        """LR of the cosine recipe at ``progress`` in [0, 1] of the fine-tuning run."""
        start = base_lr * self.qat.lr_start_fraction
        end = start * self.qat.lr_end_fraction
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))

    # ------------------------------------------------------------------ non-finite steps
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        saved, self._skipped_lrs = getattr(self, "_skipped_lrs", None), None
        if saved is not None:  # the skipped step ran at LR 0: give the groups their LR back
            for opt, lrs in zip(trainer.optimizers, saved):
                for group, lr in zip(opt.param_groups, lrs):
                    group["lr"] = lr
            for buf, value in getattr(self, "_bn_saved", []):
                buf.copy_(value)
        self._bn_saved = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        import torch

        params = [(n, p) for n, p in pl_module.named_parameters() if p.grad is not None]
        if not params:
            return
        finite = [torch.isfinite(p.grad).all() for _, p in params]
        if bool(torch.stack([f.to(finite[0].device) for f in finite]).all()):  # one host sync per step
            return
        bad = [n for (n, _), ok in zip(params, finite) if not bool(ok)]
        bad_amax = [n for n, q in iter_quantizers(pl_module) if q.learn_amax and isinstance(q.amax, torch.Tensor)
                    and q.amax.grad is not None and not torch.isfinite(q.amax.grad).all()]
        for _, p in params:
            p.grad.zero_()
        self._skipped_lrs = [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers]
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                group["lr"] = 0.0
        self._bn_saved = getattr(self, "_bn_before", [])
        self.skipped_steps = getattr(self, "skipped_steps", 0) + 1
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            f"lq: step {trainer.global_step} (epoch {trainer.current_epoch}, batch of this epoch "
            f"{trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1}) produced non-finite gradients in "
            f"{len(bad)} parameter(s) ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})"
            + (f", among them the learned amax of {', '.join(bad_amax)}" if bad_amax else "")
            + "; the step was skipped (weights, amax and BatchNorm statistics kept). Check the data for NaN/Inf, "
            "or lower the learning rate / clip gradients (Trainer(gradient_clip_val=...)).")

    def _remember_bn(self, pl_module) -> None:
        """The BatchNorm running statistics before this step's forward (a NaN batch writes NaN into them)."""
        self._bn_before = [(b, b.detach().clone()) for bn in _bn_modules(pl_module) if bn.training
                           for b in (bn.running_mean, bn.running_var) if b is not None]

    # ------------------------------------------------------------------ logging
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.amax_start:
            return
        metrics = {}
        for name, q in iter_quantizers(pl_module):
            start = self.amax_start.get(name)
            if start is None or q.amax is None or q.amax.shape != start.shape:
                continue
            cur = q.amax.detach().to(start.device)
            drift = ((cur - start).abs() / start.abs().clamp_min(1e-12)).max()
            metrics[f"lq/amax_drift/{name}"] = float(drift)
        if metrics and trainer.loggers:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        self.last_drift = metrics

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            "policy": self.policy,
            "base_lrs": self.base_lrs,
            "amax_start": {k: v.cpu() for k, v in self.amax_start.items()},
            "amax_frozen": self._amax_frozen,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.base_lrs = state_dict.get("base_lrs")
        self.policy = state_dict.get("policy")
        self.amax_start = dict(state_dict.get("amax_start") or {})
        self._amax_frozen = bool(state_dict.get("amax_frozen", False))


__all__ = ["QATSchedule"]
