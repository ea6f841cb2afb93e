"""Apply a recipe (:class:`lq.config.QuantConfig`) to a model, and the recipe each export target runs best.

One place turns a recipe into quantized modules: the callback's swap (:class:`lq.callbacks.QuantSwap`),
``lq.quantize_model(model)`` with no descriptors, checkpoint loading and the pipeline all call
:func:`apply_recipe`, so a recipe means the same layers and grids wherever it is used.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lq.config import EXPORT_TARGETS, RECIPES, QuantConfig

#: what lq's own entry points quantize with when given no recipe, by where the model will run: onnxruntime's CPU
#: kernels' own grids (asymmetric uint8 activations, 7-bit weights, no clamping op in the file) for onnxruntime,
#: pytorch-quantization's symmetric INT8 (zero point 0 everywhere, 8-bit per-channel weights) for TensorRT, symmetric
#: activations on the layers' inputs only for OpenVINO
TARGET_RECIPES = {"onnxruntime": "int8_onnxruntime", "tensorrt": "int8_per_channel", "openvino": "int8_openvino"}
#: with learned ranges (``QATConfig.learn_amax``): symmetric grids, which PACT-style clipping learns; asymmetric
#: learned ranges are not built, so onnxruntime gets its fastest symmetric recipe
LEARNED_RANGE_RECIPES = {"onnxruntime": "int8_reduce_range", "tensorrt": "int8_per_channel",
                         "openvino": "int8_openvino"}
assert set(TARGET_RECIPES) == set(LEARNED_RANGE_RECIPES) == set(EXPORT_TARGETS)


def default_recipe(target: str = "onnxruntime", learn_amax: bool = False) -> QuantConfig:
    """The recipe for ``target`` (see :data:`TARGET_RECIPES`; :data:`LEARNED_RANGE_RECIPES` with ``learn_amax``)."""
    if target not in TARGET_RECIPES:
        raise ValueError(f"target={target!r} is not allowed: one of {list(TARGET_RECIPES)}")
    return RECIPES[(LEARNED_RANGE_RECIPES if learn_amax else TARGET_RECIPES)[target]]()


def input_config(cfg, learn_amax: bool):
    """An input quantizer's config under ``learn_amax`` (QAT with learned ranges): symmetric grids only."""
    if not (learn_amax and cfg.enabled and cfg.block_size is None):
        return cfg
    if cfg.asymmetric:
        raise ValueError("QATConfig.learn_amax=true needs symmetric input quantizers, and this recipe's are "
                         "asymmetric (calibrated affine ranges); use learn_amax=false (QAT then trains the "
                         "weights on the calibrated ranges) or quant=int8_reduce_range")
    return replace(cfg, learn_amax=True)


def apply_recipe(model: nn.Module, quant: QuantConfig, *, learn_amax: bool = False, type_map=None,
                 overrides: dict | None = None, sample=None) -> Any:
    """Quantize ``model`` in place per ``quant``; returns the conversion summary.

    ``type_map`` (lq.quantize_model's meaning) replaces the recipe's layer types; ``overrides``
    (``{glob: {"input"/"weight": QuantDescriptor}}``) apply after the recipe's own; ``sample``: inputs to capture
    the model with (:func:`lq.convert.quantize_model`).
    """
    from lq.convert import quantize_model
    from lq.nn.modules.tensor_quantizer import name_quantizers

    merged = _transposed_conv_overrides(model, quant)
    for glob, per in quant.overrides.items():
        merged[glob] = {}
        for role in per:
            cfg = quant.override_for(role, glob)
            merged[glob][role] = (input_config(cfg, learn_amax) if role == "input" else cfg).to_descriptor()
    for glob, per in (overrides or {}).items():
        merged.setdefault(glob, {}).update(per)
    if type_map is None:
        type_map = recipe_type_map(quant)
    _check_blocks(model, quant, type_map)
    summary = quantize_model(
        model,
        type_map=type_map,
        include=tuple(quant.include),
        exclude=tuple(quant.exclude),
        overrides=merged or None,
        quant_desc_input=input_config(quant.input, learn_amax).to_descriptor(),
        quant_desc_weight=quant.weight.to_descriptor(),
        glue=quant.glue,
        unsigned_after_relu=quant.unsigned_after_relu,
        shared_inputs=quant.shared_inputs,
        recurrent=quant.recurrent,
        activations=quant.activations,
        sample=sample,
    )
    name_quantizers(model, overwrite=True)
    _apply_enabled(model, quant)
    return summary


def recipe_type_map(quant: QuantConfig):
    """The float classes the recipe quantizes: ``types`` by name (None: all of lq's layers), plus SiLU and
    HardSwish when the recipe quantizes ``activations``."""
    from lq.convert import DEFAULT_TYPE_MAP
    from lq.nn.modules.quant_activation import ACTIVATION_MODULE_CLASSES

    full = dict(DEFAULT_TYPE_MAP) | (dict(ACTIVATION_MODULE_CLASSES) if quant.activations else {})
    if quant.types is None:
        return None if not quant.activations else full
    by_name = {cls.__name__: cls for cls in full}
    unknown = [t for t in quant.types if t not in by_name]
    if unknown:
        raise ValueError(f"QuantConfig.types has unknown layer type(s) {unknown}; allowed: {sorted(by_name)}")
    return {by_name[t]: full[by_name[t]] for t in quant.types}


def _check_blocks(model, quant: QuantConfig, type_map) -> None:
    """Block sizes must divide every selected layer's weight dim: fail before changing anything."""
    from lq.convert import DEFAULT_TYPE_MAP

    kinds = tuple(type_map) if type_map is not None else tuple(DEFAULT_TYPE_MAP)  # a mapping: its keys
    bad = []
    for name, m in model.named_modules():
        if not name or not isinstance(m, kinds) or not quant.selects(name):
            continue
        cfg = quant.quantizer_for(name, "weight")
        w = getattr(m, "weight", None)
        if cfg.block_size is None or not cfg.enabled or not isinstance(w, torch.Tensor):
            continue
        axis = cfg.block_axis % w.dim()
        if w.shape[axis] % cfg.block_size:
            bad.append(f"{name} (weight {tuple(w.shape)}, dim {axis} = {w.shape[axis]})")
    if bad:
        raise ValueError(
            f"weight block_size={quant.weight.block_size} does not divide the block axis of: {', '.join(bad)}; "
            "exclude those layers (quant.exclude), restrict quant.types, or override their block_size"
        )


def _transposed_conv_overrides(model, quant: QuantConfig) -> dict:
    """Per-channel weights of ConvTranspose layers live on axis 1 (weights are (in, out, k...)).

    The recipe's ``axis: [0]`` means "per output channel"; for transposed convolutions that is
    axis 1, so those layers get their own descriptor (user overrides still apply after this).
    """
    w = quant.weight
    if w.axis != [0]:
        return {}
    kinds = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)  # quantized ones subclass these
    desc = replace(w, axis=[1]).to_descriptor()
    return {name: {"weight": desc} for name, m in model.named_modules()
            if isinstance(m, kinds) and name and quant.selects(name)}


def _apply_enabled(model, quant: QuantConfig) -> None:
    """Turn off the quantizers whose config says ``enabled: false`` (e.g. weight-only recipes)."""
    from lq.nn.modules.tensor_quantizer import iter_quantizers

    for name, tq in iter_quantizers(model):
        layer, _, attr = name.rpartition(".")
        role = "weight" if "weight" in attr else "input"
        if not quant.selects(layer):
            continue
        if not quant.quantizer_for(layer, role).enabled:
            tq.disable()
