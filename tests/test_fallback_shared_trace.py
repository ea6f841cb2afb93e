"""The fallback's tries share the export's one trace (lq.export.trace._bypass): the traced graph with a group of
quantizers passing their input on must give the very file that tracing the copy with those quantizers off gives.

Reference: the copy (quantizers disabled in PyTorch) traced again by torch.onnx and rewritten by the same passes.
Both files are compared op by op and on outputs in onnxruntime; the copy's own PyTorch outputs are the check that
both compute what the copy computes.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import warnings

import numpy as np
import pytest
import torch

from bench import styles
from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.export import _export
from lq.export.timing import _fallback
from lq.export.trace import _bypass, _trace
from lq.export.prepare import _prepare

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)


def _prepared(arch: str, style: str, exporter: str = "dynamo"):
    torch.manual_seed(0)
    model = styles.build(arch, style).eval()
    x = torch.randn(8, *styles.ZOO[arch][0])
    quantize_model(model, sample=x)
    calibrate_model(model, [torch.randn(16, *styles.ZOO[arch][0]) for _ in range(2)])
    cfg = _export.export_config(None, None, exporter=exporter, speed_check=False)
    return model, x, cfg


def _file(prep, traced, cfg, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _export._from_trace(prep, traced, dataclasses.replace(cfg, path=str(path)), 0.0)


def _ops(path) -> collections.Counter:
    import onnx

    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _run(path, x) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


@pytest.mark.parametrize("arch,style", [("resnet", "b"), ("mobilenet", "a"), ("transformer", "d")])
def test_a_group_off_in_the_shared_trace_gives_the_file_of_the_copy_traced_again(tmp_path, arch, style):
    model, x, cfg = _prepared(arch, style)
    prep = _prepare.prepare(model, (x,), cfg)
    traced = _trace.trace(prep, cfg)
    order = _fallback.call_order(prep.work, prep.args)
    # a stage from the middle and the glue quantizers (adds, pools, matmuls) of the model: both kinds of placeholder
    off = frozenset(order[len(order) // 3: len(order) // 2] + [q for q in order if ".lq_glue." in f".{q}"])
    assert off, order
    shared = _bypass.without(traced.proto, prep.work, off)
    assert shared is not None  # the current exporter names every placeholder's quantizer

    copy_model = copy.deepcopy(prep.work)
    _fallback.disable(copy_model, sorted(off))
    cand = _prepare.prepare(copy_model, prep.args, cfg)
    a = _file(cand, dataclasses.replace(traced, proto=shared), cfg, tmp_path / "shared.onnx")
    b = _file(cand, _trace.trace(cand, cfg), cfg, tmp_path / "traced.onnx")
    assert a.verdict and b.verdict and a.ort_ops == b.ort_ops
    assert _ops(a.path) == _ops(b.path)
    assert sorted(k.layer for k in a.layer_kernels if k.integer) == sorted(k.layer for k in b.layer_kernels if k.integer)
    np.testing.assert_array_equal(_run(a.path, x), _run(b.path, x))
    # and the group really is off: fewer QuantizeLinear than the file with every quantizer
    full = _file(prep, _trace.trace(prep, cfg), cfg, tmp_path / "full.onnx")
    assert _ops(a.path)["QuantizeLinear"] < _ops(full.path)["QuantizeLinear"]


def test_an_unnamed_placeholder_or_the_legacy_exporter_traces_the_copy_again(tmp_path):
    model, x, cfg = _prepared("resnet", "b", exporter="legacy")
    prep = _prepare.prepare(model, (x,), cfg)
    traced = _trace.trace(prep, cfg)
    order = _fallback.call_order(prep.work, prep.args)
    # the legacy exporter's scope names leave out the glue's container: its placeholders are not told apart
    assert _bypass.without(traced.proto, prep.work, frozenset(order[:2])) is None


def test_a_fallback_try_does_not_call_torch_onnx_export_again(tmp_path, monkeypatch):
    """The export's own trace, then no other trace of the quantized model: each try reuses it."""
    from lq.export.timing import _speed, _timing

    model, x, _ = _prepared("resnet", "b")
    calls = []
    real = _trace.trace
    monkeypatch.setattr(_trace, "trace", lambda *a, **k: calls.append(1) or real(*a, **k))
    slow = _timing.SpeedCheck(ratio=0.5, int8_ms=2.0, fp32_ms=1.0, ratio_p25=0.49, ratio_p75=0.51, rounds=5,
                              noisy=False)
    seen = []

    def measure(self, data, below=None):  # every try is slower: the search tries every group, then every layer off
        seen.append(len(data))
        return slow

    monkeypatch.setattr(_speed.Timer, "measure", measure)
    monkeypatch.setattr(_speed, "speed_check", lambda data, timer, notes: slow)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = _export.export_onnx(model, x, tmp_path / "m.onnx", fallback_seconds=120)
    assert res.fallback is not None and len(res.fallback.tries) >= 2, res.fallback
    assert all(t.check is not None for t in res.fallback.tries), [t.text() for t in res.fallback.tries]
    assert len(calls) == 1, f"{len(calls)} traces for {len(res.fallback.tries)} tries"


def test_a_corrected_layer_sent_to_float_gets_its_own_bias_back_in_the_shared_trace(tmp_path, monkeypatch):
    """Bias correction's shift corrects a quantization error: a layer the fallback sends to float has none, so the
    try's file computes that layer with the user's own bias, as the user's model does with its quantizers off
    (reference: that model in PyTorch), from the shared trace (no second trace)."""
    torch.manual_seed(0)
    model = styles.build("resnet", "b").eval()
    shape = styles.ZOO["resnet"][0]
    x = torch.randn(8, *shape)
    quantize_model(model, sample=x)
    res = calibrate_model(model, [torch.randn(16, *shape) for _ in range(4)], bias_correction=True, progress=False)
    assert res.bias_correction is not None and res.bias_correction.corrected
    cfg = _export.export_config(None, None, speed_check=False)
    prep = _prepare.prepare(model, (x,), cfg)
    traced = _trace.trace(prep, cfg)
    order = _fallback.call_order(prep.work, prep.args)

    def sent_to_float(m, layer):
        out = copy.deepcopy(m)
        _fallback.disable(out, [q for q in order if q.startswith(layer + ".")])
        return out

    # a layer whose quantizers all turn off (not one sharing its input's quantizer with a sibling) and whose shift
    # moves the output: the user's model with the layer in float, and the export's copy with the stale shift
    for layer in prep.folded_biases:
        with torch.no_grad():
            want, wrong = sent_to_float(model, layer)(x).numpy(), sent_to_float(prep.work, layer)(x).numpy()
        if np.abs(want - wrong).max() > 1e-3:
            break
    else:
        pytest.fail(f"no corrected layer's shift moves the output: {list(prep.folded_biases)}")
    off = frozenset(q for q in order if q.startswith(layer + "."))

    calls = []
    monkeypatch.setattr(_trace, "trace", lambda *a, **k: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _export._export_without(prep, traced, dataclasses.replace(cfg, path=str(tmp_path / "try.onnx")), off,
                                      0.0)
    assert not calls  # the shared trace, its bias initializer rewritten
    out = _run(got.path, x)
    np.testing.assert_allclose(out, want, rtol=0, atol=0.05 * np.abs(want).max())
    assert np.abs(out - want).max() < np.abs(out - wrong).max() / 2  # nearer the user's model than the stale bias
