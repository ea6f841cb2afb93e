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


class CheckpointError(ValueError):
    """A file is not a checkpoint lq can read safely; the message names the file and what to do."""


def read_checkpoint(checkpoint_path, map_location: Any = "cpu", trusted: bool = False) -> dict:
    """Load a Lightning checkpoint without executing anything from it.

    ``torch.load(..., weights_only=True)``: tensors, containers and plain values only, so a file someone
    else made cannot run code on load (a pickle's ``__reduce__`` trick). ``trusted=True`` is the explicit
    opt-in to full unpickling, for a file you wrote yourself that holds other Python objects.
    """
    import os
    import pickle

    path = os.fspath(checkpoint_path)
    made_by = "a checkpoint is written by Trainer.save_checkpoint or ModelCheckpoint"
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file ({made_by})")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path} is empty, not a readable checkpoint ({made_by})")
    if not _looks_like_torch_file(path):
        raise CheckpointError(f"{path} is not a torch checkpoint (neither torch.save's zip archive nor a pickle; "
                              f"text or another format?): {made_by}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=not trusted)
    except pickle.UnpicklingError as e:
        if trusted or "global" not in str(e).lower():  # damaged, not a pickle of objects weights_only refuses
            raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: "
                                  f"{_first_line(e)}; {made_by})") from e
        raise CheckpointError(
            f"{path} holds Python objects beyond tensors and plain values, and lq loads checkpoints with "
            f"weights_only=True so that no file can run code on load ({_first_line(e)}). If you "
            "wrote this file yourself and trust it, pass trusted=True.") from e
    except Exception as e:  # noqa: BLE001 - whatever the unpickler raises on a damaged file: one named error
        raise CheckpointError(f"{path} is not a readable checkpoint: it is truncated or not a torch file "
                              f"({type(e).__name__}: {str(e)[:200]}; {made_by})") from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{path} is a torch file but not a Lightning checkpoint (no 'state_dict'; {made_by})")
    return ckpt


def save_with_weights(source_path, state_dict: dict, dest_path) -> None:
    """A copy of the checkpoint at ``source_path`` (read ``weights_only``) whose model weights are ``state_dict``:
    how the post-training model is saved beside the QAT one, with the same ``lq`` entry and hyperparameters, so
    :func:`load_quantized` reads it the same way."""
    ckpt = read_checkpoint(source_path)
    ckpt["state_dict"] = {k: v.detach().cpu() for k, v in state_dict.items()}
    torch.save(ckpt, dest_path)


def _looks_like_torch_file(path: str) -> bool:
    """torch.save writes a zip archive (its first bytes ``PK``; a truncated one too) or, in the legacy format, a
    pickle (protocol opcode 0x80 first)."""
    with open(path, "rb") as f:
        head = f.read(2)
    return head[:1] == b"\x80" or head == b"PK"


def _first_line(e: Exception) -> str:
    """torch's weights_only error spans a page; its line that names the refused global is what matters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if "unsupported" in ln.lower()]
    return (named or lines or [type(e).__name__])[0][:200]


def load_quantized(module_class, checkpoint_path: str, map_location: Any = "cpu", strict: bool = True,
                   trusted: bool = False, **kwargs) -> Any:
    """``module_class`` built from its saved hyperparameters, quantized as in training, weights and amax loaded.

    The one-call way to get a QAT model back for evaluation or export::

        model = lq.load_quantized(MyModule, "epoch=2.ckpt")

    The file is read with ``weights_only=True`` (nothing in it can run code); ``trusted=True`` allows
    full unpickling of a file you wrote yourself.
    """
    from lq.callbacks.swap import QuantSwap

    ckpt = read_checkpoint(checkpoint_path, map_location, trusted)
    quant, learn_amax = quant_config_from_checkpoint(ckpt)
    hparams = dict(ckpt.get("hyper_parameters") or {})
    hparams.update(kwargs)
    model = module_class(**hparams)
    QuantSwap(quant, learn_amax=learn_amax).swap(model, _placement_sample(ckpt, model))
    model.load_state_dict(ckpt["state_dict"], strict=strict)
    model.eval()
    return model


def load_quantized_state(model: torch.nn.Module, checkpoint_path: str, map_location: Any = "cpu",
                         strict: bool = True, trusted: bool = False) -> torch.nn.Module:
    """Quantize an already built ``model`` as the checkpoint says and load its weights and amax (read with
    ``weights_only=True`` unless ``trusted``)."""
    from lq.callbacks.swap import QuantSwap

    ckpt = read_checkpoint(checkpoint_path, map_location, trusted)
    quant, learn_amax = quant_config_from_checkpoint(ckpt)
    QuantSwap(quant, learn_amax=learn_amax).swap(model, _placement_sample(ckpt, model))
    model.load_state_dict(ckpt["state_dict"], strict=strict)
    return model.eval()


def _placement_sample(checkpoint: dict, model: torch.nn.Module):
    """The stand-in inputs the callback captured the model with (:func:`lq.callbacks.swap.sample_template`), on
    the model's device, so the rebuilt model gets the quantizers it was trained with."""
    sample = checkpoint[CHECKPOINT_KEY].get("sample")
    if sample is None:
        return None
    device = next((p.device for p in model.parameters()), None)
    if device is None:
        return sample
    from lightning.pytorch.utilities import move_data_to_device

    return move_data_to_device(sample, device)
