"""The C++ CPU kernels (``csrc/*.cpp``) against the pure-PyTorch reference, bit for bit.

Every ``torch.ops.lq`` op is called with the extension loaded (so the CPU
dispatch key runs the compiled kernel) and compared with the function of
:mod:`lq._reference` called directly. Comparisons are bitwise (signed zeros
included); only the payload of NaNs may differ.

With ``LQ_DISABLE_EXT=1`` the kernel-vs-reference tests skip (there is no
kernel to compare); when the extension should be there but failed to build,
they fail. Error and autograd tests run on either path.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from lq import _ext, _ops
from lq import _reference as R

torch.set_flush_denormal(True)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OPS = torch.ops.lq


# ====================================================================== helpers
@pytest.fixture
def ext():
    """Skip without the extension on purpose (LQ_DISABLE_EXT); fail when it should be there but is not."""
    if _ext.disabled():
        pytest.skip("LQ_DISABLE_EXT is set: no compiled kernel to compare with the reference")
    assert _ext.load(), f"lq's C++ extension did not build/load: {_ext._STATE['error']}"
    return True


_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float64: torch.int64}


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str = ""):
    """Same shape, dtype and bits (signed zeros too); NaN where the other has NaN."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not got.is_floating_point():
        assert torch.equal(got, want), f"{what}: {got} != {want}"
        return
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN positions differ ({int((gn ^ wn).sum())} elements)"
    gi = got.contiguous().view(_INT_VIEW[got.dtype])[~gn]
    wi = want.contiguous().view(_INT_VIEW[want.dtype])[~wn]
    bad = gi != wi
    if bad.any():
        i = int(bad.nonzero()[0])
        g, w = got[~gn][i].item(), want[~wn][i].item()
        raise AssertionError(f"{what}: {int(bad.sum())} of {got.numel()} elements differ, e.g. {g!r} != {w!r}")


SPECIALS = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, 1e-30, 2.0**-24, 65504.0]


def rand_x(shape, dtype, rng: random.Random, specials=True, positive=False):
    x = torch.randn(shape) * rng.choice([0.01, 1.0, 3.0, 100.0])
    if specials and x.numel():
        flat = x.view(-1)
        for _ in range(rng.randint(0, 4)):
            flat[rng.randrange(flat.numel())] = rng.choice(SPECIALS)
    if positive:
        x = x.abs()  # keeps NaN; -0.0 becomes 0.0
    return x.to(dtype)


def rand_shape(rng: random.Random, max_dims=4, max_size=40, allow_empty=True, max_numel=20_000):
    """A random shape of 0..max_dims dims (sometimes with a 0 size), at most max_numel elements."""
    while True:
        nd = rng.randint(0, max_dims)
        shape = tuple(0 if (allow_empty and rng.random() < 0.03) else rng.choice(
            [1, 2, 3, 5, 16, 17, 33, rng.randint(1, max_size)]) for _ in range(nd))
        if math.prod(shape) <= max_numel:
            return shape


def amax_for(x: torch.Tensor, rng: random.Random, axis=None, zeros=True):
    """Per-tensor amax (axis None) or per-channel amax keeping `axis`, some below the data's max."""
    xf = x.float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs()
    if axis is None or x.dim() == 0:
        a = (xf.max() if xf.numel() else torch.tensor(1.0)) * rng.choice([0.5, 0.9, 1.0, 1.5])
        a = a.reshape(()) if rng.random() < 0.7 else a.reshape([1] * x.dim())
        return a if float(a) > 0 else torch.tensor(1.0)
    dims = [d for d in range(x.dim()) if d != axis]
    a = xf.amax(dim=dims, keepdim=True) if xf.numel() else torch.ones([1] * x.dim())
    a = a * torch.empty_like(a).uniform_(0.3, 1.5)
    a = torch.where(a > 0, a, torch.ones_like(a))
    if zeros and a.numel() > 1:
        flat = a.view(-1)
        flat[rng.randrange(flat.numel())] = rng.choice([0.0, 2.0**-24, 2.0**-23])
    if rng.random() < 0.3 and a.dim() > 0:  # drop leading size-1 dims: broadcasting aligns at the right
        while a.dim() > 0 and a.shape[0] == 1:
            a = a[0]
    return a


def views(x: torch.Tensor, rng: random.Random):
    """x itself and non-contiguous views of (a bigger) x with the same values pattern."""
    out = [("contiguous", x)]
    if x.dim() >= 2:
        out.append(("transposed", x.transpose(0, -1).contiguous().transpose(0, -1)))
    if x.dim() >= 1 and x.numel():
        big = torch.repeat_interleave(x, 2, dim=-1)
        out.append(("stepped", big[..., ::2]))
    return out


# ====================================================================== the kernels are registered
def test_every_op_has_a_cpu_kernel(ext):
    for name in _ops.SCHEMAS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"lq::{name}", "CPU"), (
            f"lq::{name} has no CPU kernel: csrc/*.cpp must register it with TORCH_LIBRARY_IMPL(lq, CPU, m)")


