"""lq.memory: the CPU output-buffer cache of the C++ kernels (csrc/host_cache.cpp)."""

import os
import subprocess
import sys

import pytest
from _limits import HANG_GUARD_S
import torch

import lq
from lq import memory
from lq.tensor_quant import fake_tensor_quant

pytestmark = pytest.mark.skipif(not lq.extension_loaded(), reason="the C++ extension is not loaded")

AMAX = torch.tensor(2.0)


def fq(x):
    return torch.ops.lq.fake_quant(x, AMAX, 8, False, True)


@pytest.fixture(autouse=True)
def _keep_limit():
    limit_mib = memory.cpu_cache_stats()["limit_bytes"] >> 20
    yield
    memory.set_cpu_cache_limit(limit_mib)


def test_freed_output_is_reused_and_values_are_right():
    memory.empty_cpu_cache()
    x = torch.randn(512, 1024)  # 2 MiB
    y = fq(x)
    s0 = memory.cpu_cache_stats()
    assert s0["live_bytes"] >= x.numel() * 4
    ptr = y.data_ptr()
    del y
    s1 = memory.cpu_cache_stats()
    assert s1["idle_bytes"] >= x.numel() * 4 and s1["live_bytes"] == s0["live_bytes"] - x.numel() * 4
    x2 = torch.randn(512, 1024)
    y2 = fq(x2)
    assert y2.data_ptr() == ptr  # the same block, handed out again
    assert memory.cpu_cache_stats()["hits"] == s1["hits"] + 1
    torch.testing.assert_close(y2, fake_tensor_quant(x2, AMAX, 8, False, True), rtol=0, atol=0)
    live = memory.cpu_cache_stats()["live_bytes"]
    memory.empty_cpu_cache()
    assert memory.cpu_cache_stats()["live_bytes"] == live  # y2's block is not freed under it
    torch.testing.assert_close(y2, fake_tensor_quant(x2, AMAX, 8, False, True), rtol=0, atol=0)
    del y2
    assert memory.empty_cpu_cache() >= x.numel() * 4
    assert memory.cpu_cache_stats()["idle_bytes"] == 0


def test_small_outputs_bypass_the_cache():
    before = memory.cpu_cache_stats()
    fq(torch.randn(1000))
    after = memory.cpu_cache_stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


def test_cached_output_keeps_strides_and_resizes():
    x = torch.randn(8, 64, 32, 32).to(memory_format=torch.channels_last)
    y = fq(x)
    assert y.stride() == x.stride()
    torch.testing.assert_close(y, fake_tensor_quant(x.contiguous(), AMAX, 8, False, True), rtol=0, atol=0)
    y.resize_(2, 8, 64, 32, 32)  # grows through the default allocator; the block goes back to the cache
    y.fill_(1.0)
    assert float(y.sum()) == y.numel()


def test_limit_zero_turns_the_cache_off():
    memory.set_cpu_cache_limit(0)
    assert memory.cpu_cache_stats()["idle_bytes"] == 0
    before = memory.cpu_cache_stats()
    y = fq(torch.randn(512, 1024))
    del y
    after = memory.cpu_cache_stats()
    assert after["idle_bytes"] == 0 and after["misses"] == before["misses"]


@pytest.mark.parametrize("bad", [-1, 1.5, "64", True])
def test_bad_limit_is_rejected(bad):
    with pytest.raises(ValueError, match="whole number of MiB"):
        memory.set_cpu_cache_limit(bad)


def test_bad_environment_value_warns_and_uses_the_default():
    code = (
        "import torch, lq.memory as m; x = torch.randn(512, 1024); "
        "y = torch.ops.lq.fake_quant(x, torch.tensor(1.0), 8, False, True); del y; "
        "print(m.cpu_cache_stats()['idle_bytes'])"
    )
    env = dict(os.environ, LQ_CPU_CACHE_MB="lots")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr
    assert "LQ_CPU_CACHE_MB must be a whole number" in r.stderr
    assert int(r.stdout.strip().splitlines()[-1]) == 512 * 1024 * 4
