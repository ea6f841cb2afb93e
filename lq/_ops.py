"""The ``torch.ops.lq`` operator library: schemas, fake impls, autograd, fallback.

One place defines every op (``SCHEMAS``). For each op this module registers

* the schema (``torch.library``, namespace ``lq``),
* a fake (meta) implementation, so ``torch.compile`` and ``torch.export``
  trace the op without running it,
* the autograd formula (straight-through estimator with clipping; on CPU the
  extension registers the same formula in C++ for ``fake_quant`` and
  ``scaled_e4m3``, csrc/autograd.cpp, tested against this one), and
* the pure-PyTorch reference from :mod:`lq._reference` as the
  ``CompositeExplicitAutograd`` kernel: it serves any device that has no
  compiled kernel, and every device when the extension is unavailable.

The first op that runs loads the compiled extension (:mod:`lq._ext`, building it
once), whose C++/CUDA kernels register for the CPU/CUDA dispatch keys and take
precedence there; ``import lq`` alone builds nothing.
"""

from __future__ import annotations

import torch

from lq import _checks, _ext, _reference

SCHEMAS = {
    "fake_quant": "fake_quant(Tensor x, Tensor amax, int num_bits, bool unsigned, bool narrow_range) -> Tensor",
    "fake_quant_out": (
        "fake_quant_out(Tensor x, Tensor amax, int num_bits, bool unsigned, bool narrow_range, Tensor(a!) out) -> ()"
    ),
    "fake_quant_backward": "fake_quant_backward(Tensor grad, Tensor x, Tensor amax) -> Tensor",
    "quant": "quant(Tensor x, Tensor amax, int num_bits, bool unsigned, bool narrow_range) -> (Tensor, Tensor)",
    "fake_affine_quant": "fake_affine_quant(Tensor x, Tensor min_range, Tensor max_range, int num_bits) -> Tensor",
    "fake_affine_quant_backward": (
        "fake_affine_quant_backward(Tensor grad, Tensor x, Tensor min_range, Tensor max_range) -> Tensor"
    ),
    "scaled_e4m3": "scaled_e4m3(Tensor x, Tensor amax) -> Tensor",
    "fake_dynamic_block_quant": (
        "fake_dynamic_block_quant(Tensor x, int axis, int block_size, int num_bits, bool unsigned, "
        "bool narrow_range) -> Tensor"
    ),
    "abs_histogram": (
        "abs_histogram(Tensor x, Tensor range_max, int num_bins, int? axis) -> (Tensor, Tensor, Tensor)"
    ),
}

_lib = torch.library.Library("lq", "DEF")
for _schema in SCHEMAS.values():
    _lib.define(_schema)


# --------------------------------------------------------------------------- reference kernels
def _ref_fake_quant(x, amax, num_bits, unsigned, narrow_range):
    _checks.check_amax_values(amax)
    _checks.check_unsigned_input(x, unsigned)
    return _reference.fake_quant(x, amax, num_bits, unsigned, narrow_range)


def _ref_fake_quant_out(x, amax, num_bits, unsigned, narrow_range, out):
    out.copy_(_ref_fake_quant(x, amax, num_bits, unsigned, narrow_range))


def _ref_quant(x, amax, num_bits, unsigned, narrow_range):
    _checks.check_amax_values(amax)
    _checks.check_unsigned_input(x, unsigned)
    return _reference.quant(x, amax, num_bits, unsigned, narrow_range)


def _ref_fake_affine_quant(x, min_range, max_range, num_bits):
    return _reference.fake_affine_quant(x, min_range, max_range, num_bits)


def _ref_scaled_e4m3(x, amax):
    _checks.check_amax_values(amax)
    return _reference.scaled_e4m3(x, amax)


def _ref_fake_dynamic_block_quant(x, axis, block_size, num_bits, unsigned, narrow_range):
    _checks.check_unsigned_input(x, unsigned)
    return _reference.fake_dynamic_block_quant(x, axis, block_size, num_bits, unsigned, narrow_range)


_REFERENCE_KERNELS = {
    "fake_quant": _ref_fake_quant,
    "fake_quant_out": _ref_fake_quant_out,
    "fake_quant_backward": _reference.fake_quant_backward,
    "quant": _ref_quant,
    "fake_affine_quant": _ref_fake_affine_quant,
    "fake_affine_quant_backward": _reference.fake_affine_quant_backward,
    "scaled_e4m3": _ref_scaled_e4m3,
    "fake_dynamic_block_quant": _ref_fake_dynamic_block_quant,
    "abs_histogram": _reference.abs_histogram,
}
def _loads_first(name: str, fn):
    """The reference kernel, which on the first call of any lq op loads the compiled kernels (building them
    once) and hands the call to them: ``import lq`` stays light and builds nothing. Afterwards the compiled
    kernels serve CPU (and CUDA) directly and this runs only for devices they do not cover."""

    def kernel(*args):
        if not _ext.attempted() and _ext.load():
            return getattr(torch.ops.lq, name)(*args)
        return fn(*args)

    kernel.__name__ = fn.__name__
    return kernel