# ====================================================================== fake_quant / quant
@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quant_random(ext, dtype):
    rng = random.Random(1000 + DTYPES.index(dtype))
    for case in range(150):
        shape = rand_shape(rng)
        unsigned = rng.random() < 0.25
        x = rand_x(shape, dtype, rng, positive=unsigned)
        axis = None if (rng.random() < 0.4 or not shape) else rng.randrange(len(shape))
        amax = amax_for(x, rng, axis)
        num_bits = rng.randint(1 if unsigned else 2, 16)
        narrow = rng.random() < 0.5
        for kind, xv in views(x, rng):
            what = f"case {case} {kind} shape={shape} axis={axis} bits={num_bits} unsigned={unsigned} narrow={narrow}"
            got = OPS.fake_quant(xv, amax, num_bits, unsigned, narrow)
            assert_bitwise(got, R.fake_quant(xv, amax, num_bits, unsigned, narrow), "fake_quant " + what)
            q, s = OPS.quant(xv, amax, num_bits, unsigned, narrow)
            rq, rs = R.quant(xv, amax, num_bits, unsigned, narrow)
            assert_bitwise(q, rq, "quant " + what)
            assert_bitwise(s, rs, "quant scale " + what)


@pytest.mark.parametrize("num_bits", range(2, 17))
def test_fake_quant_every_bit_width(ext, num_bits):
    rng = random.Random(num_bits)
    for dtype in DTYPES:
        x = rand_x((7, 45), dtype, rng)
        for unsigned, narrow in ((False, True), (False, False), (True, False), (True, True)):
            xx = x.float().abs().to(dtype) if unsigned else x
            for amax in (amax_for(xx, rng, None), amax_for(xx, rng, 0), amax_for(xx, rng, 1)):
                got = OPS.fake_quant(xx, amax, num_bits, unsigned, narrow)
                assert_bitwise(got, R.fake_quant(xx, amax, num_bits, unsigned, narrow),
                               f"{dtype} unsigned={unsigned} narrow={narrow} amax {tuple(amax.shape)}")
                q, s = OPS.quant(xx, amax, num_bits, unsigned, narrow)
                rq, rs = R.quant(xx, amax, num_bits, unsigned, narrow)
                assert_bitwise(q, rq)
                assert_bitwise(s, rs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_bits", [2, 4, 8, 13])
def test_exact_ties_round_half_to_even(ext, dtype, num_bits):
    """x * scale == k + 0.5 exactly: both round to the even neighbour."""
    _, max_bound = R.int_bounds(num_bits, False, True)
    k = torch.arange(-int(max_bound) - 1, int(max_bound) + 1, dtype=torch.float32)
    found = 0
    for a in (max_bound, max_bound / 4, max_bound * 8, 3.0):
        amax = torch.tensor(a)
        scale = R.quant_scale(amax, num_bits, False)
        x = ((k + 0.5) / scale).to(dtype)
        prod = x.float() * scale
        x = x[prod == torch.floor(prod) + 0.5]  # keep the exact ties
        found += x.numel()
        got = OPS.fake_quant(x, amax, num_bits, False, False)
        assert_bitwise(got, R.fake_quant(x, amax, num_bits, False, False))
        q, _ = OPS.quant(x, amax, num_bits, False, False)
        qf = q.float()
        assert torch.all(torch.remainder(qf[qf.abs() < max_bound], 2) == 0), "ties must round to even"
    assert found > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quant_tiny_and_zero_amax(ext, dtype):
    x = torch.tensor([[1.0, -2.0, float("nan"), float("inf"), -0.0, 3e-8],
                      [0.5, -0.5, 1e-8, -1e-8, float("-inf"), 0.0]], dtype=dtype)
    for a in (0.0, 2.0**-24, 2.0**-24 * 1.0000001, 2.0**-23, 1e-7):
        amax = torch.tensor(a)
        assert_bitwise(OPS.fake_quant(x, amax, 8, False, True), R.fake_quant(x, amax, 8, False, True), f"amax={a}")
        q, s = OPS.quant(x, amax, 8, False, True)
        rq, rs = R.quant(x, amax, 8, False, True)
        assert_bitwise(q, rq, f"quant amax={a}")
        assert_bitwise(s, rs, f"quant scale amax={a}")
    amax = torch.tensor([[0.0], [2.0]])
    assert_bitwise(OPS.fake_quant(x, amax, 8, False, True), R.fake_quant(x, amax, 8, False, True))
    assert_bitwise(OPS.quant(x, amax, 8, False, True)[1], R.quant(x, amax, 8, False, True)[1])


# ====================================================================== the scale, written out in numpy
def _amax_and_scales(max_bound: float, n: int = 5000, seed: int = 0):
    """float32 amax values with ``max_bound / amax`` in one rounding (numpy) and in two (1 / amax, then times
    max_bound: what torch makes of ``number / tensor``)."""
    a = np.random.RandomState(seed).uniform(0.01, 10.0, n).astype(np.float32)
    one = np.float32(max_bound) / a
    two = (np.float32(1.0) / a) * np.float32(max_bound)
    assert one.dtype == two.dtype == np.float32
    assert (one != two).sum() > n // 50, "test construction: the amax values must tell the two formulas apart"
    return a, one, two


@pytest.mark.parametrize("num_bits,unsigned,narrow", [(8, False, True), (8, False, False), (4, False, True),
                                                      (8, True, False), (16, True, False)])
def test_integer_scale_is_one_float32_division(num_bits, unsigned, narrow):
    """pytorch-quantization's scale is ``max_bound / amax`` in one IEEE division (its kernels, and its formula
    with max_bound as a tensor); fake quantization is ``round(clip(x * s)) / s`` in float32. Written out in
    numpy, per element, against the reference and the public API (compiled kernel or reference path)."""
    from lq import tensor_quant as tq

    max_bound = float(2 ** (num_bits - 1 + int(unsigned)) - 1)
    lo = 0.0 if unsigned else (-max_bound if narrow else -max_bound - 1)
    a, one, _ = _amax_and_scales(max_bound)
    x = np.random.RandomState(1).uniform(0.0 if unsigned else -1.0, 1.0, a.size).astype(np.float32) * a * 1.2
    want = (np.round(np.clip(x * one, lo, max_bound)) / one).astype(np.float32)
    amax, xt = torch.from_numpy(a), torch.from_numpy(x)
    np.testing.assert_array_equal(R.quant_scale(amax, num_bits, unsigned).numpy(), one)
    np.testing.assert_array_equal(R.fake_quant(xt, amax, num_bits, unsigned, narrow).numpy(), want)
    np.testing.assert_array_equal(tq.fake_tensor_quant(xt, amax, num_bits, unsigned, narrow).numpy(), want)
    q, scale = tq.tensor_quant(xt, amax, num_bits, unsigned, narrow)
    np.testing.assert_array_equal(scale.numpy(), one)
    np.testing.assert_array_equal(q.numpy(), np.round(np.clip(x * one, lo, max_bound)))
    for k in (0, 1, 2, a.size - 1):  # per tensor: the single-amax paths
        np.testing.assert_array_equal(tq.fake_tensor_quant(xt, amax[k], num_bits, unsigned, narrow).numpy(),
                                      (np.round(np.clip(x * one[k], lo, max_bound)) / one[k]).astype(np.float32))


def test_e4m3_scale_is_reciprocal_times_448():
    """pytorch-quantization's ``scaled_e4m3`` computes ``448.0 / amax`` with a Python number, which torch
    evaluates as ``reciprocal(amax) * 448``: lq keeps that rounding for FP8 (written out in numpy; the E4M3
    rounding itself is torch's float8 cast)."""
    from lq import tensor_quant as tq

    a, _, _ = _amax_and_scales(448.0)
    two = (np.float32(1.0) / a) * np.float32(448.0)
    x = np.random.RandomState(2).uniform(-1.0, 1.0, a.size).astype(np.float32) * a
    y = torch.from_numpy(np.clip(x * two, -448.0, 448.0)).to(torch.float8_e4m3fn).float().numpy()
    want = (y / two).astype(np.float32)
    amax, xt = torch.from_numpy(a), torch.from_numpy(x)
    np.testing.assert_array_equal(R.scaled_e4m3(xt, amax).numpy(), want)
    np.testing.assert_array_equal(tq.scaled_e4m3(xt, amax).numpy(), want)


def test_fake_quant_amax_dtypes_and_shapes(ext):
    x = torch.randn(4, 6, 5)
    for amax in (torch.tensor(2.0, dtype=torch.float16), torch.tensor([2.0], dtype=torch.bfloat16),
                 torch.full((1, 1, 1), 2.0, dtype=torch.float64), torch.rand(6, 1) + 0.5, torch.rand(5) + 0.5,
                 torch.rand(4, 1, 5) + 0.5, torch.rand(4, 6, 5) + 0.5):
        assert_bitwise(OPS.fake_quant(x, amax, 8, False, True), R.fake_quant(x, amax, 8, False, True),
                       f"amax {amax.dtype} {tuple(amax.shape)}")
        q, s = OPS.quant(x, amax, 8, False, True)
        assert s.dtype == torch.float32 and s.shape == amax.shape
        assert_bitwise(q, R.quant(x, amax, 8, False, True)[0])
        assert_bitwise(s, R.quant(x, amax, 8, False, True)[1])


def test_fake_quant_empty_and_scalar(ext):
    for dtype in DTYPES:
        for shape in ((0,), (3, 0), (0, 4, 2), ()):
            x = torch.randn(shape).to(dtype)
            for amax in (torch.tensor(1.0), torch.ones([1] * len(shape))):
                assert_bitwise(OPS.fake_quant(x, amax, 8, False, True), R.fake_quant(x, amax, 8, False, True))
                q, s = OPS.quant(x, amax, 8, False, True)
                assert_bitwise(q, R.quant(x, amax, 8, False, True)[0])
                assert_bitwise(s, R.quant(x, amax, 8, False, True)[1])
                assert_bitwise(OPS.scaled_e4m3(x, amax), R.scaled_e4m3(x, amax))
        x = torch.randn(3, 0)
        amax = torch.ones(3, 1)
        assert_bitwise(OPS.fake_quant(x, amax, 8, False, True), R.fake_quant(x, amax, 8, False, True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_amax_every_layout(ext, dtype):
    """A one-element amax (any shape, any float dtype) with contiguous, transposed, stepped and expanded x."""
    rng = random.Random(17)
    base = rand_x((33, 70), dtype, rng)
    layouts = {"contiguous": base, "transposed": base.t(), "stepped": base[:, ::3], "sliced": base[1:, 5:],
               "expanded": base[:1].expand(9, 70), "big": rand_x((70_001,), dtype, rng),
               "big stepped": rand_x((140_002,), dtype, rng)[::2]}
    for name, x in layouts.items():
        g = torch.randn(x.shape).to(dtype)
        for amax in (torch.tensor(2.5), torch.tensor([[2.5]]), torch.full((1, 1, 1), 2.5),
                     torch.tensor(2.5, dtype=torch.float16), torch.tensor([2.5], dtype=torch.float64),
                     torch.tensor(0.0)):
            what = f"{name} amax {amax.dtype}{tuple(amax.shape)}"
            assert_bitwise(OPS.fake_quant(x, amax, 5, False, True), R.fake_quant(x, amax, 5, False, True), what)
            for got, want in zip(OPS.quant(x, amax, 7, False, False), R.quant(x, amax, 7, False, False)):
                assert_bitwise(got, want, "quant " + what)
            assert_bitwise(OPS.scaled_e4m3(x, amax), R.scaled_e4m3(x, amax), "e4m3 " + what)
            assert_bitwise(OPS.fake_quant_backward(g, x, amax), R.fake_quant_backward(g, x, amax), "bwd " + what)
            if amax.dim() <= x.dim():  # (affine ranges of higher rank broadcast x in the reference)
                lo = -amax * 0.5
                assert_bitwise(OPS.fake_affine_quant(x, lo, amax + 0.1, 8),
                               R.fake_affine_quant(x, lo, amax + 0.1, 8), "affine " + what)
                assert_bitwise(OPS.fake_affine_quant_backward(g, x, lo, amax),
                               R.fake_affine_quant_backward(g, x, lo, amax), "affine bwd " + what)
            out = torch.empty(x.shape, dtype=dtype)
            OPS.fake_quant_out(x, amax, 5, False, True, out)
            assert_bitwise(out, R.fake_quant(x, amax, 5, False, True), "out= " + what)


def test_large_tensors_parallel_paths(ext):
    """Sizes above the parallel grain, odd lengths (vector tails), per-tensor and per-row."""
    rng = random.Random(7)
    for dtype in DTYPES:
        x = rand_x((301, 1037), dtype, rng)
        for amax in (amax_for(x, rng, None), amax_for(x, rng, 0), amax_for(x, rng, 1)):
            assert_bitwise(OPS.fake_quant(x, amax, 8, False, True), R.fake_quant(x, amax, 8, False, True))
            assert_bitwise(OPS.scaled_e4m3(x, amax), R.scaled_e4m3(x, amax))
            g = torch.randn(x.shape).to(dtype)
            assert_bitwise(OPS.fake_quant_backward(g, x, amax), R.fake_quant_backward(g, x, amax))
        xt = x.t()
        amax = amax_for(xt, rng, 1)
        assert_bitwise(OPS.fake_quant(xt, amax, 4, False, False), R.fake_quant(xt, amax, 4, False, False))


# ====================================================================== fake_quant_out
@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quant_out(ext, dtype):
    rng = random.Random(5)
    for case in range(30):
        shape = rand_shape(rng, max_dims=3) or (5,)
        x = rand_x(shape, dtype, rng)
        axis = None if rng.random() < 0.5 else rng.randrange(len(shape))
        amax = amax_for(x, rng, axis)
        bits = rng.randint(2, 12)
        want = R.fake_quant(x, amax, bits, False, True)
        out = torch.full_like(x, 7.0)
        assert OPS.fake_quant_out(x, amax, bits, False, True, out) is None
        assert_bitwise(out, want, f"out= case {case}")
        inplace = x.clone()
        OPS.fake_quant_out(inplace, amax, bits, False, True, inplace)
        assert_bitwise(inplace, want, f"in place case {case}")
        if x.dim() >= 2:
            strided = torch.empty(tuple(reversed(shape)), dtype=dtype).transpose(0, -1)
            strided = strided if strided.shape == x.shape else torch.empty_like(x)
            OPS.fake_quant_out(x, amax, bits, False, True, strided)
            assert_bitwise(strided, want, f"non-contiguous out case {case}")
    x = rand_x((6, 9), dtype, rng)
    amax = torch.tensor(1.5)
    out32 = torch.empty(6, 9, dtype=torch.float64)  # another dtype: computed, then copied as copy_ would
    OPS.fake_quant_out(x, amax, 8, False, True, out32)
    assert torch.equal(out32, R.fake_quant(x, amax, 8, False, True).to(torch.float64))
    big = rand_x((4, 18), dtype, rng)  # out overlapping x partly
    src, dst = big[:, :9], big[:, 3:12]
    want = R.fake_quant(src.clone(), amax, 8, False, True)
    OPS.fake_quant_out(src, amax, 8, False, True, dst)
    assert_bitwise(dst, want, "partially overlapping out")


def test_fake_quant_out_unsigned_negative_leaves_out_untouched(ext):
    x = torch.rand(100, 40)
    x[57, 3] = -1.0
    before = x.clone()
    with pytest.raises(ValueError, match="Negative values encountered in unsigned quantization"):
        OPS.fake_quant_out(x, torch.tensor(1.0), 8, True, False, x)
    assert torch.equal(x, before)


# ====================================================================== STE backward
@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quant_backward_random(ext, dtype):
    rng = random.Random(11)
    for case in range(80):
        shape = rand_shape(rng)
        x = rand_x(shape, dtype, rng)
        axis = None if (rng.random() < 0.4 or not shape) else rng.randrange(len(shape))
        amax = amax_for(x, rng, axis)
        if x.numel() and rng.random() < 0.5:  # put values exactly on the boundary |x| == amax
            x = torch.where(torch.rand(x.shape) < 0.3, -amax.to(dtype).expand_as(x), x)
        g = rand_x(shape, dtype, rng)
        for kind, xv in views(x, rng):
            gv = dict(views(g, rng))[kind]
            assert_bitwise(OPS.fake_quant_backward(gv, xv, amax), R.fake_quant_backward(gv, xv, amax),
                           f"case {case} {kind} shape={shape} axis={axis}")
    x = torch.randn(8, 8).to(dtype)
    g32 = torch.randn(8, 8)
    amax = torch.tensor(0.7)
    assert_bitwise(OPS.fake_quant_backward(g32, x, amax), R.fake_quant_backward(g32, x, amax),
                   f"grad float32, x {dtype}")


def test_ste_boundary_is_inclusive(ext):
    amax = torch.tensor([[1.0], [0.5]])
    x = torch.tensor([[1.0, -1.0, 1.0000001, -1.0000001, float("nan")], [0.5, -0.5, 0.6, 0.0, float("inf")]])
    g = torch.ones_like(x)
    got = OPS.fake_quant_backward(g, x, amax)
    assert got.tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 1, 0]]
    assert_bitwise(got, R.fake_quant_backward(g, x, amax))


# ====================================================================== autograd through the ops (either path)
@pytest.mark.parametrize("dtype", DTYPES)
def test_autograd_fake_quant_and_quant(dtype):
    x = (torch.randn(6, 10) * 2).to(dtype)
    amax = torch.tensor([[1.0], [2.0], [0.5], [3.0], [1.5], [0.25]])
    x[0, 0], x[1, 1] = 1.0, -2.0  # exactly on the boundary: gradient passes
    x.requires_grad_(True)
    g = torch.randn(6, 10).to(dtype)
    OPS.fake_quant(x, amax, 8, False, True).backward(g)
    want = torch.where(x.detach().float().abs() <= amax, g, torch.zeros_like(g))
    assert torch.equal(x.grad, want)
    assert x.grad[0, 0] == g[0, 0] and x.grad[1, 1] == g[1, 1]
    x.grad = None
    q, _ = OPS.quant(x, amax, 8, False, True)
    q.backward(g)
    assert torch.equal(x.grad, want)
    x.grad = None
    OPS.scaled_e4m3(x, amax).backward(g)
    assert torch.equal(x.grad, want)


def test_autograd_learned_amax_and_affine():
    x = torch.randn(5, 7, requires_grad=True)
    amax = torch.full((5, 1), 0.8, requires_grad=True)
    y = OPS.fake_quant(x, amax, 8, False, True)
    y.sum().backward()
    xd = x.detach()
    assert torch.equal(x.grad, (xd.abs() <= 0.8).float())
    assert torch.allclose(amax.grad, torch.where(xd.abs() > 0.8, torch.sign(xd), 0.0).sum(1, keepdim=True))
    x.grad = None
    lo, hi = torch.tensor(-0.5), torch.tensor(0.9)
    OPS.fake_affine_quant(x, lo, hi, 8).sum().backward()
    assert torch.equal(x.grad, ((xd >= -0.5) & (xd <= 0.9)).float())
    x.grad = None
    OPS.fake_dynamic_block_quant(x, 1, 7, 4, False, True).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(xd))


