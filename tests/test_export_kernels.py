"""The export says which kernel onnxruntime runs for every quantized layer, and warns when INT8 is slower.

The per-layer answer must agree with onnxruntime's own optimized graph (counted independently here), a
float layer must come with its reason, and the FP32 file the INT8 file is timed against must compute what
the PyTorch model computes with its quantizers off (else the reported speed-up compares different models).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import lq.nn as qnn
from lq import report
from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.export import INT8_KERNELS, export_onnx, optimized_op_counts
from lq.tensor_quant import QuantDescriptor
from lq.export.timing import _timing

ort = pytest.importorskip("onnxruntime")


class ResidualNet(nn.Module):
    """Conv -> ReLU -> conv, a QuantAdd residual, global pool, linear: every layer fuses in onnxruntime."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(4, 16, 3, padding=1)  # 4 channels: not a stem that runs in float
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.add = qnn.QuantAdd()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        y = self.add(torch.relu(self.c2(y)), y)
        return self.fc(self.pool(y).flatten(1))


class GroupNormNet(nn.Module):
    """A conv read by GroupNorm, as models are written today: without an output quantizer (``glue=False``)
    onnxruntime cannot fuse that conv."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 16, 3, padding=1)
        self.gn = nn.GroupNorm(4, 16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        y = nn.functional.silu(self.gn(self.c1(x)))
        return self.fc(y.mean((2, 3)))


def _quantized(model, x, glue=True, method=None, **kw):
    model = model.eval()
    quantize_model(model, glue=glue, **kw)
    calibrate_model(model, [x], **({"method": method} if method else {}))
    return model


def _export(model, x, tmp_path, **kw):
    """The file with every quantizer lq placed (no measured fallback: these tests check the placement)."""
    return export_onnx(model, x, str(tmp_path / "m.onnx"), **{"fallback_seconds": 0, **kw})


def test_integer_kernels_match_onnxruntimes_optimized_graph(tmp_path):
    x = torch.randn(4, 4, 16, 16)
    res = _export(_quantized(ResidualNet(), x), x, tmp_path)
    kernels = {k.layer: k for k in res.layer_kernels}
    assert {"c1", "c2", "fc"} <= set(kernels)
    assert kernels["c1"].kernel == "QLinearConv" and kernels["c2"].kernel == "QLinearConv"
    assert kernels["fc"].kernel == "QGemm"
    assert all(k.reason is None for k in res.layer_kernels if k.integer)
    # independent count: the compute kernels onnxruntime's optimized graph holds
    ops = optimized_op_counts(res.path)
    reported = [k.kernel for k in res.layer_kernels if k.op in ("Conv", "Gemm", "MatMul")]
    assert sorted(reported) == sorted(
        [op for op in ("QLinearConv", "QGemm") for _ in range(ops.get(op, 0))])
    assert "layers on integer kernels" in res.summary()


def test_float_layer_is_reported_with_its_reason(tmp_path):
    x = torch.randn(4, 8, 16, 16)
    res = _export(_quantized(GroupNormNet(), x, glue=False), x, tmp_path)
    c1 = next(k for k in res.layer_kernels if k.layer == "c1")
    assert c1.kernel not in INT8_KERNELS and c1.kernel in optimized_op_counts(res.path)
    assert "read by gn (" in c1.reason and "without a quantizer" in c1.reason  # the module that reads it
    assert res.kernel_of("c1").startswith(c1.kernel + " (float: ")
    assert next(k for k in res.layer_kernels if k.layer == "fc").kernel == "QGemm"


def test_fp32_reference_is_the_model_without_quantizers(tmp_path, monkeypatch):
    """The FP32 file timed against the INT8 file computes the PyTorch model with quantization off."""
    x = torch.randn(4, 8, 16, 16)
    model = _quantized(GroupNormNet(), x, glue=False)
    seen = {}
    real = _timing.compare

    def spy(int8_model, fp32_model, feeds, providers=None, **kw):
        seen["fp32"] = fp32_model
        return real(int8_model, fp32_model, feeds, providers, **kw)

    monkeypatch.setattr(_timing, "compare", spy)
    res = _export(model, x, tmp_path)
    assert res.speedup is not None and np.isfinite(res.speedup) and res.speedup > 0
    sess = ort.InferenceSession(seen["fp32"], providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"input": x.numpy()})
    for _, m in model.named_modules():
        if isinstance(m, qnn.TensorQuantizer):
            m.disable()
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_slower_than_fp32_warns_with_ratio_and_float_layers(tmp_path, monkeypatch):
    x = torch.randn(4, 8, 16, 16)
    monkeypatch.setattr(_timing, "time_rounds", lambda *a, **k: ([2e-3] * 3, [1.04e-3] * 3, 1))
    res = _export(_quantized(GroupNormNet(), x, glue=False), x, tmp_path)
    slow = [w for w in res.warnings if "the speed of the plain FP32 export" in w]
    assert len(slow) == 1 and "0.52x" in slow[0] and "c1 (" in slow[0]
    assert "fc (" not in slow[0]  # fc runs QGemm: not responsible


def test_no_slowdown_warning_when_faster(tmp_path, monkeypatch):
    x = torch.randn(4, 4, 16, 16)
    monkeypatch.setattr(_timing, "time_rounds", lambda *a, **k: ([1e-3] * 3, [1.8e-3] * 3, 1))
    res = _export(_quantized(ResidualNet(), x), x, tmp_path)
    assert res.speedup == pytest.approx(1.8) and not any("the speed of" in w for w in res.warnings)


def test_quantizer_table_gets_the_kernel_column(tmp_path):
    x = torch.randn(4, 8, 16, 16)
    model = _quantized(GroupNormNet(), x, glue=False)
    res = _export(model, x, tmp_path)
    rows = report.with_kernels(report.quantizer_rows(model), res)
    by_q = {r["quantizer"]: r[report.KERNEL_COLUMN] for r in rows}
    assert by_q["fc._input_quantizer"] == "QGemm" and by_q["fc._weight_quantizer"] == "QGemm"
    assert "float:" in by_q["c1._input_quantizer"]
    md = report.markdown_table(rows)
    assert report.KERNEL_COLUMN in md.splitlines()[0]
    assert report.KERNEL_COLUMN not in report.markdown_table(report.quantizer_rows(model)).splitlines()[0]


class AttentionNet(nn.Module):
    """nn.MultiheadAttention: its fused q/k/v weight is quantized per row, then split in three."""

    def __init__(self, d=32):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def test_split_attention_weights_still_run_integer_matmuls(tmp_path):
    """Each of the q, k, v projections reads its own weight DequantizeLinear (the split moved onto the
    int8 constant), so onnxruntime runs all of them, and both attention matmuls, as integer kernels."""
    x = torch.randn(4, 6, 32)
    res = _export(_quantized(AttentionNet(), x), x, tmp_path)
    # (a projection whose bias is added right after it is written as Gemm: lq.export.passes._linear_gemm)
    attn = [k for k in res.layer_kernels if k.layer.startswith("attn") and k.op in ("MatMul", "Gemm")]
    assert len(attn) == 6 and all(k.integer for k in attn), [(k.layer, k.kernel, k.reason) for k in attn]


class DepthwiseNet(nn.Module):
    """A 1-channel stem and a depthwise conv, each read by GroupNorm: onnxruntime's float conv is faster there."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 3, padding=1)
        self.gn1 = nn.GroupNorm(4, 16)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.gn2 = nn.GroupNorm(4, 16)
        self.pw = nn.Conv2d(16, 16, 1)
        self.gn3 = nn.GroupNorm(4, 16)

    def forward(self, x):
        y = nn.functional.silu(self.gn1(self.stem(x)))
        y = nn.functional.silu(self.gn2(self.dw(y)))
        return self.gn3(self.pw(y))


