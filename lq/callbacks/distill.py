"""QuantDistill: quantization-aware distillation from a frozen FP32 copy of the model.

QAT fine-tunes on the task labels, so it keeps moving the model the way
training would, and test samples the FP32 model was unsure of can change
class for reasons that have nothing to do with quantization. Distillation
makes the FP32 model the target instead: the quantized model learns to give
the FP32 model's output distribution, which is what "INT8 as accurate as
FP32" asks for.

How it attaches, without touching ``forward`` or the user's loss: a forward
hook on the distilled module (the LightningModule, or ``distill_module``)
runs the teacher on the same arguments and passes the student's logits
through an identity whose backward mixes the training loss's gradient with
the analytic gradient of the distillation loss::

    d/dz  = (1 - w) * dL_task/dz  +  w * T * (softmax(z / T) - softmax(z_teacher / T)) / N

which is the gradient of ``(1 - w) * L_task + w * T^2 * KL(p_teacher || p_student)``
(KL averaged over the N output rows) as far as ``L_task`` flows through the
logits. The distillation term follows Lightning's loss scaling: divided by
``accumulate_grad_batches`` under automatic optimization and multiplied by the
AMP grad scaler's scale where one is active.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
import torch
import torch.nn.functional as F
from torch import nn

from lq.config import QATConfig, coerce
from lq.nn.modules import _bias_shift
from lq.nn.modules.tensor_quantizer import iter_quantizers

# Hooks on the output side (a user's feature capture, logging, our own distillation hook) must not run for
# the teacher; forward pre-hooks stay, since modules use them to work (old-style weight_norm/spectral_norm,
# the quantized attention's fast-path guard).
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_backward_hooks", "_backward_pre_hooks")


class _TeacherGradient(torch.autograd.Function):
    """Identity in forward; backward returns ``(1 - w) * grad + w * scale * diff``."""

    @staticmethod
    def forward(ctx, logits, diff, weight: float, scale: float):
        ctx.save_for_backward(diff)
        ctx.weight, ctx.scale = weight, scale
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        (diff,) = ctx.saved_tensors
        teacher = (ctx.weight * ctx.scale) * diff
        if ctx.weight == 1.0:  # distillation only: the task gradient is dropped, NaN included
            return teacher.to(grad.dtype), None, None, None
        return (1.0 - ctx.weight) * grad + teacher.to(grad.dtype), None, None, None


def _logits(output: Any, where: str) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    raise TypeError(
        f"lq distillation: {where} returned {type(output).__name__}; it needs a Tensor of logits or a mapping with a "
        "'logits' Tensor. Set QATConfig.distill_module to the submodule that returns the logits."
    )


def _with_logits(output: Any, logits: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return logits
    out = copy.copy(output)  # a shallow copy, so the caller's mapping is not changed under it
    out["logits"] = logits
    return out


def distill_gradient(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T * (p_student - p_teacher) / N, T^2 * KL(p_teacher || p_student))`` over the last dimension, N = rows.

    The first is the gradient of the second with respect to the student logits: the reference the
    tests check the hook against (with ``torch.autograd``).
    """
    t = float(temperature)
    dtype = torch.promote_types(student.dtype, torch.float32)  # half logits: the softmax in float32
    log_ps = F.log_softmax(student.detach().to(dtype) / t, dim=-1)
    log_pt = F.log_softmax(teacher.detach().to(dtype) / t, dim=-1)
    pt = log_pt.exp()
    rows = max(1, student.numel() // max(1, student.shape[-1]))
    diff = (log_ps.exp() - pt) * (t / rows)
    kl = (pt * (log_pt - log_ps)).sum() * (t * t / rows)
    return diff, kl


class QuantDistill(L.Callback):
    """Quantization-aware distillation (``QATConfig.distill_weight > 0``).

    * ``setup("fit")``: a frozen copy of the distilled module is taken as the
      teacher, with any quantizers in it disabled, its forward and backward
      hooks dropped (forward pre-hooks kept), in eval mode. In :class:`lq.QuantCallback` this runs before the swap, so the
      teacher is the FP32 model.
    * Every training batch: the teacher runs on the student's arguments (no
      grad) and the student's logits carry the distillation gradient (see the
      module docstring). ``lq/distill_kl`` is logged per step and per epoch.
    * ``state_dict`` holds the teacher's weights, so a resumed fit distills
      from the same FP32 model and not from whatever the module was built with.
    * ``teardown``: the hook is removed and the teacher module freed; its
      weights stay on the host, so fitting again distills from the same FP32
      model, not from the quantized model's own float weights.

    Args:
        qat: :class:`lq.config.QATConfig` (``distill_weight``, ``distill_temperature``,
            ``distill_module``); inactive when the weight is 0 or QAT is disabled.
    """

    def __init__(self, qat: Optional[QATConfig] = None) -> None:
        self.qat = coerce(qat, QATConfig, "QuantDistill.qat")
        self.teacher: Optional[nn.Module] = None
        self._handle = None
        self._active = False
        self._scale = 1.0
        self._kl: list[torch.Tensor] = []
        self._pending: Optional[dict] = None

    @property
    def enabled(self) -> bool:
        return self.qat.enabled and self.qat.distill_weight > 0

    def _target(self, pl_module: L.LightningModule) -> nn.Module:
        path = self.qat.distill_module
        if not path:
            return pl_module
        try:
            return pl_module.get_submodule(path)
        except AttributeError as err:
            raise ValueError(
                f"QATConfig.distill_module={path!r} is not a submodule of {type(pl_module).__name__}: "
                f"choose one of {[n for n, _ in pl_module.named_modules() if n][:20]} or '' for the module itself"
            ) from err

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not self.enabled or self.teacher is not None:
            return
        target = self._target(pl_module)
        self.teacher = copy.deepcopy(target)  # a LightningModule's copy drops its trainer reference
        for m in self.teacher.modules():
            for name in _HOOK_DICTS:
                hooks = getattr(m, name, None)
                if hooks is not None:
                    hooks.clear()
        for _, q in iter_quantizers(self.teacher):
            q.disable()
        self.teacher.eval().requires_grad_(False)
        if self._pending is not None:
            self._load_teacher(self._pending)
            self._pending = None
        self._handle = target.register_forward_hook(self._hook, with_kwargs=True)
        rank_zero_info(f"lq: QAT distills from a frozen FP32 copy of {type(target).__name__} "
                       f"(weight {self.qat.distill_weight:g}, temperature {self.qat.distill_temperature:g})")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.teacher is not None:
            self.teacher.to(pl_module.device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self.teacher is None:
            return
        scale = 1.0
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            scale = float(scaler.get_scale())
        if pl_module.automatic_optimization:
            scale /= max(1, trainer.accumulate_grad_batches)
        self._scale = scale
        self._active = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._active = False
        if self._kl:
            kl = torch.stack(self._kl).mean()
            self._kl.clear()
            pl_module.log("lq/distill_kl", kl, on_step=True, on_epoch=True, batch_size=1)

    def _hook(self, module: nn.Module, args, kwargs, output):
        if not self._active or not torch.is_grad_enabled():
            return None
        logits = _logits(output, f"{type(module).__name__}.forward")
        if not logits.requires_grad:
            return None
        with torch.no_grad():
            teacher = _logits(self.teacher(*args, **kwargs), f"the teacher copy of {type(module).__name__}")
            if teacher.shape != logits.shape:
                raise RuntimeError(f"lq distillation: teacher logits {tuple(teacher.shape)} and student logits "
                                   f"{tuple(logits.shape)} differ in shape")
            diff, kl = distill_gradient(logits, teacher, self.qat.distill_temperature)
        self._kl.append(kl)
        out = _TeacherGradient.apply(logits, diff, float(self.qat.distill_weight), self._scale)
        return _with_logits(output, out)

    def _release(self) -> None:
        self._active = False
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.teacher is not None:  # kept on the host, so a second fit distills from the same FP32 model
            self._pending = self._teacher_weights()
        self.teacher = None
        self._kl.clear()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._release()

    # ------------------------------------------------------------------ state
    def _load_teacher(self, weights: dict) -> None:
        """The saved teacher into the fresh copy. Quantizer state (and bias correction's shifts) may be on one side
        only (the copy was taken from an already quantized module, or the other way round): the teacher's
        quantizers are off anyway, and the shifts with them."""
        missing, unexpected = self.teacher.load_state_dict(weights, strict=False)
        wrong = [k for k in (*missing, *unexpected)
                 if "_quantizer." not in k and k.rpartition(".")[2] != _bias_shift.BUFFER]  # quantization state
        if wrong:
            raise RuntimeError(f"lq distillation: the saved FP32 teacher does not fit the model: {wrong[:10]} "
                               "(the checkpoint was made with a different model)")

    def _teacher_weights(self) -> dict:
        return {k: v.detach().cpu() for k, v in self.teacher.state_dict().items()}

    def state_dict(self) -> dict:
        if self.teacher is not None:
            return {"teacher": self._teacher_weights()}
        return {} if self._pending is None else {"teacher": self._pending}

    def load_state_dict(self, state_dict: dict) -> None:
        weights = state_dict.get("teacher")
        if weights is None:
            return
        if self.teacher is not None:
            self._load_teacher(weights)
        else:
            self._pending = weights


__all__ = ["QuantDistill", "distill_gradient"]