def test_autograd_gradcheck_style_ste_matches_reference():
    """Gradients through the op equal the reference STE for every dtype and a per-channel amax."""
    for dtype in DTYPES:
        x = torch.randn(3, 4, 5).to(dtype).requires_grad_(True)
        amax = torch.rand(1, 4, 1) + 0.2
        g = torch.randn(3, 4, 5).to(dtype)
        OPS.fake_quant(x, amax, 6, False, False).backward(g)
        assert torch.equal(x.grad, R.fake_quant_backward(g, x.detach(), amax))


# ====================================================================== affine
@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_affine_quant_random(ext, dtype):
    rng = random.Random(21)
    for case in range(80):
        shape = rand_shape(rng)
        x = rand_x(shape, dtype, rng)
        lo = -rng.choice([0.0, 0.1, 1.0, 2.5, 100.0]) * rng.random()
        hi = rng.choice([0.05, 1.0, 3.0, 100.0]) * (0.1 + rng.random())
        lo_t, hi_t = torch.tensor(lo), torch.tensor(hi)
        if rng.random() < 0.2 and x.dim():
            lo_t, hi_t = lo_t.reshape(1), hi_t.to(torch.float16).float()
        bits = rng.randint(2, 16)
        for kind, xv in views(x, rng):
            what = f"case {case} {kind} shape={shape} lo={lo} hi={hi} bits={bits}"
            assert_bitwise(OPS.fake_affine_quant(xv, lo_t, hi_t, bits), R.fake_affine_quant(xv, lo_t, hi_t, bits),
                           "fake_affine_quant " + what)
            g = torch.randn(xv.shape).to(dtype)
            assert_bitwise(OPS.fake_affine_quant_backward(g, xv, lo_t, hi_t),
                           R.fake_affine_quant_backward(g, xv, lo_t, hi_t), "backward " + what)


