"""The export's speed check: one measurement, one definition, against the file a user compares with.

The INT8 file is timed against the plain FP32 export of the same model (``torch.onnx.export`` of the float
model), at the batch the user names or the sample's; the ratio is the median FP32 time over the median INT8
time, those two times are the ones printed, and the check says when its rounds disagree. No test here asserts
a wall-clock speed: the statistics get synthetic round times, the export gets injected ones where the verdict
matters, and the real timing is only run to see that both files run at the batch asked for.
"""

from __future__ import annotations

import copy
import io
import re
import statistics
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lq.calibration import calibrate_model
from lq.config import ExportConfig
from lq.convert import quantize_model
from lq.export import _export, export_onnx
from lq.export.timing import _float_twin, _fp32_reference, _timing
from lq.export.verify import _verify

torch.set_flush_denormal(True)
ort = pytest.importorskip("onnxruntime")

QDQ = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "DynamicQuantizeLSTM"}


class ConvBN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> Linear: the BatchNorm is what onnxruntime folds."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(5, 12, batch_first=True)
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.fc(y[:, -1])


def _float(model):
    """``model`` in eval mode with BatchNorm statistics that are not the identity (so folding them matters)."""
    model = model.eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
    return model


def _calibrated(model, x):
    """A quantized, calibrated copy of the float ``model`` (``model`` itself stays float)."""
    model = copy.deepcopy(_float(model))
    quantize_model(model)
    calibrate_model(model, [x])
    return model


def _ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _spy_compare(monkeypatch) -> dict:
    """Record what the export hands to :func:`_timing.compare` (and let it time for real)."""
    seen, real = {}, _timing.compare

    def spy(int8_model, fp32_model, feeds, providers=None, **kw):
        seen.update(int8=int8_model, fp32=fp32_model, feeds=feeds, **kw)
        return real(int8_model, fp32_model, feeds, providers, **kw)

    monkeypatch.setattr(_timing, "compare", spy)
    return seen


def _fake_rounds(monkeypatch, int8_s, fp32_s) -> dict:
    """Replace the timing itself by these round times (the statistics and the wording stay real)."""
    seen = {}

    def fake(int8_model, fp32_model, feeds, providers=None, **kw):
        seen.update(fp32=fp32_model, feeds=feeds)
        return list(int8_s), list(fp32_s), 7

    monkeypatch.setattr(_timing, "time_rounds", fake)
    return seen


# =========================================================================== the statistics, on synthetic rounds
def test_the_ratio_and_the_times_come_from_the_same_numbers():
    """The issue's contradiction: a median of per-round ratios below 1 beside median times that say 1.7x. Now
    the ratio is the ratio of the printed medians, and the disagreement is reported as noise."""
    int8 = [1.0e-3, 1.0e-3, 1.0e-3, 3.0e-3, 3.0e-3]
    fp32 = [0.9e-3, 0.9e-3, 3.4e-3, 3.4e-3, 3.4e-3]
    per_round = [f / q for q, f in zip(int8, fp32)]
    assert statistics.median(per_round) < 1.2  # what the old check reported: not the times' ratio
    c = _timing.summarize(int8, fp32, batch=8)
    assert c.int8_ms == pytest.approx(1e3 * statistics.median(int8))
    assert c.fp32_ms == pytest.approx(1e3 * statistics.median(fp32))
    assert c.ratio == pytest.approx(c.fp32_ms / c.int8_ms) == pytest.approx(3.4)
    assert c.noisy and "outside the per-round ratios' interquartile range" in c.noise
    text = c.text()
    # the printed times give the printed ratio
    m = re.search(r"^([\d.]+)x .* \(INT8 ([\d.]+) ms vs FP32 ([\d.]+) ms at batch 8", text)
    assert m, text
    r, q, f = map(float, m.groups())
    assert f / q == pytest.approx(r, rel=0.01)
    assert "Noisy: " in text and c.reference in text


