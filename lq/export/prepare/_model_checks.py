"""What the export needs to know about the PyTorch model's quantizers before it runs ``torch.onnx.export``.

Which quantizers are enabled, dynamic, uncalibrated or FP8 (the opset depends on it), and the export mode in
which they call lq's own ops, so the exporter lowers them exactly. Duck-typed: pytorch-quantization's
``TensorQuantizer`` passes the same checks.
"""

from __future__ import annotations

import contextlib

import torch


def find_uncalibrated_quantizers(model: torch.nn.Module) -> list[str]:
    """Names of enabled quantizers that would need an amax and have none."""
    bad = []
    for name, m in model.named_modules():
        if not _is_quantizer(m):
            continue
        if not _quantizer_enabled(m):
            continue
        if _is_dynamic(m):
            continue
        if getattr(m, "amax", None) is None and getattr(m, "_min_range", None) is None:
            bad.append(name or "<model>")
    return bad


def _is_quantizer(m) -> bool:
    return type(m).__name__ in ("TensorQuantizer", "ScaledTensorQuantizer") or (
        hasattr(m, "_if_quant") and hasattr(m, "num_bits") and hasattr(m, "amax"))


def _quantizer_enabled(m) -> bool:
    for attr in ("is_enabled", "enabled"):
        v = getattr(m, attr, None)
        if isinstance(v, bool):
            if not v:
                return False
            break
    if getattr(m, "_disabled", False):
        return False
    if getattr(m, "_if_quant", True) is False:
        return False
    return True


def _is_dynamic(m) -> bool:
    desc = getattr(m, "_quant_desc", None) or getattr(m, "quant_desc", None)
    for obj in (m, desc):
        if obj is None:
            continue
        d = getattr(obj, "dynamic", None)
        if isinstance(d, bool) and d:
            return True
        if getattr(obj, "_dynamic", False) is True:
            return True
    bs = getattr(m, "block_sizes", None)
    if isinstance(bs, dict) and bs.get("type") == "dynamic":
        return True
    return False


@contextlib.contextmanager
def export_mode(model: torch.nn.Module):
    """Quantizers call lq's ops during the export (``use_fb_fake_quant`` off): lq lowers them itself, exactly
    (torch's fake_quantize_* cannot express narrow range and do not trace with torch.export)."""
    classes = {cls for _, m in model.named_modules() if _is_quantizer(m) for cls in type(m).__mro__
               if "use_fb_fake_quant" in vars(cls)}
    saved = [(cls, cls.use_fb_fake_quant) for cls in classes]
    for cls, _ in saved:
        cls.use_fb_fake_quant = False
    try:
        yield
    finally:
        for cls, v in saved:
            cls.use_fb_fake_quant = v

def model_min_opset(model) -> int:
    """The lowest opset that can hold the model's quantizers: 19 for FP8 (float8e4m3fn), 21 for blocked
    quantizers (``block_size`` on DequantizeLinear), else 13 (per-channel axis)."""
    need = 13
    for _, m in model.named_modules():
        if not (_is_quantizer(m) and _quantizer_enabled(m)):
            continue
        if getattr(m, "num_bits", None) == (4, 3):
            need = max(need, 19)
        if getattr(m, "block_sizes", None):
            need = max(need, 21)
    return need