def test_fake_affine_quant_per_channel_ranges(ext):
    x = torch.randn(4, 33) * 2
    lo = -torch.rand(4, 1)
    hi = torch.rand(4, 1) + 0.1
    x[0, 0], x[1, 1] = lo[0, 0], hi[1, 0]  # boundaries pass the gradient
    assert_bitwise(OPS.fake_affine_quant(x, lo, hi, 8), R.fake_affine_quant(x, lo, hi, 8))
    g = torch.randn_like(x)
    got = OPS.fake_affine_quant_backward(g, x, lo, hi)
    assert_bitwise(got, R.fake_affine_quant_backward(g, x, lo, hi))
    assert got[0, 0] == g[0, 0] and got[1, 1] == g[1, 1]


# ====================================================================== FP8 E4M3
def _e4m3_grid() -> torch.Tensor:
    """Every finite E4M3 value, its midpoints to the neighbours and the floats right around them."""
    bits = torch.arange(256, dtype=torch.uint8)
    vals = bits.view(torch.float8_e4m3fn).float()
    vals = torch.unique(vals[torch.isfinite(vals)])
    mids = (vals[1:] + vals[:-1]) / 2  # exact in float32
    pts = torch.cat([vals, mids, torch.tensor([449.0, 460.0, 464.0, 465.0, 480.0, 1e6, 2.0**-10, 2.0**-11])])
    up = torch.nextafter(pts, torch.full_like(pts, math.inf))
    down = torch.nextafter(pts, torch.full_like(pts, -math.inf))
    allp = torch.cat([pts, up, down])
    return torch.cat([allp, -allp, torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])])


