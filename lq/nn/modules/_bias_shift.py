"""The bias shift of a quantized conv / linear: what bias correction adds to its bias while it quantizes.

Bias correction (:mod:`lq.calib.bias_correction`) compensates the mean output shift that quantizing causes, so
it belongs to the quantized layer, not to the float model: the shift is a buffer of its own, added to the bias
only while one of the layer's quantizers is on. With every quantizer off the layer computes the user's float
model exactly (a float region, the speed check's FP32 reference, ``dequantize``), and ``to_float`` drops it. A
bias-less conv gets the shift as its bias (the BatchNorm after it then folds onto it in the file).

The buffer exists only once a correction was made, so a module that never had one has the state_dict keys of
the reference toolkit; a checkpoint that holds one loads into a freshly quantized model (the load pre-hook
creates the buffer first). In the file the shift is part of the layer's bias initializer (the exporters fold
the constant sum).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BUFFER", "bias_shift", "fold_into_bias", "install", "quant_bias", "set_bias_shift", "unfold_where_float",
           "without"]

BUFFER = "_bias_shift"


def bias_shift(module: nn.Module) -> torch.Tensor | None:
    """The shift added to ``module``'s bias while it quantizes (None: none)."""
    return module._buffers.get(BUFFER)


def set_bias_shift(module: nn.Module, shift: torch.Tensor | None) -> None:
    """Set (a per-output-channel tensor) or remove (None) ``module``'s bias shift."""
    if shift is None:
        module._buffers.pop(BUFFER, None)
        return
    ref = module.weight
    module.register_buffer(BUFFER, shift.detach().to(device=ref.device, dtype=ref.dtype).reshape(-1).clone())


def _quantizing(module: nn.Module) -> bool:
    return any(q.is_enabled for _, q in module.iter_quantizers())


def quant_bias(module: nn.Module) -> torch.Tensor | None:
    """The bias ``module``'s forward uses: its own, plus the shift while one of its quantizers is on."""
    shift = module._buffers.get(BUFFER)
    if shift is None or not _quantizing(module):
        return module.bias
    return shift if module.bias is None else module.bias + shift


def fold_into_bias(model: nn.Module) -> dict[str, torch.Tensor]:
    """In an export's own copy of the model: each quantizing layer's shift added into its bias parameter (made where
    it had none), the buffer dropped. The traced graph then reads the layer's bias initializer as the uncorrected
    model's does (the export's passes find their pattern), and the values are the forward's own float32 sum.
    Returns ``{module path: its bias before the fold}`` (zeros where it had none), which :func:`unfold_where_float`
    puts back in a copy whose layer the fallback sends to float."""
    folded = {}
    for name, m in model.named_modules():
        shift = m._buffers.get(BUFFER)
        if shift is None:
            continue
        if _quantizing(m):
            with torch.no_grad():
                value = quant_bias(m).detach().clone()
                folded[name] = m.bias.detach().clone() if m.bias is not None else torch.zeros_like(value)
            m._parameters["bias"] = nn.Parameter(value, requires_grad=False)
        del m._buffers[BUFFER]
    return folded


def unfold_where_float(model: nn.Module, folded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In a copy of a folded model (:func:`fold_into_bias`): each folded layer that no longer quantizes (the
    fallback turned its quantizers off) gets its bias from before the fold back, so it computes the user's float
    layer, as the user's model does with those quantizers off (the shift corrects an error that is gone). Returns
    ``{module path: the bias put back}``."""
    back = {}
    for name, bias in folded.items():
        m = model.get_submodule(name)
        if not _quantizing(m):
            with torch.no_grad():
                m.bias.copy_(bias)
            back[name] = bias
    return back


def _load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """A checkpoint with a shift loads into a module without one yet: make the buffer it fills."""
    src = state_dict.get(prefix + BUFFER)
    if isinstance(src, torch.Tensor) and BUFFER not in module._buffers:
        module.register_buffer(BUFFER, torch.zeros(src.shape, dtype=module.weight.dtype, device=module.weight.device))


def install(module: nn.Module) -> None:
    """Let ``module`` load a checkpoint's shift (once per module)."""
    if not any(getattr(h, "hook", None) is _load_pre_hook for h in module._load_state_dict_pre_hooks.values()):
        module.register_load_state_dict_pre_hook(_load_pre_hook)


def without(state: dict) -> dict:
    """A module ``__dict__`` copy (``to_float``'s) without the shift and its load hook."""
    state["_buffers"].pop(BUFFER, None)
    hooks = state.get("_load_state_dict_pre_hooks")
    if hooks:
        state["_load_state_dict_pre_hooks"] = type(hooks)(
            (k, h) for k, h in hooks.items() if getattr(h, "hook", None) is not _load_pre_hook)
    return state
