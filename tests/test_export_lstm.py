"""QuantLSTM exports as ONNX Scan loops (one per layer and direction), not unrolled.

What must hold: the graph does not grow with the sequence length (its size is the same for a sample of 3 and
of 24 steps), the sequence length can be a dynamic input axis, onnxruntime (all optimizations on) computes
what PyTorch's fake-quant QuantLSTM computes on lengths the export never saw, and the step's matmuls run on
integer kernels inside the loop. The expected numbers come from a quantized LSTM written out here (the
reference toolkit's definition: ``[x_t | h_{t-1}]`` and ``[W_ih | W_hh]`` each quantized as one tensor), not
from lq's module code.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lq.nn as quant_nn
from lq import tensor_quant as tq
from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.export import export_onnx
from lq.export._ir import all_nodes
from lq.tensor_quant import QuantDescriptor

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)


# ---------------------------------------------------------------- the reference, written out
def ref_quant_lstm(m: nn.LSTM, x, hx=None):
    """``(output, (h_n, c_n))`` of the quantized LSTM with ``m``'s weights and calibrated amaxes, time-first
    ``x`` (T, B, F); per layer and direction ``[x_t | h]`` is quantized with the input amax (one tensor) and
    ``[W_ih | W_hh]`` per row with the weight amax."""
    nd = 2 if m.bidirectional else 1
    H = m.hidden_size
    n = m.num_layers * nd
    h0, c0 = hx if hx is not None else (torch.zeros(n, x.shape[1], H), torch.zeros(n, x.shape[1], H))
    seq, hs, cs = x, [], []
    for layer in range(m.num_layers):
        outs = []
        for d in range(nd):
            i = layer * nd + d
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(m, "weight_ih" + sfx), getattr(m, "weight_hh" + sfx)
            b_ih, b_hh = getattr(m, "bias_ih" + sfx), getattr(m, "bias_hh" + sfx)
            a_in, a_w = m._input_quantizers[i].amax, m._weight_quantizers[i].amax
            w = tq.fake_tensor_quant(torch.cat([w_ih, w_hh], 1), a_w, 8, False, False)
            w_ih, w_hh = w[:, : w_ih.shape[1]], w[:, w_ih.shape[1]:]
            h, c = h0[i], c0[i]
            o = [None] * seq.shape[0]
            for t in reversed(range(seq.shape[0])) if d else range(seq.shape[0]):
                xh = tq.fake_tensor_quant(torch.cat([seq[t], h], 1), a_in, 8, False, False)
                xq, hq = xh[:, : seq.shape[2]], xh[:, seq.shape[2]:]
                gates = F.linear(xq, w_ih, b_ih) + F.linear(hq, w_hh, b_hh)
                gi, gf, gg, go = gates.chunk(4, 1)
                c = torch.sigmoid(gf) * c + torch.sigmoid(gi) * torch.tanh(gg)
                h = torch.sigmoid(go) * torch.tanh(c)
                o[t] = h
            outs.append(torch.stack(o))
            hs.append(h)
            cs.append(c)
        seq = torch.cat(outs, 2)
    return seq, (torch.stack(hs), torch.stack(cs))


class Seq(nn.Module):
    """An nn.LSTM whose outputs are the model's outputs (all steps, and the final h and c)."""

    def __init__(self, batch_first: bool, bidirectional: bool = True, num_layers: int = 2, with_state=False):
        super().__init__()
        self.with_state = with_state
        self.rnn = nn.LSTM(5, 7, num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first)

    def forward(self, x, h0=None, c0=None):
        out, (h, c) = self.rnn(x, (h0, c0) if self.with_state else None)
        return out, h, c


def _quantized(model, batch_first, seed=0):
    quantize_model(model, quant_desc_input=QuantDescriptor())
    model.eval()
    g = torch.Generator().manual_seed(seed)
    shape = (4, 9, 5) if batch_first else (9, 4, 5)
    data = [(torch.randn(*shape, generator=g),) for _ in range(2)]
    if model.with_state:
        n = model.rnn.num_layers * (2 if model.rnn.bidirectional else 1)
        data = [(x, torch.randn(n, 4, 7, generator=g) * 0.5, torch.randn(n, 4, 7, generator=g) * 0.5)
                for (x,) in data]
    with torch.no_grad():
        calibrate_model(model, data, method="max", forward=lambda m, batch: m(*batch))
    assert isinstance(model.rnn, quant_nn.QuantLSTM)
    return model