def test_depthwise_and_thin_stem_run_float_by_choice_with_the_same_numbers(tmp_path):
    """No output quantizer on the stem and the depthwise conv (the pointwise conv gets one); the export stores
    their dequantized weights as float, onnxruntime runs its float conv, the report says why, and the file
    still equals PyTorch fake-quant (within the export's bound) with every optimization on and off (no
    onnxruntime pass re-quantized the float weights)."""
    x = torch.randn(4, 1, 16, 16)
    model = _quantized(DepthwiseNet(), x)
    assert not hasattr(model.stem, "_output_quantizer") and not hasattr(model.dw, "_output_quantizer")
    assert hasattr(model.pw, "_output_quantizer")
    res = _export(model, x, tmp_path)
    kernels = {k.layer: k for k in res.layer_kernels}
    for name in ("stem", "dw"):
        assert kernels[name].by_choice and kernels[name].kernel == "Conv", kernels[name]
        assert "input channels per group" in res.kernel_of(name)
    assert kernels["pw"].kernel == "QLinearConv"
    ops = optimized_op_counts(res.path)
    assert ops.get("QLinearConv") == 1 and "DequantizeLinear" in ops
    g = onnx.load(res.path).graph
    assert len([i for i in g.initializer if "float_by_choice" in i.name]) == 2
    with torch.no_grad():
        want = model(x).numpy()
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        assert res.judge([_run(res.path, x, level)], [want]) == ""  # the export's own rule
    # where no output quantizer follows, the float conv is PyTorch's fake-quant conv to float rounding, fused
    # or not (onnxruntime re-quantizing the float weights per tensor would be off by ~1e-2 here)
    thin = _quantized(nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16)), x)
    res = export_onnx(thin, x, str(tmp_path / "thin.onnx"), fallback_seconds=0)
    assert res.layer_kernels[0].by_choice
    with torch.no_grad():
        want = thin(x).numpy()
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        np.testing.assert_allclose(_run(res.path, x, level), want, rtol=1e-4, atol=1e-4)


