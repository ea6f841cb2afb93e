"""QuantSwap: replace a LightningModule's layers with quantized ones at ``setup``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lq.config import QuantConfig, coerce
from lq.recipe import default_recipe


class QuantSwap(L.Callback):
    """Swap supported layers (Conv, Linear, pooling, ...) for their ``lq.nn`` quantized versions.

    Runs in ``setup``: before a checkpoint is restored (so a QAT checkpoint's
    amax loads into quantized layers) and before ``configure_optimizers`` (so
    learned-amax parameters reach the optimizer). The swap keeps the very same
    Parameter objects, never patches ``forward``, and is idempotent: a second
    ``fit`` finds the layers already quantized and leaves them alone. Placement is
    decided on one capture of the whole model (:mod:`lq.capture`), run on the
    module's ``example_input_array`` or else on the first batch of the stage's
    dataloader.

    Args:
        quant: the recipe (:class:`lq.config.QuantConfig` or one of its subclasses, or a mapping); None: the
            onnxruntime recipe (:func:`lq.recipe.default_recipe`).
        learn_amax: make every input amax a learned parameter (QAT with PACT-style clipping).
    """

    def __init__(self, quant: Optional[QuantConfig] = None, learn_amax: bool = False) -> None:
        self.quant = coerce(quant, QuantConfig, "QuantSwap.quant") if quant is not None else default_recipe()
        self.learn_amax = bool(learn_amax)
        self.summary: Any = None
        #: the shapes and dtypes the model was captured with (:func:`sample_template`), kept in checkpoints so that
        #: :func:`lq.load_quantized` places the same quantizers
        self.template: Any = None

    def swap(self, model, sample=None) -> Any:
        """Quantize ``model`` in place per the recipe (:func:`lq.recipe.apply_recipe`), placing on a capture of the
        model run on ``sample`` (its ``example_input_array`` when None); returns the summary."""
        from lq.recipe import apply_recipe

        return apply_recipe(model, self.quant, learn_amax=self.learn_amax, sample=sample)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if str(getattr(trainer, "precision", "")).startswith("64"):
            raise ValueError(
                "lq quantizes float32, float16 and bfloat16 tensors; Trainer(precision='64-true') is not supported: "
                "use '32-true', 'bf16-true', 'bf16-mixed' or '16-mixed'")
        sample = _first_batch_inputs(trainer, pl_module, stage)
        self.summary = self.swap(pl_module, sample)
        self.template = sample_template(sample if sample is not None else getattr(pl_module, "example_input_array", None))
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


def sample_template(sample, rows: int = 2):
    """A stand-in for ``sample`` with its structure, shapes (at most ``rows`` rows) and dtypes: zeros for float
    tensors, ones for integer and boolean ones (token ids, attention masks that keep every token). Placement
    depends on what the forward runs, not on the values, so the stand-in places the same quantizers; it holds
    only tensors, so a checkpoint keeps loading with ``weights_only=True``, and no training data is stored."""
    if isinstance(sample, torch.Tensor):
        t = sample[:rows] if sample.dim() else sample
        return torch.zeros_like(t, device="cpu") if t.is_floating_point() else torch.ones_like(t, device="cpu")
    if isinstance(sample, (list, tuple)):
        return tuple(sample_template(v, rows) for v in sample)
    if isinstance(sample, dict):
        return {k: sample_template(v, rows) for k, v in sample.items()}
    return None if sample is None else sample


def _first_batch_inputs(trainer: L.Trainer, pl_module: L.LightningModule, stage: str):
    """The model's inputs from the first batch of the stage's dataloader (what the capture runs the model on), or
    None (the module's ``example_input_array`` is used first; no loader: placement falls back to torch.fx)."""
    if getattr(pl_module, "example_input_array", None) is not None:
        return None
    loop = {"fit": "fit_loop", "validate": "validate_loop", "test": "test_loop", "predict": "predict_loop"}.get(stage)
    try:
        source = getattr(trainer, loop)._data_source
        if not source.is_defined():
            return None
        loaders = source.dataloader()
        loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
        batch = next(iter(loader))
    except Exception:  # noqa: BLE001 - no loader to read: the summary says how placement was done
        return None
    from lightning.pytorch.utilities import move_data_to_device

    from lq.calib._forward import model_inputs

    try:
        args, kwargs = model_inputs(pl_module, batch)
    except TypeError:
        return None
    device = next((p.device for p in pl_module.parameters()), None)
    args, kwargs = (move_data_to_device((args, kwargs), device) if device is not None else (args, kwargs))
    if kwargs and not args:
        return dict(kwargs)
    return None if kwargs else tuple(args)


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