class Proj(nn.Module):
    """An nn.LSTM with proj_size (h is projected: no ONNX LSTM attribute for that), all steps out."""

    def __init__(self, **kw):
        super().__init__()
        self.rnn = nn.LSTM(5, 8, proj_size=3, batch_first=True, **kw)

    def forward(self, x):
        return self.rnn(x)[0]


def _calibrated_proj(**kw) -> nn.Module:
    model = Proj(**kw)
    quantize_model(model, quant_desc_input=QuantDescriptor())
    model.eval()
    with torch.no_grad():
        calibrate_model(model, [torch.randn(4, 9, 5) for _ in range(2)], method="max")
    return model


def _nodes(path) -> int:
    return sum(1 for _ in all_nodes(onnx.load(str(path)).graph))


def _run(path, feeds):
    return _run_model(str(path), feeds)


def _run_model(model, feeds):
    """onnxruntime (all optimizations on) on a file path or a ModelProto."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    source = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: np.ascontiguousarray(f) for i, f in zip(sess.get_inputs(), feeds)})


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "time_first"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no_h0", "h0_c0"])
def test_lstm_exports_as_loops_with_a_dynamic_length(tmp_path, batch_first, with_state):
    model = _quantized(Seq(batch_first, with_state=with_state), batch_first)
    T_axis = 1 if batch_first else 0

    def sample(T, B, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(*((B, T, 5) if batch_first else (T, B, 5)), generator=g)
        n = 4
        return (x, torch.randn(n, B, 7, generator=g) * 0.5, torch.randn(n, B, 7, generator=g) * 0.5) \
            if with_state else (x,)

    # x's batch and time axes depend on batch_first, h0/c0 have the batch on dim 1: named per input
    x_dims = {1 - T_axis: "batch", T_axis: "time"}
    if batch_first and not with_state:
        kw = dict(dynamic_dims=(1,))  # the short form: dim 0 is the batch (dynamic_batch), dim 1 of every input
    else:
        kw = dict(dynamic_batch=False, dynamic_dims=[x_dims] + ([{1: "batch"}, {1: "batch"}] if with_state else []))
    res = export_onnx(model, sample(6, 3, 1), tmp_path / "lstm.onnx", fallback_seconds=0, **kw)
    proto = onnx.load(str(tmp_path / "lstm.onnx"))
    assert [n.op_type for n in proto.graph.node].count("Scan") == 4  # 2 layers x 2 directions
    assert res.verified
    # lengths and batch sizes the export never saw, against the written-out reference
    for T, B in ((1, 2), (4, 3), (13, 5)):
        feeds = sample(T, B, 10 + T)
        x = feeds[0] if not batch_first else feeds[0].transpose(0, 1)
        with torch.no_grad():
            e_out, (e_h, e_c) = ref_quant_lstm(model.rnn, x, feeds[1:] if with_state else None)
        if batch_first:
            e_out = e_out.transpose(0, 1)
        got = _run(tmp_path / "lstm.onnx", [f.numpy() for f in feeds])
        assert got[0].shape == tuple(e_out.shape)
        why = res.judge(got, [e.numpy() for e in (e_out, e_h, e_c)])  # the export's own rule
        assert not why, (T, B, why)
        for g_, e in zip(got, (e_out, e_h, e_c)):
            diff = np.abs(g_ - e.numpy())
            # the same numbers up to float rounding, bar the rare rounding tie the runtimes break apart (a flip
            # in h carries on through later steps, so not every value; an unquantized h moves nearly all of them
            # by about half a quantization step, ~1e-2 here)
            assert float(np.median(diff)) <= 1e-4, (T, B, float(np.median(diff)))


def test_graph_size_does_not_grow_with_the_sequence(tmp_path):
    model = _quantized(Seq(True), True)
    sizes = []
    for T in (3, 24):
        p = tmp_path / f"t{T}.onnx"
        export_onnx(model, torch.randn(2, T, 5), p, dynamic_dims=(1,), fallback_seconds=0)
        sizes.append(_nodes(p))
    assert sizes[0] == sizes[1], sizes
    # and the step is written once per layer and direction: a handful of nodes per loop, not per time step
    assert sizes[0] < 4 * 40, sizes


def test_the_steps_matmuls_run_on_integer_kernels_inside_the_loop(tmp_path):
    model = _quantized(Seq(True), True)
    res = export_onnx(model, torch.randn(2, 6, 5), tmp_path / "lstm.onnx", dynamic_dims=(1,), fallback_seconds=0)
    rnn = [k for k in res.layer_kernels if k.layer == "rnn"]
    # per layer and direction: the input projection of all steps (outside; with its bias a Gemm on the flattened
    # steps, lq.export.passes._linear_gemm) and the recurrent Gemm (in the body)
    assert sorted(k.op for k in rnn) == ["Gemm"] * 8
    assert all(k.integer for k in rnn), [k.text() for k in rnn]
    assert res.ort_ops["QGemm"] >= 4  # counted inside the loop bodies too
    assert res.speedup is not None  # the FP32 twin (placeholders in the bodies made Identity) runs
    # and no warning calls them float: onnxruntime fuses a Gemm/MatMul whose float output an Add reads
    assert not [w for w in res.warnings if w.startswith("onnxruntime runs")], res.warnings


def _twins(monkeypatch, model, sample, path):
    """Export ``model`` and return its FP32 twin both ways, from the exporter's graph: recurrent layers as
    ONNX LSTM ops (what the export times against) and as the float Scan of the INT8 file's step."""
    from lq.export import _export
    from lq.export.timing import _float_twin

    seen, real = [], _float_twin.float_twin

    def spy(proto, *a, **kw):
        seen.append(onnx.ModelProto.FromString(proto.SerializeToString()))
        return real(proto, *a, **kw)

    monkeypatch.setattr(_export._float_twin, "float_twin", spy)
    res = export_onnx(model, sample, path, dynamic_dims=(1,), fallback_seconds=0)
    (pre,) = seen
    return res, real(pre), real(pre, fused_recurrent=False)