def _prelu_net():
    return nn.Sequential(nn.Conv2d(8, 16, 3), nn.PReLU(16), nn.Conv2d(16, 16, 3), nn.PReLU(16), nn.Conv2d(16, 16, 1),
                         nn.PReLU(16), nn.Conv2d(16, 4, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def test_convs_no_quantizer_reads_get_their_dequantized_weights_as_float(tmp_path):
    """Convs read by PReLU (on pytorch-quantization's symmetric grids, where lq gives them no output quantizer:
    slope ties) run in float: the export stores their dequantized weights as float, so onnxruntime neither
    dequantizes them on every run nor misses its blocked float conv; the report still names the reader, and the
    numbers are PyTorch fake-quant's."""
    x = torch.randn(4, 8, 12, 12)
    model = _quantized(_prelu_net(), x, quant_desc_input=QuantDescriptor())
    res = _export(model, x, tmp_path)
    kernels = {k.layer: k for k in res.layer_kernels}
    for name in ("0", "2", "4"):
        k = kernels[name]
        assert k.kernel == "Conv" and not k.by_choice and "PRelu" in k.reason and "symmetric" in k.reason, k
    assert kernels["6"].kernel == "QLinearConv"  # the pool's input quantizer reads it
    g = onnx.load(res.path).graph
    floats = [i.name for i in g.initializer if "dequantized_float" in i.name]
    assert not [i for i in g.initializer if "float_by_choice" in i.name], floats
    # the two 3x3 convs; the 1x1 conv keeps its DequantizeLinear (one GEMM either way, no NCHWc reorders)
    weights = {n.name: n.input[1] for n in g.node if n.op_type == "Conv"}
    assert len(floats) == 2 and sum(w in floats for w in weights.values()) == 2, weights
    with torch.no_grad():
        want = model(x).numpy()
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        np.testing.assert_allclose(_run(res.path, x, level), want, rtol=1e-4, atol=1e-4)


def test_the_default_recipe_runs_convs_read_by_prelu_as_qlinearconv(tmp_path):
    """int8_onnxruntime (the default) gives a conv read by PReLU an output quantizer (lq.glue._rules.SLOPED): the conv
    runs as QLinearConv and the PReLU in float between DQ and Q, as in onnxruntime's own files; on its asymmetric
    grids the file is verified against PyTorch like any other."""
    x = torch.randn(4, 8, 12, 12)
    model = _quantized(_prelu_net(), x)
    assert all(hasattr(model[i], "_output_quantizer") for i in (0, 2, 4)) and not hasattr(model[6], "_output_quantizer")
    res = _export(model, x, tmp_path)
    kernels = {k.layer: k.kernel for k in res.layer_kernels}
    assert all(kernels[name] == "QLinearConv" for name in ("0", "2", "4", "6")), kernels
    assert res.verified


def _run(path, x, level):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]


class LeakyPoolNet(nn.Module):
    """A 1-channel stem (float by choice), a conv read by LeakyReLU then a max pool (the export pools first),
    a conv the next one's quantizer reads (integer)."""

    def __init__(self):
        super().__init__()
        self.stem, self.gn = nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(4, 8)
        self.c1, self.act, self.pool = nn.Conv2d(8, 16, 3, padding=1), nn.LeakyReLU(0.1), nn.MaxPool2d(2)
        self.c2, self.c3 = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return self.c3(torch.relu(self.c2(self.pool(self.act(self.c1(self.gn(self.stem(x)))))))).mean((2, 3))


def test_float_warning_counts_the_layers_it_names_and_a_moved_pool_names_the_activation(tmp_path):
    """The export's "runs N in float" warning counts exactly the quantized layers it lists (not the float-by-choice
    stem, which the report explains per layer), and a conv whose max pool was moved above its activation is
    reported as read by the pool, then by the activation."""
    x = torch.randn(4, 1, 16, 16)
    # pytorch-quantization's symmetric grids: c1 gets no output quantizer before its LeakyReLU; under max calibration
    # the pool's quantizer and c2's have one grid, so the pool moves above the activation
    res = _export(_quantized(LeakyPoolNet(), x, method="max", quant_desc_input=QuantDescriptor()), x, tmp_path)
    kernels = {k.layer: k for k in res.layer_kernels}
    assert kernels["stem"].by_choice and kernels["c2"].kernel == "QLinearConv"
    assert "pool (MaxPool), then by act (LeakyRelu), without a quantizer" in kernels["c1"].reason, kernels["c1"]
    (note,) = [w for w in res.warnings if w.startswith("onnxruntime runs")]
    floats = [k.layer for k in res.layer_kernels if not k.integer and not k.by_choice]
    assert note.startswith(f"onnxruntime runs {len(floats)} quantized conv/gemm/matmul in float: "), note
    assert sorted(floats) == ["c1", "c3"] and all(f"{name}: " in note for name in floats), note
    # a model whose only float conv is the stem, by choice: nothing to warn about
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.GroupNorm(4, 8), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 12 * 12, 4))
    res = _export(_quantized(model, x), x, tmp_path)
    assert [k.layer for k in res.layer_kernels if not k.integer] == ["0"] and res.layer_kernels[0].by_choice
    assert not [w for w in res.warnings if w.startswith("onnxruntime runs")], res.warnings


