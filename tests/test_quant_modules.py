"""Quantized modules: every output equals the float op applied to fake-quantized input and weight.

The expected values are computed here with ``lq.tensor_quant.fake_tensor_quant``
and ``torch.nn.functional`` directly, never through the module under test.
Defaults: inputs per tensor, weights per output channel (axis 0; axis 1 for
transposed convolutions), 8 bits, ``narrow_range=False``, amax = max |x| when
the quantizer is not calibrated.
"""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lq.nn as quant_nn
from lq import tensor_quant as tq
from lq.tensor_quant import QuantDescriptor

torch.set_flush_denormal(True)


# ---------------------------------------------------------------- reference helpers
def fq(x, axis=None, amax=None, num_bits=8):
    """Fake-quantize like an uncalibrated TensorQuantizer: amax = max |x| over the dims not in ``axis``."""
    if amax is None:
        if axis is None:
            amax = x.detach().abs().amax()
        else:
            axes = {a % x.dim() for a in ((axis,) if isinstance(axis, int) else axis)}
            dims = tuple(d for d in range(x.dim()) if d not in axes)
            amax = x.detach().abs().amax(dim=dims, keepdim=True)
    elif not isinstance(amax, torch.Tensor):
        amax = torch.tensor(float(amax))
    return tq.fake_tensor_quant(x, amax.float(), num_bits, False, False)


def quantizers(module):
    return [m for m in module.modules() if isinstance(m, quant_nn.TensorQuantizer)]


def disable_all(module):
    for q in quantizers(module):
        q.disable()
    return module


# ---------------------------------------------------------------- linear / conv
def test_linear_matches_reference():
    m = quant_nn.QuantLinear(7, 5)
    x = torch.randn(4, 3, 7)
    expect = F.linear(fq(x), fq(m.weight, axis=0), m.bias)
    assert torch.equal(m(x), expect)
    assert m._input_quantizer.axis is None and m._weight_quantizer.axis == 0


def test_linear_fixed_amax_and_bits():
    m = quant_nn.Linear(6, 4, bias=False, quant_desc_input=QuantDescriptor(num_bits=4, amax=0.5),
                        quant_desc_weight=QuantDescriptor(num_bits=6))
    x = torch.randn(3, 6)
    expect = F.linear(fq(x, amax=0.5, num_bits=4), fq(m.weight, num_bits=6))
    assert torch.equal(m(x), expect)
    # the quantized input is really coarse: 4 bits with amax 0.5 clips everything above
    assert not torch.equal(m(x), F.linear(x, m.weight))


@pytest.mark.parametrize(
    "cls,fn,shape,kwargs",
    [
        (quant_nn.QuantConv1d, F.conv1d, (2, 4, 11), dict(stride=2, padding=1)),
        (quant_nn.QuantConv2d, F.conv2d, (2, 4, 9, 8), dict(padding=1, dilation=2, groups=2)),
        (quant_nn.QuantConv3d, F.conv3d, (1, 4, 5, 6, 5), dict(stride=(1, 2, 1))),
    ],
)
def test_conv_matches_reference(cls, fn, shape, kwargs):
    m = cls(4, 6, 3, **kwargs)
    x = torch.randn(*shape)
    expect = fn(fq(x), fq(m.weight, axis=0), m.bias, m.stride, m.padding, m.dilation, m.groups)
    assert torch.equal(m(x), expect)


def test_conv_padding_mode_reflect():
    m = quant_nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
    x = torch.randn(2, 3, 6, 6)
    xp = F.pad(fq(x), (1, 1, 1, 1), mode="reflect")
    expect = F.conv2d(xp, fq(m.weight, axis=0), m.bias)
    assert torch.equal(m(x), expect)


@pytest.mark.parametrize(
    "cls,fn,shape",
    [
        (quant_nn.QuantConvTranspose1d, F.conv_transpose1d, (2, 4, 7)),
        (quant_nn.QuantConvTranspose2d, F.conv_transpose2d, (2, 4, 5, 6)),
        (quant_nn.QuantConvTranspose3d, F.conv_transpose3d, (1, 4, 3, 4, 3)),
    ],
)
def test_conv_transpose_matches_reference(cls, fn, shape):
    m = cls(4, 6, 3, stride=2, padding=1, groups=2)
    assert m._weight_quantizer.axis == 1  # weights are (in, out // groups, k...)
    x = torch.randn(*shape)
    w = fq(m.weight, axis=1)
    expect = fn(fq(x), w, m.bias, m.stride, m.padding, 0, m.groups, m.dilation)
    assert torch.equal(m(x), expect)
    # output_size keyword argument (chooses output_padding) works like torch's
    out_size = [2 * s for s in shape[2:]]
    y = m(x, output_size=out_size)
    assert list(y.shape[2:]) == out_size
    expect = fn(fq(x), w, m.bias, m.stride, m.padding, 1, m.groups, m.dilation)
    assert torch.equal(y, expect)


