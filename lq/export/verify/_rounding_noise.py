"""How far PyTorch's own fake-quant model moves when its arithmetic moves by a rounding error.

Verification compares onnxruntime's output with PyTorch's in output quantization steps. Two runtimes that compute
the same quantized model differ in their float arithmetic (a BatchNorm folded into the conv, a bias rounded to
int32, a reciprocal for a division, a polynomial sigmoid): far below one step, but every value that sits that close
to a rounding boundary lands on the other grid point, and a flipped step tips more boundaries downstream. How much
that moves the output is a property of the model and the data, not of the file: a shallow net moves by a step on a
few elements, a deep net with squeeze-excite gates on images with large flat backgrounds (one boundary value
repeated over a whole background: measured, a 16-block EfficientNet-style net on padded MNIST digits) moves its
logits as far as quantization itself moves them from FP32.

This module measures that property: it runs the model again with every activation quantizer's input moved by a
seeded random fraction (at most :data:`NOISE_STEPS`) of that quantizer's step, the size of the float differences
two runtimes leave. Verification then judges the file against what the model does to itself under rounding-level
noise, not against a fixed count that only shallow nets meet. A file with a real error (a wrong scale, a wrong
rewrite) moves values by whole steps at the layer where it is wrong, which this noise does not; on a model too
chaotic for its logits to tell, the top-1 agreement (judged separately, unchanged) still does.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from lq import _reference

#: the largest move of a quantizer's input, in that quantizer's steps: onnxruntime's int32 bias (at most half an
#: accumulator unit, measured up to 0.005 output steps on a depthwise conv with a folded BatchNorm) and its float32
#: requantization (about 1e-4 steps) stay well inside it
NOISE_STEPS = 0.01


def activation_step(q) -> torch.Tensor | None:
    """One step of an activation quantizer's grid (its largest, per channel), None for one without a fixed integer
    grid (dynamic, FP8, blocks, disabled)."""
    if not getattr(q, "is_enabled", False) or not getattr(q, "_if_quant", False) or q.dynamic or q.is_fp8:
        return None
    if getattr(q, "_block_sizes", None):
        return None
    lo, hi = getattr(q, "_min_range", None), getattr(q, "_max_range", None)
    if lo is not None and hi is not None:  # asymmetric: the affine grid's step
        return _reference.affine_params(lo.detach(), hi.detach(), q.num_bits)[0].float().reshape(())
    step = q.step_size
    return None if step is None else step.detach().float().max().reshape(())


@contextlib.contextmanager
def rounding_noise(model: torch.nn.Module, seed: int = 0, steps: float = NOISE_STEPS):
    """Inside: every activation quantizer of ``model`` sees its input moved by uniform noise in ``+-steps`` of its
    step (seeded: the same numbers on every call and every rank). Weight quantizers are left alone (the file holds
    the same integer weights). The hooks are removed on exit, also on error."""
    from lq.nn.modules.tensor_quantizer import TensorQuantizer

    gen = torch.Generator().manual_seed(seed)

    def hook(step, unsigned: bool):
        def move(_module, inputs):
            x = inputs[0]
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return None
            u = torch.rand(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)
            moved = x + (2 * u - 1) * (steps * step.to(x.dtype))
            # an unsigned quantizer reads a ReLU's output: its zeros are exact in every runtime, and it refuses < 0
            return (moved.clamp_min(0) if unsigned else moved,) + tuple(inputs[1:])
        return move

    handles = []
    try:
        for name, m in model.named_modules():
            if isinstance(m, TensorQuantizer) and not name.endswith("weight_quantizer"):
                step = activation_step(m)
                if step is not None and float(step) > 0:
                    handles.append(m.register_forward_pre_hook(hook(step, bool(getattr(m, "unsigned", False)))))
        yield len(handles)
    finally:
        for h in handles:
            h.remove()


def noisy_outputs(model: torch.nn.Module, run, seed: int = 0) -> list[np.ndarray] | None:
    """``run(model)``'s flattened outputs (numpy, float32) with :func:`rounding_noise` on; None when the model has
    no activation quantizer to move."""
    with rounding_noise(model, seed) as n:
        if not n:
            return None
        with torch.no_grad():
            return run(model)