for _name, _fn in _REFERENCE_KERNELS.items():
    _lib.impl(_name, _loads_first(_name, _fn), "CompositeExplicitAutograd")


# --------------------------------------------------------------------------- fake (meta) impls
@torch.library.register_fake("lq::fake_quant")
def _(x, amax, num_bits, unsigned, narrow_range):
    _checks.check_num_bits(num_bits, unsigned)
    _checks.check_amax_shape(x, amax)
    return torch.empty_like(x)


@torch.library.register_fake("lq::fake_quant_out")
def _(x, amax, num_bits, unsigned, narrow_range, out):
    _checks.check_num_bits(num_bits, unsigned)
    _checks.check_amax_shape(x, amax)


@torch.library.register_fake("lq::fake_quant_backward")
def _(grad, x, amax):
    return torch.empty_like(grad)


@torch.library.register_fake("lq::quant")
def _(x, amax, num_bits, unsigned, narrow_range):
    _checks.check_num_bits(num_bits, unsigned)
    _checks.check_amax_shape(x, amax)
    return torch.empty_like(x), torch.empty_like(amax, dtype=torch.float32)


@torch.library.register_fake("lq::fake_affine_quant")
def _(x, min_range, max_range, num_bits):
    return torch.empty_like(x)


@torch.library.register_fake("lq::fake_affine_quant_backward")
def _(grad, x, min_range, max_range):
    return torch.empty_like(grad)


@torch.library.register_fake("lq::scaled_e4m3")
def _(x, amax):
    _checks.check_amax_shape(x, amax)
    return torch.empty_like(x)


@torch.library.register_fake("lq::fake_dynamic_block_quant")
def _(x, axis, block_size, num_bits, unsigned, narrow_range):
    _checks.check_num_bits(num_bits, unsigned)
    _checks.check_block(x, axis, block_size)
    return torch.empty_like(x)


@torch.library.register_fake("lq::abs_histogram")
def _(x, range_max, num_bins, axis):
    if axis is None:
        lead: tuple = ()
    else:
        lead = (x.shape[_checks.normalize_axis(axis, x.dim())],)
    return (
        x.new_empty(lead + (num_bins,), dtype=torch.int64),
        x.new_empty(lead, dtype=torch.float32),
        x.new_empty(lead, dtype=torch.int64),
    )


# --------------------------------------------------------------------------- autograd
def sum_to_shape(t: torch.Tensor, shape) -> torch.Tensor:
    """Sum ``t`` over the dims that were broadcast to reach ``t.shape`` from ``shape``."""
    shape = tuple(shape)
    lead = t.dim() - len(shape)
    if lead > 0:
        t = t.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and t.shape[i] != 1)
    if dims:
        t = t.sum(dim=dims, keepdim=True)
    return t.reshape(shape)


def clip_amax_grad(grad: torch.Tensor, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """PACT-style gradient of amax: ``sign(x)`` where ``|x| > amax``, summed to amax's shape."""
    cd = _reference.compute_dtype(x)
    xf = x.to(cd)
    outside = xf.abs() > amax.to(cd)
    g = torch.where(outside, grad.to(cd) * torch.sign(xf), torch.zeros_like(xf))
    return sum_to_shape(g, amax.shape).to(amax.dtype)


def _setup_x_amax(ctx, inputs, output):
    x, amax = inputs[0], inputs[1]
    ctx.save_for_backward(x, amax)


def _backward_ste(ctx, grad, *unused):
    x, amax = ctx.saved_tensors
    grad_x = torch.ops.lq.fake_quant_backward(grad, x, amax) if ctx.needs_input_grad[0] else None
    grad_amax = clip_amax_grad(grad, x, amax) if ctx.needs_input_grad[1] else None
    return (grad_x, grad_amax) + (None,) * (len(ctx.needs_input_grad) - 2)


torch.library.register_autograd("lq::fake_quant", _backward_ste, setup_context=_setup_x_amax)
torch.library.register_autograd("lq::scaled_e4m3", _backward_ste, setup_context=_setup_x_amax)


def _backward_quant(ctx, grad_q, grad_scale):
    return _backward_ste(ctx, grad_q)


torch.library.register_autograd("lq::quant", _backward_quant, setup_context=_setup_x_amax)


def _setup_affine(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2])


def _backward_affine(ctx, grad):
    x, lo, hi = ctx.saved_tensors
    grad_x = torch.ops.lq.fake_affine_quant_backward(grad, x, lo, hi) if ctx.needs_input_grad[0] else None
    return grad_x, None, None, None


torch.library.register_autograd("lq::fake_affine_quant", _backward_affine, setup_context=_setup_affine)


def _setup_nothing(ctx, inputs, output):
    pass


def _backward_identity(ctx, grad):
    # A dynamic amax bounds every value of its block, so the clipped STE passes everything.
    return grad, None, None, None, None, None


torch.library.register_autograd(
    "lq::fake_dynamic_block_quant", _backward_identity, setup_context=_setup_nothing
)


# --------------------------------------------------------------------------- compiled kernels
# The extension registers its kernels for these schemas when the first op runs (see _loads_first).
