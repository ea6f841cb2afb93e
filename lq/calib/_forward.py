"""How a calibration batch becomes a model call: one rule for calibration, ``auto``'s and sensitivity's
fidelity metric, the AWQ / block searches and the export's sample input.

It sits below :mod:`lq.calibration`, :mod:`lq.auto_calib` and :mod:`lq.sensitivity` so that each of them (and
the searches in :mod:`lq.calib`) can run a model on a batch without importing another of them; the public
names stay importable from :mod:`lq.calibration`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["default_forward", "model_inputs"]


def _positional(model: nn.Module) -> tuple[int, float, list[str]] | None:
    """``(required, most, names)`` of ``model.forward``'s positional parameters (``most`` is inf with
    ``*args``), or None when the signature cannot be read."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    pos = [p for p in sig.parameters.values() if p.kind in kinds]
    required = sum(p.default is inspect.Parameter.empty for p in pos)
    star = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values())
    return required, math.inf if star else len(pos), [p.name for p in pos]


def _describe(batch: Any) -> str:
    if isinstance(batch, torch.Tensor):
        return f"Tensor{list(batch.shape)}"
    if isinstance(batch, Mapping):
        return "dict(" + ", ".join(f"{k}={_describe(v)}" for k, v in batch.items()) + ")"
    if isinstance(batch, (list, tuple)):
        return f"{type(batch).__name__} of {len(batch)}: (" + ", ".join(_describe(b) for b in batch) + ")"
    return type(batch).__name__


def model_inputs(model: nn.Module, batch: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)``: how ``model`` is called on one ``batch`` -- the one rule calibration, ``auto``
    and the export's sample batch share.

    * a mapping is keyword arguments: ``model(**batch)``;
    * a tuple/list batch, when ``forward`` needs at most one positional input, is ``(inputs, target, ...)``:
      ``model(batch[0])`` (what most training code passes);
    * when ``forward`` needs two or more positional inputs: a tuple/list batch whose first element is a
      mapping, or a tuple that fits them, is ``(inputs, target)``: ``model(**batch[0])`` /
      ``model(*batch[0])``; else a batch whose length fits ``forward``'s positional parameters (at least
      the required ones, at most all of them) is those inputs: ``model(*batch)``, e.g.
      ``(input_ids, attention_mask)``;
    * anything else is passed as is: ``model(batch)``.

    Raises:
        TypeError: a tuple/list batch that fits none of these; the message shows what was received and
            how to say it (a dict batch, or ``forward=``).
    """
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if not isinstance(batch, (list, tuple)):
        return (batch,), {}
    sig = _positional(model)
    if not batch:
        return (batch,), {}
    if sig is None or sig[0] <= 1:
        return (batch[0],), {}
    required, most, names = sig
    head = batch[0]
    if isinstance(head, Mapping):
        return (), dict(head)
    if isinstance(head, (list, tuple)) and required <= len(head) <= most:
        return tuple(head), {}
    if required <= len(batch) <= most:
        return tuple(batch), {}
    name = type(model).__name__
    want = f"{required}" if most == required else f"{required} to {most}"
    raise TypeError(
        f"cannot tell how to call {name}.forward({', '.join(names)}) on a calibration batch: it takes {want} "
        f"positional inputs and the batch is a {_describe(batch)}. Pass each batch as a dict of its inputs "
        f"(model(**batch)), as a tuple of exactly its inputs, or as (inputs, target) with the inputs a tuple "
        f"or dict; or say how: calibrate_model(..., forward=lambda model, batch: model(batch[0], batch[1])) "
        f"(QuantCalibrate(forward=...), or a calibration_step(batch) method on a LightningModule)")


def default_forward(model: nn.Module, batch: Any) -> Any:
    """Run ``model`` on ``batch`` the way most training code does.

    A LightningModule with a ``calibration_step(batch)`` method decides itself; otherwise
    ``model(*args, **kwargs)`` with the call :func:`model_inputs` reads from the batch: a mapping is keyword
    arguments, a tuple/list is ``(inputs, target)`` for a one-input ``forward`` and the inputs themselves
    when it fits a ``forward`` of several (``(input_ids, attention_mask)``), anything else is passed as is.
    """
    step = getattr(model, "calibration_step", None)
    if callable(step):
        return step(batch)
    args, kwargs = model_inputs(model, batch)
    return model(*args, **kwargs)