def test_rounds_that_agree_are_not_noisy():
    int8 = [1.00e-3, 1.01e-3, 0.99e-3, 1.00e-3, 1.02e-3]
    fp32 = [2.00e-3, 2.01e-3, 2.02e-3, 1.99e-3, 2.00e-3]
    c = _timing.summarize(int8, fp32)
    assert not c.noisy and c.noise == "" and "oisy" not in c.text()
    assert c.ratio_p25 <= c.ratio <= c.ratio_p75 and c.ratio == pytest.approx(2.0, rel=0.02)
    assert c.rounds == 5 and not c.slower


def test_rounds_that_disagree_on_which_file_is_faster_are_noisy():
    int8 = [1.0e-3] * 6
    fp32 = [0.80e-3, 0.85e-3, 0.95e-3, 1.05e-3, 1.15e-3, 1.20e-3]
    c = _timing.summarize(int8, fp32)
    assert c.ratio_p25 < 1.0 < c.ratio_p75
    assert c.noisy and "do not agree on which file is faster" in c.noise
    assert "time again on a quiet machine" in c.text()


def test_a_wide_spread_of_per_round_ratios_is_noisy_even_above_one():
    int8 = [1.0e-3] * 5
    fp32 = [1.5e-3, 1.8e-3, 2.0e-3, 2.3e-3, 2.6e-3]
    c = _timing.summarize(int8, fp32)
    assert c.ratio_p25 > 1.0 and c.noisy
    assert f"wider than {_timing.NOISE_FRACTION:.0%} of the ratio" in c.noise
    assert "do not agree on which file" not in c.noise


@pytest.mark.parametrize("int8,fp32", [([], []), ([1e-3], []), ([1e-3, 0.0], [1e-3, 1e-3]),
                                       ([float("nan")], [1e-3])])
def test_summarize_refuses_rounds_it_cannot_read(int8, fp32):
    with pytest.raises(ValueError):
        _timing.summarize(int8, fp32)


def test_feeds_at_another_batch_repeat_the_sample_along_the_batch_axes():
    x = torch.arange(12.0).reshape(3, 4)
    h = torch.arange(6.0).reshape(1, 3, 2)  # batch on axis 1 (an LSTM's state)
    dims = [{0: "batch"}, {1: "batch"}]
    assert _timing.batch_size([x, h], dims) == 3
    fx, fh = _timing.batch_feeds([x, h], dims, 7)
    assert fx.shape == (7, 4) and fh.shape == (1, 7, 2)
    np.testing.assert_array_equal(fx, np.concatenate([x.numpy()] * 3)[:7])
    np.testing.assert_array_equal(fh[:, 3:6], h.numpy())
    same = _timing.batch_feeds([x, h], dims, None)
    np.testing.assert_array_equal(same[0], x.numpy())
    small = _timing.batch_feeds([x], [{0: "batch"}], 2)[0]
    np.testing.assert_array_equal(small, x.numpy()[:2])


