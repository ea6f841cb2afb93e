"""``target="openvino"``: the recipe, a standard-ONNX file verified and timed in OpenVINO's CPU plugin, and the
precision each layer runs at there.

References independent of the export's own report: OpenVINO's compiled graph read here (its layers' runtime
precision), onnxruntime running the same file, and the Q/DQ nodes of the file itself.
"""

from __future__ import annotations

import copy
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from _limits import HANG_GUARD_S
import torch.nn.functional as F
from torch import nn

import lq
from lq import report
from lq.config import ExportConfig
from lq.export import VerificationError, export_onnx
from lq.export._ir import ExportError
from lq.export.passes import _pipeline
from lq.export.timing import _timing
from lq.export.verify import _no_vnni, _openvino

ov = pytest.importorskip("openvino")
ort = pytest.importorskip("onnxruntime")


class Block(nn.Module):
    """Dense conv -> BN -> ReLU -> max pool, a depthwise conv with SiLU, a residual add, a pooled Linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.pw = nn.Conv2d(16, 32, 1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.act = nn.SiLU()
        self.proj = nn.Conv2d(32, 16, 1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x):
        x = self.stem(x)
        return self.head(x + self.proj(self.act(self.dw(torch.relu(self.pw(x))))))


def _calibrated(seed: int = 0):
    torch.manual_seed(seed)
    m = Block().eval()
    x = torch.randn(64, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    lq.quantize_model(m, target="openvino", sample=x[:2])
    lq.calibrate_model(m, list(x.split(32)), method="max")
    return m, x[:32]


def _compiled_precisions(path: str) -> list[str]:
    core = ov.Core()
    cm = core.compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
    out = []
    for op in cm.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        if rt["layerType"].astype(str) in ("Convolution", "GroupConvolution", "FullyConnected"):
            out.append(rt["runtimePrecision"].astype(str))
    return out


def test_quantize_model_picks_the_symmetric_recipe():
    m, _ = _calibrated()
    assert isinstance(m.stem[0], lq.nn.QuantConv2d) and isinstance(m.head[2], lq.nn.QuantLinear)
    assert isinstance(m.stem[3], lq.nn.QuantMaxPool2d)
    assert not isinstance(m.head[0], lq.nn.QuantAdaptiveAvgPool2d)  # a separate FakeQuantize in OpenVINO
    from lq.nn.modules.tensor_quantizer import iter_quantizers

    assert not any(q.asymmetric for _, q in iter_quantizers(m))
    assert not m.pw._input_quantizer.asymmetric and not m.pw._input_quantizer.narrow_range
    assert m.dw._input_quantizer.unsigned  # reads a ReLU's output: [0, 255]
    assert m.pw._weight_quantizer.num_bits == 7 and m.pw._weight_quantizer.axis == 0  # |q| <= 63: no int16 overflow


_NO_VNNI = """
import sys, torch, lq
from lq.export import VerificationError, export_onnx
sys.path.insert(0, {tests!r})
from test_export_openvino import Block
torch.manual_seed(0)
x = torch.randn(64, 3, 16, 16, generator=torch.Generator().manual_seed(0))
for bits in (7, 8):
    m = Block().eval()
    overrides = {{}} if bits == 7 else {{"*": {{"weight": {{"num_bits": 8, "axis": 0}}}}}}
    lq.quantize_model(m, target="openvino", sample=x[:2], overrides=overrides)
    lq.calibrate_model(m, list(x.split(32)), method="max")
    assert m.pw._weight_quantizer.num_bits == bits
    try:
        export_onnx(m, x[:32], {path!r} + str(bits) + ".onnx", target="openvino", progress=False, speed_check=False)
        print(bits, "verified")
    except VerificationError as e:
        print(bits, "refused:", str(e).splitlines()[0][:200])
