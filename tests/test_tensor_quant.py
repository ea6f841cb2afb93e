"""The public API of lq.tensor_quant: the documented example, descriptors, functions, tracing, errors."""

import subprocess
import sys

import numpy as np
import pytest
from _limits import HANG_GUARD_S
import torch

from lq import tensor_quant as tq
from lq.tensor_quant import QuantDescriptor


# ---------------------------------------------------------------- the documented example
def test_seeded_example_exact():
    torch.manual_seed(12345)
    x = torch.rand(10)
    q, scale = tq.tensor_quant(x, x.abs().max())
    assert q.tolist() == [126, 113, 127, 59, 11, 23, 47, 73, 43, 27]
    assert round(float(scale), 4) == 128.0057
    fq = tq.fake_tensor_quant(x, x.abs().max())
    expect = [0.9843, 0.8828, 0.9921, 0.4609, 0.0859, 0.1797, 0.3672, 0.5703, 0.3359, 0.2109]
    assert [round(v, 4) for v in fq.tolist()] == expect
    # and the fake result is exactly the dequantized integers
    assert torch.equal(fq, q / scale)


def test_hand_computed_grid_and_ties():
    amax = torch.tensor(1.27)  # scale = 127 / 1.27 = 100 (float32: 99.99999...)
    scale = torch.tensor(127.0) / amax
    # choose x so that x * scale is exactly k + 0.5 in float32 -> half to even
    ks = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    x = ks / scale
    assert torch.equal(x * scale, ks), "test construction: products must be exact ties"
    q, _ = tq.tensor_quant(x, amax)
    assert q.tolist() == [0, 2, 2, -0, -2, -2, 126]


@pytest.mark.parametrize(
    "num_bits,unsigned,narrow,lo,hi",
    [(8, False, True, -127, 127), (8, False, False, -128, 127), (8, True, False, 0, 255), (4, False, True, -7, 7),
     (4, False, False, -8, 7), (2, False, True, -1, 1)],
)
def test_integer_range(num_bits, unsigned, narrow, lo, hi):
    x = torch.linspace(0 if unsigned else -5, 5, 1001)
    q, scale = tq.tensor_quant(x, torch.tensor(1.0), num_bits, unsigned, narrow)
    assert q.min().item() == lo and q.max().item() == hi
    assert float(scale) == pytest.approx(hi if unsigned else 2 ** (num_bits - 1) - 1)


def test_per_channel_broadcast_and_zero_amax():
    x = torch.randn(4, 6)
    amax = torch.tensor([[1.0], [0.0], [2.0], [0.5]])
    out = tq.fake_tensor_quant(x, amax)
    assert torch.equal(out[1], torch.zeros(6)), "a zero amax channel quantizes to 0"
    for c in (0, 2, 3):
        assert torch.equal(out[c], tq.fake_tensor_quant(x[c], amax[c, 0]))
    q, scale = tq.tensor_quant(x, amax)
    assert scale[1, 0].item() == 1.0 and torch.equal(q[1], torch.zeros(6))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_kept(dtype):
    x = torch.randn(3, 5).to(dtype)
    out = tq.fake_tensor_quant(x, torch.tensor(2.0))
    assert out.dtype == dtype
    ref = tq.fake_tensor_quant(x.float(), torch.tensor(2.0)).to(dtype)
    assert torch.equal(out, ref)


def test_ste_gradient_inclusive_boundary():
    amax = torch.tensor(1.0)
    x = torch.tensor([-1.5, -1.0, -0.3, 0.0, 0.7, 1.0, 1.0001], requires_grad=True)
    tq.fake_tensor_quant(x, amax).backward(torch.arange(1.0, 8.0))
    assert x.grad.tolist() == [0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0]


def test_learned_amax_gets_pact_gradient():
    """The quantizer's path (a learned amax) gets sign(x) summed where |x| > amax."""
    x = torch.tensor([-3.0, -0.5, 0.2, 2.0, 4.0])
    amax = torch.tensor(1.0, requires_grad=True)
    tq._fake_tensor_quant(x, amax).sum().backward()
    # sign(x) summed where |x| > amax: -1 + 1 + 1
    assert amax.grad.item() == 1.0
    amax_c = torch.tensor([[1.0], [5.0]], requires_grad=True)
    tq._fake_tensor_quant(torch.stack([x, x]), amax_c).sum().backward()
    assert amax_c.grad.flatten().tolist() == [1.0, 0.0]