def test_scaled_e4m3_rounding_grid_bit_exact(ext):
    """amax = 448 gives scale exactly 1, so the kernel's arithmetic E4M3 rounding meets torch's float8 cast."""
    amax = torch.tensor(448.0)
    assert float(R.E4M3_MAX / amax.float()) == 1.0
    v = _e4m3_grid()
    assert_bitwise(OPS.scaled_e4m3(v, amax), R.scaled_e4m3(v, amax), "grid")
    logs = torch.empty(200_000).uniform_(-30, 10)  # random magnitudes over every binade and the subnormals
    r = torch.exp2(logs) * torch.where(torch.rand(200_000) < 0.5, -1.0, 1.0)
    assert_bitwise(OPS.scaled_e4m3(r, amax), R.scaled_e4m3(r, amax), "random")
    clamped = torch.clamp(r, -448, 448)
    assert_bitwise(OPS.scaled_e4m3(r, amax), clamped.to(torch.float8_e4m3fn).float(), "float8 cast")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_e4m3_random(ext, dtype):
    rng = random.Random(31)
    for case in range(100):
        shape = rand_shape(rng)
        x = rand_x(shape, dtype, rng)
        axis = None if (rng.random() < 0.4 or not shape) else rng.randrange(len(shape))
        amax = amax_for(x, rng, axis)
        for kind, xv in views(x, rng):
            assert_bitwise(OPS.scaled_e4m3(xv, amax), R.scaled_e4m3(xv, amax),
                           f"case {case} {kind} shape={shape} axis={axis}")


