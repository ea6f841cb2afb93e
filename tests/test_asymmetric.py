"""The asymmetric activation grid (``QuantizerConfig.asymmetric``) and the ``int8_onnxruntime`` recipe.

References are independent of lq's affine code: the data's own min/max, a symmetric quantizer calibrated the
same way (its amax is the clip), ``torch.fake_quantize_per_tensor_affine`` on the uint8 grid for the values,
and onnxruntime running the exported file.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from lq.calib import HistogramCalibrator, MaxCalibrator
from lq.calibration import calibrate_model
from lq.callbacks.swap import QuantSwap
from lq.config import Int8OnnxruntimeConfig, QuantizerConfig
from lq.nn import TensorQuantizer
from lq.tensor_quant import QuantDescriptor

from _mobile_blocks import SE, ConvBNAct

torch.set_flush_denormal(True)


def _skewed(n=4096, seed=0):
    """A HardSwish-like tensor: a long positive tail, a short negative one."""
    g = torch.Generator().manual_seed(seed)
    return nn.functional.hardswish(torch.randn(n, generator=g) * 3)


def _uint8_reference(x, lo, hi):
    """The uint8 affine grid of ``[lo, hi]`` (onnxruntime's activations), by torch's own op."""
    scale = float(hi - lo) / 255
    zp = int(round(-float(lo) / scale))
    return torch.fake_quantize_per_tensor_affine(x, scale, zp, 0, 255)


def _calibrated(desc, x, calibrator, method=None, **kw):
    q = TensorQuantizer(desc, calibrator=calibrator)
    q.disable_quant()
    q.enable_calib()
    for part in x.split(1000):
        q(part)
    q.disable_calib()
    q.enable_quant()
    q.load_calib_amax(method, **kw)
    return q


@pytest.mark.parametrize("cls", [MaxCalibrator, lambda: HistogramCalibrator(signed_range=True)],
                         ids=["max", "histogram"])
def test_calibrators_keep_the_signed_range_and_merge_it(cls):
    a, b = _skewed(seed=1), _skewed(seed=2) - 0.2
    one, two, both = cls(), cls(), cls()
    one.collect(a)
    two.collect(b)
    both.collect(a)
    both.collect(b)
    lo, hi = one.merge(two).compute_range()
    assert float(lo) == float(torch.cat([a, b]).min()) and float(hi) == float(torch.cat([a, b]).max())
    assert [float(v) for v in both.compute_range()] == [float(lo), float(hi)]
    fresh = cls()
    fresh.load_state_dict(both.state_dict())
    assert [float(v) for v in fresh.compute_range()] == [float(lo), float(hi)]
    old = {k: v for k, v in both.state_dict().items() if not k.startswith("_range_")}  # saved before the range
    fresh.load_state_dict(old)
    assert fresh.compute_range() is None


def test_per_channel_and_symmetric_histograms_keep_no_signed_range():
    for c in (MaxCalibrator(axis=0), HistogramCalibrator(axis=0, signed_range=True), HistogramCalibrator()):
        c.collect(torch.randn(4, 8))
        assert c.compute_range() is None


@pytest.mark.parametrize("method,kw", [("max", {}), ("percentile", {"percentile": 99.0}), ("mse", {}),
                                       ("entropy", {})])
def test_the_range_is_the_data_clipped_by_the_methods_amax(method, kw):
    x = _skewed()
    symmetric = _calibrated(QuantDescriptor(), x, "histogram", method, **kw)
    q = _calibrated(QuantDescriptor(asymmetric=True), x, "histogram", method, **kw)
    amax = float(symmetric.amax)
    assert float(q.min_range) == pytest.approx(max(float(x.min()), -amax))
    assert float(q.max_range) == pytest.approx(min(float(x.max()), amax))
    assert float(q.min_range) > -0.4  # the short negative tail keeps its own end: no half-empty grid
    with torch.no_grad():
        torch.testing.assert_close(q(x), _uint8_reference(x, q.min_range, q.max_range), rtol=0, atol=0)


def test_setting_amax_moves_the_range_and_the_grid_beats_the_symmetric_one():
    x = _skewed()
    q = _calibrated(QuantDescriptor(asymmetric=True), x, "max")
    sym = _calibrated(QuantDescriptor(), x, "max")
    with torch.no_grad():
        assert (q(x) - x).pow(2).mean() < 0.5 * (sym(x) - x).pow(2).mean()  # twice the levels on the data
    q.amax = 2.0
    assert float(q.min_range) == pytest.approx(float(x.min())) and float(q.max_range) == 2.0
    q.amax = None
    assert q.min_range is None


def test_float64_inputs_quantize_on_the_same_grid_in_float64():
    """As the symmetric grid does (and pytorch-quantization's kernels): float64 runs the reference arithmetic in
    float64, so verification can run a whole model in float64. Reference: the grid written out by hand."""
    x = _skewed()
    q = _calibrated(QuantDescriptor(asymmetric=True, narrow_range=False), x, "max")
    lo, hi = float(q.min_range), float(q.max_range)
    step = (hi - lo) / 255
    zp = round(lo / step)  # the grid is step * (zp + 0..255)
    xd = x.double()
    with torch.no_grad():
        got = q(xd)
    want = torch.clamp(torch.round(xd / step), zp, zp + 255) * step
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=0, atol=1e-9 * step)
    with torch.no_grad():
        assert (q(x).double() - got).abs().max() <= 1e-6 * float(x.abs().max())  # float32: the same levels


def test_asymmetric_refuses_what_an_affine_grid_cannot_be():
    for bad in ({"axis": 0}, {"unsigned": True}, {"learn_amax": True}, {"num_bits": (4, 3)}):
        with pytest.raises(ValueError, match="asymmetric=True is not allowed"):
            QuantDescriptor(asymmetric=True, **bad)
    with pytest.raises(ValueError, match="asymmetric"):
        QuantizerConfig(asymmetric=True, block_size=32)


class HardSwishNet(nn.Module):
    """Blocks as ``nn.Sequential(conv, bn, act)`` (torchvision's Conv2dNormActivation), ReLU and HardSwish."""

    def __init__(self, c=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(4, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.Hardswish())
        self.out = nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.Hardswish())
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(self.out(self.mid(self.stem(x))).mean((2, 3)))


def _trained_bn(m, x):
    """BatchNorm statistics of real activations (the file folds them)."""
    m.train()
    with torch.no_grad():
        for _ in range(3):
            m(x)
    return m.eval()


def _exported(model: nn.Module, x: torch.Tensor, n_calib: int, path, **calib_kw):
    """The recipe as a user runs it: BatchNorm statistics, swap, calibrate on the first ``n_calib`` rows, export;
    the file checked against PyTorch on the rest. Returns the export's result."""
    from lq.export import export_onnx

    from _export_checks import assert_file_matches_pytorch

    m = _trained_bn(model, x)
    QuantSwap(Int8OnnxruntimeConfig()).swap(m)
    with torch.no_grad():
        calibrate_model(m, list(x[:n_calib].split(16)), **calib_kw)
    res = export_onnx(m, x[:8], str(path / "m.onnx"), fallback_seconds=0)
    assert_file_matches_pytorch(m, res, x[n_calib:])
    return res


def test_sequential_conv_bn_act_gets_its_output_quantizer_on_the_batchnorm():
    torch.manual_seed(0)
    m = HardSwishNet()
    QuantSwap(Int8OnnxruntimeConfig(activations=False)).swap(m)
    assert hasattr(m.mid[1], "_output_quantizer") and hasattr(m.out[1], "_output_quantizer")
    assert not hasattr(m.mid[0], "_output_quantizer")  # not between the conv and its BatchNorm
    assert not hasattr(m.stem[1], "_output_quantizer")  # ReLU: the next layer's input quantizer moves across it
    from lq.convert import dequantize_model

    dequantize_model(m)
    assert not hasattr(m.mid[1], "_output_quantizer") and not m.mid[1]._forward_hooks


def test_int8_onnxruntime_file_has_uint8_zero_points_no_clamp_and_equals_pytorch(tmp_path):
    pytest.importorskip("onnxruntime")
    from lq.export import optimized_op_counts

    torch.manual_seed(0)
    res = _exported(HardSwishNet(), torch.randn(64, 4, 12, 12), 48, tmp_path, method="max")
    g = onnx.load(res.path).graph
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    zps = [consts[n.input[2]] for n in g.node if n.op_type == "QuantizeLinear"]
    assert zps and all(z.dtype == np.uint8 for z in zps)
    assert any(int(z) not in (0, 128) for z in zps)  # a zero point from the data (HardSwish's short negative tail)
    ops = optimized_op_counts(res.path)
    assert "Max" not in ops and "Relu" not in ops, ops  # full range: no clamp; ReLU's grid starts at 0
    kernels = {(k.layer, k.op): k.kernel for k in res.layer_kernels}
    assert kernels[("mid.0", "Conv")] == "QLinearConv" and kernels[("out.0", "Conv")] == "QLinearConv", kernels


def test_the_recipe_is_int16_safe_without_reencoding(tmp_path):
    """7-bit weights x full-range uint8 activations: every pair of products fits int16 (the file's own check), so
    the weights stay int8 (u8 x s8 kernels) instead of being re-encoded as uint8."""
    pytest.importorskip("onnxruntime")
    from lq.export import export_onnx
    from lq.export.passes._int16 import int16_risks

    torch.manual_seed(1)
    x = torch.randn(32, 4, 12, 12) * 4
    m = _trained_bn(HardSwishNet(), x)
    QuantSwap(Int8OnnxruntimeConfig()).swap(m)
    with torch.no_grad():
        calibrate_model(m, [x], method="max")
    res = export_onnx(m, x[:4], str(tmp_path / "m.onnx"), fallback_seconds=0)
    model = onnx.load(res.path)
    assert int16_risks(model) == []
    consts = {t.name: t.data_type for t in model.graph.initializer}
    weights = [n.input[0] for n in model.graph.node
               if n.op_type == "DequantizeLinear" and n.input[0] in consts and "bias" not in n.input[0]]
    assert weights and all(consts[w] == onnx.TensorProto.INT8 for w in weights)


def test_hydra_and_copies_keep_the_recipe():
    from test_config import _compose

    cfg = _compose(["quant=int8_onnxruntime"])
    assert cfg.quant.input.asymmetric is True and cfg.quant.weight.num_bits == 7
    q = TensorQuantizer(Int8OnnxruntimeConfig().input.to_descriptor(), calibrator="max")
    q2 = copy.deepcopy(q)
    assert q2.asymmetric


def test_learned_amax_with_an_asymmetric_recipe_is_refused_by_name():
    from lq.callbacks import QuantCallback
    from lq.config import QATConfig

    with pytest.raises(ValueError, match="learn_amax=true needs symmetric input quantizers"):
        QuantCallback(quant="int8_onnxruntime", qat=QATConfig(learn_amax=True)).swap.swap(HardSwishNet())


class SiLUNet(nn.Module):
    """EfficientNet's MBConv pattern in miniature: conv -> bn -> SiLU (a traced forward, not a Sequential)."""

    def __init__(self, c=16):
        super().__init__()
        self.conv1, self.bn1, self.act1 = nn.Conv2d(4, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.SiLU()
        self.conv2, self.bn2, self.act2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.Hardswish()
        self.head = nn.Conv2d(c, 10, 1)

    def forward(self, x):
        h = self.act1(self.bn1(self.conv1(x)))
        return self.head(self.act2(self.bn2(self.conv2(h)))).mean((2, 3))


def test_silu_and_hardswish_quantize_their_input_like_a_hand_written_reference():
    from lq.nn.modules.quant_activation import GATE, QuantHardswish, QuantSiLU
    from lq.tensor_quant import fake_tensor_quant

    torch.manual_seed(0)
    x = torch.randn(256) * 3
    for cls, act in ((QuantSiLU, nn.functional.silu), (QuantHardswish, nn.functional.hardswish)):
        m = cls.from_float(cls._float_module(), quant_desc_input=QuantDescriptor(amax=4.0))
        want = act(fake_tensor_quant(x, torch.tensor(4.0), 8, False, False))  # the activation in float
        with torch.no_grad():
            torch.testing.assert_close(m(x), want, rtol=0, atol=0)
        assert type(m.to_float()) is cls._float_module
        # a checkpoint with a gate range loads: SiLU gets its gate quantizer back, HardSwish drops an old one's
        old = {**m.state_dict(), "_gate_quantizer._amax": torch.tensor(1.0)}
        assert not nn.Sequential(m).load_state_dict({f"0.{k}": v for k, v in old.items()}).unexpected_keys
        assert (GATE in m._modules) == (cls is QuantSiLU)


def test_a_gated_silu_quantizes_its_gate_on_an_unsigned_grid_like_a_hand_written_reference():
    from lq.nn.modules.quant_activation import QuantSiLU, gate_descriptor
    from lq.tensor_quant import fake_tensor_quant

    torch.manual_seed(0)
    x = torch.randn(512) * 3
    m = QuantSiLU.from_float(nn.SiLU(), quant_desc_input=QuantDescriptor(amax=4.0))
    d = gate_descriptor(m._input_quantizer.quant_desc)
    assert d.unsigned and not d.narrow_range and d.num_bits == 8
    m.quantize_gate(QuantDescriptor(amax=1.0, unsigned=True, narrow_range=False))
    xq = fake_tensor_quant(x, torch.tensor(4.0), 8, False, False)
    want = xq * torch.clamp(torch.round(torch.sigmoid(xq) * 255), 0, 255) / 255  # 256 steps on [0, 1]
    with torch.no_grad():
        got = m(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got - nn.functional.silu(xq)).abs().max() > 0  # the gate is on a grid: not the float SiLU
    # the checkpoint keeps the gate: a fresh module loads it and computes the same
    fresh = QuantSiLU.from_float(nn.SiLU(), quant_desc_input=QuantDescriptor(amax=4.0))
    fresh.load_state_dict(m.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), got, rtol=0, atol=0)


class GateNet(nn.Module):
    """conv -> bn -> SiLU twice, the SiLU written as a module or as ``F.silu`` in a helper."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.conv1, self.bn1 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)  # not a float stem
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.acts = nn.ModuleList([nn.SiLU(), nn.SiLU()] if style == "module" else [])
        self.head = nn.Conv2d(16, 10, 1)

    def _act(self, h, i):
        return self.acts[i](h) if self.style == "module" else nn.functional.silu(h)

    def forward(self, x):
        h = self._act(self.bn1(self.conv1(x)), 0)
        return self.head(self._act(self.bn2(self.conv2(h)), 1)).mean((2, 3))


@pytest.mark.parametrize("style", ["module", "functional"])
def test_silus_on_large_maps_run_on_the_integers_and_small_ones_in_float(style, tmp_path):
    pytest.importorskip("onnxruntime")
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model
    from lq.export import export_onnx, optimized_op_counts
    from lq.rules.onnxruntime import ORT_INT8_SILU_GATE_MIN_ELEMENTS

    from _export_checks import assert_file_matches_pytorch

    counts = {}
    for side in (16, 64):  # 16 x 16 x 16 = 4K elements per sample, 16 x 64 x 64 = 64K
        torch.manual_seed(0)
        x = torch.randn(24, 16, side, side)
        m = _trained_bn(GateNet(style), x)
        quantize_model(m, sample=x[:2])
        gated = 16 * side * side >= ORT_INT8_SILU_GATE_MIN_ELEMENTS
        gates = [n for n, _ in m.named_modules() if n.endswith("_gate_quantizer") or n.endswith("_gate")]
        assert len(gates) == (2 if gated else 0), gates
        with torch.no_grad():
            calibrate_model(m, list(x[:16].split(8)), method="max")
        res = export_onnx(m, x[:2], str(tmp_path / f"{side}.onnx"), speed_check=False, fallback_seconds=0)
        assert_file_matches_pytorch(m, res, x[16:])
        ops = optimized_op_counts(res.path)
        if gated:  # the SiLUs' gates run on the codes, as onnxruntime's own quantize_static writes them
            assert ops.get("QLinearSigmoid") == 2 and ops.get("QLinearMul") == 2 and "QuickGelu" not in ops, ops
        else:
            assert ops.get("QuickGelu") == 2 and not {"QLinearSigmoid", "QLinearMul"} & set(ops), ops
        counts[side] = ops.get("QLinearConv")
    assert counts[16] == counts[64], counts


def test_the_recipe_swaps_silu_and_hardswish_only_when_it_quantizes_activations():
    from lq.nn.modules.quant_activation import QuantHardswish, QuantSiLU

    on, off = SiLUNet(), SiLUNet()
    QuantSwap(Int8OnnxruntimeConfig()).swap(on)
    QuantSwap(Int8OnnxruntimeConfig(activations=False)).swap(off)
    assert isinstance(on.act1, QuantSiLU) and isinstance(on.act2, QuantHardswish)
    assert not hasattr(on.bn1, "_output_quantizer")  # the SiLU's own input quantizer is the BatchNorm's output's
    assert type(off.act1) is nn.SiLU and hasattr(off.bn1, "_output_quantizer")
    assert on.act1._input_quantizer.asymmetric and not hasattr(on.act1, "_gate_quantizer")


def test_silu_and_hardswish_run_as_one_float_kernel_between_integer_convs(tmp_path):
    pytest.importorskip("onnxruntime")
    from lq.export import optimized_op_counts

    torch.manual_seed(0)
    res = _exported(SiLUNet(), torch.randn(64, 4, 12, 12), 48, tmp_path, method="max")
    ops = optimized_op_counts(res.path)
    # onnxruntime runs HardSwish as HardSigmoid and Mul, in float between the Q/DQ like the SiLU
    assert ops.get("QuickGelu") == 1 and ops.get("HardSigmoid") == 1 and ops.get("Mul") == 1, ops
    assert not {"Sigmoid", "QLinearSigmoid", "QLinearMul"} & set(ops), ops
    kernels = {(k.layer, k.op): k.kernel for k in res.layer_kernels}
    assert kernels[("conv1", "Conv")] == "QLinearConv" and kernels[("conv2", "Conv")] == "QLinearConv", kernels


class StemNet(nn.Module):
    """An image net's stem (1 channel, 3x3: 9 products per output) -> BN -> SiLU, then a 16-channel conv."""

    def __init__(self, act=nn.SiLU):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), act())
        self.conv, self.bn, self.act = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), act()
        self.head = nn.Conv2d(16, 10, 1)

    def forward(self, x):
        return self.head(self.act(self.bn(self.conv(self.stem(x))))).mean((2, 3))


