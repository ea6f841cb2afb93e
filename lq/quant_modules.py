"""Monkey-patch ``torch.nn`` so that models built afterwards use quantized modules.

This is the reference toolkit's API (``quant_modules.initialize()`` before the
model is constructed, ``deactivate()`` after), made safe:

* **idempotent**: ``initialize()`` first undoes any earlier patch, so calling it
  twice and ``deactivate()`` once restores ``torch.nn`` exactly;
* **all or nothing**: every argument is validated before anything is patched,
  and a failure while patching undoes what was done;
* **scoped**: ``with quant_modules.quantized(): model = build()`` restores the
  previous state in ``finally``, also when the block raises.

Prefer :func:`lq.convert.quantize_model`, which converts an existing model
without touching ``torch.nn`` at all.
"""

from __future__ import annotations

import threading
from collections import namedtuple
from contextlib import contextmanager

import torch

from lq import nn as quant_nn

__all__ = [
    "initialize",
    "deactivate",
    "quantized",
    "enable_onnx_export",
    "is_active",
    "active_patches",
    "QuantModuleReplacementHelper",
]

_quant_entry = namedtuple("quant_entry", "orig_mod mod_name replace_mod")

#: what ``initialize()`` replaces by default (the reference toolkit's list)
_DEFAULT_QUANT_MAP = [
    _quant_entry(torch.nn, "Conv1d", quant_nn.QuantConv1d),
    _quant_entry(torch.nn, "Conv2d", quant_nn.QuantConv2d),
    _quant_entry(torch.nn, "Conv3d", quant_nn.QuantConv3d),
    _quant_entry(torch.nn, "ConvTranspose1d", quant_nn.QuantConvTranspose1d),
    _quant_entry(torch.nn, "ConvTranspose2d", quant_nn.QuantConvTranspose2d),
    _quant_entry(torch.nn, "ConvTranspose3d", quant_nn.QuantConvTranspose3d),
    _quant_entry(torch.nn, "Linear", quant_nn.QuantLinear),
    _quant_entry(torch.nn, "LSTM", quant_nn.QuantLSTM),
    _quant_entry(torch.nn, "LSTMCell", quant_nn.QuantLSTMCell),
    _quant_entry(torch.nn, "AvgPool1d", quant_nn.QuantAvgPool1d),
    _quant_entry(torch.nn, "AvgPool2d", quant_nn.QuantAvgPool2d),
    _quant_entry(torch.nn, "AvgPool3d", quant_nn.QuantAvgPool3d),
    _quant_entry(torch.nn, "AdaptiveAvgPool1d", quant_nn.QuantAdaptiveAvgPool1d),
    _quant_entry(torch.nn, "AdaptiveAvgPool2d", quant_nn.QuantAdaptiveAvgPool2d),
    _quant_entry(torch.nn, "AdaptiveAvgPool3d", quant_nn.QuantAdaptiveAvgPool3d),
]

_LOCK = threading.RLock()
# (owner, attribute name) -> the original object, for every attribute currently patched
_ORIGINALS: dict[tuple[object, str], object] = {}


def _entries(float_module_list=None, custom_quant_modules=None) -> list[tuple[object, str, type]]:
    """Validate the arguments and return ``[(owner, name, quant_cls), ...]`` to patch (nothing is patched)."""
    default_names = [e.mod_name for e in _DEFAULT_QUANT_MAP]
    if float_module_list is None:
        skip = set()
    else:
        if isinstance(float_module_list, (str, type)):
            float_module_list = [float_module_list]
        try:
            items = list(float_module_list)
        except TypeError:
            raise TypeError(
                f"float_module_list must be a list of module names such as ['Linear'], got {float_module_list!r}"
            ) from None
        skip = set()
        for item in items:
            name = item.__name__ if isinstance(item, type) else item
            if not isinstance(name, str):
                raise TypeError(f"float_module_list entries must be module names (str), got {item!r}")
            if name not in default_names:
                raise ValueError(
                    f"float_module_list: {name!r} is not a module initialize() replaces; allowed: {default_names}"
                )
            skip.add(name)

    custom: list[tuple[object, str, type]] = []
    if custom_quant_modules is not None:
        if isinstance(custom_quant_modules, dict):
            items = [(*k, v) if isinstance(k, tuple) else (k, v) for k, v in custom_quant_modules.items()]
        else:
            try:
                items = list(custom_quant_modules)
            except TypeError:
                raise TypeError(
                    "custom_quant_modules must be a list of (owner, 'Name', QuantClass) tuples, "
                    f"got {custom_quant_modules!r}"
                ) from None
        for item in items:
            if not isinstance(item, (tuple, list)) or len(item) != 3:
                raise TypeError(
                    f"custom_quant_modules entries must be (owner, 'Name', QuantClass) tuples, e.g. "
                    f"(torch.nn, 'Linear', MyQuantLinear); got {item!r}"
                )
            owner, name, quant_cls = item
            if not isinstance(name, str) or not hasattr(owner, name):
                raise ValueError(f"custom_quant_modules: {owner!r} has no attribute {name!r}")
            if not (isinstance(quant_cls, type) and issubclass(quant_cls, torch.nn.Module)):
                raise TypeError(
                    f"custom_quant_modules: replacement for {name!r} must be an nn.Module class, got {quant_cls!r}"
                )
            custom.append((owner, name, quant_cls))

    out = {(e.orig_mod, e.mod_name): e.replace_mod for e in _DEFAULT_QUANT_MAP if e.mod_name not in skip}
    for owner, name, quant_cls in custom:
        out[(owner, name)] = quant_cls
    return [(owner, name, cls) for (owner, name), cls in out.items()]


