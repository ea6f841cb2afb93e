"""QuantLSTMCell / QuantLSTM compute the reference toolkit's quantized LSTM.

The definition (pytorch-quantization's QuantLSTM), written out here step by step
and independently of lq's module code:

* per layer and direction, one input quantizer sees ``[x_t | h_{t-1}]`` (the two
  concatenated along features) at every step, so both get ONE amax;
* one weight quantizer sees ``[W_ih | W_hh]`` (concatenated along columns; per row by
  default, so a row's amax covers its input and its hidden weights);
* biases and the cell state are not quantized; gates are (i, f, g, o);
* ``gates = linear(x_q, W_ih_q, b_ih) + linear(h_q, W_hh_q, b_hh)``.

Uncalibrated quantizers use amax = max |tensor| (per row with axis 0).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import lq.nn as quant_nn
from lq import tensor_quant as tq
from lq.tensor_quant import QuantDescriptor

torch.set_flush_denormal(True)


# ---------------------------------------------------------------- the reference, written out
def fq(x, num_bits=8, per_row=False, amax=None):
    """Fake quantization; amax: the given one, else max |x| (per row when ``per_row``)."""
    if amax is None:
        amax = x.detach().abs().amax(dim=1, keepdim=True) if per_row else x.detach().abs().amax()
    return tq.fake_tensor_quant(x, amax, num_bits, False, False)


def ref_step(x, h, c, w_ih, w_hh, b_ih, b_hh, bits_in=8, bits_w=8, per_row=True, quant=True, amax_in=None,
             amax_w=None):
    """One step of the reference quantized LSTM cell (2-D x, h, c)."""
    if quant:
        xh = fq(torch.cat([x, h], 1), bits_in, amax=amax_in)
        x, h = xh[:, : x.shape[1]], xh[:, x.shape[1]:]
        w = fq(torch.cat([w_ih, w_hh], 1), bits_w, per_row, amax=amax_w)
        w_ih, w_hh = w[:, : w_ih.shape[1]], w[:, w_ih.shape[1]:]
    gates = F.linear(x, w_ih, b_ih) + F.linear(h, w_hh, b_hh)
    H = gates.shape[1] // 4
    i, f, g, o = gates[:, :H], gates[:, H: 2 * H], gates[:, 2 * H: 3 * H], gates[:, 3 * H:]
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def params(m, layer, d):
    sfx = f"_l{layer}" + ("_reverse" if d else "")
    get = lambda n: getattr(m, n + sfx, None)  # noqa: E731
    return get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh")


def ref_lstm(m, x, h0, c0, lengths=None, **kw):
    """Multi-layer (bi)LSTM over time-major ``x`` (T, B, F). With ``lengths``, sequence b runs
    for its first ``lengths[b]`` steps only: each step quantizes the rows still running."""
    T, B = x.shape[:2]
    lengths = torch.full((B,), T) if lengths is None else lengths
    D = 2 if m.bidirectional else 1
    layer_in, hn, cn = x, [], []
    for layer in range(m.num_layers):
        outs = []
        for d in range(D):
            p = params(m, layer, d)
            w_hr = getattr(m, f"weight_hr_l{layer}" + ("_reverse" if d else ""), None)
            h, c = h0[layer * D + d].clone(), c0[layer * D + d].clone()
            out = torch.zeros(T, B, h.shape[1])
            for t in (reversed(range(T)) if d else range(T)):
                run = lengths > t
                h_new, c_new = ref_step(layer_in[t][run], h[run], c[run], *p, **kw)
                if w_hr is not None:  # lq's extension: W_hr per row, its input (o * tanh(c)) float
                    h_new = F.linear(h_new, fq(w_hr, kw.get("bits_w", 8), kw.get("per_row", True)))
                h[run], c[run], out[t][run] = h_new, c_new, h_new
            outs.append(out)
            hn.append(h)
            cn.append(c)
        layer_in = torch.cat(outs, 2)
    return layer_in, torch.stack(hn), torch.stack(cn)


def disable_all(module):
    for q in module.modules():
        if isinstance(q, quant_nn.TensorQuantizer):
            q.disable()
    return module


# ---------------------------------------------------------------- QuantLSTMCell
@pytest.mark.parametrize("bias", [True, False])
def test_cell_matches_reference_definition(bias):
    m = quant_nn.QuantLSTMCell(5, 6, bias=bias)
    x, h, c = torch.randn(3, 5) * 2, torch.randn(3, 6) * 0.3, torch.randn(3, 6)
    h1, c1 = m(x, (h, c))
    eh, ec = ref_step(x, h, c, m.weight_ih, m.weight_hh, m.bias_ih, m.bias_hh)
    torch.testing.assert_close(h1, eh, rtol=0, atol=1e-7)
    torch.testing.assert_close(c1, ec, rtol=0, atol=1e-7)
    # the fused amax matters: x and h quantized each with its own amax give something else
    w = fq(torch.cat([m.weight_ih, m.weight_hh], 1), per_row=True)
    h_sep, _ = ref_step(fq(x), fq(h), c, w[:, :5], w[:, 5:], m.bias_ih, m.bias_hh, quant=False)
    assert not torch.allclose(h1, h_sep, rtol=0, atol=1e-4)


def test_cell_per_tensor_low_bits_and_default_state():
    m = quant_nn.QuantLSTMCell(7, 4, quant_desc_input=QuantDescriptor(num_bits=5),
                               quant_desc_weight=QuantDescriptor(num_bits=4))
    x = torch.randn(2, 7)
    h1, c1 = m(x)
    zero = torch.zeros(2, 4)
    eh, ec = ref_step(x, zero, zero, m.weight_ih, m.weight_hh, m.bias_ih, m.bias_hh, 5, 4, per_row=False)
    torch.testing.assert_close(h1, eh, rtol=0, atol=1e-7)
    torch.testing.assert_close(c1, ec, rtol=0, atol=1e-7)
    # unbatched input, like nn.LSTMCell
    hu, cu = m(x[0], (zero[0], zero[0]))
    assert hu.shape == (4,)
    torch.testing.assert_close(hu, ref_step(x[:1], zero[:1], zero[:1], m.weight_ih, m.weight_hh, m.bias_ih,
                                            m.bias_hh, 5, 4, per_row=False)[0][0], rtol=0, atol=1e-7)


def test_cell_has_one_input_and_one_weight_quantizer():
    m = quant_nn.QuantLSTMCell(3, 4)
    assert [n for n, _ in m.iter_quantizers()] == ["_input_quantizer", "_weight_quantizer"]
    assert m.input_quantizer is m._input_quantizer and m._weight_quantizer.axis == 0
    (q, w), = m.weight_quantizer_pairs()
    assert q is m._weight_quantizer and torch.equal(w, torch.cat([m.weight_ih, m.weight_hh], 1))


def test_cell_disabled_equals_torch():
    f = nn.LSTMCell(5, 6)
    m = disable_all(quant_nn.QuantLSTMCell.from_float(f))
    x, h, c = torch.randn(3, 5), torch.randn(3, 6), torch.randn(3, 6)
    for a, b in zip(m(x, (h, c)), f(x, (h, c)), strict=True):
        torch.testing.assert_close(a, b)


def test_cell_errors():
    m = quant_nn.QuantLSTMCell(5, 6)
    with pytest.raises(RuntimeError, match="input_size"):
        m(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"hidden\[0\]"):
        m(torch.randn(2, 5), (torch.randn(3, 6), torch.randn(2, 6)))


# ---------------------------------------------------------------- QuantLSTM
LSTM_CASES = [
    dict(),
    dict(num_layers=2),
    dict(bias=False),
    dict(batch_first=True),
    dict(bidirectional=True),
    dict(num_layers=2, bidirectional=True, batch_first=True),
    dict(num_layers=2, bidirectional=True, proj_size=3),
]


@pytest.mark.parametrize("given_state", [True, False])
@pytest.mark.parametrize("kwargs", LSTM_CASES, ids=str)
def test_lstm_matches_reference_definition(kwargs, given_state):
    m = quant_nn.QuantLSTM(4, 5, **kwargs)
    L, D, T, B = m.num_layers, 2 if m.bidirectional else 1, 6, 3
    x = torch.randn(T, B, 4) * 2
    h0, c0 = torch.randn(L * D, B, m.proj_size or 5) * 0.5, torch.randn(L * D, B, 5)
    if not given_state:
        h0, c0 = torch.zeros_like(h0), torch.zeros_like(c0)
    xin = x.transpose(0, 1) if m.batch_first else x
    out, (hn, cn) = m(xin, (h0, c0)) if given_state else m(xin)
    if m.batch_first:
        out = out.transpose(0, 1)
    e_out, e_h, e_c = ref_lstm(m, x, h0, c0)
    torch.testing.assert_close(out, e_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(hn, e_h, rtol=0, atol=1e-6)
    torch.testing.assert_close(cn, e_c, rtol=0, atol=1e-6)


def test_lstm_other_precisions():
    m = quant_nn.QuantLSTM(6, 5, num_layers=2, quant_desc_input=QuantDescriptor(num_bits=6),
                           quant_desc_weight=QuantDescriptor(num_bits=4))
    x, h0, c0 = torch.randn(4, 2, 6), torch.randn(2, 2, 5), torch.randn(2, 2, 5)
    out, (hn, cn) = m(x, (h0, c0))
    e_out, e_h, e_c = ref_lstm(m, x, h0, c0, bits_in=6, bits_w=4, per_row=False)
    torch.testing.assert_close(out, e_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(cn, e_c, rtol=0, atol=1e-6)


def test_lstm_quantizers_one_per_layer_and_direction():
    m = quant_nn.QuantLSTM(3, 4, num_layers=2, bidirectional=True)
    names = [n for n, _ in m.iter_quantizers()]
    assert names == [f"_input_quantizers.{i}" for i in range(4)] + [f"_weight_quantizers.{i}" for i in range(4)]
    pairs = list(m.weight_quantizer_pairs())
    assert [q for q, _ in pairs] == list(m._weight_quantizers)
    w_ih, w_hh = m.weight_ih_l1_reverse, m.weight_hh_l1_reverse
    assert torch.equal(pairs[3][1], torch.cat([w_ih, w_hh], 1)) and pairs[3][1].shape == (16, 8 + 4)
    assert not hasattr(m, "input_quantizer") and not hasattr(m, "weight_quantizer")  # lists only


CASES_TORCH = [
    dict(num_layers=2, bidirectional=True),
    dict(batch_first=True, proj_size=3),
    dict(num_layers=2, bidirectional=True, proj_size=2),
    dict(bias=False),
]


@pytest.mark.parametrize("kwargs", CASES_TORCH, ids=str)
def test_lstm_disabled_equals_torch(kwargs):
    f = nn.LSTM(4, 5, **kwargs).eval()
    m = disable_all(quant_nn.QuantLSTM.from_float(f))
    x = torch.randn(6, 3, 4)
    (a, (ah, ac)), (b, (bh, bc)) = m(x), f(x)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ah, bh)
    torch.testing.assert_close(ac, bc)
    # unbatched input, with a given state
    D = 2 if f.bidirectional else 1
    hs = f.proj_size or f.hidden_size
    hx = (torch.randn(f.num_layers * D, hs), torch.randn(f.num_layers * D, 5))
    for u, v in zip(m(x[:, 0], hx)[1], f(x[:, 0], hx)[1], strict=True):
        torch.testing.assert_close(u, v)


def test_lstm_packed_sequence_disabled_equals_torch():
    f = nn.LSTM(4, 5, num_layers=2, bidirectional=True)
    m = disable_all(quant_nn.QuantLSTM.from_float(f))
    x = torch.randn(7, 4, 4)
    packed = pack_padded_sequence(x, torch.tensor([3, 7, 5, 1]), enforce_sorted=False)
    h0, c0 = torch.randn(4, 4, 5), torch.randn(4, 4, 5)
    (a, (ah, ac)), (b, (bh, bc)) = m(packed, (h0, c0)), f(packed, (h0, c0))
    assert torch.equal(a.batch_sizes, b.batch_sizes) and torch.equal(a.unsorted_indices, b.unsorted_indices)
    torch.testing.assert_close(a.data, b.data)
    torch.testing.assert_close(ah, bh)
    torch.testing.assert_close(ac, bc)


def test_lstm_packed_sequence_quantizes_running_rows_only():
    m = quant_nn.QuantLSTM(4, 5, num_layers=2, bidirectional=True)
    lengths = torch.tensor([3, 7, 5, 1])
    x = torch.randn(7, 4, 4)
    x[3:, 0] = 50.0  # padding of a finished sequence: must not enter any amax
    h0, c0 = torch.randn(4, 4, 5), torch.randn(4, 4, 5)
    out, (hn, cn) = m(pack_padded_sequence(x, lengths, enforce_sorted=False), (h0, c0))
    out, _ = pad_packed_sequence(out)
    e_out, e_h, e_c = ref_lstm(m, x, h0, c0, lengths=lengths)
    torch.testing.assert_close(out, e_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(hn, e_h, rtol=0, atol=1e-6)
    torch.testing.assert_close(cn, e_c, rtol=0, atol=1e-6)


@pytest.mark.parametrize("weight_axis", [0, None, 1], ids=["per-row", "per-tensor", "per-column"])
def test_lstm_calibrated_matches_reference_definition(weight_axis):
    """With a static amax lq quantizes x and h (W_ih and W_hh) one by one where that is exact, so
    exported graphs have each Q/DQ at its matmul: the numbers must still be those of the fused tensors."""
    m = quant_nn.QuantLSTM(4, 5, num_layers=2, bidirectional=True,
                           quant_desc_weight=QuantDescriptor(axis=weight_axis))
    amax_in, amax_w = [], []
    for i in range(4):
        amax_in.append(torch.tensor(0.7 + 0.3 * i))  # clips part of x and of h
        layer, d = divmod(i, 2)
        w = torch.cat(params(m, layer, d)[:2], 1).detach()
        amax_w.append(w.abs().amax() * 0.8 if weight_axis is None else w.abs().amax(dim=1 - weight_axis,
                                                                                     keepdim=True) * 0.8)
        m._input_quantizers[i].amax = amax_in[i]
        m._weight_quantizers[i].amax = amax_w[i]
    x, h0, c0 = torch.randn(5, 3, 4) * 2, torch.randn(4, 3, 5), torch.randn(4, 3, 5)
    out, (hn, cn) = m(x, (h0, c0))
    # the reference with the same amax per layer and direction
    layer_in, e_h = x, []
    for layer in range(2):
        outs = []
        for d in range(2):
            i = layer * 2 + d
            h, c = h0[i], c0[i]
            o = [None] * 5
            for t in (reversed(range(5)) if d else range(5)):
                h, c = ref_step(layer_in[t], h, c, *params(m, layer, d), amax_in=amax_in[i], amax_w=amax_w[i])
                o[t] = h
            outs.append(torch.stack(o))
            e_h.append(h)
        layer_in = torch.cat(outs, 2)
    # equal up to float rounding of the GEMMs (operand layouts differ); a quantization step is ~1e-2
    torch.testing.assert_close(out, layer_in, rtol=0, atol=1e-6)
    torch.testing.assert_close(hn, torch.stack(e_h), rtol=0, atol=1e-6)


def test_parts_quantize_alike_only_when_exact():
    from lq.nn.modules.quant_rnn import _parts_quantize_alike

    q = quant_nn.TensorQuantizer(QuantDescriptor(axis=0))
    assert not _parts_quantize_alike(q, 2)  # dynamic amax: the whole decides it
    q.amax = torch.ones(4, 1)
    assert _parts_quantize_alike(q, 2)  # per row: the same amax along dim 1
    q.enable_calib()
    assert not _parts_quantize_alike(q, 2)  # a calibrator sees the fused tensor
    q.disable_calib()
    q = quant_nn.TensorQuantizer(QuantDescriptor(axis=1, amax=torch.ones(1, 6)))
    assert not _parts_quantize_alike(q, 2)  # per column: each part has its own columns' amax
    q.disable()
    assert _parts_quantize_alike(q, 2)


def test_lstm_calibration_sees_every_step():
    m = quant_nn.QuantLSTM(3, 4)
    q_in, q_w = m._input_quantizers[0], m._weight_quantizers[0]
    for q in (q_in, q_w):
        q.disable_quant()
        q.enable_calib()
    x = torch.randn(5, 2, 3)
    with torch.no_grad():
        out, _ = m(x)
    for q in (q_in, q_w):
        q.load_calib_amax()
        q.enable_quant()
        q.disable_calib()
    # calibration runs the float LSTM: [x_t | h_{t-1}] over all steps, h_{-1} = 0
    h_prev = torch.cat([torch.zeros(1, 2, 4), out[:-1]])
    expect = torch.cat([x, h_prev], 2).abs().max()
    assert float(q_in.amax) == pytest.approx(float(expect), rel=1e-6)
    w = torch.cat([m.weight_ih_l0, m.weight_hh_l0], 1).detach()
    torch.testing.assert_close(q_w.amax.reshape(-1), w.abs().amax(1), rtol=0, atol=0)


def test_lstm_static_amax_and_gradients():
    m = quant_nn.QuantLSTM(3, 4, quant_desc_input=QuantDescriptor(amax=1.0))
    x = (torch.randn(4, 2, 3) * 2).requires_grad_()
    out, _ = m(x)
    out.sum().backward()
    # clipped straight-through: no gradient where |x| > amax, a gradient everywhere else
    clipped = x.detach().abs() > 1.0
    assert clipped.any() and (x.grad[clipped] == 0).all() and (x.grad[~clipped] != 0).all()
    assert m.weight_ih_l0.grad.abs().sum() > 0 and m.weight_hh_l0.grad.abs().sum() > 0


def test_lstm_state_dict_round_trip_keeps_amax():
    m = quant_nn.QuantLSTM(3, 4, bidirectional=True)
    for i, q in enumerate(m._input_quantizers):
        q.amax = 1.5 + i
    m2 = quant_nn.QuantLSTM(3, 4, bidirectional=True)
    m2.load_state_dict(copy.deepcopy(m.state_dict()))
    assert float(m2._input_quantizers[1].amax) == 2.5
    x = torch.randn(3, 2, 3)
    assert torch.equal(m(x)[0], m2(x)[0])


def test_lstm_errors():
    m = quant_nn.QuantLSTM(4, 5)
    with pytest.raises(RuntimeError, match="input_size"):
        m(torch.randn(3, 2, 6))
    with pytest.raises(RuntimeError, match=r"hidden\[0\]"):
        m(torch.randn(3, 2, 4), (torch.randn(1, 3, 5), torch.randn(1, 2, 5)))
    with pytest.raises(ValueError, match="2D or 3D"):
        m(torch.randn(4))


def test_quant_lstm_exports_to_onnx(tmp_path):
    pytest.importorskip("onnxruntime")
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model
    from lq.export import export_onnx

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True)
            self.head = nn.Linear(12, 3)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    model = Net()
    quantize_model(model, quant_desc_input=QuantDescriptor())
    model.eval()
    with torch.no_grad():
        calibrate_model(model, [torch.randn(8, 5, 4) for _ in range(2)], method="max")
    res = export_onnx(model, torch.randn(2, 5, 4), tmp_path / "lstm.onnx", fallback_seconds=0)
    assert res.max_abs_diff < 1e-4
    # one Scan per layer and direction (tests/test_export_lstm.py): the input projection of all steps before
    # it and the recurrent Gemm in its body read their Q/DQ directly, so onnxruntime runs both on integer kernels
    rnn = [k for k in res.layer_kernels if k.layer == "rnn"]
    assert len(rnn) == 2 * 2 * 2 and all(k.reason is None for k in rnn), [k for k in rnn if k.reason]