# ====================================================================== dynamic block quantization
@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_dynamic_block_quant_random(ext, dtype):
    rng = random.Random(41)
    for case in range(100):
        while True:
            nd = rng.randint(1, 4)
            axis = rng.randrange(nd)
            block = rng.choice([1, 2, 3, 4, 8, 16, 32, 33, 64, 128])
            shape = [rng.randint(1, 9) for _ in range(nd)]
            shape[axis] = block * rng.randint(1, 4)
            if rng.random() < 0.3 and nd > 1:
                shape[-1 if axis != nd - 1 else 0] = rng.choice([31, 40, 70, 200])
            if math.prod(shape) <= 20_000:
                break
        unsigned = rng.random() < 0.2
        x = rand_x(tuple(shape), dtype, rng, positive=unsigned)
        if x.numel() and rng.random() < 0.2:  # an all-zero block region
            x.view(-1)[: block] = 0
        bits = rng.randint(1 if unsigned else 2, 16)
        narrow = rng.random() < 0.5
        ax = axis - nd if rng.random() < 0.3 else axis
        for kind, xv in views(x, rng):
            what = f"case {case} {kind} shape={tuple(shape)} axis={ax} block={block} bits={bits} unsigned={unsigned}"
            assert_bitwise(OPS.fake_dynamic_block_quant(xv, ax, block, bits, unsigned, narrow),
                           R.fake_dynamic_block_quant(xv, ax, block, bits, unsigned, narrow), what)