def test_the_speed_check_times_against_the_fused_float_lstm(tmp_path, monkeypatch):
    """A plain FP32 export of nn.LSTM is one ONNX LSTM op per layer and direction, which onnxruntime runs
    faster than a float Scan of the step: the export's FP32 twin must be that op, computing what the float
    model computes (torch's gate order rewritten to ONNX's), or the speed check flatters the INT8 file."""
    model = _quantized(Seq(True), True)
    res, fused, scan = _twins(monkeypatch, model, torch.randn(2, 6, 5), tmp_path / "lstm.onnx")
    assert res.speedup is not None
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("LSTM") == 4 and "Scan" not in ops and "MatMul" not in ops, ops
    assert [n.op_type for n in scan.graph.node].count("Scan") == 4
    x = torch.randn(3, 11, 5, generator=torch.Generator().manual_seed(3))
    for q in model.modules():  # the float model: every quantizer off
        if isinstance(q, quant_nn.TensorQuantizer):
            q.disable()
    with torch.no_grad():
        want = [t.numpy() for t in model(x)]
    for twin in (fused, scan):
        got = _run_model(twin, [x.numpy()])
        for g_, e in zip(got, want):
            assert g_.shape == e.shape and float(np.abs(g_ - e).max()) <= 1e-5, float(np.abs(g_ - e).max())


def test_the_speed_check_keeps_a_float_scan_for_an_lstm_the_op_cannot_express(tmp_path, monkeypatch):
    """proj_size has no ONNX LSTM attribute: that layer's twin stays the float Scan, and still computes the
    float model."""

    model = _calibrated_proj(num_layers=1, bidirectional=False)
    _, fused, _ = _twins(monkeypatch, model, torch.randn(2, 6, 5), tmp_path / "proj.onnx")
    ops = [n.op_type for n in fused.graph.node]
    assert "LSTM" not in ops and ops.count("Scan") == 1, ops
    x = torch.randn(3, 10, 5)
    for q in model.modules():
        if isinstance(q, quant_nn.TensorQuantizer):
            q.disable()
    with torch.no_grad():
        want = model(x).numpy()
    assert float(np.abs(_run_model(fused, [x.numpy()])[0] - want).max()) <= 1e-5