# ---------------------------------------------------------------- input-only modules
@pytest.mark.parametrize(
    "cls,fn,shape,args",
    [
        (quant_nn.QuantMaxPool1d, lambda x: F.max_pool1d(x, 3, 2), (2, 3, 11), (3, 2)),
        (quant_nn.QuantMaxPool2d, lambda x: F.max_pool2d(x, 2), (2, 3, 8, 8), (2,)),
        (quant_nn.QuantMaxPool3d, lambda x: F.max_pool3d(x, 2), (1, 2, 4, 4, 6), (2,)),
        (quant_nn.QuantAvgPool1d, lambda x: F.avg_pool1d(x, 3, 2, 1), (2, 3, 11), (3, 2, 1)),
        (quant_nn.QuantAvgPool2d, lambda x: F.avg_pool2d(x, 2), (2, 3, 8, 8), (2,)),
        (quant_nn.QuantAvgPool3d, lambda x: F.avg_pool3d(x, 2), (1, 2, 4, 4, 6), (2,)),
        (quant_nn.QuantAdaptiveAvgPool1d, lambda x: F.adaptive_avg_pool1d(x, 4), (2, 3, 11), (4,)),
        (quant_nn.QuantAdaptiveAvgPool2d, lambda x: F.adaptive_avg_pool2d(x, (3, 2)), (2, 3, 8, 7), ((3, 2),)),
        (quant_nn.QuantAdaptiveAvgPool3d, lambda x: F.adaptive_avg_pool3d(x, 1), (1, 2, 4, 4, 6), (1,)),
    ],
)
def test_pooling_matches_reference(cls, fn, shape, args):
    m = cls(*args)
    x = torch.randn(*shape)
    assert torch.equal(m(x), fn(fq(x)))
    assert not hasattr(m, "_weight_quantizer")


@pytest.mark.parametrize(
    "cls,shape", [(quant_nn.QuantInstanceNorm1d, (2, 3, 9)), (quant_nn.QuantInstanceNorm2d, (2, 3, 5, 6)),
                  (quant_nn.QuantInstanceNorm3d, (2, 3, 3, 4, 5))],
)
def test_instancenorm_matches_reference(cls, shape):
    m = cls(3, affine=True)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-0.5, 0.5)
    x = torch.randn(*shape) * 3
    expect = F.instance_norm(fq(x), weight=m.weight, bias=m.bias, eps=m.eps)
    assert torch.equal(m(x), expect)


# ---------------------------------------------------------------- residual add / concat
def test_add_and_cat_share_one_quantizer():
    add = quant_nn.QuantAdd(quant_desc_input=QuantDescriptor(amax=1.5))
    cat = quant_nn.QuantCat(dim=1, quant_desc_input=QuantDescriptor(amax=1.5))
    assert len(quantizers(add)) == 1 and len(quantizers(cat)) == 1
    a, b = torch.randn(2, 3, 4), torch.randn(2, 5, 4) * 3
    assert torch.equal(add(a, a * 2), fq(a, amax=1.5) + fq(a * 2, amax=1.5))
    assert torch.equal(cat([a, b]), torch.cat([fq(a, amax=1.5), fq(b, amax=1.5)], 1))


def test_add_calibrates_one_amax_over_both_inputs():
    add = quant_nn.Add()
    q = add._input_quantizer
    q.disable_quant()
    q.enable_calib()
    a, b = torch.randn(4, 8), torch.randn(4, 8) * 10
    add(a, b)
    q.disable_calib()
    q.enable_quant()
    q.load_calib_amax()
    assert float(q.amax) == pytest.approx(float(torch.cat([a, b]).abs().max()))
    assert torch.equal(add(a, b), fq(a, amax=q.amax) + fq(b, amax=q.amax))