def test_fake_dynamic_block_quant_large_and_special(ext):
    rng = random.Random(43)
    for dtype in DTYPES:
        x = rand_x((64, 4096), dtype, rng, specials=False)
        x[3, 100], x[5, 7], x[60, 4000] = float("nan"), float("inf"), -float("inf")
        for axis, block in ((1, 32), (1, 128), (0, 16), (0, 64), (1, 4096)):
            assert_bitwise(OPS.fake_dynamic_block_quant(x, axis, block, 4, False, True),
                           R.fake_dynamic_block_quant(x, axis, block, 4, False, True), f"{dtype} {axis} {block}")
    x = torch.zeros(0, 32)
    assert OPS.fake_dynamic_block_quant(x, 1, 16, 8, False, True).shape == (0, 32)


# ====================================================================== errors through the ops
def _err(fn, exc, *patterns):
    with pytest.raises(exc) as info:
        fn()
    for p in patterns:
        assert p in str(info.value), f"{p!r} not in {str(info.value)!r}"


def test_value_errors_any_path():
    """The reference path and the kernels raise the same ValueErrors for bad values."""
    x = torch.randn(4, 5)
    _err(lambda: OPS.fake_quant(x, torch.tensor(-1.0), 8, False, True), ValueError, "amax must be >= 0", "-1.0")
    _err(lambda: OPS.fake_quant(x, torch.tensor(float("nan")), 8, False, True), ValueError, "amax must be finite")
    _err(lambda: OPS.fake_quant(x, torch.tensor([[1.0], [float("inf")], [1.0], [1.0]]), 8, False, True),
         ValueError, "amax must be finite")
    _err(lambda: OPS.quant(x, torch.tensor(-0.5), 8, False, True), ValueError, "amax must be >= 0")
    _err(lambda: OPS.scaled_e4m3(x, torch.tensor(-0.5)), ValueError, "amax must be >= 0")
    _err(lambda: OPS.fake_quant(x, torch.tensor(1.0), 8, True, False), ValueError,
         "Negative values encountered in unsigned quantization")
    _err(lambda: OPS.quant(x, torch.tensor(1.0), 8, True, False), ValueError, "Negative values encountered")
    _err(lambda: OPS.fake_quant(x, torch.tensor(0.0), 8, True, False), ValueError, "Negative values encountered")
    _err(lambda: OPS.fake_dynamic_block_quant(x, 1, 5, 8, True, False), ValueError, "Negative values encountered")
    OPS.fake_quant(torch.tensor([0.0, -0.0, float("nan")]), torch.tensor(1.0), 8, True, False)  # not negative


