"""The C++ autograd of lq::fake_quant / lq::scaled_e4m3 on CPU (csrc/autograd.cpp)
against the Python formula of lq/_ops.py, including every case where computing
the input gradient in place would be wrong (a gradient shared by two branches,
retained, hooked, passed by the user, or part of a double-backward graph).
"""

import pytest
import torch

import lq
from lq import _ops
from lq.memory import cpu_cache_stats

pytestmark = pytest.mark.skipif(not lq.extension_loaded(), reason="the C++ extension is not loaded")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ste_grad(g, x, amax):
    return torch.where(x.float().abs() <= amax.float(), g, torch.zeros_like(g))


def fq(x, amax, num_bits=8):
    return torch.ops.lq.fake_quant(x, amax, num_bits, False, False)


def requests():
    s = cpu_cache_stats()
    return s["hits"] + s["misses"]


def test_cpu_autograd_is_the_cpp_function():
    x = torch.randn(8, requires_grad=True)
    y = fq(x, torch.tensor(1.0))
    assert type(y.grad_fn).__name__ == "CppFunction"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 31, 33, 4099, 300_001])
def test_input_grad_matches_formula(dtype, n):
    g = torch.Generator().manual_seed(n)
    x0 = (torch.randn(n, generator=g) * 2).to(dtype)
    x0[::7] = float("nan") if n > 7 else x0[::7]
    amax = torch.tensor(2.5)
    up = torch.randn(n, generator=g).to(dtype)
    x = x0.clone().requires_grad_()
    (fq(x, amax) * up).sum().backward()
    torch.testing.assert_close(x.grad, ste_grad(up, x0, amax), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_channel_and_learned_amax_match_python(dtype):
    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(6, 5, 40, generator=g) * 3).to(dtype)
    for amax0 in (torch.tensor(2.0), torch.rand(1, 5, 1, generator=g) * 3 + 0.5):
        up = torch.randn(x0.shape, generator=g).to(dtype)
        x = x0.clone().requires_grad_()
        amax = amax0.clone().requires_grad_()
        (fq(x, amax) * up).sum().backward()
        torch.testing.assert_close(x.grad, ste_grad(up, x0, amax0), rtol=0, atol=0)
        torch.testing.assert_close(amax.grad, _ops.clip_amax_grad(up, x0, amax0), rtol=0, atol=0)


def test_owned_gradient_is_reused_in_place():
    x = torch.randn(256, 1024, requires_grad=True)  # 1 MiB: large enough to be served by the cache
    amax = torch.tensor(1.0)
    fq(x, amax).mul(3.0).sum().backward()  # warm up
    x.grad = None
    y = fq(x, amax)
    z = y.mul(3.0)  # MulBackward hands fq a fresh gradient that nothing else holds
    before = requests()
    z.sum().backward()
    assert requests() == before  # no output buffer requested: written in place
    torch.testing.assert_close(x.grad, ste_grad(torch.full_like(x, 3.0), x.detach(), amax), rtol=0, atol=0)


def test_shared_gradient_is_not_modified():
    """a + b hands the same gradient tensor to both branches; each must see it unmasked."""
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(512, 600, generator=g) * 2).requires_grad_()
    b = (torch.randn(512, 600, generator=g) * 2).requires_grad_()
    up = torch.randn(512, 600, generator=g)
    (fq(a, torch.tensor(0.5)) + fq(b, torch.tensor(3.0))).mul(up).sum().backward()
    torch.testing.assert_close(a.grad, ste_grad(up, a.detach(), torch.tensor(0.5)), rtol=0, atol=0)
    torch.testing.assert_close(b.grad, ste_grad(up, b.detach(), torch.tensor(3.0)), rtol=0, atol=0)


def test_retained_hooked_and_user_gradients_are_not_modified():
    x = (torch.randn(300, 1000) * 2).requires_grad_()
    amax = torch.tensor(1.0)
    y = fq(x, amax)
    y.retain_grad()
    seen = []
    y.register_hook(lambda gr: seen.append(gr))
    up = torch.randn(300, 1000)
    (y * up).sum().backward()
    torch.testing.assert_close(y.grad, up, rtol=0, atol=0)
    torch.testing.assert_close(seen[0], up, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, ste_grad(up, x.detach(), amax), rtol=0, atol=0)

    user = torch.randn(300, 1000)
    keep = user.clone()
    (gx,) = torch.autograd.grad(fq(x, amax), x, grad_outputs=user)
    torch.testing.assert_close(user, keep, rtol=0, atol=0)
    torch.testing.assert_close(gx, ste_grad(keep, x.detach(), amax), rtol=0, atol=0)


def test_create_graph_and_non_contiguous_gradient():
    x = (torch.randn(64, 96) * 2).requires_grad_()
    amax = torch.tensor(1.5)
    y = fq(x, amax)
    up = torch.randn(96, 64)
    (gx,) = torch.autograd.grad((y.t() * up).sum(), x, create_graph=True)
    torch.testing.assert_close(gx, ste_grad(up.t(), x.detach(), amax), rtol=0, atol=0)


def test_scaled_e4m3_grad_matches_formula():
    x0 = torch.randn(1000, 70) * 300
    amax = torch.tensor(200.0, requires_grad=True)
    x = x0.clone().requires_grad_()
    up = torch.randn_like(x0)
    (torch.ops.lq.scaled_e4m3(x, amax) * up).sum().backward()
    torch.testing.assert_close(x.grad, ste_grad(up, x0, amax.detach()), rtol=0, atol=0)
    torch.testing.assert_close(amax.grad, _ops.clip_amax_grad(up, x0, amax.detach()), rtol=0, atol=0)


def test_compiled_step_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(lq.nn.QuantLinear(32, 64), torch.nn.ReLU(), lq.nn.QuantLinear(64, 10))
    for m in model.modules():
        if isinstance(m, lq.nn.TensorQuantizer):
            m.amax = torch.tensor(1.0)
    x = torch.randn(16, 32) * 2
    compiled = torch.compile(model, fullgraph=True)
    grads = []
    for run in (model, compiled):
        model.zero_grad()
        run(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
