"""QuantSwap: replace a LightningModule's layers with quantized ones at ``setup``."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lq.config import QuantConfig, coerce


class QuantSwap(L.Callback):
    """Swap supported layers (Conv, Linear, pooling, ...) for their ``lq.nn`` quantized versions.

    Runs in ``setup``: before a checkpoint is restored (so a QAT checkpoint's
    amax loads into quantized layers) and before ``configure_optimizers`` (so
    learned-amax parameters reach the optimizer). The swap keeps the very same
    Parameter objects, never patches ``forward``, and is idempotent: a second
    ``fit`` finds the layers already quantized and leaves them alone.

    Args:
        quant: the recipe (:class:`lq.config.QuantConfig` or one of its subclasses, or a mapping).
        learn_amax: make every input amax a learned parameter (QAT with PACT-style clipping).
    """

    def __init__(self, quant: Optional[QuantConfig] = None, learn_amax: bool = False) -> None:
        self.quant = coerce(quant, QuantConfig, "QuantSwap.quant")
        self.learn_amax = bool(learn_amax)
        self.summary: Any = None

    def _input_cfg(self, cfg):
        if not (self.learn_amax and cfg.enabled and cfg.block_size is None):
            return cfg
        if cfg.asymmetric:
            raise ValueError("QATConfig.learn_amax=true needs symmetric input quantizers, and this recipe's are "
                             "asymmetric (calibrated affine ranges); use learn_amax=false (QAT then trains the "
                             "weights on the calibrated ranges) or quant=int8_reduce_range")
        return replace(cfg, learn_amax=True)

    def swap(self, model) -> Any:
        """Quantize ``model`` in place per the recipe; returns the conversion summary."""
        from lq.convert import quantize_model
        from lq.nn.modules.tensor_quantizer import name_quantizers

        q = self.quant
        overrides = self._transposed_conv_overrides(model)
        for glob, per in q.overrides.items():
            overrides[glob] = {}
            for role in per:
                cfg = q.override_for(role, glob)
                overrides[glob][role] = (self._input_cfg(cfg) if role == "input" else cfg).to_descriptor()
        type_map = self._type_map()
        self._check_blocks(model, type_map)
        summary = quantize_model(
            model,
            type_map=type_map,
            include=tuple(q.include),
            exclude=tuple(q.exclude),
            overrides=overrides or None,
            quant_desc_input=self._input_cfg(q.input).to_descriptor(),
            quant_desc_weight=q.weight.to_descriptor(),
            glue=q.glue,
            unsigned_after_relu=q.unsigned_after_relu,
            recurrent=q.recurrent,
            activations=q.activations,
        )
        name_quantizers(model, overwrite=True)
        self._apply_enabled(model)
        return summary

    def _type_map(self):
        """The float classes the recipe quantizes: ``types`` by name (None: all of lq's layers), plus SiLU and
        HardSwish when the recipe quantizes ``activations``."""
        from lq.convert import DEFAULT_TYPE_MAP
        from lq.nn.modules.quant_activation import ACTIVATION_MODULE_CLASSES

        full = dict(DEFAULT_TYPE_MAP) | (dict(ACTIVATION_MODULE_CLASSES) if self.quant.activations else {})
        if self.quant.types is None:
            return None if not self.quant.activations else full
        by_name = {cls.__name__: cls for cls in full}
        unknown = [t for t in self.quant.types if t not in by_name]
        if unknown:
            raise ValueError(f"QuantConfig.types has unknown layer type(s) {unknown}; allowed: {sorted(by_name)}")
        return {by_name[t]: full[by_name[t]] for t in self.quant.types}

    def _check_blocks(self, model, type_map) -> None:
        """Block sizes must divide every selected layer's weight dim: fail before changing anything."""
        from lq.convert import DEFAULT_TYPE_MAP

        kinds = tuple(type_map) if type_map is not None else tuple(DEFAULT_TYPE_MAP)  # a mapping: its keys
        bad = []
        for name, m in model.named_modules():
            if not name or not isinstance(m, kinds) or not self.quant.selects(name):
                continue
            cfg = self.quant.quantizer_for(name, "weight")
            w = getattr(m, "weight", None)
            if cfg.block_size is None or not cfg.enabled or not isinstance(w, torch.Tensor):
                continue
            axis = cfg.block_axis % w.dim()
            if w.shape[axis] % cfg.block_size:
                bad.append(f"{name} (weight {tuple(w.shape)}, dim {axis} = {w.shape[axis]})")
        if bad:
            raise ValueError(
                f"weight block_size={self.quant.weight.block_size} does not divide the block axis of: {', '.join(bad)}; "
                "exclude those layers (quant.exclude), restrict quant.types, or override their block_size"
            )

    def _transposed_conv_overrides(self, model) -> dict:
        """Per-channel weights of ConvTranspose layers live on axis 1 (weights are (in, out, k...)).

        The recipe's ``axis: [0]`` means "per output channel"; for transposed convolutions that is
        axis 1, so those layers get their own descriptor (user overrides still apply after this).
        """
        from torch import nn

        w = self.quant.weight
        if w.axis != [0]:
            return {}
        kinds = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)  # quantized ones subclass these
        desc = replace(w, axis=[1]).to_descriptor()
        return {name: {"weight": desc} for name, m in model.named_modules()
                if isinstance(m, kinds) and name and self.quant.selects(name)}

    def _apply_enabled(self, model) -> None:
        """Turn off the quantizers whose config says ``enabled: false`` (e.g. weight-only recipes)."""
        from lq.nn.modules.tensor_quantizer import iter_quantizers

        for name, tq in iter_quantizers(model):
            layer, _, attr = name.rpartition(".")
            role = "weight" if "weight" in attr else "input"
            if not self.quant.selects(layer):
                continue
            if not self.quant.quantizer_for(layer, role).enabled:
                tq.disable()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if str(getattr(trainer, "precision", "")).startswith("64"):
            raise ValueError(
                "lq quantizes float32, float16 and bfloat16 tensors; Trainer(precision='64-true') is not supported: "
                "use '32-true', 'bf16-true', 'bf16-mixed' or '16-mixed'")
        self.summary = self.swap(pl_module)
        _refuse_spawned_fit(trainer, stage, self.summary)
        rank_zero_info(f"lq: quantized {self._count(self.summary)} layer(s) of {type(pl_module).__name__}")

    @staticmethod
    def _count(summary) -> int:
        rows = getattr(summary, "rows", None)
        rows = rows() if callable(rows) else rows
        return len(rows) if rows is not None else 0

    def state_dict(self) -> dict:
        return {"quant": asdict(self.quant), "quant_class": type(self.quant).__name__, "learn_amax": self.learn_amax}

    def load_state_dict(self, state_dict: dict) -> None:
        # The configuration the user passed wins; the saved one is kept for reference and for
        # lq.load_quantized(), which rebuilds the quantized model without this callback.
        self._restored_config = state_dict


def _refuse_spawned_fit(trainer: L.Trainer, stage: str, summary) -> None:
    """``ddp_spawn`` / ``ddp_fork`` / ``ddp_notebook`` fit in child processes and copy rank 0's weights back into
    the parent's model with ``strict=False``. A model the swap had to change there was never swapped in the
    parent, so its quantizers would be dropped silently and ``trainer.test`` or ``save_checkpoint`` afterwards
    would use FP32. A model quantized before ``fit`` (``lq.convert.quantize_model``) has the same modules on
    both sides, and its calibrated amax comes back with the weights."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    newly = getattr(summary, "quantized", None)
    newly = newly() if callable(newly) else newly
    if (stage == "fit" and newly and
            isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher)):
        raise RuntimeError(
            f"lq.QuantCallback cannot train under strategy={type(trainer.strategy).__name__}"
            f"('{getattr(trainer.strategy, '_start_method', 'spawn')}'): it trains in child processes and "
            "copies only matching weights back, so the model you hold would lose its quantizers. Use "
            "strategy='ddp' (the script is run once per process and the model is quantized in each), or "
            "quantize the model before fit with lq.convert.quantize_model(model) (same modules in every process).")
