"""Whether a model's weights are still the ones it was calibrated with: post-training quantization, no training
since.

The export's fallback refuses a copy with quantizers off whose outputs move far from the quantized model's
(:data:`lq.export.timing._fallback.FIDELITY`): a model trained quantized can compute something else without its
quantizers. A model calibrated and not trained since is, with its quantizers off, the user's own trained model,
however far quantizing moved its outputs: a MobileNetV3-style net at 32x32 moved 12%, the gate refused the float
model, and the saved file ran at 0.68x FP32. :func:`stamp` records each parameter's storage and version counter
(every in-place update, an optimizer step among them, bumps it) at the end of calibration; :func:`untouched`
compares. A copy, a move to another device or a loaded state dict makes new storage or bumps the counter: the model
then counts as trained, and the gate applies.
"""

from __future__ import annotations

import weakref

from torch import nn

_STAMPS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _fingerprint(model: nn.Module) -> tuple:
    return tuple((name, p.data_ptr(), p._version) for name, p in model.named_parameters())


def stamp(model: nn.Module) -> None:
    """Record ``model``'s parameters as calibration left them."""
    _STAMPS[model] = _fingerprint(model)


def untouched(model: nn.Module) -> bool:
    """``model`` was calibrated (:func:`stamp`) and none of its parameters changed since."""
    recorded = _STAMPS.get(model)
    return recorded is not None and recorded == _fingerprint(model)
