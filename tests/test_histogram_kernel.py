"""lq::abs_histogram's C++ kernel against the reference (and against a plain numpy count)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lq import _ext, _ops  # noqa: F401
from lq import _reference as R

torch.set_flush_denormal(True)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OPS = torch.ops.lq


@pytest.fixture
def ext():
    if _ext.disabled():
        pytest.skip("LQ_DISABLE_EXT is set: no compiled kernel to compare with the reference")
    assert _ext.load(), f"lq's C++ extension did not build/load: {_ext._STATE['error']}"


def assert_same(got, want, what=""):
    for name, g, w in zip(("counts", "absmax", "nonfinite"), got, want):
        got_meta, want_meta = (g.dtype, tuple(g.shape)), (w.dtype, tuple(w.shape))
        assert got_meta == want_meta, f"{what} {name}: {got_meta} vs {want_meta}"
        assert torch.equal(g, w), f"{what} {name} differ: {g} vs {w}"


def numpy_counts(x: torch.Tensor, rng: float, num_bins: int):
    """Independent per-tensor count in float32 numpy, straight from the documented rule."""
    a = np.abs(x.float().numpy().ravel())
    fin = np.isfinite(a)
    a = a[fin]
    r = np.float32(rng)
    inv = np.float32(np.float32(1) / r) * np.float32(num_bins) if r > 0 else np.float32(0)
    keep = (a <= r) & ((r > 0) | (a == 0))
    idx = np.minimum(np.floor(a[keep] * inv), num_bins - 1).astype(np.int64)
    return np.bincount(idx, minlength=num_bins), float(a.max()) if a.size else 0.0, int((~fin).sum())


def rand_data(shape, dtype, rng: random.Random, specials=True):
    x = torch.randn(shape) * rng.choice([0.1, 1.0, 10.0])
    if rng.random() < 0.3:
        x = torch.relu(x)  # many exact zeros: runs of one bin
    if specials and x.numel():
        for _ in range(rng.randint(0, 5)):
            x.view(-1)[rng.randrange(x.numel())] = rng.choice([float("nan"), float("inf"), -float("inf"), -0.0])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_tensor_random(ext, dtype):
    rng = random.Random(3)
    for case in range(60):
        shape = tuple(rng.randint(1, 50) for _ in range(rng.randint(0, 3)))
        x = rand_data(shape, dtype, rng)
        finite = x.float()[torch.isfinite(x.float())].abs()
        top = float(finite.max()) if finite.numel() else 1.0
        r = torch.tensor(rng.choice([top, top * 0.5, top * 2, 1.0, 0.0, 1e-3]))
        nb = rng.choice([1, 2, 7, 128, 2048])
        got = OPS.abs_histogram(x, r, nb, None)
        assert_same(got, R.abs_histogram(x, r, nb, None), f"case {case} shape={shape} range={float(r)} bins={nb}")
        counts, absmax, nonfinite = numpy_counts(x, float(r), nb)
        assert got[0].tolist() == counts.tolist()
        assert float(got[1]) == absmax and int(got[2]) == nonfinite


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_channel_every_axis(ext, dtype):
    rng = random.Random(4)
    for case in range(60):
        nd = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 20) for _ in range(nd))
        x = rand_data(shape, dtype, rng)
        axis = rng.randrange(-nd, nd)
        C = shape[axis]
        r = torch.rand(C) * 3
        if C > 1:
            r[0] = 0.0
        nb = rng.choice([3, 64, 2048])
        xv = x if rng.random() < 0.7 else x.transpose(0, -1).contiguous().transpose(0, -1)
        assert_same(OPS.abs_histogram(xv, r, nb, axis), R.abs_histogram(xv, r, nb, axis),
                    f"case {case} shape={shape} axis={axis} bins={nb}")


def test_large_parallel_paths(ext):
    """Above the parallel grain: per-tensor tasks, channel tasks (long and short channels), row tasks."""
    rng = random.Random(5)
    for dtype in DTYPES:
        x = rand_data((200, 1001), dtype, rng)
        r = torch.tensor(2.5)
        assert_same(OPS.abs_histogram(x, r, 2048, None), R.abs_histogram(x, r, 2048, None), f"{dtype} tensor")
        if dtype != torch.float32:
            continue
        for axis in (0, 1, -1):
            rc = torch.rand(x.shape[axis]) * 4
            assert_same(OPS.abs_histogram(x, rc, 256, axis), R.abs_histogram(x, rc, 256, axis), f"{dtype} axis {axis}")
        x3 = rand_data((4000, 3, 7), dtype, rng)  # few channels, short inner runs
        rc = torch.tensor([1.0, 2.0, 0.5])
        assert_same(OPS.abs_histogram(x3, rc, 100, 1), R.abs_histogram(x3, rc, 100, 1), f"{dtype} rows")
        x4 = rand_data((2, 40000), dtype, rng)  # long channels: private 32-bit sub-histograms
        assert_same(OPS.abs_histogram(x4, torch.tensor([1.0, 3.0]), 64, 0),
                    R.abs_histogram(x4, torch.tensor([1.0, 3.0]), 64, 0), f"{dtype} long channels")


def test_bin_edges_and_range_boundary(ext):
    nb = 16
    r = torch.tensor(4.0)
    edges = torch.linspace(0, 4, nb + 1)
    x = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, 10.0)),
                   torch.nextafter(edges, torch.zeros_like(edges)), torch.tensor([4.0, -4.0, 4.0000005])])
    got = OPS.abs_histogram(x, r, nb, None)
    assert_same(got, R.abs_histogram(x, r, nb, None))
    assert int(got[0][-1]) >= 3  # |x| == range_max lands in the last bin
    assert int(got[0].sum()) == int((x.abs() <= 4.0).sum())


def test_special_ranges(ext):
    x = torch.tensor([0.0, -0.0, 1.0, 2.0, float("nan"), float("inf"), 3e38])
    for r in (0.0, -1.0, float("inf"), 1e-30, 1e-38, 3.4e38, float("nan")):
        rt = torch.tensor(r)
        got = OPS.abs_histogram(x, rt, 8, None)
        if r == 1e-38:  # reciprocal overflows; the reference would index with NaN -> compare what is defined
            assert int(got[0].sum()) == 2 and int(got[2]) == 2
            continue
        assert_same(got, R.abs_histogram(x, rt, 8, None), f"range_max={r}")


def test_empty_and_all_nonfinite(ext):
    for x in (torch.empty(0), torch.empty(3, 0), torch.tensor([float("nan"), float("inf")])):
        assert_same(OPS.abs_histogram(x, torch.tensor(1.0), 10, None), R.abs_histogram(x, torch.tensor(1.0), 10, None))
    x = torch.empty(4, 0)
    assert_same(OPS.abs_histogram(x, torch.ones(4), 10, 0), R.abs_histogram(x, torch.ones(4), 10, 0))


def test_histogram_errors(ext):
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match="one value per channel"):
        OPS.abs_histogram(x, torch.ones(4), 10, 1)
    with pytest.raises(ValueError, match="one value for a per-tensor histogram"):
        OPS.abs_histogram(x, torch.ones(2), 10, None)
    with pytest.raises(ValueError, match=r"axis=2 is out of range.*\[-2, 2\)"):
        OPS.abs_histogram(x, torch.ones(4), 10, 2)
    with pytest.raises(ValueError, match="num_bins"):
        OPS.abs_histogram(x, torch.tensor(1.0), 0, None)
    with pytest.raises(TypeError, match="torch.int64"):
        OPS.abs_histogram(x.long(), torch.tensor(1.0), 10, None)
    with pytest.raises(TypeError, match="range_max must be a floating point"):
        OPS.abs_histogram(x, torch.tensor(1), 10, None)