def test_kernel_argument_errors(ext):
    x = torch.randn(4, 6)
    one = torch.tensor(1.0)
    _err(lambda: OPS.fake_quant(x, one, 17, False, True), ValueError, "num_bits=17 is not supported", "2 to 16")
    _err(lambda: OPS.fake_quant(x, one, 1, False, True), ValueError, "num_bits=1 is not supported")
    _err(lambda: OPS.quant(x, one, 0, True, True), ValueError, "num_bits=0", "1 to 16")
    _err(lambda: OPS.fake_dynamic_block_quant(x, 1, 4, 20, False, True), ValueError, "num_bits=20")
    _err(lambda: OPS.fake_affine_quant(x, -one, one, 40), ValueError, "num_bits=40")
    _err(lambda: OPS.fake_quant(x, torch.ones(5), 8, False, True), ValueError, "does not broadcast",
         "(4, 6)", "allowed: 1 or 6")
    _err(lambda: OPS.fake_quant(x, torch.ones(2, 4, 6), 8, False, True), ValueError, "more dims than inputs")
    _err(lambda: OPS.fake_quant_backward(x, x, torch.ones(3, 1)), ValueError, "does not broadcast")
    _err(lambda: OPS.scaled_e4m3(x, torch.ones(6, 1)), ValueError, "does not broadcast")
    _err(lambda: OPS.fake_quant(x.long(), one, 8, False, True), TypeError, "float32, float16 or bfloat16",
         "torch.int64")
    _err(lambda: OPS.fake_quant(x.double(), one, 8, False, True), TypeError, "torch.float64")
    _err(lambda: OPS.fake_quant(x, torch.tensor(1), 8, False, True), TypeError, "amax must be a floating point")
    _err(lambda: OPS.fake_dynamic_block_quant(x, 1, 4, 8, False, True), ValueError,
         "block size 4 does not divide dim 1 of size 6", "divisors of 6")
    _err(lambda: OPS.fake_dynamic_block_quant(x, 2, 2, 8, False, True), ValueError, "block axis=2 is out of range",
         "[-2, 2)")
    _err(lambda: OPS.fake_dynamic_block_quant(x, 1, 0, 8, False, True), ValueError, "block size must be a positive")
    _err(lambda: OPS.fake_quant_backward(x.int(), x, one), TypeError, "grad must be float32")
    _err(lambda: OPS.fake_quant_out(x, torch.tensor(-2.0), 8, False, True, torch.empty(4, 6)), ValueError,
         "amax must be >= 0", "-2.0")
    _err(lambda: OPS.fake_quant(x, torch.tensor(-0.1), 8, False, True), ValueError, "got min -0.1")


def test_public_api_uses_the_kernels(ext):
    """tensor_quant's functions reach the compiled kernels (same bits, same errors)."""
    from lq import tensor_quant as tq

    torch.manual_seed(12345)
    x = torch.rand(10)
    q, s = tq.tensor_quant(x, x.abs().max())
    assert q.tolist() == [126, 113, 127, 59, 11, 23, 47, 73, 43, 27]
    assert abs(float(s) - 128.0057) < 1e-3
    fq = tq.fake_tensor_quant(x, x.abs().max())
    assert torch.allclose(fq, torch.tensor([0.9843, 0.8828, 0.9921, 0.4609, 0.0859, 0.1797, 0.3672, 0.5703,
                                            0.3359, 0.2109]), atol=1e-4)
    assert_bitwise(fq, R.fake_quant(x, x.abs().max()))


# ====================================================================== tracing still sees the schema
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_fake_impls_agree_with_kernel_shapes_and_strides(ext, layout):
    """What torch.compile/export trace (the fake impls) is what the kernels return: shapes, dtypes, strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(8, 3) if layout == "contiguous" else torch.randn(3, 8).t()
    amax = torch.rand(8, 1) + 0.5 if layout == "contiguous" else (torch.rand(1, 8) + 0.5).t()
    two, ones = torch.tensor(2.0), torch.ones(3)

    def calls(xx, aa, tt, oo):
        return [OPS.fake_quant(xx, aa, 8, False, True), *OPS.quant(xx, aa, 8, False, True),
                OPS.scaled_e4m3(xx, aa), OPS.fake_dynamic_block_quant(xx, 0, 4, 8, False, True),
                OPS.fake_affine_quant(xx, -tt, tt, 8), OPS.fake_affine_quant_backward(xx, xx, -tt, tt),
                OPS.fake_quant_backward(xx, xx, aa), *OPS.abs_histogram(xx, tt, 16, None),
                *OPS.abs_histogram(xx, oo, 16, 1)]

    real = calls(x, amax, two, ones)
    with FakeTensorMode() as mode:
        fake = calls(*(mode.from_tensor(t) for t in (x, amax, two, ones)))
    def strides(t):  # the stride of a size-1 dim means nothing
        return tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)

    for i, (r, f) in enumerate(zip(real, fake)):
        assert (r.shape, r.dtype, strides(r)) == (f.shape, f.dtype, strides(f)), f"output {i}"


def test_threads_do_not_change_results(ext):
    x = torch.randn(257, 999)
    amax = x.abs().amax(1, keepdim=True) * 0.8
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [OPS.fake_quant(x, amax, 8, False, True), OPS.fake_dynamic_block_quant(x, 0, 257, 4, False, True),
               *OPS.abs_histogram(x, torch.tensor(3.0), 512, None)]
    finally:
        torch.set_num_threads(n)
    many = [OPS.fake_quant(x, amax, 8, False, True), OPS.fake_dynamic_block_quant(x, 0, 257, 4, False, True),
            *OPS.abs_histogram(x, torch.tensor(3.0), 512, None)]
    for a, b in zip(one, many):
        assert_bitwise(a, b)