def test_float_add_cat_convert():
    from lq.convert import quantize_model

    model = nn.ModuleDict({"add": quant_nn.FloatAdd(), "cat": quant_nn.FloatCat(dim=-1)})
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(model["add"](a, b), a + b)
    quantize_model(model, quant_desc_input=QuantDescriptor())
    assert isinstance(model["add"], quant_nn.QuantAdd) and isinstance(model["cat"], quant_nn.QuantCat)
    assert model["cat"].dim == -1
    amax = torch.cat([a, b]).abs().max()
    model["cat"]._input_quantizer.amax = amax
    assert torch.equal(model["cat"]([a, b]), torch.cat([fq(a, amax=amax), fq(b, amax=amax)], -1))


# ---------------------------------------------------------------- LSTM: tests/test_quant_rnn.py


# ---------------------------------------------------------------- multi-head attention
def ref_mha(m, query, key, value, attn_mask=None, key_padding_mask=None):
    """Quantized attention for batch-first inputs: every matmul input fake-quantized (per-row weights)."""
    N, L, E = query.shape
    H = m.num_heads
    Dh = E // H
    w_q, w_k, w_v = fq(m.in_proj_weight, axis=0).chunk(3)
    b_q, b_k, b_v = m.in_proj_bias.chunk(3)
    amax_in = torch.stack([query.abs().max(), key.abs().max(), value.abs().max()])
    q = F.linear(fq(query, amax=amax_in[0]), w_q, b_q)
    k = F.linear(fq(key, amax=amax_in[1]), w_k, b_k)
    v = F.linear(fq(value, amax=amax_in[2]), w_v, b_v)
    q, k, v = (t.reshape(N, -1, H, Dh).transpose(1, 2) for t in (q, k, v))
    scores = fq(q) @ fq(k).transpose(-2, -1) / math.sqrt(Dh)
    if attn_mask is not None:
        scores = scores.masked_fill(attn_mask, float("-inf"))
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    a = fq(torch.softmax(scores, -1))
    out = (a @ fq(v)).transpose(1, 2).reshape(N, L, E)
    out = F.linear(fq(out), fq(m.out_proj.weight, axis=0), m.out_proj.bias)
    return out, a.mean(1)