"""


def test_the_recipes_weights_are_exact_on_a_cpu_without_vnni(tmp_path):
    """OpenVINO with its kernels capped at AVX2 (``ONEDNN_MAX_CPU_ISA``, read when the plugin loads: a process of
    its own) adds pairs of u8 x s8 products in a saturating int16 as a CPU without VNNI does: the recipe's 7-bit
    weights verify there; the same model with 8-bit weights (a ReLU's output on [0, 255] times weights up to 127)
    does not: what the 7 bits are for."""
    import os
    import subprocess

    code = _NO_VNNI.format(tests=os.path.dirname(__file__), path=str(tmp_path / "m"))
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln[:2] in ("7 ", "8 ")]
    assert lines[0] == "7 verified", out.stdout
    assert lines[1].startswith("8 refused: OpenVINO's output is not the PyTorch fake-quant output"), out.stdout


def test_the_file_is_standard_onnx_verified_in_openvino_with_every_layer_on_int8(tmp_path):
    m, x = _calibrated()
    res = export_onnx(m, x, str(tmp_path / "ov.onnx"), target="openvino", progress=False, speed_check=False)
    assert res.providers == ["OpenVINO CPU"] and res.verdict
    proto = onnx.load(res.path)
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}  # no com.microsoft kernels
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    acts = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    assert acts and all(not inits[n.input[2]].any() for n in acts)  # zero point 0: symmetric
    assert {inits[n.input[2]].dtype for n in acts} == {np.dtype(np.int8), np.dtype(np.uint8)}
    # the report's precisions are the compiled graph's: 4 convs (the depthwise one grouped) and the Linear
    precisions = _compiled_precisions(res.path)
    assert len(precisions) == 5 and set(precisions) <= {"i8", "u8"}, precisions
    assert len(res.layer_kernels) == 5 and all(k.integer for k in res.layer_kernels), res.layer_kernels
    assert sorted(k.kernel.split(" (")[1].split(",")[0] for k in res.layer_kernels) == sorted(precisions)
    assert report.kernel_table(res).columns[2].header == "OpenVINO kernel"
    assert "OpenVINO vs PyTorch fake-quant" in res.summary() and "layers on integer kernels: 5 of 5" in res.summary()
    # onnxruntime runs the same file to the same numbers as OpenVINO does (two runtimes, one file)
    got_ov = ov.Core().compile_model(res.path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})([x.numpy()])[0]
    got_ort = ort.InferenceSession(res.path, providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        want = m(x).numpy()
    step = res.output_checks[0].step
    assert np.abs(got_ov - want).max() < 6 * step and np.abs(got_ort - want).max() < 6 * step
    assert (got_ov.argmax(1) == want.argmax(1)).mean() >= 0.95


def test_a_wrong_scale_fails_verification_in_openvino(tmp_path, monkeypatch):
    m, x = _calibrated(1)
    rewrite = _pipeline.rewrite

    def skewed(proto, cfg, opset):  # the first weight scale 20% off: the file no longer computes the model
        out, r = rewrite(proto, cfg, opset)
        names = {i.name for i in out.graph.initializer}
        dq = next(n for n in out.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in names)
        init = next(i for i in out.graph.initializer if i.name == dq.input[1])
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.2), init.name))
        return out, r

    monkeypatch.setattr(_pipeline, "rewrite", skewed)
    with pytest.raises(VerificationError, match="OpenVINO's output is not the PyTorch fake-quant output"):
        export_onnx(m, x, str(tmp_path / "bad.onnx"), target="openvino", progress=False, speed_check=False)
    assert not (tmp_path / "bad.onnx").exists()


def test_without_openvino_the_error_names_the_extra(tmp_path, monkeypatch):
    m, x = _calibrated()
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(ImportError, match=r"pip install 'lq\[openvino\]'"):
        export_onnx(m, x, str(tmp_path / "x.onnx"), target="openvino", progress=False)
    assert ExportConfig(target="openvino").target == "openvino"
    with pytest.raises(ValueError, match="target='openvno' is not allowed"):
        ExportConfig(target="openvno")


def test_onnxruntime_s_fused_lstm_is_refused_for_openvino(tmp_path):
    class Rnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(8, 16, batch_first=True)
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(self.lstm(x)[0][:, -1])

    m = Rnn().eval()
    x = torch.randn(4, 5, 8)
    lq.quantize_model(m, recipe="int8_onnxruntime")  # recurrent="dynamic": onnxruntime's com.microsoft kernel
    lq.calibrate_model(m, [x], method="max")
    with pytest.raises(ExportError, match="DynamicQuantizeLSTM.*export with target='onnxruntime'"):
        export_onnx(m, x, str(tmp_path / "lstm.onnx"), target="openvino", progress=False, speed_check=False)


def test_the_fallback_times_its_tries_in_openvino(tmp_path, monkeypatch):
    """A cost model (as in tests/test_fallback.py): the INT8 file takes 1 ms plus 1 ms while the Linear head is
    quantized, FP32 1.5 ms. The fallback's tries run in OpenVINO too, and the saved file (verified there) has the
    head in float and computes the model with the head's quantizers off."""
    timed = []

    def rounds(int8_model, fp32_model, feeds, providers=None, **kw):
        assert providers and providers[0].startswith("OpenVINO CPU")
        m = onnx.load_from_string(int8_model)
        if not any(n.op_type == "QuantizeLinear" for n in m.graph.node):  # the two FP32 files, compared
            return [1e-3] * 5, [1e-3] * 5, 3
        made_by = {o: n.op_type for n in m.graph.node for o in n.output}
        head = any(n.op_type == "Gemm" and made_by.get(n.input[1]) == "DequantizeLinear" for n in m.graph.node)
        timed.append(head)
        return [1e-3 * (2.0 if head else 1.0)] * 5, [1.5e-3] * 5, 3

    monkeypatch.setattr(_timing, "time_rounds", rounds)
    m, x = _calibrated(2)
    res = export_onnx(m, x, str(tmp_path / "fb.onnx"), target="openvino", progress=False)
    assert res.fallback is not None and res.float_fallback == ["head.2"], res.fallback.note()
    assert timed[0] is True and timed[-1] is False and res.speed_check.ratio == pytest.approx(1.5)
    assert "OpenVINO (CPU plugin, f32 precision hint)" in res.speed_check.text()
    # where the CPU runs bf16 natively (OpenVINO's default precision there), both files timed so, said in a note
    assert any("with the bf16 hint the INT8 file runs at" in w for w in res.warnings) == _openvino.has_bf16()
    ref = copy.deepcopy(m)
    ref.head[2]._input_quantizer.disable()
    ref.head[2]._weight_quantizer.disable()
    with torch.no_grad():
        want = ref(x).numpy()
    got = ov.Core().compile_model(res.path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})([x.numpy()])[0]
    assert res.judge([got], [want]) == ""


