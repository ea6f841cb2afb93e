"""The CUDA kernel layer run on the CPU, bit for bit against ``lq._reference``.

``csrc/cuda/emulation.cu`` (built here with nvcc into a small host library)
runs the kernels' own per-thread code (the ``LQ_HD`` bodies in
``csrc/cuda/*.cuh``) thread by thread behind the same layout planning and
dtype dispatch (``lq_api.cuh``) that the torch glue uses on a GPU. This checks
the indexing (dense / vectorized / per-channel / general broadcast / strided
paths, ragged tails, misaligned pointers, block groups, histogram grids) and the
float32 arithmetic without a GPU. ``tests/test_cuda_kernels.py`` checks the
real kernels where CUDA is available.

The helpers below mirror what ``csrc/cuda/lq_cuda.cu`` does with tensors
(float32 amax expanded to x's shape, contiguous fallbacks).
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lq import _reference as ref

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "csrc" / "cuda"
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not installed: cannot build the host emulation")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class CView(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("sizes", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
    ]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("lq_emu") / "lq_emulation.so"
    cmd = [
        NVCC, "-std=c++17", "-O2", "-DLQ_HOST_EMULATION",
        "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr",
        "-arch=sm_80", "-shared", "-Xcompiler", "-fPIC,-fno-strict-aliasing",
        str(CUDA_DIR / "emulation.cu"), "-o", str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"nvcc failed:\n{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    so = ctypes.CDLL(str(out))
    P = ctypes.POINTER(CView)
    for name, nviews, extra in [
        ("lqemu_fake_quant", 3, [ctypes.c_int] * 3),
        ("lqemu_quant", 5, [ctypes.c_int] * 3),
        ("lqemu_fake_quant_backward", 4, []),
        ("lqemu_fake_affine_quant", 4, [ctypes.c_int]),
        ("lqemu_fake_affine_quant_backward", 5, []),
        ("lqemu_scaled_e4m3", 3, []),
    ]:
        fn = getattr(so, name)
        fn.argtypes = [P] * nviews + extra
        fn.restype = ctypes.c_int
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    so.lqemu_fake_dynamic_block_quant.argtypes = [vp, vp, ctypes.c_int, i64, i64, i64, i64] + [ctypes.c_int] * 3
    so.lqemu_fake_dynamic_block_quant.restype = ctypes.c_int
    so.lqemu_abs_histogram.argtypes = [vp, ctypes.c_int, i64, i64, i64, vp, ctypes.c_int, i64, vp, vp, vp, ctypes.c_int]
    so.lqemu_abs_histogram.restype = ctypes.c_int
    so.lqemu_e4m3_round.argtypes = [vp, vp, i64, ctypes.c_int]
    so.lqemu_e4m3_round.restype = None
    so.lqemu_divmod_check.argtypes = [ctypes.c_uint64, vp, i64]
    so.lqemu_divmod_check.restype = ctypes.c_int64
    return so


# --------------------------------------------------------------------------- helpers
def view(t: torch.Tensor, keep: list):
    sizes = (ctypes.c_int64 * max(t.dim(), 1))(*t.shape)
    strides = (ctypes.c_int64 * max(t.dim(), 1))(*t.stride())
    v = CView(t.data_ptr(), DT_CODE[t.dtype], t.dim(), sizes, strides)
    keep += [sizes, strides, v, t]
    return ctypes.byref(v)


def expand_to(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a = a.float()
    if a.dim() > x.dim():
        a = a.reshape(())
    return a.expand(x.shape)


def run_views(fn, out: torch.Tensor, ins: list[torch.Tensor], *args):
    """Call an elementwise entry point; on kUnsupportedLayout retry on contiguous copies (as the glue does)."""
    keep: list = []
    rc = fn(view(out, keep), *[view(t, keep) for t in ins], *args)
    if rc == 1:
        tmp = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        keep = []
        rc = fn(view(tmp, keep), *[view(t.contiguous(), keep) for t in ins], *args)
        if tmp is not out:
            out.copy_(tmp)
    assert rc == 0, f"status {rc}"
    return out


def emu_fake_quant(lib, x, amax, num_bits=8, unsigned=False, narrow_range=True, out=None):
    out = torch.empty_like(x) if out is None else out
    return run_views(lib.lqemu_fake_quant, out, [x, expand_to(amax, x)], num_bits, int(unsigned), int(narrow_range))


def emu_quant(lib, x, amax, num_bits=8, unsigned=False, narrow_range=True):
    q = torch.empty_like(x)
    amax_raw = amax.float()
    scale = torch.empty_like(amax_raw)
    keep: list = []
    amax_e = expand_to(amax, x)
    rc = lib.lqemu_quant(view(q, keep), view(scale, keep), view(x, keep), view(amax_e, keep),
                         view(amax_raw, keep), num_bits, int(unsigned), int(narrow_range))
    if rc == 1:  # too many dims after coalescing: contiguous copies, as the glue does
        qc = torch.empty(x.shape, dtype=x.dtype)
        rc = lib.lqemu_quant(view(qc, keep), view(scale, keep), view(x.contiguous(), keep),
                             view(amax_e.contiguous(), keep), view(amax_raw, keep), num_bits, int(unsigned),
                             int(narrow_range))
        q.copy_(qc)
    assert rc == 0
    return q, scale


def emu_backward(lib, grad, x, amax):
    xx = x if x.dtype == grad.dtype else x.float()
    return run_views(lib.lqemu_fake_quant_backward, torch.empty_like(grad), [grad, xx, expand_to(amax, x)])


def emu_affine(lib, x, lo, hi, num_bits):
    return run_views(lib.lqemu_fake_affine_quant, torch.empty_like(x), [x, expand_to(lo, x), expand_to(hi, x)], num_bits)


def emu_affine_backward(lib, grad, x, lo, hi):
    xx = x if x.dtype == grad.dtype else x.float()
    return run_views(lib.lqemu_fake_affine_quant_backward, torch.empty_like(grad),
                     [grad, xx, expand_to(lo, x), expand_to(hi, x)])


def emu_e4m3(lib, x, amax):
    return run_views(lib.lqemu_scaled_e4m3, torch.empty_like(x), [x, expand_to(amax, x)])


def emu_block(lib, x, axis, bs, num_bits=8, unsigned=False, narrow_range=True):
    nd = x.dim()
    ax = axis % nd if nd else 0
    n = x.shape[ax] if nd else 1
    outer = math.prod(x.shape[:ax]) if nd else 1
    inner = math.prod(x.shape[ax + 1:]) if nd else 1
    xc = x.contiguous()
    out = torch.empty_like(xc)
    rc = lib.lqemu_fake_dynamic_block_quant(out.data_ptr(), xc.data_ptr(), DT_CODE[x.dtype], outer, n, inner, bs,
                                            num_bits, int(unsigned), int(narrow_range))
    assert rc == 0
    return out


def is_dense(x: torch.Tensor) -> bool:
    dims = sorted((s, n) for s, n in zip(x.stride(), x.shape) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return True


def emu_histogram(lib, x, range_max, num_bins, axis=None, sm_count=4):
    rng = range_max.float().contiguous()
    xd = x if is_dense(x) else x.contiguous()
    numel = x.numel()
    channels, outer, inner = 1, 1, numel
    if axis is None:
        counts = torch.zeros(num_bins, dtype=torch.int64)
        absmax = torch.zeros((), dtype=torch.float32)
        nonfinite = torch.zeros((), dtype=torch.int64)
    else:
        ax = axis % x.dim()
        channels = x.shape[ax]
        if channels > 1:
            inner = xd.stride(ax)
            outer = numel // (channels * inner)
        counts = torch.zeros(channels, num_bins, dtype=torch.int64)
        absmax = torch.zeros(channels, dtype=torch.float32)
        nonfinite = torch.zeros(channels, dtype=torch.int64)
    if numel:
        # data_ptr of a dense tensor is its lowest address (torch strides are >= 0)
        rc = lib.lqemu_abs_histogram(xd.data_ptr(), DT_CODE[x.dtype], outer, channels, inner, rng.data_ptr(),
                                     int(rng.numel() != 1), num_bins, counts.data_ptr(), absmax.data_ptr(),
                                     nonfinite.data_ptr(), sm_count)
        assert rc == 0, f"status {rc}"
    return counts, absmax, nonfinite


_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_bits(actual: torch.Tensor, expected: torch.Tensor):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.contiguous(), expected.contiguous()
    if not a.is_floating_point():
        assert torch.equal(a, e)
        return
    an, en = torch.isnan(a), torch.isnan(e)
    assert torch.equal(an, en), f"NaN positions differ: {an.sum()} vs {en.sum()}"
    ai = a.view(_INT_VIEW[a.dtype])[~an]
    ei = e.view(_INT_VIEW[e.dtype])[~en]
    bad = (ai != ei).nonzero()
    if bad.numel():
        i = bad[0, 0]
        raise AssertionError(
            f"{bad.numel()} of {ai.numel()} elements differ, first: {a[~an][i].item()!r} vs {e[~en][i].item()!r}"
        )


def make_x(shape, dtype, seed=0, special=True, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    if special and x.numel() >= 8:
        flat = x.view(-1)
        flat[0] = float("nan")
        flat[1] = float("inf")
        flat[2] = float("-inf")
        flat[3] = 0.0
        flat[4] = -0.0
        flat[5] = 1e30
    return x.to(dtype)


def ties(amax: float, num_bits: int, n: int, dtype) -> torch.Tensor:
    """Values that land exactly on .5 of the integer grid (where representable)."""
    s = (2 ** (num_bits - 1) - 1) / amax
    k = torch.arange(-n // 2, n // 2, dtype=torch.float32)
    return ((k + 0.5) / s).to(dtype)


# --------------------------------------------------------------------------- building blocks
def test_divmod(lib):
    import random

    rnd = random.Random(0)
    divisors = [1, 2, 3, 5, 7, 8, 255, 256, 1000, 4095, 65536, 65537, 2**20 + 3, 2**30, 2**31 - 1, 2**31, 2**33 + 5]
    divisors += [rnd.randrange(1, 2**31) for _ in range(200)]
    for d in divisors:
        nums = [0, 1, d - 1, d, d + 1, 2 * d - 1, 2**31 - 1, 2**31 - 2, 2**32 + 7, 2**40 + 3]
        nums += [rnd.randrange(0, 2**31) for _ in range(2000)]
        nums += [rnd.randrange(0, 2**45) for _ in range(50)]
        nums = [n for n in nums if n >= 0]
        arr = (ctypes.c_uint64 * len(nums))(*nums)
        assert lib.lqemu_divmod_check(d, ctypes.addressof(arr), len(nums)) == 0, d


@pytest.mark.parametrize("which", [0, 1], ids=["arith", "cuda_fp8_cvt"])
def test_e4m3_rounding_all_floats(lib, which):
    # every 37th float32 bit pattern in [0, 448] and beyond (clamped like the reference), both signs,
    # plus all midpoints between neighbouring E4M3 values (ties to even)
    bits = torch.arange(0, 0x43E00000 + 4096, 37, dtype=torch.int64).to(torch.int32)
    v = bits.view(torch.float32)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    v = torch.cat([v, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                   torch.tensor([float("nan"), 2.0**-10, 2.0**-9 * 1.5, 2.0**-126, 1e-45])])
    v = torch.cat([v, -v]).clamp(-448.0, 448.0)
    out = torch.empty_like(v)
    lib.lqemu_e4m3_round(v.data_ptr(), out.data_ptr(), v.numel(), which)
    assert_bits(out, ref.round_to_e4m3(v))


# --------------------------------------------------------------------------- fake_quant / quant
LAYOUTS = [
    # (name, x shape, amax shape or None for per-tensor, how to derive x)
    ("tensor_1d_ragged", (1003,), None, "contig"),
    ("tensor_0d", (), None, "contig"),
    ("tensor_misaligned", (517,), None, "offset"),
    ("nchw_axis1", (3, 8, 5, 7), (1, 8, 1, 1), "contig"),
    ("nchw_axis1_channels_last", (3, 8, 5, 7), (1, 8, 1, 1), "channels_last"),
    ("weight_axis0", (16, 40), (16, 1), "contig"),
    ("weight_axis0_odd", (16, 9), (16, 1), "contig"),
    ("last_axis", (12, 24), (24,), "contig"),
    ("last_axis_wrap", (10, 6), (6,), "contig"),
    ("middle_axis_wrap", (7, 3, 5), (1, 3, 1), "contig"),
    ("two_axes", (4, 6, 8), (4, 1, 8), "contig"),
    ("two_axes_lead_scalar", (4, 6, 8), (1, 1, 1, 1), "contig"),
    ("strided", (10, 24), (10, 1), "slice"),
    ("transposed", (24, 10), (1, 10), "transpose"),
    ("conv_weight_axis0_strided", (8, 4, 3, 3), (8, 1, 1, 1), "slice"),
    ("rank9", (2, 2, 2, 2, 2, 2, 2, 2, 3), (2, 1, 1, 1, 1, 1, 1, 1, 3), "slice9"),
]


def derive(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "contig":
        return x
    if how == "offset":
        buf = torch.empty(x.numel() + 1, dtype=x.dtype)
        buf[1:] = x.reshape(-1)
        return buf[1:].view(x.shape)
    if how == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if how == "slice":
        big = torch.zeros(*x.shape[:-1], x.shape[-1] * 2, dtype=x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    if how == "slice9":
        big = torch.zeros(*[2 * s for s in x.shape], dtype=x.dtype)
        sl = tuple(slice(None, None, 2) for _ in x.shape)
        big[sl] = x
        return big[sl]
    if how == "transpose":
        return x.t().contiguous().t()
    raise ValueError(how)


def make_amax(x: torch.Tensor, shape, seed=1):
    xf = x.float().nan_to_num(0.0, 0.0, 0.0)
    if shape is None:
        return xf.abs().amax() if xf.numel() else torch.tensor(1.0)
    if len(shape) > x.dim():
        a = xf.abs().amax()
    else:
        lead = x.dim() - len(shape)
        red = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1]
        a = xf.abs().amax(dim=red, keepdim=True) if red else xf.abs()
    a = a.reshape(shape) * 0.8 + 0.01
    flat = a.view(-1)
    if flat.numel() > 3:
        flat[0] = 0.0  # quantizes to 0
        flat[1] = 1e-9  # below 2^-24
        flat[2] = 2.0**-24
    return a


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_fake_quant_layouts(lib, dtype, layout):
    _, shape, amax_shape, how = layout
    x = derive(make_x(shape, dtype), how)
    amax = make_amax(x, amax_shape)
    for num_bits, unsigned, narrow in [(8, False, True), (8, False, False), (4, False, True), (8, True, False)]:
        xx = x.abs() if unsigned else x
        got = emu_fake_quant(lib, xx, amax, num_bits, unsigned, narrow)
        # (an amax with more dims than x broadcasts the reference's result up; the op keeps x's shape)
        assert_bits(got, ref.fake_quant(xx, amax, num_bits, unsigned, narrow).reshape(xx.shape))
        q, s = emu_quant(lib, xx, amax, num_bits, unsigned, narrow)
        rq, rs = ref.quant(xx, amax, num_bits, unsigned, narrow)
        assert_bits(q, rq.reshape(xx.shape))
        assert_bits(s, rs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_bits", [2, 3, 5, 8, 11, 16])
def test_fake_quant_bits_and_ties(lib, dtype, num_bits):
    amax = torch.tensor(2.5)
    x = torch.cat([ties(2.5, num_bits, 512, dtype), make_x((999,), dtype, seed=num_bits)])
    for unsigned in (False, True):
        for narrow in (False, True):
            got = emu_fake_quant(lib, x, amax, num_bits, unsigned, narrow)
            assert_bits(got, ref.fake_quant(x, amax, num_bits, unsigned, narrow))
    # unsigned quantization of negative inputs clamps to 0 (the CPU path raises; CUDA cannot check)
    got = emu_fake_quant(lib, x, amax, num_bits, True, True)
    assert_bits(got, ref.fake_quant(x, amax, num_bits, True, True))


def test_fake_quant_spec_example(lib):
    torch.manual_seed(12345)
    x = torch.rand(10)
    q, s = emu_quant(lib, x, x.abs().max())
    assert q.tolist() == [126, 113, 127, 59, 11, 23, 47, 73, 43, 27]
    assert abs(s.item() - 128.0057) < 1e-4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fake_quant_out_strided(lib, dtype):
    x = make_x((6, 20), dtype)
    amax = make_amax(x, (6, 1))
    out = torch.full((20, 6), 7.0, dtype=dtype).t()  # a transposed destination
    emu_fake_quant(lib, x, amax, out=out)
    assert_bits(out, ref.fake_quant(x, amax))
    y = x.clone()  # in place
    emu_fake_quant(lib, y, amax, out=y)
    assert_bits(y, ref.fake_quant(x, amax))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bad_amax_gives_nan(lib, dtype):
    x = make_x((4, 16), dtype, special=False)
    amax = torch.tensor([[1.0], [-1.0], [float("nan")], [float("inf")]])
    got = emu_fake_quant(lib, x, amax).float()
    assert not torch.isnan(got[0]).any()
    assert torch.isnan(got[1:]).all()
    q, s = emu_quant(lib, x, amax)
    assert torch.isnan(s[1:]).all() and torch.isnan(q.float()[1:]).all()
    assert torch.isnan(emu_e4m3(lib, x, amax).float()[1:]).all()


# --------------------------------------------------------------------------- backward
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_fake_quant_backward_layouts(lib, dtype, layout):
    _, shape, amax_shape, how = layout
    x = derive(make_x(shape, dtype), how)
    amax = make_amax(x, amax_shape)
    if x.numel() > 8:  # exactly on the clipping boundary: inclusive
        xv = x.reshape(-1) if x.is_contiguous() else None
        if xv is not None:
            xv[7] = amax.reshape(-1)[0].to(dtype)
    grad = make_x(shape, dtype, seed=5, special=False)

    def expected(g, xx):
        return ref.fake_quant_backward(g, xx, amax).reshape(g.shape)

    assert_bits(emu_backward(lib, grad, x, amax), expected(grad, x))
    # an expanded (stride 0) gradient, as from y.sum().backward()
    g0 = torch.ones((), dtype=dtype).expand(x.shape)
    assert_bits(emu_backward(lib, g0, x, amax), expected(g0, x))
    # x in float32 with a reduced-precision gradient
    if dtype != torch.float32:
        xf = x.float()
        assert_bits(emu_backward(lib, grad, xf, amax), expected(grad, xf))


# --------------------------------------------------------------------------- affine
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_bits", [4, 8, 16])
def test_fake_affine(lib, dtype, num_bits):
    x = make_x((1001,), dtype)
    for lo, hi in [(-2.0, 3.5), (0.0, 6.0), (-1e-3, 1e-3), (-7.25, -1.0), (1.0, 1.0)]:
        tlo, thi = torch.tensor(lo), torch.tensor(hi)
        assert_bits(emu_affine(lib, x, tlo, thi, num_bits), ref.fake_affine_quant(x, tlo, thi, num_bits))
        grad = make_x((1001,), dtype, seed=3, special=False)
        assert_bits(emu_affine_backward(lib, grad, x, tlo, thi), ref.fake_affine_quant_backward(grad, x, tlo, thi))
    # per-channel ranges, strided x
    x2 = derive(make_x((6, 10), dtype), "slice")
    lo = -torch.rand(6, 1) * 3
    hi = torch.rand(6, 1) * 3 + 0.1
    assert_bits(emu_affine(lib, x2, lo, hi, num_bits), ref.fake_affine_quant(x2, lo, hi, num_bits))


# --------------------------------------------------------------------------- FP8
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_scaled_e4m3(lib, dtype, layout):
    _, shape, amax_shape, how = layout
    x = derive(make_x(shape, dtype, scale=50.0), how)
    amax = make_amax(x, amax_shape)
    assert_bits(emu_e4m3(lib, x, amax), ref.scaled_e4m3(x, amax).reshape(x.shape))
    # tiny values (E4M3 subnormals after scaling) and saturation
    t = torch.cat([torch.logspace(-12, 3, 700), -torch.logspace(-12, 3, 700)]).to(dtype)
    for a in (1.0, 448.0, 3.3, 1e-3):
        amax = torch.tensor(a)
        assert_bits(emu_e4m3(lib, t, amax), ref.scaled_e4m3(t, amax))


# --------------------------------------------------------------------------- dynamic blocks
BLOCK_CASES = [
    ((6, 64), -1, 32), ((6, 64), -1, 16), ((6, 64), -1, 64), ((5, 48), -1, 48), ((5, 48), -1, 3),
    ((4, 30), -1, 1), ((4, 30), -1, 2), ((3, 512), -1, 256), ((2, 4096), -1, 4096),
    ((64, 6), 0, 16), ((8, 16, 12), 1, 4), ((8, 16, 5), 1, 8), ((7,), 0, 7), ((4, 6, 8), 0, 2),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=[f"{c[0]}-ax{c[1]}-b{c[2]}" for c in BLOCK_CASES])
def test_dynamic_block(lib, dtype, case):
    shape, axis, bs = case
    x = make_x(shape, dtype, special=False)
    flat = x.view(-1)
    flat[:bs] = 0.0  # an all-zero block (for inner == 1)
    flat[-1] = float("nan")  # a NaN block
    if flat.numel() > 3 * bs:
        flat[2 * bs] = float("inf")
    for num_bits, unsigned, narrow in [(4, False, True), (8, False, False), (4, True, False)]:
        xx = x.abs() if unsigned else x
        assert_bits(emu_block(lib, xx, axis, bs, num_bits, unsigned, narrow),
                    ref.fake_dynamic_block_quant(xx, axis, bs, num_bits, unsigned, narrow))
    # misaligned start (no vector loads)
    xm = derive(x, "offset")
    assert_bits(emu_block(lib, xm, axis, bs), ref.fake_dynamic_block_quant(xm, axis, bs))


# --------------------------------------------------------------------------- histogram
HIST_CASES = [
    ("tensor", (1000,), None, "contig"),
    ("tensor_4d", (3, 8, 5, 7), None, "contig"),
    ("tensor_strided", (10, 24), None, "slice"),
    ("tensor_misaligned", (517,), None, "offset"),
    ("axis0", (16, 40), 0, "contig"),
    ("axis1_nchw", (3, 8, 5, 7), 1, "contig"),
    ("axis1_channels_last", (3, 8, 5, 7), 1, "channels_last"),
    ("axis_last", (12, 24), -1, "contig"),
    ("axis0_strided", (10, 24), 0, "slice"),
    ("axis1_transposed", (24, 10), 1, "transpose"),
    ("axis_size1", (1, 24), 0, "contig"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", HIST_CASES, ids=[c[0] for c in HIST_CASES])
def test_abs_histogram(lib, dtype, case):
    _, shape, axis, how = case
    x = derive(make_x(shape, dtype), how)
    xf = x.float().nan_to_num(0.0, 0.0, 0.0).abs()
    for num_bins in (1, 7, 128, 2048, 20000):
        if axis is None:
            ranges = [xf.amax(), xf.amax() * 0.5, torch.tensor(0.0), torch.tensor(-1.0), torch.tensor(float("nan"))]
        else:
            ax = axis % x.dim()
            r = xf.movedim(ax, 0).reshape(x.shape[ax], -1).amax(dim=1)
            r2 = r.clone()
            r2[0] = 0.0
            ranges = [r, r * 0.5, r2, torch.tensor(1.5)]
        for rng in ranges:
            for sm in (1, 132):
                got = emu_histogram(lib, x, rng, num_bins, axis, sm_count=sm)
                exp = ref.abs_histogram(x, rng, num_bins, axis)
                for g, e in zip(got, exp):
                    assert_bits(g, e)


def test_abs_histogram_ties_on_bin_edges(lib):
    # values exactly on bin edges and at range_max
    x = torch.linspace(0, 1, 2049)
    for num_bins in (8, 2048, 1000):
        got = emu_histogram(lib, x, torch.tensor(1.0), num_bins)
        for g, e in zip(got, ref.abs_histogram(x, torch.tensor(1.0), num_bins)):
            assert_bits(g, e)