def test_mha_matches_reference_self_and_cross():
    m = quant_nn.QuantMultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    out, w = m(x, x, x)
    e_out, e_w = ref_mha(m, x, x, x)
    torch.testing.assert_close(out, e_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(w, e_w, rtol=0, atol=1e-6)
    # cross attention with masks; query/key/value are different tensors
    mem = torch.randn(2, 4, 8) * 2
    am = torch.triu(torch.ones(5, 4, dtype=torch.bool), 1)
    kpm = torch.tensor([[False, False, False, True], [False, False, False, False]])
    out, w = m(x, mem, mem, attn_mask=am, key_padding_mask=kpm)
    # the input quantizer is shared by query/key/value, so it sees each tensor with its own dynamic amax
    e_out, e_w = ref_mha(m, x, mem, mem, attn_mask=am, key_padding_mask=kpm)
    torch.testing.assert_close(out, e_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(w, e_w, rtol=0, atol=1e-6)
    assert float(w[0, :, 3].detach().abs().max()) == 0.0  # the padded key gets no attention


def test_mha_quantizes_both_matmuls():
    m = quant_nn.QuantMultiheadAttention(8, 2)
    names = {n for n, _ in m.iter_quantizers()}
    assert {"_matmul_q_input_quantizer", "_matmul_k_input_quantizer", "_matmul_a_input_quantizer",
            "_matmul_v_input_quantizer", "_input_quantizer", "_in_proj_weight_quantizer"} <= names
    assert isinstance(m.out_proj, quant_nn.QuantLinear)
    x = torch.randn(5, 2, 8)
    for name in ("_matmul_q_input_quantizer", "_matmul_k_input_quantizer", "_matmul_a_input_quantizer",
                 "_matmul_v_input_quantizer"):
        disable_all(m)
        ref = m(x, x, x)[0]
        q = getattr(m, name)
        q.enable()
        assert not torch.equal(m(x, x, x)[0], ref), f"{name} has no effect"
        disable_all(m)


MHA_CASES = [
    dict(),
    dict(batch_first=True),
    dict(add_bias_kv=True, add_zero_attn=True),
    dict(kdim=5, vdim=3),
    dict(bias=False, batch_first=True),
]


@pytest.mark.parametrize("ctor", MHA_CASES)
@pytest.mark.parametrize(
    "call",
    [
        dict(),
        dict(need_weights=False),
        dict(average_attn_weights=False),
        dict(attn_mask="bool"),
        dict(attn_mask="float", key_padding_mask=True),
        dict(attn_mask="causal", is_causal=True, need_weights=False),
        dict(attn_mask="3d"),
    ],
)
def test_mha_disabled_equals_torch(ctor, call):
    torch.manual_seed(0)
    f = nn.MultiheadAttention(8, 2, **ctor).eval()
    m = disable_all(quant_nn.QuantMultiheadAttention.from_float(f))
    N, L, S = 3, 4, 6
    bf = ctor.get("batch_first", False)
    shape = (lambda n, s, e: (n, s, e)) if bf else (lambda n, s, e: (s, n, e))
    q = torch.randn(*shape(N, L, 8))
    k = torch.randn(*shape(N, S, ctor.get("kdim", 8)))
    v = torch.randn(*shape(N, S, ctor.get("vdim", 8)))
    kw = dict(call)
    mask = kw.pop("attn_mask", None)
    if mask == "bool":
        kw["attn_mask"] = torch.rand(L, S) < 0.3
    elif mask == "float":
        kw["attn_mask"] = torch.randn(L, S)
    elif mask == "causal":
        kw["attn_mask"] = torch.triu(torch.ones(L, S, dtype=torch.bool), 1)
    elif mask == "3d":
        kw["attn_mask"] = torch.randn(N * 2, L, S)
    if kw.pop("key_padding_mask", None):  # float, like the float attn_mask it comes with
        kw["key_padding_mask"] = torch.zeros(N, S).masked_fill(torch.tensor([[False] * (S - 1) + [True]] * N), -1e9)
    (a, aw), (b, bw) = m(q, k, v, **kw), f(q, k, v, **kw)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if bw is None:
        assert aw is None
    else:
        torch.testing.assert_close(aw, bw, rtol=1e-5, atol=1e-5)


def test_mha_unbatched_equals_torch():
    f = nn.MultiheadAttention(8, 2).eval()
    m = disable_all(quant_nn.QuantMultiheadAttention.from_float(f))
    x = torch.randn(4, 8)
    (a, aw), (b, bw) = m(x, x, x), f(x, x, x)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(aw, bw)


def test_mha_in_transformer_layer_is_not_bypassed_by_fast_path():
    """TransformerEncoderLayer's fused inference kernel would read the weights directly."""
    from lq.convert import quantize_model

    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True, dropout=0.0)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    summary = quantize_model(enc, quant_desc_input=QuantDescriptor())
    assert all(isinstance(lyr.self_attn, quant_nn.QuantMultiheadAttention) for lyr in enc.layers)
    assert summary.notes  # nested-tensor path turned off
    q = enc.layers[0].self_attn._matmul_a_input_quantizer
    q.enable_calib()
    x = torch.randn(2, 5, 8)
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        y = enc(x, src_key_padding_mask=kpm)
    q.disable_calib()
    assert q.calibrator.has_data, "the quantized attention forward was bypassed"
    assert y.shape == x.shape and torch.isfinite(y[0]).all()


# ---------------------------------------------------------------- from_float / to_float / API
ALL_FLOAT = [
    (nn.Linear(4, 3), quant_nn.QuantLinear),
    (nn.Conv1d(2, 3, 3), quant_nn.QuantConv1d),
    (nn.Conv2d(2, 3, 3), quant_nn.QuantConv2d),
    (nn.Conv3d(2, 3, 3), quant_nn.QuantConv3d),
    (nn.ConvTranspose1d(2, 3, 3), quant_nn.QuantConvTranspose1d),
    (nn.ConvTranspose2d(2, 3, 3), quant_nn.QuantConvTranspose2d),
    (nn.ConvTranspose3d(2, 3, 3), quant_nn.QuantConvTranspose3d),
    (nn.MaxPool2d(2), quant_nn.QuantMaxPool2d),
    (nn.AvgPool1d(2), quant_nn.QuantAvgPool1d),
    (nn.AdaptiveAvgPool3d(1), quant_nn.QuantAdaptiveAvgPool3d),
    (nn.InstanceNorm2d(3, affine=True, track_running_stats=True), quant_nn.QuantInstanceNorm2d),
    (nn.LSTM(3, 4, num_layers=2), quant_nn.QuantLSTM),
    (nn.LSTMCell(3, 4), quant_nn.QuantLSTMCell),
    (nn.MultiheadAttention(4, 2), quant_nn.QuantMultiheadAttention),
]


@pytest.mark.parametrize("float_mod,cls", ALL_FLOAT, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_from_float_shares_state_and_to_float_round_trips(float_mod, cls):
    float_mod.eval()
    params = dict(float_mod.named_parameters())
    buffers = dict(float_mod.named_buffers())
    keys = set(float_mod.state_dict())
    q = cls.from_float(float_mod)
    assert type(q) is cls and isinstance(q, type(float_mod))
    assert not q.training and all(not qq.training for qq in quantizers(q))
    for name, p in q.named_parameters():
        assert p is params[name]
    for name, b in buffers.items():
        assert q.get_buffer(name) is b
    # float keys unchanged; only quantizer state is added
    qkeys = set(q.state_dict())
    assert keys <= qkeys and all("quantizer" in k for k in qkeys - keys)
    # the float module itself is untouched
    assert not quantizers(float_mod) and type(float_mod) is not cls
    back = q.to_float()
    assert type(back) is type(float_mod)
    assert set(back.state_dict()) == keys
    for name, p in back.named_parameters():
        assert p is params[name]


def test_from_float_keeps_dtype_and_amax_float32():
    f = nn.Linear(8, 4).to(torch.bfloat16)
    q = quant_nn.QuantLinear.from_float(f)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    y = q(x)
    assert y.dtype == torch.bfloat16 and q.weight.dtype == torch.bfloat16
    q._input_quantizer.amax = 2.0
    q.to(torch.float16)
    assert q._input_quantizer.amax.dtype == torch.float32


def test_from_float_rejects_wrong_modules():
    with pytest.raises(TypeError, match="expects a Linear"):
        quant_nn.QuantLinear.from_float(nn.Conv2d(1, 1, 1))
    with pytest.raises(TypeError, match="already"):
        quant_nn.QuantLinear.from_float(quant_nn.QuantLinear(2, 2))

    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="overrides forward"):
        quant_nn.QuantLinear.from_float(MyLinear(2, 2))
    with pytest.raises(quant_nn.DescriptorTypeError):
        quant_nn.QuantLinear.from_float(nn.Linear(2, 2), quant_desc_input=8)


def test_constructor_signatures_match_torch():
    for float_cls, quant_cls in [(nn.Conv2d, quant_nn.QuantConv2d), (nn.Linear, quant_nn.QuantLinear),
                                 (nn.ConvTranspose3d, quant_nn.QuantConvTranspose3d),
                                 (nn.MaxPool2d, quant_nn.QuantMaxPool2d)]:
        fparams = list(inspect.signature(float_cls).parameters)
        qparams = list(inspect.signature(quant_cls).parameters)
        assert qparams[: len(fparams)] == fparams
        assert "quant_desc_input" in qparams
        assert ("quant_desc_weight" in qparams) == quant_cls._has_weight
    # positional arguments pass through
    m = quant_nn.Conv2d(3, 8, 3, 2, 1, bias=False)
    assert m.stride == (2, 2) and m.padding == (1, 1) and m.bias is None


def test_aliases_and_defaults():
    assert quant_nn.Conv2d is quant_nn.QuantConv2d
    assert quant_nn.Linear is quant_nn.QuantLinear
    assert quant_nn.LSTM is quant_nn.QuantLSTM
    assert quant_nn.MaxPool2d is quant_nn.QuantMaxPool2d
    assert quant_nn.InstanceNorm1d is quant_nn.QuantInstanceNorm1d
    from lq.nn.modules.tensor_quantizer import TensorQuantizer

    assert quant_nn.TensorQuantizer is TensorQuantizer
    assert quant_nn.QuantConv2d.default_quant_desc_weight == tq.QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL
    assert quant_nn.QuantConvTranspose2d.default_quant_desc_weight.axis == 1
    assert quant_nn.QuantLinear.default_quant_desc_input.axis is None


def test_set_default_quant_desc_is_per_class():
    old = quant_nn.QuantLinear.default_quant_desc_input
    try:
        quant_nn.QuantLinear.set_default_quant_desc_input(QuantDescriptor(num_bits=4, calib_method="histogram"))
        assert quant_nn.QuantLinear(2, 2)._input_quantizer.num_bits == 4
        assert quant_nn.QuantConv2d(1, 1, 1)._input_quantizer.num_bits == 8
        with pytest.raises(ValueError):
            quant_nn.QuantLinear.set_default_quant_desc_weight({"num_bits": 4})
    finally:
        quant_nn.QuantLinear.default_quant_desc_input = old


def test_keyword_forward_args_and_grad():
    m = quant_nn.QuantConv2d(2, 3, 3)
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    m(input=x).sum().backward()
    assert x.grad is not None and m.weight.grad is not None
    mha = quant_nn.QuantMultiheadAttention(4, 1)
    y = torch.randn(3, 1, 4)
    out, w = mha(query=y, key=y, value=y, need_weights=False)
    assert w is None and out.shape == y.shape


def test_weight_quantizer_pairs():
    lstm = quant_nn.QuantLSTM(3, 4, bidirectional=True)
    pairs = list(lstm.weight_quantizer_pairs())  # one fused [W_ih | W_hh] per direction
    assert len(pairs) == 2 and all(w.shape == (16, 3 + 4) for _, w in pairs)
    mha = quant_nn.QuantMultiheadAttention(4, 2)
    assert [w for _, w in mha.weight_quantizer_pairs()][0] is mha.in_proj_weight


# ---------------------------------------------------------------- constructor errors (reference behaviour)
FAKE_ONLY = [
    lambda d: quant_nn.QuantLinear(7, 9, bias=False, quant_desc_weight=d),
    lambda d: quant_nn.QuantLinear(7, 9, quant_desc_input=d),
    lambda d: quant_nn.QuantConv2d(3, 4, 3, quant_desc_weight=d),
    lambda d: quant_nn.QuantConvTranspose1d(3, 4, 3, quant_desc_input=d),
    lambda d: quant_nn.QuantMaxPool2d(3, quant_desc_input=d),
    lambda d: quant_nn.QuantAdaptiveAvgPool3d(1, quant_desc_input=d),
    lambda d: quant_nn.QuantInstanceNorm1d(3, quant_desc_input=d),
    lambda d: quant_nn.QuantLSTM(3, 4, quant_desc_weight=d),
    lambda d: quant_nn.QuantLSTMCell(3, 4, quant_desc_input=d),
    lambda d: quant_nn.QuantLinear.from_float(nn.Linear(2, 2), quant_desc_weight=d),
    lambda d: quant_nn.QuantMaxPool1d.from_float(nn.MaxPool1d(2), quant_desc_input=d),
    lambda d: quant_nn.QuantLinear(2, 2).init_quantizer(QuantDescriptor(), d),
]


@pytest.mark.parametrize("make", FAKE_ONLY)
def test_integer_output_descriptors_are_refused(make):
    """A module's float op cannot take the integers of fake_quant=False: ValueError, as in the reference."""
    with pytest.raises(ValueError, match="Only fake quantization is supported"):
        make(QuantDescriptor(fake_quant=False))
    make(QuantDescriptor(fake_quant=True))  # the same call with fake quantization builds


@pytest.mark.parametrize(
    "make",
    [
        lambda: quant_nn.QuantConv2d(32, 257, 3, descriptor="oops"),
        lambda: quant_nn.QuantLinear(32, 257, descriptor="oops"),
        lambda: quant_nn.QuantLSTM(3, 4, descriptor="oops"),  # nn.LSTM takes **kwargs: checked against RNNBase
        lambda: quant_nn.QuantLSTMCell(3, 4, bias=False, descriptor="oops"),
        lambda: quant_nn.QuantAvgPool2d(2, quant_desc_weight=QuantDescriptor()),
    ],
)
def test_unknown_keywords_raise_unused_keys(make):
    with pytest.raises(TypeError, match=r"Unused keys: \['(descriptor|quant_desc_weight)'\]"):
        make()


def test_pop_quant_desc_in_kwargs():
    from lq.nn.modules._utils import pop_quant_desc_in_kwargs

    qi, qw = pop_quant_desc_in_kwargs(quant_nn.QuantLinear, quant_desc_input=QuantDescriptor(num_bits=4))
    assert qi.num_bits == 4 and qw == quant_nn.QuantLinear.default_quant_desc_weight
    assert pop_quant_desc_in_kwargs(quant_nn.QuantMaxPool2d, input_only=True) == tq.QUANT_DESC_8BIT_PER_TENSOR
    with pytest.raises(TypeError, match="Unused keys"):
        pop_quant_desc_in_kwargs(quant_nn.QuantLinear, other=1)