@pytest.mark.parametrize("fn", [tq.fake_tensor_quant, lambda x, a: tq.tensor_quant(x, a)[0]])
def test_public_functions_give_amax_no_gradient(fn):
    """As in the reference toolkit: an amax computed from the input must not send gradient back into it,
    so the input's gradient is exactly the clipped STE."""
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    amax = x.abs().max() / 2
    ((fn(x, amax) - 0.5) ** 2).sum().backward()
    inside = (x.detach().abs() <= amax.detach())
    assert torch.equal(x.grad != 0, inside)


def test_float64_inputs_are_quantized_in_float64():
    """float64 runs the reference arithmetic in float64 (the reference toolkit's result), gradients included."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, generator=g, dtype=torch.float64) * 3).requires_grad_()
    amax = torch.tensor(2.0, dtype=torch.float64)
    out = tq.fake_tensor_quant(x, amax)
    scale = 127.0 / 2.0
    want = torch.clamp(torch.round(x.detach() * scale), -127, 127) / scale  # written out, in float64
    assert out.dtype == torch.float64 and torch.equal(out.detach(), want)
    out.sum().backward()
    assert torch.equal(x.grad, (x.detach().abs() <= 2.0).double())
    q, s = tq.tensor_quant(x.detach(), amax)
    assert torch.equal(q, torch.clamp(torch.round(x.detach() * scale), -127, 127)) and s.dtype == torch.float32


def test_float64_every_function_written_out():
    """Every quantization function takes float64 (as the reference toolkit) and computes in float64: values
    against the formulas written out here, gradients included (the kernels take no float64)."""
    from lq import cuda_ext

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 20, generator=g, dtype=torch.float64) * 2
    amax = torch.tensor(1.5, dtype=torch.float64)
    # FP8: scale 448.0 / amax as the reference writes it, rounded to E4M3 through float32
    scale = 448.0 / amax
    e4m3 = (x * scale).float().clamp(-448, 448).to(torch.float8_e4m3fn).float().double() / scale
    assert tq.scaled_e4m3(x, amax).dtype == torch.float64 and torch.equal(tq.scaled_e4m3(x, amax), e4m3)
    assert torch.equal(cuda_ext.fake_e4m3fy(x), x.float().clamp(-448, 448).to(torch.float8_e4m3fn).double())
    # affine (gemmlowp): step, zero point, clamp to [-2^(b-1), 2^(b-1) - 1], all in float64
    step = (2.0 - -1.0) / 255
    zp = round(-1.0 / step) + 128
    affine = (torch.clamp(torch.round(x / step) - zp, -128, 127) + zp) * step
    assert torch.equal(tq.fake_affine_tensor_quant(x, -1.0, 2.0), affine)
    # dynamic blocks of 5 along the last axis, 4 bits
    xb = x.reshape(6, 4, 5)
    s = torch.tensor(7.0, dtype=torch.float64) / xb.abs().amax(-1, keepdim=True)
    blocks = (torch.clamp(torch.round(xb * s), -7, 7) / s).reshape(6, 20)
    assert torch.equal(tq.fake_block_quant(x, {-1: 5}, 4), blocks)
    assert tq.block_amax(x, {-1: 5}).dtype == torch.float64
    # in place, per axis
    y = x.clone()
    cuda_ext.fake_tensor_quant_(y, amax)
    s8 = torch.tensor(127.0, dtype=torch.float64) / amax
    assert torch.equal(y, torch.clamp(torch.round(x * s8), -127, 127) / s8)
    per = torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0], dtype=torch.float64)
    sp = torch.tensor(127.0, dtype=torch.float64) / per.view(6, 1)
    assert torch.equal(cuda_ext.fake_tensor_quant_with_axis(x, per, 0), torch.clamp(torch.round(x * sp), -127, 127) / sp)
    # gradients: clipped STE for the input (every spelling), PACT for a learned FP8 amax
    inside = (x.abs() <= amax).double()
    for fn in (lambda v: tq.TensorQuantFunction.apply(v, amax)[0], lambda v: tq.FakeTensorQuantFunction.apply(v, amax),
               lambda v: tq.ScaledE4M3Function.apply(v, amax), lambda v: tq.scaled_e4m3(v, amax),
               lambda v: tq.legacy_fake_tensor_quant(v, amax)):
        v = x.clone().requires_grad_()
        fn(v).sum().backward()
        assert torch.equal(v.grad, inside)
    v = x.clone().requires_grad_()
    tq.FakeAffineTensorQuantFunction.apply(v, -1.0, 2.0, 8).sum().backward()
    assert torch.equal(v.grad, ((x >= -1.0) & (x <= 2.0)).double())
    learned = amax.clone().requires_grad_()
    tq.scaled_e4m3(x, learned).sum().backward()
    assert learned.grad.item() == torch.where(x.abs() > amax, torch.sign(x), torch.zeros_like(x)).sum().item()


def test_float64_traces_without_data_dependent_branches():
    """torch.export and torch.compile(fullgraph) trace every float64 path (the value checks run in eager mode
    only) and give the eager results."""

    class M(torch.nn.Module):
        def forward(self, x):
            y = tq.fake_tensor_quant(x, x.abs().amax()) + tq.tensor_quant(x, torch.tensor(2.0, dtype=x.dtype))[0]
            y = y + tq.scaled_e4m3(x, torch.tensor(2.0)) + tq.fake_affine_tensor_quant(x, -1.0, 2.0)
            return y + tq.fake_block_quant(x, {-1: 5}, 4) + tq.legacy_fake_tensor_quant(x, torch.tensor(1.5))

    x = torch.randn(4, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    eager = M()(x)
    assert torch.equal(torch.export.export(M(), (x,)).module()(x), eager)
    assert torch.equal(torch.compile(M(), fullgraph=True, backend="aot_eager")(x), eager)


def test_negative_unsigned_input_is_both_value_and_type_error():
    x = torch.tensor([-1.0, 2.0])
    for fn in (tq.fake_tensor_quant, tq.tensor_quant):
        with pytest.raises(ValueError, match="Negative values encountered"):
            fn(x, torch.tensor(2.0), 8, True)
        with pytest.raises(TypeError, match="Negative values encountered"):
            fn(x, torch.tensor(2.0), 8, True)


def test_fp16_real_quant_refuses_a_scale_above_fp16_max():
    """tensor_quant of float16 data raises (as the reference toolkit does) when max_bound / amax is above 65504,
    the largest float16; fake quantization, other dtypes and scales that fit are unaffected."""
    from lq._checks import ScaleOverflowError

    x = torch.randn(257, generator=torch.Generator().manual_seed(3)).half()
    tiny = torch.tensor(1e-4).half()
    for call in (lambda a: tq.tensor_quant(x, a, 8, False), lambda a: tq.TensorQuantFunction.apply(x, a, 8, False)):
        with pytest.raises(ValueError, match="scale is too large for FP16") as info:
            call(tiny)
        assert isinstance(info.value, ScaleOverflowError)
        assert "65504" in str(info.value)
    with pytest.raises(ScaleOverflowError):  # one channel is enough
        tq.tensor_quant(torch.stack([x, x]), torch.tensor([[1.0], [1e-4]]))
    fits, too_big = torch.tensor(127.0 / 65000.0), torch.tensor(127.0 / 66000.0)
    q, scale = tq.tensor_quant(x, fits)
    assert q.dtype == torch.float16 and float(scale) <= 65504.0
    with pytest.raises(ScaleOverflowError):
        tq.tensor_quant(x, too_big)
    for dtype in (torch.float32, torch.bfloat16):
        q, scale = tq.tensor_quant(x.to(dtype), tiny)
        assert float(scale) > 65504.0 and q.dtype == dtype
    out = tq.fake_tensor_quant(x, tiny)
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())


def test_scaled_e4m3_without_amax_rounds_unscaled():
    x = torch.tensor([0.1, 1.1, 3.3, 500.0, -1000.0])
    want = x.to(torch.float8_e4m3fn).float().clamp(-448, 448)
    assert torch.equal(tq.scaled_e4m3(x, None), want)


def test_descriptor_amax_is_a_float32_array():
    import numpy as np

    d = tq.QuantDescriptor(amax=[1.3, 1.4])
    assert isinstance(d.amax, np.ndarray) and d.amax.dtype == np.float32
    np.testing.assert_array_equal(d.amax, np.float32([1.3, 1.4]))
    assert tq.QuantDescriptor(amax=d.amax) == d and tq.QuantDescriptor().amax is None
    with pytest.raises(TypeError, match="axis is ignored and must be None"):
        tq.QuantDescriptor(axis=(1,), amax=0.7, learn_amax=True)
    with pytest.raises(ValueError, match="axis is ignored and must be None"):
        tq.QuantDescriptor(axis=(1,), amax=0.7, learn_amax=True)


def test_autograd_function_classes_match_functions():
    x = torch.randn(20, requires_grad=True)
    amax = torch.tensor(1.0)
    a = tq.FakeTensorQuantFunction.apply(x, amax, 8, False, True)
    b = tq.fake_tensor_quant(x, amax)
    c = tq.LegacyFakeTensorQuantFunction.apply(x, amax, 8, False, True)
    assert torch.equal(a, b) and torch.equal(a, c)
    q1, s1 = tq.TensorQuantFunction.apply(x, amax, 8, False, True)
    q2, s2 = tq.tensor_quant(x, amax)
    assert torch.equal(q1, q2) and torch.equal(s1, s2)
    g1 = torch.autograd.grad(a.sum(), x)[0]
    g2 = torch.autograd.grad(c.sum(), x)[0]
    assert torch.equal(g1, g2)
    e = tq.ScaledE4M3Function.apply(x, amax, 4, 3)
    assert torch.equal(e, tq.scaled_e4m3(x, amax))
    f = tq.FakeAffineTensorQuantFunction.apply(x, -1.0, 2.0, 8)
    assert torch.equal(f, tq.fake_affine_tensor_quant(x, -1.0, 2.0))


# ---------------------------------------------------------------- affine, fp8, blocks
def test_affine_hand_computed():
    # min=-1, max=2, 2 bits: step = 1, zero_point = round(-1) + 2 = 1, q in [-2, 1]
    x = torch.tensor([-3.0, -1.0, -0.4, 0.5, 1.5, 2.0, 9.0])
    out = tq.fake_affine_tensor_quant(x, -1.0, 2.0, num_bits=2)
    assert out.tolist() == [-1.0, -1.0, 0.0, 0.0, 2.0, 2.0, 2.0]


def test_e4m3_grid_hand_computed():
    amax = torch.tensor(448.0)  # scale 1
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1875, 17.0, 500.0, -500.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-11])
    out = tq.scaled_e4m3(x, amax)
    # 1.0625 is a tie between 1.0 and 1.125 -> even (1.0); 1.1875 tie -> 1.25; 17 tie between 16 and 18 -> 16
    # 2^-9 is the smallest subnormal; 2^-10 ties to 0 (even); 3*2^-10 ties up to 2^-8; 2^-11 -> 0
    assert out.tolist() == [0.0, 1.0, 1.0, 1.25, 16.0, 448.0, -448.0, 2.0**-9, 0.0, 2.0**-8, 0.0]
    assert tq.scaled_e4m3(torch.tensor([1e-30]), torch.tensor(1.0)).item() == 0.0


def test_block_quant_dynamic_equals_manual():
    w = torch.randn(8, 64)
    out = tq.fake_block_quant(w, {-1: 16}, num_bits=4)
    blocks = w.reshape(8, 4, 16)
    manual = tq.fake_tensor_quant(blocks, blocks.abs().amax(-1, keepdim=True), 4).reshape(8, 64)
    assert torch.equal(out, manual)
    # static: the same amax given explicitly
    amax = tq.block_amax(w, {-1: 16})
    assert amax.shape == (8, 4)
    assert torch.equal(tq.fake_block_quant(w, {-1: 16}, 4, amax=amax), manual)
    # 2-D blocks
    out2 = tq.fake_block_quant(w, {0: 4, 1: 16}, num_bits=8)
    b2 = w.reshape(2, 4, 4, 16)
    m2 = tq.fake_tensor_quant(b2, b2.abs().amax(dim=(1, 3), keepdim=True)).reshape(8, 64)
    assert torch.equal(out2, m2)


def test_block_quant_double_quantized_scales():
    w = torch.randn(4, 64)
    out = tq.fake_block_quant(w, {-1: 16, "type": "dynamic", "scale_bits": 8}, num_bits=4)
    amax = tq.block_amax(w, {-1: 16})
    amax_q = tq.fake_tensor_quant(amax, amax.amax(), 8, True, False)
    manual = tq.fake_tensor_quant(w.reshape(4, 4, 16), amax_q.unsqueeze(-1), 4).reshape(4, 64)
    assert torch.equal(out, manual)
    fp8 = tq.fake_block_quant(w, {-1: 16, "scale_bits": (4, 3)}, num_bits=4, amax=amax)
    manual8 = tq.fake_tensor_quant(w.reshape(4, 4, 16), tq.scaled_e4m3(amax, amax.amax()).unsqueeze(-1), 4)
    assert torch.equal(fp8, manual8.reshape(4, 64))


# ---------------------------------------------------------------- descriptor
def test_descriptor_defaults_and_properties():
    d = QuantDescriptor()
    assert d.num_bits == 8 and d.axis is None and d.fake_quant and not d.unsigned
    assert not d.narrow_range and d.calib_method == "max" and d.amax is None and not d.dynamic
    assert d.dict() == {}
    with pytest.raises(AttributeError):
        d.num_bits = 4


ALL_FIELDS = dict(
    num_bits=4, name="w", fake_quant=False, axis=(0, 1), amax=[1.5, 2.5], learn_amax=False, scale_amax=0.5,
    calib_method="histogram", unsigned=True, narrow_range=True, dynamic=True,
)


@pytest.mark.parametrize(
    "kwargs",
    [
        ALL_FIELDS,
        dict(num_bits=(4, 3), axis=0),
        dict(num_bits=4, block_sizes={-1: 32, "type": "dynamic", "scale_bits": 8, "scale_block_sizes": {-1: 4}}),
        dict(num_bits=8, block_sizes={-1: 16, -2: 16, "scale_bits": (4, 3)}, narrow_range=True),
        dict(learn_amax=True, amax=3.0),
        dict(narrow_range=True),
    ],
)
def test_descriptor_round_trips(kwargs):
    d = QuantDescriptor(**kwargs)
    assert QuantDescriptor(**d.dict()) == d
    back = QuantDescriptor.from_yaml(d.to_yaml())
    assert back == d and back.dict() == d.dict()
    for k, v in kwargs.items():
        got = getattr(d, k)
        if k == "amax":  # a float32 numpy array, as in the reference toolkit
            np.testing.assert_array_equal(got, np.float32(v))
        else:
            assert got == v, k


def test_narrow_range_survives_yaml():
    d = QuantDescriptor(narrow_range=True)
    assert "narrow_range: true" in d.to_yaml()
    assert QuantDescriptor.from_yaml(d.to_yaml()).narrow_range is True


def test_predefined_descriptors():
    assert tq.QUANT_DESC_8BIT_PER_TENSOR.axis is None
    assert tq.QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR.unsigned
    for d in (tq.QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL, tq.QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL,
              tq.QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL, tq.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW):
        assert d.axis == 0 and d.num_bits == 8
    for d in (tq.QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL,
              tq.QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL,
              tq.QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL):
        assert d.axis == 1
    assert tq.ScaledQuantDescriptor is tq.QuantDescriptor


@pytest.mark.parametrize(
    "kwargs,exc,words",
    [
        (dict(num_bits=1), ValueError, "num_bits"),
        (dict(num_bits=32), ValueError, "num_bits"),
        (dict(num_bits=(5, 2)), ValueError, "(4, 3)"),
        (dict(num_bits="8"), TypeError, "num_bits"),
        (dict(axis="0"), TypeError, "axis"),
        (dict(axis=0, block_sizes={-1: 32}), ValueError, "axis must be None"),
        (dict(block_sizes={-1: 0}), ValueError, "positive"),
        (dict(block_sizes={-1: 32, "type": "sometimes"}), ValueError, "static"),
        (dict(block_sizes={-1: 32, "colour": 1}), ValueError, "allowed"),
        (dict(calib_method="entropy"), ValueError, "histogram"),
        (dict(amax=-1.0), ValueError, "amax"),
        (dict(amax=float("nan")), ValueError, "amax"),
        (dict(unsigned="yes"), TypeError, "unsigned"),
        (dict(narow_range=True), TypeError, "narrow_range"),
        (dict(num_bits=(4, 3), unsigned=True), ValueError, "unsigned"),
        (dict(scale_amax=0), ValueError, "scale_amax"),
    ],
)
def test_descriptor_errors_name_the_problem(kwargs, exc, words):
    with pytest.raises(exc, match=None) as info:
        QuantDescriptor(**kwargs)
    assert words in str(info.value)


# ---------------------------------------------------------------- function errors (SPEC section 6)
@pytest.mark.parametrize(
    "call,exc,words",
    [
        (lambda: tq.fake_tensor_quant([1.0, 2.0], 1.0), TypeError, "torch.Tensor"),
        (lambda: tq.fake_tensor_quant(torch.arange(4), 1.0), TypeError, "float32"),
        (lambda: tq.fake_tensor_quant(torch.randn(4), 1.0, num_bits=40), ValueError, "num_bits"),
        (lambda: tq.fake_tensor_quant(torch.randn(4), torch.tensor(-1.0)), ValueError, ">= 0"),
        (lambda: tq.fake_tensor_quant(torch.randn(4), torch.tensor(float("inf"))), ValueError, "finite"),
        (lambda: tq.fake_tensor_quant(torch.randn(4), torch.tensor(float("nan"))), ValueError, "finite"),
        (lambda: tq.fake_tensor_quant(torch.randn(4, 3), torch.ones(4)), ValueError, "broadcast"),
        (lambda: tq.tensor_quant(torch.randn(8), 1.0, unsigned=True), ValueError, "unsigned"),
        (lambda: tq.fake_block_quant(torch.randn(4, 30), {-1: 16}), ValueError, "divide"),
        (lambda: tq.fake_block_quant(torch.randn(4, 32), {5: 16}), ValueError, "out of range"),
        (lambda: tq.scaled_e4m3(torch.randn(4), 1.0, E=5, M=2), ValueError, "E4M3"),
        (lambda: tq.fake_affine_tensor_quant(torch.randn(4), 2.0, 1.0), ValueError, "min_range"),
    ],
)
def test_function_errors_name_the_problem(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


def test_unsupported_float_format_is_one_error_class():
    """Descriptor and scaled_e4m3 refuse formats other than (4, 3) with the same class: lq's ValueError and the
    reference toolkit's TypeError."""
    from lq._checks import FloatFormatError

    for call in (lambda: tq.scaled_e4m3(torch.randn(4), 1.0, E=5, M=2), lambda: QuantDescriptor(num_bits=(7, 3))):
        with pytest.raises(TypeError) as info:
            call()
        assert isinstance(info.value, FloatFormatError) and isinstance(info.value, ValueError)
    assert tq.FloatFormatError is FloatFormatError