class Audio(nn.Module):
    """CREPE's shape: 1-D convs, the third one 16 -> 16 channels with 16 taps (the layer a faulty kernel hits)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv1d(1, 16, 32, stride=4, padding=14), nn.ReLU(), nn.MaxPool1d(2))
        self.c2 = nn.Sequential(nn.Conv1d(16, 16, 16, padding=7), nn.ReLU(), nn.MaxPool1d(2))
        self.c3 = nn.Sequential(nn.Conv1d(16, 32, 5, padding=2), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.c3(self.c2(self.c1(x))).mean(-1))


def _faulty_plugin(monkeypatch, shape=(16, 16, 16)):
    """OpenVINO as if its int8 kernel for one conv were wrong (the AMX fault of lq.export.verify._runtime_faults,
    on any CPU): every file it compiles has that conv's weight scale tripled while the weights are int8."""
    from onnx import numpy_helper as nh

    compile_model = _openvino.compile_model

    def faulty(path_or_bytes, threads=None, precision="f32"):
        m = onnx.load_from_string(path_or_bytes) if isinstance(path_or_bytes, bytes) else onnx.load(path_or_bytes)
        inits = {i.name: i for i in m.graph.initializer}
        made_by = {o: n for n in m.graph.node for o in n.output}
        for n in m.graph.node:
            dq = made_by.get(n.input[1]) if n.op_type == "Conv" else None
            if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in inits \
                    and tuple(inits[dq.input[0]].dims) == shape:
                s = inits[dq.input[1]]
                s.CopyFrom(nh.from_array(nh.to_array(s) * np.float32(3), s.name))
        return compile_model(m.SerializeToString(), threads, precision)

    monkeypatch.setattr(_openvino, "compile_model", faulty)


def test_a_layer_openvino_computes_wrong_stays_float_and_the_rest_verifies(tmp_path, monkeypatch):
    torch.manual_seed(0)
    m = Audio().eval()
    x = torch.randn(64, 1, 256, generator=torch.Generator().manual_seed(5))
    lq.quantize_model(m, target="openvino", sample=x[:2])
    lq.calibrate_model(m, list(x.split(32)), method="max")
    _faulty_plugin(monkeypatch)
    res = export_onnx(m, x[:32], str(tmp_path / "a.onnx"), target="openvino", progress=False, speed_check=False)
    assert "computes c2.0" in res.warnings[0] and "stays float" in res.warnings[0], res.warnings
    assert not (tmp_path / "a.unverified.onnx").exists()
    saved = onnx.load(res.path)
    made_by = {o: n.op_type for n in saved.graph.node for o in n.output}
    quantized = [made_by.get(n.input[1]) == "DequantizeLinear" for n in saved.graph.node if n.op_type == "Conv"]
    assert quantized == [True, False, True], quantized  # c2's conv float, c1 and c3 on integers
    ref = copy.deepcopy(m)  # independent reference: PyTorch with c2's quantizers off
    ref.c2[0]._input_quantizer.disable()
    ref.c2[0]._weight_quantizer.disable()
    with torch.no_grad():
        want = ref(x[:32]).numpy()
    got = ort.InferenceSession(res.path, providers=["CPUExecutionProvider"]).run(None, {"input": x[:32].numpy()})[0]
    assert res.judge([got], [want]) == ""
    assert m.c2[0]._input_quantizer.is_enabled  # the user's model keeps every quantizer


