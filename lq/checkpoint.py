"""Rebuild a quantized LightningModule from a QAT checkpoint without the callback."""

from __future__ import annotations

from typing import Any

import torch

from lq.callbacks.quant_callback import CHECKPOINT_KEY
from lq.config import RECIPES, QuantConfig


def quant_config_from_checkpoint(checkpoint: dict) -> tuple[QuantConfig, bool]:
    """The recipe and learn_amax flag that ``QuantCallback`` stored in ``checkpoint["lq"]``."""
    if CHECKPOINT_KEY not in checkpoint:
        raise KeyError(
            "this checkpoint has no 'lq' entry: it was not written by a Trainer with lq.QuantCallback "
            "(load it with the module's own load_from_checkpoint)"
        )
    meta = checkpoint[CHECKPOINT_KEY]
    classes = {cls.__name__: cls for cls in RECIPES.values()}
    cls = classes.get(meta.get("quant_class"), QuantConfig)
    return cls(**meta["quant"]), bool(meta.get("learn_amax", False))


def load_quantized(module_class, checkpoint_path: str, map_location: Any = "cpu", strict: bool = True,
                   **kwargs) -> Any:
    """``module_class`` built from its saved hyperparameters, quantized as in training, weights and amax loaded.

    The one-call way to get a QAT model back for evaluation or export::

        model = lq.load_quantized(MyModule, "epoch=2.ckpt")
    """
    from lq.callbacks.swap import QuantSwap

    ckpt = torch.load(checkpoint_path, map_location=map_location, weights_only=False)
    quant, learn_amax = quant_config_from_checkpoint(ckpt)
    hparams = dict(ckpt.get("hyper_parameters") or {})
    hparams.update(kwargs)
    model = module_class(**hparams)
    QuantSwap(quant, learn_amax=learn_amax).swap(model)
    model.load_state_dict(ckpt["state_dict"], strict=strict)
    model.eval()
    return model


def load_quantized_state(model: torch.nn.Module, checkpoint_path: str, map_location: Any = "cpu",
                         strict: bool = True) -> torch.nn.Module:
    """Quantize an already built ``model`` as the checkpoint says and load its weights and amax."""
    from lq.callbacks.swap import QuantSwap

    ckpt = torch.load(checkpoint_path, map_location=map_location, weights_only=False)
    quant, learn_amax = quant_config_from_checkpoint(ckpt)
    QuantSwap(quant, learn_amax=learn_amax).swap(model)
    model.load_state_dict(ckpt["state_dict"], strict=strict)
    return model.eval()