def test_empty_tensor():
    x = torch.empty(0, 3)
    assert tq.fake_tensor_quant(x, 1.0).shape == (0, 3)
    assert tq.fake_block_quant(torch.empty(0, 32), {-1: 16}).shape == (0, 32)


# ---------------------------------------------------------------- tracing
class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)
        self.register_buffer("amax_in", torch.tensor(2.0))
        self.register_buffer("amax_w", torch.rand(8, 1) + 0.5)

    def forward(self, x):
        x = tq.fake_tensor_quant(x, self.amax_in)
        w = tq.fake_tensor_quant(self.lin.weight, self.amax_w)
        y = torch.nn.functional.linear(x, w, self.lin.bias)
        y = tq.scaled_e4m3(y, self.amax_in) + tq.fake_block_quant(y, {-1: 4}, 4)
        return tq.fake_affine_tensor_quant(y, torch.tensor(-1.0), torch.tensor(3.0))


def test_torch_compile_fullgraph_forward_and_backward():
    m = _Model()
    x = torch.randn(4, 16, requires_grad=True)
    eager = m(x)
    g_eager = torch.autograd.grad(eager.sum(), x)[0]
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert torch.equal(out, eager)
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], g_eager)


def test_torch_export_keeps_lq_ops():
    m = _Model()
    x = torch.randn(4, 16)
    ep = torch.export.export(m, (x,))
    code = ep.graph_module.code
    assert "torch.ops.lq.fake_quant" in code and "torch.ops.lq.scaled_e4m3" in code
    assert torch.equal(ep.module()(x), m(x))