def _restore_all() -> None:
    for (owner, name), orig in list(_ORIGINALS.items()):
        setattr(owner, name, orig)
    _ORIGINALS.clear()


def initialize(float_module_list=None, custom_quant_modules=None) -> None:
    """Replace ``torch.nn.Conv2d``, ``torch.nn.Linear``, ... by their quantized versions.

    Args:
        float_module_list: names of modules to leave float, e.g. ``["Linear"]``.
        custom_quant_modules: extra replacements, a list of ``(owner, "Name", QuantClass)``
            tuples (e.g. ``(torch.nn, "MultiheadAttention", quant_nn.QuantMultiheadAttention)``).

    Calling it again first undoes the previous call. Invalid arguments raise before
    anything is patched.
    """
    entries = _entries(float_module_list, custom_quant_modules)
    with _LOCK:
        _restore_all()
        try:
            for owner, name, quant_cls in entries:
                _ORIGINALS[(owner, name)] = getattr(owner, name)
                setattr(owner, name, quant_cls)
        except BaseException:
            _restore_all()
            raise


def deactivate() -> None:
    """Undo :func:`initialize`: every patched attribute gets its original back (a no-op when inactive)."""
    with _LOCK:
        _restore_all()


def is_active() -> bool:
    """True while ``torch.nn`` is patched."""
    return bool(_ORIGINALS)


def active_patches() -> dict[str, type]:
    """``{"torch.nn.Linear": QuantLinear, ...}`` for what is patched now."""
    out = {}
    for owner, name in _ORIGINALS:
        owner_name = getattr(owner, "__name__", repr(owner))
        out[f"{owner_name}.{name}"] = getattr(owner, name)
    return out


@contextmanager
def quantized(float_module_list=None, custom_quant_modules=None):
    """``initialize(...)`` for the duration of a ``with`` block; the state before the block
    (patched or not) is restored on exit, also when the block raises."""
    entries = _entries(float_module_list, custom_quant_modules)
    with _LOCK:
        saved_originals = dict(_ORIGINALS)
        touched = {(o, n) for o, n, _ in entries} | set(_ORIGINALS)
        saved_values = {key: getattr(*key) for key in touched}
    try:
        initialize(float_module_list, custom_quant_modules)
        yield
    finally:
        with _LOCK:
            for (owner, name), value in saved_values.items():
                setattr(owner, name, value)
            _ORIGINALS.clear()
            _ORIGINALS.update(saved_originals)


@contextmanager
def enable_onnx_export():
    """Within the block ``TensorQuantizer.use_fb_fake_quant`` is True (quantizers use PyTorch's
    own fake-quantize ops, which ONNX exporters turn into QuantizeLinear/DequantizeLinear);
    the previous value is restored on exit, also on error."""
    TensorQuantizer = quant_nn.TensorQuantizer
    previous = TensorQuantizer.use_fb_fake_quant
    TensorQuantizer.use_fb_fake_quant = True
    try:
        yield
    finally:
        TensorQuantizer.use_fb_fake_quant = previous


class QuantModuleReplacementHelper:
    """The reference toolkit's helper object, kept for code that uses it directly."""

    def __init__(self):
        self.orginal_func_map = set()
        self.default_quant_map = list(_DEFAULT_QUANT_MAP)
        self.quant_map = []

    def prepare_state(self, float_module_list=None, custom_map=None):
        self.quant_map = [_quant_entry(o, n, c) for o, n, c in _entries(float_module_list, custom_map)]

    def apply_quant_modules(self):
        with _LOCK:
            _restore_all()
            try:
                for e in self.quant_map:
                    _ORIGINALS[(e.orig_mod, e.mod_name)] = getattr(e.orig_mod, e.mod_name)
                    setattr(e.orig_mod, e.mod_name, e.replace_mod)
            except BaseException:
                _restore_all()
                raise

    def restore_float_modules(self):
        deactivate()