# =========================================================================== the FP32 reference
def test_the_reference_is_the_plain_fp32_export_of_the_float_model(tmp_path, monkeypatch):
    """No Q/DQ, no lq op, the same operators as ``torch.onnx.export`` of the float model (before quantization),
    BatchNorm folded as onnxruntime folds it, and the float model's numbers, run at the batch asked for."""
    x = torch.randn(4, 3, 16, 16)
    float_model = _float(ConvBN())
    model = _calibrated(float_model, x)
    seen = _spy_compare(monkeypatch)
    res = export_onnx(model, x, tmp_path / "m.onnx", speed_batch=9, fallback_seconds=0)
    ref = onnx.load_from_string(seen["fp32"])
    ops = _ops(ref)
    assert not QDQ & set(ops) and all(n.domain in ("", "ai.onnx") for n in ref.graph.node), ops
    c = res.speed_check
    dynamo = "current exporter's file" in c.reference  # the faster of the user's two plain exports
    assert dynamo or "legacy exporter's file" in c.reference, c.reference
    if dynamo:
        user = torch.onnx.export(float_model, (x,), dynamo=True, input_names=["input"], output_names=["output"],
                                 dynamic_shapes=({0: torch.export.Dim("batch", min=1)},)).model_proto
    else:
        buf = io.BytesIO()
        torch.onnx.export(float_model, (x,), buf, dynamo=False, input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
        user = onnx.load_from_string(buf.getvalue())
    assert ops == _ops(user), (ops, _ops(user))
    assert "BatchNormalization" not in _ops(_verify.optimized_model(seen["fp32"]))  # folded (or never there)
    # the float model's numbers, at the speed batch: both files ran on 9 rows
    (feed,) = seen["feeds"]
    assert feed.shape == (9, 3, 16, 16) and seen["batch"] == 9
    sess = ort.InferenceSession(seen["fp32"], providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = float_model(torch.from_numpy(feed)).numpy()
    np.testing.assert_allclose(sess.run(None, {"input": feed})[0], want, rtol=1e-4, atol=1e-5)
    assert c.reference.startswith(_timing.PLAIN) and c.batch == 9 and c.rounds >= 3
    assert res.speedup == c.ratio == pytest.approx(c.fp32_ms / c.int8_ms)  # no speed asserted


def test_the_reference_is_the_faster_of_the_two_exporters_files(tmp_path, monkeypatch):
    """Both plain exports are made and timed against each other; the faster one is the reference, and the check
    names it. Timing replaced: the legacy file is made 2x faster, then 2x slower."""
    from lq.export.timing import _speed

    x = torch.randn(4, 3, 16, 16)
    model = _calibrated(ConvBN(), x)
    real, real_twin = _speed._fp32_reference.plain_export, _speed._float_twin.plain_twin
    for legacy_faster in (True, False):
        made = []

        def plain(*a, **kw):
            proto = real(*a, **kw)
            made.append((a[2], proto.SerializeToString()))  # (dynamo, the file)
            return proto

        def twin(*a, **kw):  # the current exporter's file, made from the export's own trace
            proto = real_twin(*a, **kw)
            if proto is not None:
                made.append((True, proto.SerializeToString()))
            return proto

        def rounds(a, b, feeds, providers=None, **kw):
            fast, slow = [0.001] * 5, [0.002] * 5
            if a == made[0][1] and b == made[1][1]:  # the two FP32 files against each other
                return (slow, fast, 1) if legacy_faster else (fast, slow, 1)
            return [0.001] * 5, [0.001] * 5, 1

        monkeypatch.setattr(_speed._fp32_reference, "plain_export", plain)
        monkeypatch.setattr(_speed._float_twin, "plain_twin", twin)
        monkeypatch.setattr(_timing, "time_rounds", rounds)
        seen = _spy_compare(monkeypatch)
        res = export_onnx(model, x, tmp_path / "m.onnx", fallback_seconds=0)
        assert [d for d, _ in made] == [True, False]  # the model's own exporter first, then the other one
        assert seen["fp32"] == (made[1][1] if legacy_faster else made[0][1])
        assert ("legacy exporter's file" if legacy_faster else "current exporter's file") in res.speed_check.reference
        assert "by 2.00x" in res.speed_check.reference
        monkeypatch.undo()


class Styles(nn.Module):
    """A residual conv block with a squeeze-excite gate written with functional calls, a max pool, a Linear whose
    weight goes to ``F.linear``, a GELU MLP: what the FP32 twin has to match the plain export on."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.conv = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.se1, self.se2 = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = self.stem(x)
        y = self.bn(self.conv(x))
        gate = torch.sigmoid(self.se2(F.relu(self.se1(y.mean((2, 3), keepdim=True)))))
        x = F.max_pool2d(F.relu(x + y * gate), 2)
        h = F.gelu(F.linear(x.mean((2, 3)), self.fc1.weight, self.fc1.bias))
        return self.fc2(h)


def _op_counts(proto):
    return Counter(n.op_type for n in proto.graph.node if n.op_type != "Identity")


def test_the_current_exporters_fp32_file_is_made_from_the_exports_own_trace():
    """The twin of the export's trace, cleaned up as the current exporter cleans up, is that exporter's plain FP32
    file: the same operators, the same initializers, the same outputs as ``torch.onnx.export`` of the float model.
    A model whose quantized modules run other code than their float ones (an LSTM) gets no twin."""
    from lq.export.prepare._prepare import prepare
    from lq.export.trace import _trace

    x = torch.randn(4, 3, 16, 16)
    model = _calibrated(Styles(), x)
    cfg = ExportConfig()
    prep = prepare(model, (x,), cfg)
    traced = _trace.trace(prep, cfg)
    twin = _float_twin.plain_twin(_float_twin.float_twin(traced.proto), prep.work)
    plain = _fp32_reference.plain_export(prep.work, prep.args, True, prep.opset, prep.input_names,
                                         prep.output_names, prep.dims)
    assert twin is not None and _op_counts(twin) == _op_counts(plain)
    assert "BatchNormalization" not in _op_counts(twin)  # folded into the convs, as the exporter folds it
    assert len(twin.graph.initializer) == len(plain.graph.initializer)
    feeds = lambda p: {p.graph.input[0].name: x.numpy()}  # noqa: E731
    a = ort.InferenceSession(twin.SerializeToString()).run(None, feeds(twin))[0]
    b = ort.InferenceSession(plain.SerializeToString()).run(None, feeds(plain))[0]
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        ref = _fp32_reference.float_model(prep.work)(x).numpy()
    np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-5)

    r = torch.randn(2, 6, 5)
    lstm = _calibrated(Recurrent(), r)
    prep = prepare(lstm, (r,), cfg)
    assert _float_twin.plain_twin(_float_twin.float_twin(_trace.trace(prep, cfg).proto), prep.work) is None


def test_an_lstm_is_compared_with_the_fused_lstm_op_a_plain_export_has(tmp_path, monkeypatch):
    """``torch.onnx.export`` of ``nn.LSTM`` writes one ONNX LSTM op (one fused kernel in onnxruntime); the
    reference is that file, not the quantized model's loop with its quantizers off."""
    x = torch.randn(2, 6, 5)
    model = _calibrated(Recurrent(), x)
    seen = _spy_compare(monkeypatch)
    res = export_onnx(model, x, tmp_path / "lstm.onnx", dynamic_dims=(1,), fallback_seconds=0)
    ops = _ops(onnx.load_from_string(seen["fp32"]))
    assert ops["LSTM"] == 1 and "Scan" not in ops and not QDQ & set(ops), ops
    assert res.speed_check.reference.startswith(_timing.PLAIN)
    float_model = _fp32_reference.float_model(model)
    assert type(float_model.rnn) is nn.LSTM and type(float_model.fc) is nn.Linear
    assert type(model.rnn) is not nn.LSTM  # the user's model is untouched


def test_the_legacy_exporter_gives_the_legacy_plain_export(tmp_path, monkeypatch):
    x = torch.randn(4, 3, 16, 16)
    float_model = _float(ConvBN())
    model = _calibrated(float_model, x)
    seen = _spy_compare(monkeypatch)
    export_onnx(model, x, tmp_path / "m.onnx", dynamo=False, fallback_seconds=0)
    ops = _ops(onnx.load_from_string(seen["fp32"]))
    assert not QDQ & set(ops) and "Conv" in ops and "Gemm" in ops, ops
    buf = io.BytesIO()
    torch.onnx.export(float_model, (x,), buf, dynamo=False, opset_version=17, input_names=["input"],
                      output_names=["output"], dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    assert ops == _ops(onnx.load_from_string(buf.getvalue()))


def test_a_model_the_exporter_cannot_export_in_float_falls_back_to_the_twin_and_says_so(tmp_path, monkeypatch):
    x = torch.randn(4, 3, 16, 16)
    model = _calibrated(ConvBN(), x)

    def fail(*a, **k):
        raise RuntimeError("cannot export this float model")

    monkeypatch.setattr(_fp32_reference, "plain_export", fail)
    monkeypatch.setattr(_float_twin, "plain_twin", lambda twin, work: None)  # as for a model with an LSTM
    seen = _spy_compare(monkeypatch)
    res = export_onnx(model, x, tmp_path / "m.onnx", fallback_seconds=0)
    assert res.speed_check is not None and res.speed_check.reference == _timing.TWIN
    note = [w for w in res.warnings if "could not export the float model" in w]
    assert len(note) == 1 and "cannot export this float model" in note[0] and _timing.TWIN in note[0]
    assert not QDQ & set(_ops(onnx.load_from_string(seen["fp32"])))


# =========================================================================== the verdict in the export
def test_a_slower_file_is_warned_about_against_the_plain_fp32_export(tmp_path, monkeypatch):
    x = torch.randn(4, 3, 16, 16)
    int8 = [2.30e-3, 2.28e-3, 2.31e-3, 2.29e-3, 2.30e-3]
    fp32 = [2.00e-3, 2.01e-3, 1.99e-3, 2.00e-3, 2.00e-3]
    _fake_rounds(monkeypatch, int8, fp32)
    res = export_onnx(_calibrated(ConvBN(), x), x, tmp_path / "m.onnx", fallback_seconds=0)
    c = res.speed_check
    assert c.slower and c.ratio == pytest.approx(2.0 / 2.3) and res.speedup == c.ratio
    assert c.int8_ms == pytest.approx(2.30) and c.fp32_ms == pytest.approx(2.00)
    slow = [w for w in res.warnings if w.startswith("the INT8 file runs at")]
    assert len(slow) == 1, res.warnings
    assert slow[0].startswith("the INT8 file runs at 0.87x the speed of the plain FP32 export of this model")
    assert "INT8 2.3 ms vs FP32 2 ms at batch 4" in slow[0] and "oisy" not in slow[0]
    assert "speed: 0.87x the speed of the plain FP32 export" in res.summary()


def test_a_slower_file_measured_in_noisy_rounds_says_both(tmp_path, monkeypatch):
    x = torch.randn(4, 3, 16, 16)
    _fake_rounds(monkeypatch, [1.0e-3] * 5, [0.7e-3, 0.8e-3, 0.9e-3, 1.1e-3, 1.3e-3])
    res = export_onnx(_calibrated(ConvBN(), x), x, tmp_path / "m.onnx", fallback_seconds=0)
    (slow,) = [w for w in res.warnings if w.startswith("the INT8 file runs at")]
    assert "0.90x the speed of the plain FP32 export" in slow
    assert "The measurement is noisy: the rounds do not agree on which file is faster" in slow


def test_a_faster_file_gets_no_warning_and_the_result_carries_consistent_numbers(tmp_path, monkeypatch):
    x = torch.randn(4, 3, 16, 16)
    _fake_rounds(monkeypatch, [1.0e-3, 1.1e-3, 0.9e-3], [1.5e-3, 1.6e-3, 1.4e-3])
    res = export_onnx(_calibrated(ConvBN(), x), x, tmp_path / "m.onnx", fallback_seconds=0)
    c = res.speed_check
    assert not c.slower and res.speedup == c.ratio == pytest.approx(1.5)
    assert c.ratio == pytest.approx(c.fp32_ms / c.int8_ms) and c.batch == 4 and c.runs_per_round == 7
    assert not any("the speed of" in w for w in res.warnings)
    assert "speed: 1.50x the speed of the plain FP32 export of this model" in res.summary()


def test_speed_batch_is_checked_before_the_export(tmp_path):
    x = torch.randn(4, 3, 16, 16)
    model = _calibrated(ConvBN(), x)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="speed_batch"):
            export_onnx(model, x, tmp_path / "m.onnx", speed_batch=bad, fallback_seconds=0)
    with pytest.raises(ValueError, match="no dynamic batch axis"):
        export_onnx(model, x, tmp_path / "m.onnx", speed_batch=8, dynamic_batch=False, fallback_seconds=0)
    assert not (tmp_path / "m.onnx").exists()


def test_export_config_takes_speed_batch_and_the_callback_passes_it(monkeypatch, tmp_path, caplog):
    """``ExportConfig.speed_batch`` reaches ``export_onnx`` through ``QuantExport``, whose report line carries the
    check's ratio, its two times and its reference, and whose slower-than-FP32 warning is a warning."""
    import logging
    from types import SimpleNamespace

    import lq.export
    from lq.callbacks.export import QuantExport

    assert ExportConfig().speed_batch is None and ExportConfig(speed_batch=32).speed_batch == 32
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="speed_batch"):
            ExportConfig(speed_batch=bad)
    check = _timing.summarize([2.3e-3] * 3, [2.0e-3] * 3, batch=32)
    warning = f"the INT8 file runs at {check.ratio:.2f}x the speed of {check.reference} in onnxruntime"
    seen = {}

    def fake_export(model, sample, path, **kw):
        seen.update(kw)
        return SimpleNamespace(max_abs_diff=None, speedup=check.ratio, speed_check=check, layer_kernels=[],
                               warnings=[warning])

    monkeypatch.setattr(lq.export, "export_onnx", fake_export)
    model = nn.Linear(3, 2)
    model.device = torch.device("cpu")
    cb = QuantExport(ExportConfig(speed_batch=32, path=str(tmp_path / "m.onnx")),
                     sample_input=lambda t, m: torch.ones(2, 3))
    with pytest.warns(UserWarning, match="0.87x the speed of the plain FP32 export"), caplog.at_level(logging.INFO):
        cb.run(SimpleNamespace(default_root_dir=str(tmp_path)), model)
    assert seen["config"].speed_batch == 32
    assert any("0.87x the speed of the plain FP32 export of this model" in r.getMessage() and "batch 32" in
               r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_the_bench_reports_the_exports_check_beside_its_own_measurement():
    """bench.ordinary's table: the export's ratio for a file, the bench's independent ratio for the same file,
    their difference, and whether they agree within 10% (computed from the row, not assumed)."""
    from bench.ordinary import check_vs_bench

    row = {"model": "CNN", "speedup": {"lq": {"median": 2.0, "p25": 1.9, "p75": 2.1},
                                       "qs": {"median": 1.5, "p25": 1.4, "p75": 1.6}},
           "check": {"lq": {"ratio": 2.1, "p25": 2.0, "p75": 2.2, "noisy": False, "batch": 32},
                     "qs": {"ratio": 1.2, "p25": 0.9, "p75": 1.3, "noisy": True, "batch": 32}}}
    (lq, qs) = check_vs_bench([row])
    assert lq == ["CNN", "lq", "2.10x [2.00-2.20]", "2.00x [1.90-2.10]", "+5%", "yes"]
    assert qs[2].endswith(" noisy") and qs[4] == "-20%" and qs[5] == "**no**"
    assert check_vs_bench([{"model": "old row without a check", "speedup": {}}]) == []


def test_speed_check_false_exports_and_verifies_without_timing(tmp_path, monkeypatch):
    """``speed_check=False`` (a caller that times the file itself, as the benches' --fast runs): no plain FP32
    export, no timing, no speed numbers; the file is still verified and its kernels reported."""
    x = torch.randn(4, 3, 16, 16)
    model = _calibrated(_float(ConvBN()), x)
    seen = _spy_compare(monkeypatch)
    exported = []
    real = _fp32_reference.plain_export
    monkeypatch.setattr(_fp32_reference, "plain_export", lambda *a, **k: exported.append(1) or real(*a, **k))
    res = export_onnx(model, x, tmp_path / "m.onnx", speed_check=False)
    assert res.speed_check is None and res.speedup is None and not seen and not exported
    assert res.output_checks and res.layer_kernels and (tmp_path / "m.onnx").exists()
    res = export_onnx(model, x, tmp_path / "m2.onnx", fallback_seconds=0)  # the default times it
    assert res.speed_check is not None and seen and exported