class PooledStem(nn.Module):
    """A 1-channel stem -> BN -> ReLU whose output a max pool reads (bench.ordinary's U-Net encoder)."""

    def __init__(self):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.enc2(nn.functional.max_pool2d(self.enc1(x), 2)).mean((2, 3)))


def test_a_stem_that_a_max_pool_reads_stays_integer(tmp_path):
    """In float its output would reach the pool in NCHW, which onnxruntime pools with its slow uint8 MaxPool
    (lq.glue._outputs.pooled_stems): the stem keeps its input quantizer and runs QLinearConv, the pool NhwcMaxPool."""
    pytest.importorskip("onnxruntime")
    from lq.convert import quantize_model

    m = PooledStem()
    quantize_model(m)
    assert m.enc1[0]._input_quantizer.is_enabled
    torch.manual_seed(0)
    res = _exported(PooledStem(), torch.rand(64, 1, 12, 12), 48, tmp_path, method="max")
    assert {(k.layer, k.op): k.kernel for k in res.layer_kernels}[("enc1.0", "Conv")] == "QLinearConv"
    assert "NhwcMaxPool" in res.ort_ops and "MaxPool" not in res.ort_ops, res.ort_ops


@pytest.mark.parametrize("act", [nn.SiLU, nn.Hardswish])
def test_the_activation_of_a_stem_that_runs_in_float_stays_float(tmp_path, act):
    """The stem runs faster in float (lq.rules.onnxruntime.ort_prefers_float_conv): its activation is not
    quantized (it would give the stem an output grid and make it a QLinearConv); the traced forward's
    activation after a 16-channel conv is."""
    pytest.importorskip("onnxruntime")
    from lq.convert import quantize_model
    from lq.nn.modules.quant_activation import ACTIVATION_MODULE_CLASSES

    m = StemNet(act)
    summary = quantize_model(m)
    assert type(m.stem[2]) is act and type(m.act) is ACTIVATION_MODULE_CLASSES[act]
    assert "faster in float" in summary["stem.2"].status
    assert not hasattr(m.stem[1], "_output_quantizer") and not hasattr(m.stem[0], "_output_quantizer")
    torch.manual_seed(0)
    res = _exported(StemNet(act), torch.randn(64, 1, 12, 12), 48, tmp_path, method="max")
    kernels = {(k.layer, k.op): k.kernel for k in res.layer_kernels}
    assert kernels[("stem.0", "Conv")] == "Conv" and kernels[("conv", "Conv")] == "QLinearConv", kernels