@pytest.mark.parametrize("kw", [dict(bidirectional=False, num_layers=1), dict(bidirectional=False, num_layers=2)],
                         ids=["1-layer", "2-layer"])
def test_unidirectional_lstm(tmp_path, kw):
    model = _quantized(Seq(False, **kw), False)
    res = export_onnx(model, torch.randn(5, 3, 5), tmp_path / "lstm.onnx", dynamic_batch=False,
                      dynamic_dims=[{0: "time", 1: "batch"}], fallback_seconds=0)
    assert [n.op_type for n in onnx.load(str(tmp_path / "lstm.onnx")).graph.node].count("Scan") == kw["num_layers"]
    x = torch.randn(11, 3, 5)
    with torch.no_grad():
        e_out, (e_h, e_c) = ref_quant_lstm(model.rnn, x)
    got = _run(tmp_path / "lstm.onnx", [x.numpy()])
    assert res.judge([got[0]], [e_out.numpy()]) == ""


def test_proj_size_exports_as_a_loop(tmp_path):
    model = _calibrated_proj(num_layers=2, bidirectional=True)
    res = export_onnx(model, torch.randn(2, 6, 5), tmp_path / "proj.onnx", dynamic_dims=(1,), fallback_seconds=0)
    assert res.verified
    x = torch.randn(3, 10, 5)
    with torch.no_grad():
        expect = model(x).numpy()
    assert res.judge([_run(tmp_path / "proj.onnx", [x.numpy()])[0]], [expect]) == ""


def test_an_lstm_the_loop_cannot_express_is_exported_unrolled_and_says_so(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(5, 7, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0]

    model = Net()
    quantize_model(model, quant_desc_input=QuantDescriptor())
    model.eval()
    # a dynamic input quantizer quantizes [x_t | h_{t-1}] with one amax of both: not expressible per step
    model.rnn._input_quantizers[0] = quant_nn.TensorQuantizer(tq.QuantDescriptor(dynamic=True))
    with torch.no_grad():
        calibrate_model(model, [torch.randn(4, 6, 5)], method="max")
    res = export_onnx(model, torch.randn(2, 4, 5), tmp_path / "unrolled.onnx", fallback_seconds=0)
    assert any("QuantLSTM 'rnn' is exported unrolled" in w and "_input_quantizers.0" in w for w in res.warnings)
    assert "Scan" not in [n.op_type for n in onnx.load(str(tmp_path / "unrolled.onnx")).graph.node]
    assert res.verified


def test_packed_input_is_refused_in_loop_mode_with_one_line():
    from torch.nn.utils.rnn import pack_padded_sequence

    m = quant_nn.QuantLSTM(5, 7)
    for q in m._input_quantizers:
        q.amax = 1.0
    m._export_as_loop = True
    packed = pack_padded_sequence(torch.randn(4, 2, 5), [4, 2])
    with pytest.raises(ValueError, match=r"PackedSequence input cannot be exported.*padded") as e:
        m(packed)
    assert "\n" not in str(e.value)


def test_the_placeholder_op_does_not_run_eagerly():
    from lq.export.trace import _loop_ops  # noqa: F401  (defines torch.ops.lq_export)

    t = torch.zeros(2, 3, 4)
    with pytest.raises(RuntimeError, match="does not run"):
        torch.ops.lq_export.lstm_scan(t, t[0, :, :1], t[0, :, :1], t[0, :, :1], t[0], None, None, False, 1)


def test_the_users_model_is_untouched(tmp_path):
    model = _quantized(Seq(True), True)
    x = torch.randn(2, 5, 5)
    with torch.no_grad():
        before = model(x)[0]
    export_onnx(model, x, tmp_path / "lstm.onnx", fallback_seconds=0)
    assert not model.rnn._export_as_loop and "_export_as_loop" not in vars(model.rnn)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], before, rtol=0, atol=0)


def test_bench_lstm_export_fast_runs_as_the_readme_shows(bench_runs):
    """``python -m bench.lstm_export`` (README) in its --fast form: every LSTM matmul integer, both lengths. (The
    run starts with the test session, beside the other benches: tests/_bench_runs.py.)"""
    r = bench_runs["lstm_export"]
    r.check()
    assert r.log.count("LSTM matmuls 8 of 8 integer") >= 4 and "another sequence length" in r.log