def test_a_layer_computed_once_per_readers_grid_is_one_row(tmp_path):
    """A conv whose ReLU output two quantizers of different scales read is exported twice (each copy fuses into
    its own QLinearConv). The kernel table listed that layer twice ("stem.0" two QLinearConv rows); it is one
    row with the kernel counted, and layer_kernels (one entry per exported op) still matches onnxruntime."""
    from lq.report import kernel_rows, kernel_table

    class Fork(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
            self.a, self.b = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 1)

        def forward(self, x):
            y = self.stem(x)
            return torch.cat([self.a(y), self.b(y)], 1).mean((2, 3))

    torch.manual_seed(0)
    x = torch.randn(8, 4, 16, 16)
    model = _quantized(Fork().eval(), x)
    assert model.b._input_quantizer is model.a._input_quantizer  # one grid (lq.glue._one_tensor) ...
    model.b._input_quantizer = copy.deepcopy(model.a._input_quantizer)
    with torch.no_grad():
        model.b._input_quantizer._max_range.mul_(0.5)  # ... here two readers of the stem's output on two grids
    res = _export(model, x, tmp_path, verify=False)
    assert [k.layer for k in res.layer_kernels].count("stem.0") == 2  # two exported convs ...
    rows = kernel_rows(res)
    assert [r[0] for r in rows].count("stem.0") == 1, rows  # ... one row
    assert next(r for r in rows if r[0] == "stem.0")[2] == "QLinearConv x2"
    assert res.kernel_of("stem.0") == "QLinearConv"
    assert sum(k.kernel == "QLinearConv" for k in res.layer_kernels) == optimized_op_counts(res.path)["QLinearConv"]
    assert kernel_table(res).row_count == len(rows)