class MBConv(nn.Module):
    def __init__(self, i, o, stride):
        super().__init__()
        self.res = stride == 1 and i == o
        self.block = nn.Sequential(ConvBNAct(i, 4 * i), ConvBNAct(4 * i, 4 * i, 3, stride, groups=4 * i),
                                   SE(4 * i, max(1, i // 4)), ConvBNAct(4 * i, o, act=None))

    def forward(self, x):
        y = self.block(x)
        return y + x if self.res else y


class TinyEfficientNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = ConvBNAct(4, 16, 3)
        self.blocks = nn.Sequential(MBConv(16, 16, 1), MBConv(16, 24, 2), MBConv(24, 24, 1))
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def test_squeeze_excite_products_are_quantized_only_with_activations_and_share_the_pools_grid():
    on, off = TinyEfficientNet(), TinyEfficientNet()
    QuantSwap(Int8OnnxruntimeConfig()).swap(on)
    QuantSwap(Int8OnnxruntimeConfig(activations=False)).swap(off)
    se_on, se_off = on.blocks[0].block[2], off.blocks[0].block[2]
    names = [n for n, _ in se_on.named_modules() if "mul" in n]
    assert names and not any("mul" in n for n, _ in se_off.named_modules())
    # x * gate: x is also the pool's input, so it is quantized by the pool's own quantizer (one grid, one Q)
    assert not any(n.endswith("mul_0_a") for n in names) and any(n.endswith("mul_0_b") for n in names), names


def test_every_conv_runs_integer_under_auto_calibration(tmp_path):
    """Auto calibration may choose different methods for two quantizers of one tensor; the residual add after a
    stride-2 block reads the tensor that the next block's first conv (inside an nn.Sequential subclass) reads,
    so it is tied to that conv's quantizer: one QuantizeLinear, and the conv that writes it fuses."""
    pytest.importorskip("onnxruntime")
    from lq.export import optimized_op_counts

    torch.manual_seed(0)
    res = _exported(TinyEfficientNet(), torch.randn(96, 4, 16, 16), 64, tmp_path)  # auto calibration
    float_kernels = [(k.layer, k.op, k.reason) for k in res.layer_kernels if not k.integer]
    assert [k for k in float_kernels if k[1] in ("Conv", "Mul")] == [], float_kernels
    ops = optimized_op_counts(res.path)
    assert ops.get("QLinearSigmoid", 0) == 3 and ops.get("QLinearMul", 0) == 3, ops  # the squeeze-excite gates
    assert ops.get("QuickGelu", 0) == 1 + 3 * 3, ops  # the SiLUs: stem, and expand, depthwise, SE in every block


class ReluNormBlock(nn.Sequential):
    """CREPE's layer as library code writes it: conv -> ReLU -> BatchNorm -> MaxPool (a Sequential subclass)."""

    def __init__(self, i: int, o: int):
        super().__init__(nn.Conv1d(i, o, 5, padding=2), nn.ReLU(inplace=True), nn.BatchNorm1d(o), nn.MaxPool1d(2))


class ReluNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = ReluNormBlock(1, 16)  # 1 input channel: float by choice
        self.a, self.b = ReluNormBlock(16, 16), nn.Sequential(nn.Conv1d(16, 32, 3, padding=1), nn.ReLU(),
                                                                nn.BatchNorm1d(32))
        self.c, self.act, self.norm = nn.Conv1d(32, 32, 3, padding=1), nn.ReLU(), nn.BatchNorm1d(32)  # traced forward
        self.head = nn.Linear(32 * 16, 10)

    def forward(self, x):
        y = self.norm(self.act(self.c(self.b(self.a(self.stem(x))))))
        return self.head(torch.flatten(y, 1))


@pytest.mark.parametrize("recipe", ["int8_onnxruntime", "int8_per_channel"])
def test_conv_relu_batchnorm_runs_the_conv_integer_with_the_quantizer_on_the_relu(recipe, tmp_path):
    """A BatchNorm after the ReLU cannot fold into the conv, so it reads the ReLU in float: with the recipe that
    quantizes activations the ReLU gets the output quantizer (zero point 0: onnxruntime drops it) and every conv
    but the 1-channel stem runs QLinearConv (before: 1 of 7 CREPE layers integer, quantize_static 7 of 7). The
    symmetric recipe keeps its placement (a ReLU output on its signed grid would not fuse)."""
    from lq.config import RECIPES
    from lq.export import export_onnx
    from lq.export.verify._verify import optimized_op_counts

    from _export_checks import assert_file_matches_pytorch

    torch.manual_seed(0)
    x = torch.randn(72, 1, 64)
    m = _trained_bn(ReluNormNet(), x)
    QuantSwap(RECIPES[recipe]()).swap(m)
    on_relu = sorted(n.rsplit(".", 1)[0] for n, _ in m.named_modules() if n.endswith("_output_quantizer"))
    with torch.no_grad():
        calibrate_model(m, list(x[:48].split(16)))
    res = export_onnx(m, x[:8], str(tmp_path / "m.onnx"), speed_check=False)
    assert_file_matches_pytorch(m, res, x[48:])
    ops = optimized_op_counts(res.path)
    if recipe == "int8_onnxruntime":
        assert on_relu == ["a.1", "act", "b.1"]  # not the stem: a float conv gains nothing from it
        assert ops["QLinearConv"] == 3 and "Relu" not in ops, ops  # every ReLU fused (the stem's into its float conv)
        assert res.kernel_of("stem.0").startswith("Conv (float") and res.kernel_of("c") == "QLinearConv"
    else:
        assert on_relu == [] and ops["QLinearConv"] < 3, ops
