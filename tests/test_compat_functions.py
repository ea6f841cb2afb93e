"""The reference toolkit's helper entry points on lq: ``lq.cuda_ext``, ``lq.nn.functional.clip``, legacy.

Each is compared with the operation written out in plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch

from lq import cuda_ext, tensor_quant
from lq.nn import functional as QF
from lq.nn.modules.clip import Clip


def _fq(x, amax, num_bits=8, unsigned=False):
    """Fake quantization as the reference toolkit's kernels compute it: the scale is one float32 division."""
    bound = 2.0 ** (num_bits - 1 + int(unsigned)) - 1
    lo = 0.0 if unsigned else -bound
    scale = torch.tensor(bound) / amax
    return torch.clamp(torch.round(x * scale), lo, bound) / scale


def test_cuda_ext_functions_run_lqs_kernels():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 4, 5, generator=g)
    amax = x.abs().max()
    assert torch.equal(cuda_ext.fake_tensor_quant(x, amax, 7, True), _fq(x, amax, 7, True))
    per = torch.tensor([0.8, 0.9, 0.7, 0.6])
    assert torch.equal(cuda_ext.fake_tensor_quant_with_axis(x, per, 1), _fq(x, per.view(1, 4, 1)))
    y = x.clone()
    out = cuda_ext.fake_tensor_quant_(y, amax)
    assert out is y
    assert torch.equal(y, _fq(x, amax))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):  # in place in every dtype the functions take
        y, a = x.to(dtype), amax.to(dtype)
        cuda_ext.fake_tensor_quant_(y, a)
        assert y.dtype == dtype and torch.equal(y, tensor_quant.fake_tensor_quant(x.to(dtype), a))
    tiny = torch.tensor([1.0, 1e-26, 1.0, 1.0]).view(1, 4, 1)
    assert cuda_ext.fake_tensor_quant_with_axis(x, tiny, axis=1)[:, 1].abs().sum() == 0
    with pytest.raises(ValueError, match="along axis 1"):
        cuda_ext.fake_tensor_quant_with_axis(x, torch.ones(3), 1)


def test_legacy_function_equals_the_kernel():
    x = torch.randn(3, 4, 5, 6)
    amax = x.abs().amax(dim=(0, 2, 3), keepdim=True)
    assert torch.equal(tensor_quant.legacy_fake_tensor_quant(x, amax), tensor_quant.fake_tensor_quant(x, amax))


def test_clip_values_broadcast_and_pact_gradients():
    x = torch.randn(3, 1025, generator=torch.Generator().manual_seed(1), requires_grad=True)
    lo = torch.tensor(0.3, requires_grad=True)
    hi = torch.tensor(0.7, requires_grad=True)
    y = QF.clip(x, lo, hi)
    assert torch.equal(y, torch.minimum(torch.maximum(x, lo), hi))
    up = torch.randn_like(y)
    y.backward(up)
    xd = x.detach()
    torch.testing.assert_close(lo.grad, up[xd <= 0.3].sum())
    torch.testing.assert_close(hi.grad, up[xd >= 0.7].sum())
    inside = (xd > 0.3) & (xd < 0.7)
    assert torch.equal(x.grad, torch.where(inside, up, torch.zeros_like(up)))
    b_lo, b_hi = torch.full((1, 4, 1), -0.1), torch.full((1, 4, 1), 0.2)
    z = torch.randn(2, 4, 5)
    assert torch.equal(QF.clip(z, b_lo, b_hi), torch.clamp(z, b_lo, b_hi))


def test_learnable_clip_bounds_must_be_scalars():
    lo = torch.zeros(3, 7, requires_grad=True)
    hi = torch.ones(3, 7, requires_grad=True)
    out = QF.clip(torch.randn(3, 7), lo, hi)
    with pytest.raises(ValueError, match="can only be scalar"):
        out.sum().backward()
    with pytest.raises(ValueError, match="must be scalar"):
        Clip(torch.tensor(0.3), torch.tensor(0.7), learn_min=True)
    c = Clip(-1.0, 1.0, learn_min=True, learn_max=True)
    c(torch.tensor([-2.0, 0.5, 3.0])).sum().backward()
    assert c.clip_value_min.grad.item() == 1.0 and c.clip_value_max.grad.item() == 1.0