def test_reference_path_warns_nothing_when_disabled_on_purpose():
    code = (
        "import warnings, torch\n"
        "warnings.simplefilter('error')\n"
        "import lq\n"
        "from lq import tensor_quant as tq\n"
        "assert not lq.extension_loaded()\n"
        "torch.manual_seed(12345); x = torch.rand(10)\n"
        "print(tq.tensor_quant(x, x.abs().max())[0].tolist())\n"
    )
    env = dict(__import__("os").environ, LQ_DISABLE_EXT="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([126.0, 113.0, 127.0, 59.0, 11.0, 23.0, 47.0, 73.0, 43.0, 27.0])


def test_missing_compiler_falls_back_with_one_warning(tmp_path):
    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import lq\n"
        "    from lq import tensor_quant as tq\n"
        "    tq.fake_tensor_quant(torch.randn(5), 1.0); tq.fake_tensor_quant(torch.randn(5), 1.0)\n"
        "msgs = [str(x.message) for x in w if 'reference' in str(x.message)]\n"
        "print(len(msgs), lq.extension_loaded())\n"
    )
    # a PATH without compilers and an empty cache: the build must fail and fall back
    env = dict(__import__("os").environ, PATH=str(tmp_path), LQ_EXT_CACHE=str(tmp_path / "cache"), CXX="no-such-cxx")
    env.pop("LQ_DISABLE_EXT", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "False"]