class TwoHeads(nn.Module):
    """Two 1x1 score-map heads on one feature map (a U-Net's region and link maps)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.region = nn.Conv2d(16, 1, 1)
        self.link = nn.Conv2d(16, 1, 1)

    def forward(self, x):
        d = self.body(x)
        return self.region(d), self.link(d)


def test_layers_reading_one_tensor_share_its_quantizer(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(32, 3, 16, 16)
    files = {}
    for shared in (True, False):
        m = TwoHeads().eval()
        lq.quantize_model(m, target="openvino", sample=x[:2], shared_inputs=shared)
        lq.calibrate_model(m, [x], method="max")
        assert (m.region._input_quantizer is m.link._input_quantizer) is shared
        if not shared:  # calibrated apart (auto calibration picks a method per quantizer): two grids
            m.link._input_quantizer.amax = m.link._input_quantizer.amax * 1.1
        res = export_onnx(m, x, str(tmp_path / f"heads_{shared}.onnx"), target="openvino", progress=False,
                          speed_check=False, output_names=["region", "link"])
        files[shared] = onnx.load(res.path)
    quantize = {k: sum(n.op_type == "QuantizeLinear" for n in f.graph.node) for k, f in files.items()}
    assert quantize == {True: 2, False: 3}, quantize  # the input's, and the heads' one (or two)
    assert lq.config.Int8OpenvinoConfig().shared_inputs and not lq.config.Int8OnnxruntimeConfig().shared_inputs


class Encoder(nn.Module):
    """A Linear on a sequence (a 3-D input: OpenVINO's FullyConnected with the dequantization moved into it), an
    attention block, a pooled head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(16, 64)
        self.att = nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        h = self.emb(x)
        a, _ = self.att(h, h, h, need_weights=False)
        return self.head((h + a).mean(1))


def test_the_report_finds_the_linears_openvino_moved_the_dequantization_into(tmp_path):
    """The plugin names such a layer ``<node>/DequantizationMultiply``: the report still finds it, and says it
    runs on integers as the compiled graph (read here) does."""
    torch.manual_seed(0)
    m = Encoder().eval()
    x = torch.randn(64, 12, 16, generator=torch.Generator().manual_seed(0))
    lq.quantize_model(m, target="openvino", sample=x[:2])
    lq.calibrate_model(m, list(x.split(32)), method="max", progress=False)
    res = export_onnx(m, x[:32], str(tmp_path / "enc.onnx"), target="openvino", progress=False, speed_check=False)
    kernels = {k.layer: k for k in res.layer_kernels if k.layer in ("emb", "head")}
    assert set(kernels) == {"emb", "head"}
    fcs = [p for p in _compiled_precisions(res.path)]
    assert len(fcs) >= 2 and set(fcs) <= {"i8", "u8"}
    for k in kernels.values():
        assert k.kernel.startswith("FullyConnected (") and k.integer, k
    projections = [k for k in res.layer_kernels if k.layer == "att" and k.kernel.startswith("FullyConnected (")]
    assert len(projections) == 3  # q, k and v


@pytest.mark.skipif(not __import__("lq.export.verify._no_vnni", fromlist=["needed"]).needed(),
                    reason="OpenVINO takes no VNNI code paths here (no VNNI, or ONEDNN_MAX_CPU_ISA below it): its "
                           "own run already is the run without it")
def test_on_a_cpu_with_vnni_the_file_is_verified_as_one_without_vnni_runs_it_too(tmp_path, monkeypatch):
    """OpenVINO takes other code paths on a CPU without VNNI (a saturating int16 for pairs of u8 x s8 products):
    the export runs the file there too, in a worker with the plugin capped at AVX2. The recipe's file passes and
    says so; the same model with 8-bit weights passes here and is refused there (the search for a wrong layer is
    left out here: every layer is, and it would only try four before the same error)."""
    m, x = _calibrated()
    res = export_onnx(m, x, str(tmp_path / "ov.onnx"), target="openvino", progress=False, speed_check=False)
    assert any(w.startswith("verified in OpenVINO without VNNI (its kernels capped at AVX2) too: ") for w in
               res.warnings), res.warnings
    torch.manual_seed(0)
    m8 = Block().eval()
    lq.quantize_model(m8, target="openvino", sample=x[:2], overrides={"*": {"weight": {"num_bits": 8, "axis": 0}}})
    lq.calibrate_model(m8, [x], method="max")
    ok = export_onnx(copy.deepcopy(m8), x, str(tmp_path / "here.onnx"), target="openvino", progress=False,
                     speed_check=False, providers=[_openvino.OPENVINO])  # this CPU's run alone: it passes
    assert ok.verdict
    from lq.export import _export

    monkeypatch.setattr(_export, "_around_fault", lambda *a, **k: None)
    with pytest.raises(VerificationError, match="OpenVINO without VNNI"):
        export_onnx(m8, x, str(tmp_path / "ov8.onnx"), target="openvino", progress=False, speed_check=False)


def test_a_plugin_capped_below_vnni_needs_no_second_run(monkeypatch):
    """``ONEDNN_MAX_CPU_ISA`` caps OpenVINO's kernels (``make test-avx2`` sets SSE41): below VNNI, the plugin's own run
    already is the run without VNNI; at or above it (or unset, on a CPU with VNNI), a second run is made."""
    from lq.export.verify import _no_vnni

    for cap in ("SSE41", "AVX2", "avx512_core"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert not _no_vnni.needed()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    with open("/proc/cpuinfo") as f:
        vnni = any(k in f.read().split() for k in ("avx512_vnni", "avx_vnni", "amx_int8"))
    assert _no_vnni.needed() == vnni


class PooledBlocks(nn.Module):
    """CREPE's block (conv -> ReLU -> BatchNorm -> max pool -> dropout) twice, then a conv whose input is the pool's
    output: the max pool's input quantizer and the next conv's are one grid or two."""

    def __init__(self):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv1d(i, o, 5, padding=2), nn.ReLU(), nn.BatchNorm1d(o), nn.MaxPool1d(2),
                                 nn.Dropout(0.25))

        self.layers = nn.Sequential(block(1, 32), block(32, 32), block(32, 32))
        self.head = nn.Linear(32 * 8, 10)

    def forward(self, x):
        return self.head(self.layers(x).flatten(1))


def _runtime_layer_types(path: str) -> list[str]:
    core = ov.Core()
    cm = core.compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
    return [op.get_rt_info()["layerType"].astype(str) for op in cm.get_runtime_model().get_ordered_ops()]


def test_a_max_pool_and_the_layer_reading_it_share_one_grid(tmp_path):
    """Two grids around a max pool run in OpenVINO as a separate FakeQuantize (and layout reorders) between the pool
    and the conv: CREPE's file spent 114 of 555 us there at batch 8. One grid: the pool runs on the integers the
    conv reads."""
    torch.manual_seed(0)
    x = torch.randn(64, 1, 64, generator=torch.Generator().manual_seed(3))
    counts = {}
    for shared in (True, False):
        m = PooledBlocks().eval()
        lq.quantize_model(m, target="openvino", sample=x[:2], shared_inputs=shared)
        lq.calibrate_model(m, list(x.split(32)))
        pools = [m.layers[i][3] for i in range(3)]
        readers = [m.layers[1][0], m.layers[2][0], m.head]
        assert [p._input_quantizer is r._input_quantizer for p, r in zip(pools, readers)] == [shared] * 3
        if not shared:  # calibrated apart (auto picks a method per quantizer): two grids
            for r in readers:
                r._input_quantizer.amax = r._input_quantizer.amax * 1.1
        res = export_onnx(m, x[:32], str(tmp_path / f"pooled_{shared}.onnx"), target="openvino", progress=False,
                          speed_check=False)
        types = _runtime_layer_types(res.path)
        counts[shared] = types.count("FakeQuantize")
        with torch.no_grad():  # independent reference: the fake-quant model in PyTorch, judged on OpenVINO's output
            want = m(x[:32]).numpy()
        got = _openvino.compile_model(res.path)(x[:32].numpy())
        assert res.judge([np.asarray(list(got.values())[0])], [want]) == ""
    # tied: only the model input's FakeQuantize (each block's is fused into its conv); apart, one after each pool.
    # A CPU without VNNI runs int8 convolutions on u8 inputs only: there the plugin itself shifts each signed
    # pooled tensor to u8 in a FakeQuantize before blocks 2 and 3, tied or not (the tied file still needs none
    # before the head, whose FullyConnected reads the pool's i8 integers as they are)
    own_shifts = 0 if _no_vnni.needed() else 2
    assert counts[True] == 1 + own_shifts and counts[False] > counts[True], counts


class FlattenHead(nn.Module):
    """O-Net's tail: conv -> PReLU, flattened into a Linear -> PReLU -> Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.act = nn.PReLU(16)
        self.dense = nn.Linear(16 * 6 * 6, 32)
        self.act2 = nn.PReLU(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.act2(self.dense(self.act(self.conv(x)).flatten(1))))


def test_the_linear_s_quantizer_moves_before_the_flatten_and_fuses_into_the_conv(tmp_path):
    """A FakeQuantize after a float Reshape ran as a layer of its own in OpenVINO; before it, the plugin fuses it
    into the conv and PReLU (lq.export.passes._quantize_first). Checked in the file, in OpenVINO's compiled
    graph (only the model input's FakeQuantize is left), and against the fake-quant model in PyTorch."""
    torch.manual_seed(0)
    m = FlattenHead().eval()
    x = torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    lq.quantize_model(m, target="openvino", sample=x[:2])
    lq.calibrate_model(m, list(x.split(32)), method="max")
    res = export_onnx(m, x[:32], str(tmp_path / "f.onnx"), target="openvino", progress=False, speed_check=False)
    saved = onnx.load(res.path)
    made_by = {o: n for n in saved.graph.node for o in n.output}
    dense_q = next(n for n in saved.graph.node if n.op_type == "QuantizeLinear" and "dense" in n.input[1])
    assert made_by[dense_q.input[0]].op_type == "PRelu"
    reshape = next(n for n in saved.graph.node if n.op_type in ("Reshape", "Flatten"))
    assert made_by[reshape.input[0]].op_type == "DequantizeLinear"
    assert _runtime_layer_types(res.path).count("FakeQuantize") == 1
    with torch.no_grad():
        want = m(x[:32]).numpy()
    got = _openvino.compile_model(res.path)(x[:32].numpy())
    assert res.judge([np.asarray(list(got.values())[0])], [want]) == ""


class SkipUNet(nn.Module):
    """A U-Net's skip, written as library code writes it: the encoder map is max-pooled (``F.max_pool2d``) into the
    next stage and concatenated (``torch.cat``) with the nearest-upsampled deeper map for a decoder conv."""

    def __init__(self):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.dec = nn.Sequential(nn.Conv2d(24, 8, 1), nn.ReLU())
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        return self.head(self.dec(torch.cat([F.interpolate(e2, scale_factor=2, mode="nearest"), e1], 1)))


def test_a_skip_tensor_pooled_and_concatenated_is_quantized_once_at_its_producer(tmp_path, monkeypatch):
    """The skip tensor's two readers (the pooled stage's conv, the decoder conv after the concat) share one quantizer
    (lq.glue._tensor_ties), and the file quantizes it once, in front of the pool and the concat
    (lq.export.passes._quantize_first): OpenVINO fuses that FakeQuantize into the conv writing the skip and runs the
    pool and the concat on the integers. Apart, FakeQuantize layers of their own run on the branches. Checked in
    the file, in OpenVINO's compiled graph and against the fake-quant model in PyTorch."""
    from lq.glue import _tensor_ties

    x = torch.randn(64, 1, 16, 16, generator=torch.Generator().manual_seed(5))
    counts = {}
    for tied in (True, False):
        if not tied:
            monkeypatch.setattr(_tensor_ties, "tensor_groups", lambda *a, **k: [])
        torch.manual_seed(0)
        m = SkipUNet().eval()
        lq.quantize_model(m, target="openvino", sample=x[:2])
        assert (m.enc2[0]._input_quantizer is m.dec[0]._input_quantizer) is tied
        lq.calibrate_model(m, list(x.split(32)), method="max")
        if not tied:  # calibrated apart (auto picks a method per quantizer): two grids
            m.dec[0]._input_quantizer.amax = m.dec[0]._input_quantizer.amax * 1.1
        res = export_onnx(m, x[:32], str(tmp_path / f"unet_{tied}.onnx"), target="openvino", progress=False,
                          speed_check=False)
        saved = onnx.load(res.path)
        made_by = {o: n for n in saved.graph.node for o in n.output}
        if tied:
            for n in saved.graph.node:
                if n.op_type in ("MaxPool", "Concat", "Resize"):
                    assert {made_by[i].op_type for i in n.input[:1] if n.op_type != "Concat"} <= {"DequantizeLinear"}
                    assert n.op_type != "Concat" or {made_by[i].op_type for i in n.input} == {"Resize",
                                                                                              "DequantizeLinear"}
            dq = made_by[next(n for n in saved.graph.node if n.op_type == "MaxPool").input[0]]
            enc1_out = made_by[dq.input[0]].input[0]  # the ReLU's output, which only one QuantizeLinear reads
            assert [n.op_type for n in saved.graph.node if enc1_out in n.input] == ["QuantizeLinear"]
        counts[tied] = _runtime_layer_types(res.path).count("FakeQuantize")
        with torch.no_grad():
            want = m(x[:32]).numpy()
        got = _openvino.compile_model(res.path)(x[:32].numpy())
        assert res.judge([np.asarray(list(got.values())[0])], [want]) == ""
    assert counts[True] == 1 and counts[False] > counts[True], counts


class SqueezeExciteFunction(nn.Module):
    """A squeeze-excite block: the input is pooled (``F.adaptive_avg_pool2d``), squeezed, gated, and scaled."""

    def __init__(self, c: int):
        super().__init__()
        self.fc1 = nn.Conv2d(c, 8, 1)
        self.fc2 = nn.Conv2d(8, c, 1)

    def forward(self, x):
        return torch.sigmoid(self.fc2(F.silu(self.fc1(F.adaptive_avg_pool2d(x, 1))))) * x


class SqueezeExciteModule(SqueezeExciteFunction):
    """The same block with its pool as a module and the product written the other way round."""

    def __init__(self, c: int):
        super().__init__(c)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc2(F.silu(self.fc1(self.pool(x)))))


class SqueezeExciteMean(SqueezeExciteFunction):
    """The same block with the pool as a spatial mean (timm's style) and the gate as a tensor method."""

    def forward(self, x):
        return x * self.fc2(F.silu(self.fc1(x.mean((2, 3), keepdim=True)))).sigmoid()


class ExciteNet(nn.Module):
    """EfficientNet's MBConv without the residual: 1x1 expansion, depthwise conv, SiLU, squeeze-excite, 1x1
    projection; the head's pool a module too (no product reads it)."""

    def __init__(self, se):
        super().__init__()
        self.pw = nn.Conv2d(3, 32, 1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.se = se(32)
        self.proj = nn.Conv2d(32, 16, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.se(F.silu(self.dw(F.silu(self.pw(x)))))
        return self.head(self.pool(self.proj(x)).flatten(1))


def _excite_file(tmp_path, se, shared: bool, x):
    """``(readers of the pool's input, FakeQuantize layers OpenVINO runs, the file's op types)`` of the OpenVINO
    export of ``ExciteNet(se)``, whose output in OpenVINO is judged against the fake-quant model in PyTorch."""
    torch.manual_seed(0)
    m = ExciteNet(se).eval()
    lq.quantize_model(m, target="openvino", sample=x[:2], shared_inputs=shared)
    lq.calibrate_model(m, list(x.split(32)), method="max")
    if shared:  # the head's pool: no product reads its input, so it stays float
        assert type(m.pool) is nn.AdaptiveAvgPool2d
    res = export_onnx(m, x[:32], str(tmp_path / f"se_{se.__name__}_{shared}.onnx"), target="openvino",
                      progress=False, speed_check=False)
    graph = onnx.load(res.path).graph
    producer = {o: n for n in graph.node for o in n.output}
    pools = [n for n in graph.node if n.op_type in ("GlobalAveragePool", "ReduceMean")]
    first = pools[0].input[0]  # the block's pool (the head's comes last)
    readers = sorted(n.op_type for n in graph.node if first in n.input) if producer[first].op_type == \
        "DequantizeLinear" else []
    with torch.no_grad():
        want = m(x[:32]).numpy()
    got = _openvino.compile_model(res.path)(x[:32].numpy())
    assert res.judge([np.asarray(list(got.values())[0])], [want]) == ""
    return readers, _runtime_layer_types(res.path).count("FakeQuantize"), [n.op_type for n in graph.node]


def test_a_squeeze_excite_input_is_quantized_once_for_its_pool_and_its_product(tmp_path):
    """OpenVINO ran a squeeze-excite block's pool and product on the float output of the depthwise conv before
    it; quantized once for both (the product's operand on the pool's grid: lq.glue._join_ties), the plugin
    fuses the FakeQuantize into that conv. Checked in the file (pool and product read one DequantizeLinear; the
    same nodes whichever way the block is written), in OpenVINO's compiled graph (no FakeQuantize left but the
    model input's), and against the fake-quant model in PyTorch."""
    x = torch.randn(64, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    files = {}
    for se in (SqueezeExciteModule, SqueezeExciteFunction, SqueezeExciteMean):
        readers, fakes, files[se] = _excite_file(tmp_path, se, True, x)
        assert (readers, fakes) == (["GlobalAveragePool", "Mul"], 1), (se.__name__, readers, fakes)
    assert len({tuple(v) for v in files.values()}) == 1, "the three styles gave different files"
    # without the tie the module pool quantizes its input alone: a FakeQuantize of its own, the product float
    readers, fakes, _ = _excite_file(tmp_path, SqueezeExciteModule, False, x)
    assert readers == ["GlobalAveragePool"] and fakes > 1, (readers, fakes)


class ResidualBody(nn.Module):
    """An inverted residual's body: 1x1 expansion, depthwise conv, 1x1 projection (SiLU between)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(16, 32, 1), nn.SiLU(), nn.Conv2d(32, 32, 3, padding=1, groups=32),
                                  nn.SiLU(), nn.Conv2d(32, 16, 1))

    def forward(self, x):
        return x + self.body(x)


class ResidualNet(nn.Module):
    """A conv stem, two residual blocks (``x + body(x)`` inside the block, or ``torch.add`` in this forward), a 1x1
    head conv, a mean and a Linear."""

    def __init__(self, inline: bool):
        super().__init__()
        self.inline = inline
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList([ResidualBody(), ResidualBody()])
        self.head = nn.Conv2d(16, 24, 1)
        self.fc = nn.Linear(24, 10)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = torch.add(b.body(x), x) if self.inline else b(x)
        return self.fc(F.relu(self.head(x)).mean((2, 3)))


@pytest.mark.parametrize("inline", [False, True])
def test_a_residual_input_is_read_by_its_add_through_the_block_s_first_conv_quantizer(tmp_path, inline):
    """A block's input ``x`` is read by its first conv (quantized) and by the ``+`` at its end: with the add reading a
    float copy, OpenVINO ran that conv's FakeQuantize as a layer of its own; reading ``x`` through the conv's input
    quantizer (lq.glue._join_ties), the FakeQuantize fuses into the conv that writes ``x``, as in NNCF's files.
    Checked in the file (the add reads the DequantizeLinear the conv reads), in OpenVINO's compiled graph, and
    against the fake-quant model in PyTorch."""
    x = torch.randn(64, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    fakes = {}
    for shared in (True, False):
        torch.manual_seed(0)
        m = ResidualNet(inline).eval()
        lq.quantize_model(m, target="openvino", sample=x[:2], shared_inputs=shared)
        lq.calibrate_model(m, list(x.split(32)), method="max")
        res = export_onnx(m, x[:32], str(tmp_path / f"res_{shared}.onnx"), target="openvino", progress=False,
                          speed_check=False)
        graph = onnx.load(res.path).graph
        producer = {o: n for n in graph.node for o in n.output}
        adds = [n for n in graph.node if n.op_type == "Add"]
        read_dq = [any(producer[i].op_type == "DequantizeLinear" and any(
            c.op_type == "Conv" and i in c.input for c in graph.node) for i in n.input) for n in adds]
        assert read_dq == [shared, shared], read_dq
        with torch.no_grad():
            want = m(x[:32]).numpy()
        got = _openvino.compile_model(res.path)(x[:32].numpy())
        assert res.judge([np.asarray(list(got.values())[0])], [want]) == ""
        fakes[shared] = _runtime_layer_types(res.path).count("FakeQuantize")
    assert fakes[True] == 1 and fakes[False] > 1, fakes


def test_a_join_whose_layer_quantizer_cannot_be_shared_reads_the_float_tensor():
    """The add's operand is quantized only through the first conv's input quantizer: where an override makes that
    quantizer per channel (no grid to share), the operand stays float (no quantizer of its own, which would run as
    a standalone FakeQuantize)."""
    from lq.glue import GlueQuantizer

    x = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    counts = []
    for overrides in ({}, {"blocks.0.body.0": {"input": {"axis": [1]}}}):
        m = ResidualNet(False).eval()
        lq.quantize_model(m, target="openvino", sample=x[:2], overrides=overrides)
        counts.append(sum(isinstance(q, GlueQuantizer) for q in m.modules()))
        with torch.no_grad():
            m(x)  # the forward runs with the tie dropped
    assert counts == [0, 0], counts
