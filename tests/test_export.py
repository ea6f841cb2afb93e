"""ONNX export (lq.export): Q/DQ lowering, BatchNorm folding, onnxruntime fusion and verification."""

from __future__ import annotations

import copy
import os
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import lq.nn as qnn
from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.export import ExportError, VerificationError, export_onnx, optimized_op_counts
from lq.tensor_quant import QuantDescriptor

ort = pytest.importorskip("onnxruntime")

torch.set_flush_denormal(True)


# =========================================================================== models
class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.add = qnn.FloatAdd()

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.add(self.bn2(self.conv2(y)), x))


class SmallNet(nn.Module):
    """conv-bn-relu stem, a residual block with a quantized add, maxpool, linear head."""

    def __init__(self, c=8, bn=True):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c) if bn else nn.Identity(),
                                  nn.ReLU())
        self.block = Residual(c)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(c * 4 * 4, 5)

    def forward(self, x):
        x = self.pool(self.block(self.stem(x)))
        return self.head(torch.flatten(x, 1))


def _randomize_bn(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(torch.randn(n, generator=g))  # some negative gammas: sign flips in the fold
                m.bias.copy_(0.2 * torch.randn(n, generator=g))
                m.running_mean.copy_(0.2 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + torch.rand(n, generator=g))


def _quantized(model, per_channel=True, **kw):
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model

    wdesc = None if per_channel else {"num_bits": 8, "axis": None}
    quantize_model(model, **({"quant_desc_weight": wdesc} if wdesc else {"quant_desc_input": QuantDescriptor()}), **kw)
    model.eval()
    batches = [torch.randn(16, 3, 8, 8) for _ in range(2)]
    with torch.no_grad():
        calibrate_model(model, batches, method="max")
    return model


def _sample():
    return torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(7))


def _net(per_channel=True, bn=True):
    torch.manual_seed(0)
    m = SmallNet(bn=bn)
    _randomize_bn(m)
    return _quantized(m, per_channel=per_channel)


def _nodes(path, op):
    return [n for n in onnx.load(path).graph.node if n.op_type == op]


def _init(path):
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}


def _signed_weight(inits, dq):
    """The integers a weight DequantizeLinear reads, zero point removed (int8, or uint8 with zero point 128)."""
    q = inits[dq.input[0]].astype(np.int32)
    zp = inits[dq.input[2]].astype(np.int32) if len(dq.input) > 2 and dq.input[2] else np.zeros((), np.int32)
    if zp.ndim == 1:
        zp = zp.reshape([-1 if d == (_attr(dq, "axis", 1) % q.ndim) else 1 for d in range(q.ndim)])
    return q - zp


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _run(path, x):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]


def _ref(model, x):
    m = copy.deepcopy(model).eval()
    with torch.no_grad():
        return m(x).numpy()


# =========================================================================== the main export (dynamo)
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = _net()
    model.train()  # export must not care (it exports an eval copy) and must leave it in train mode
    before = copy.deepcopy(model.state_dict())
    types_before = [(n, type(m)) for n, m in model.named_modules()]
    path = str(tmp_path_factory.mktemp("export") / "net.onnx")
    res = export_onnx(model, _sample(), path, speed_check=False)
    return model, res, path, before, types_before


def test_export_checks_runs_and_matches_pytorch(exported):
    model, res, path, _, _ = exported
    assert os.path.exists(path) and res.file_size == os.path.getsize(path)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600: a server user can read it
    onnx.checker.check_model(onnx.load(path), full_check=True)
    x = _sample()
    out = _run(path, x)
    ref = _ref(model, x)
    assert out.shape == ref.shape
    diff = float(np.abs(out - ref).max())
    assert res.verified
    assert diff <= 0.05 * np.abs(ref).max()
    # never the whole model's output shifted: most outputs agree to float precision
    assert np.mean(np.abs(out - ref) < 1e-4) > 0.9
    assert res.exporter == "dynamo" and "CPUExecutionProvider" in res.providers
    assert "net.onnx" in str(res)


def test_dynamic_batch(exported):
    model, _, path, _, _ = exported
    for n in (1, 9):
        x = torch.randn(n, 3, 8, 8)
        out = _run(path, x)
        assert out.shape == (n, 5)
        assert np.abs(out - _ref(model, x)).max() <= 0.05 * np.abs(_ref(model, x)).max() + 1e-3


def test_training_model_unchanged(exported):
    model, _, _, before, types_before = exported
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert [(n, type(m)) for n, m in model.named_modules()] == types_before
    assert model.training  # mode kept
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())  # BN not folded in the training model
    # and it still trains (on a copy: the other tests read this model's BatchNorm statistics)
    m = copy.deepcopy(model)
    m(torch.randn(4, 3, 8, 8)).sum().backward()
    assert m.head.weight.grad is not None


def test_qdq_scales_and_axis(exported):
    model, res, path, _, _ = exported
    inits = _init(path)
    q_nodes = _nodes(path, "QuantizeLinear")
    dq_nodes = _nodes(path, "DequantizeLinear")
    assert q_nodes and dq_nodes
    # activation scale = amax / 127 (int8 grid; onnxruntime target stores it as uint8 with zero point 128)
    amax_in = float(model.stem[0]._input_quantizer.amax)
    q_in = next(n for n in q_nodes if n.input[0] == "input")
    np.testing.assert_allclose(inits[q_in.input[1]], amax_in / 127, rtol=1e-6)
    zp = inits[q_in.input[2]]
    assert zp.dtype in (np.int8, np.uint8) and int(zp) == (128 if zp.dtype == np.uint8 else 0)
    # per-channel weights: 8-bit initializers, 1-D scale along axis 0 = amax * |gamma / sqrt(var + eps)| / 127
    conv = model.block.conv1
    bn = model.block.bn1
    k = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach()
    expect = (conv._weight_quantizer.amax.reshape(-1) * k.abs() / 127).numpy()
    w_dqs = [n for n in dq_nodes if inits.get(n.input[0]) is not None
             and inits[n.input[0]].dtype in (np.int8, np.uint8) and inits[n.input[0]].ndim == 4]
    assert len(w_dqs) == 3
    scales = [inits[n.input[1]] for n in w_dqs]
    match = [s for s in scales if s.shape == expect.shape and np.allclose(s, expect, rtol=1e-5)]
    assert match, "block.conv1 weight scale not found"
    for n in w_dqs:
        assert _attr(n, "axis") == 0
    infos = {q.layer: q for q in res.quantized}
    assert "block.conv1._weight_quantizer" in infos and infos["block.conv1._weight_quantizer"].axis == 0
    assert "block.add._input_quantizer" in infos


def test_batchnorm_folded(exported):
    _, res, path, _, _ = exported
    assert not _nodes(path, "BatchNormalization")
    folded = {f.bn for f in res.folded_bn if f.skipped is None}
    assert folded == {"stem.1", "block.bn1", "block.bn2"}


def test_onnxruntime_fuses_int8_kernels(exported):
    _, res, path, _, _ = exported
    ops = optimized_op_counts(path)
    assert ops["QLinearConv"] >= 3
    assert ops["QLinearAdd"] == 1
    assert ops["QGemm"] + ops["QLinearMatMul"] == 1
    assert ops.get("Conv", 0) == 0 and ops.get("FusedConv", 0) == 0
    assert res.int8_kernels["QLinearConv"] == ops["QLinearConv"]


# =========================================================================== variants
def test_per_tensor_weights_without_bn_scale_is_amax_over_127(tmp_path):
    model = _net(per_channel=False, bn=False)
    path = str(tmp_path / "pt.onnx")
    res = export_onnx(model, _sample(), path, dynamo=False, speed_check=False)
    assert res.verified
    inits = _init(path)
    stem_amax = float(model.stem[0]._weight_quantizer.amax)
    w_dq = next(n for n in _nodes(path, "DequantizeLinear")
                if n.input[0] in inits and inits[n.input[0]].shape == (8, 3, 3, 3))
    s = inits[w_dq.input[1]]
    assert s.ndim == 0 and np.isclose(float(s), stem_amax / 127, rtol=1e-6)
    # the weights themselves: lq's rounding of w * 127 / amax
    w = model.stem[0].weight.detach().numpy()
    np.testing.assert_array_equal(_signed_weight(inits, w_dq), np.clip(np.round(w * (127 / stem_amax)), -128, 127))
    assert optimized_op_counts(path)["QLinearConv"] >= 3


def test_per_tensor_weights_with_bn_fold_become_per_channel(tmp_path):
    model = _net(per_channel=False, bn=True)
    path = str(tmp_path / "ptbn.onnx")
    res = export_onnx(model, _sample(), path, dynamo=False, speed_check=False)
    assert res.verified
    inits = _init(path)
    conv, bn = model.stem[0], model.stem[1]
    k = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach().numpy()
    w_dq = next(n for n in _nodes(path, "DequantizeLinear")
                if n.input[0] in inits and inits[n.input[0]].shape == (8, 3, 3, 3))
    np.testing.assert_allclose(inits[w_dq.input[1]], float(conv._weight_quantizer.amax) * np.abs(k) / 127,
                               rtol=1e-5)
    assert _attr(w_dq, "axis") == 0


def test_no_bn_folding_keeps_batchnorm(tmp_path):
    model = _net()
    path = str(tmp_path / "nofold.onnx")
    res = export_onnx(model, _sample(), path, dynamo=False, fold_bn=False, speed_check=False)
    assert len(_nodes(path, "BatchNormalization")) == 3
    assert res.verified
    assert not res.folded_bn


def test_legacy_exporter(tmp_path):
    model = _net()
    path = str(tmp_path / "legacy.onnx")
    res = export_onnx(model, _sample(), path, dynamo=False, opset=13, speed_check=False)
    assert res.exporter == "legacy" and res.opset == 13
    assert res.verified
    assert not _nodes(path, "BatchNormalization")
    ops = optimized_op_counts(path)
    assert ops["QLinearConv"] >= 3 and ops["QLinearAdd"] == 1
    out = _run(path, torch.randn(2, 3, 8, 8))
    assert out.shape == (2, 5)


def test_tensorrt_target_is_int8_zero_point_0(tmp_path):
    model = _net()
    path = str(tmp_path / "trt.onnx")
    res = export_onnx(model, _sample(), path, dynamo=False, target="tensorrt")
    assert res.verified
    inits = _init(path)
    for n in _nodes(path, "QuantizeLinear") + _nodes(path, "DequantizeLinear"):
        zp = inits[n.input[2]]
        if zp.dtype == np.int32:  # none expected: TensorRT takes float bias
            raise AssertionError("int32 bias in a TensorRT export")
        assert zp.dtype == np.int8 and not zp.any()
    # weights as float + Q -> DQ (TensorRT's explicit quantization)
    assert any(n.input[0] in inits and inits[n.input[0]].dtype == np.float32 and inits[n.input[0]].ndim == 4
               for n in _nodes(path, "QuantizeLinear"))


# =========================================================================== errors
def test_uncalibrated_quantizer_is_named(tmp_path):
    model = _net()
    model.block.conv2._input_quantizer.amax = None
    before = copy.deepcopy(model.state_dict())
    path = tmp_path / "bad.onnx"
    with pytest.raises(ExportError, match=r"block\.conv2\._input_quantizer"):
        export_onnx(model, _sample(), path, speed_check=False)
    assert not path.exists()
    assert before.keys() == model.state_dict().keys()


def test_verification_failure_names_diff_and_tolerance(tmp_path):
    model = _net()
    path = tmp_path / "model.onnx"
    path.write_bytes(b"previous export")
    with pytest.raises(VerificationError, match=r"max abs diff .* tolerance 1e-12"):
        export_onnx(model, _sample() * 3, path, dynamo=False, atol=1e-12, speed_check=False)
    assert path.read_bytes() == b"previous export"  # never overwritten on failure
    assert (tmp_path / "model.unverified.onnx").exists()


def test_refuses_checkpoint_paths(tmp_path):
    with pytest.raises(ValueError, match="checkpoint"):
        export_onnx(_net(), _sample(), tmp_path / "last.ckpt", speed_check=False)
    with pytest.raises(ValueError, match="opset"):
        export_onnx(_net(), _sample(), tmp_path / "x.onnx", opset=11, speed_check=False)


def test_fp8_needs_opset_19_and_exports_float8_qdq(tmp_path):
    fp8 = QuantDescriptor(num_bits=(4, 3))
    torch.manual_seed(0)
    model = nn.Sequential(qnn.QuantConv2d(3, 4, 3, quant_desc_input=fp8,
                                          quant_desc_weight=QuantDescriptor(num_bits=(4, 3), axis=0)),
                          nn.ReLU())
    from lq.calibration import calibrate_model

    model.eval()
    calibrate_model(model, [torch.randn(8, 3, 8, 8)])
    with pytest.raises(ExportError, match=r"'0\._input_quantizer' is FP8 .*opset >= 19"):
        export_onnx(model, _sample(), tmp_path / "fp8_17.onnx", opset=17, dynamo=False, speed_check=False)
    path = str(tmp_path / "fp8.onnx")
    res = export_onnx(model, _sample(), path, opset=19, dynamo=False, speed_check=False)
    inits = {i.name: i for i in onnx.load(path).graph.initializer}
    f8 = onnx.TensorProto.FLOAT8E4M3FN
    q = _nodes(path, "QuantizeLinear")
    assert q and all(inits[n.input[2]].data_type == f8 for n in q)
    amax = float(model[0]._input_quantizer.amax)
    np.testing.assert_allclose(numpy_helper.to_array(inits[q[0].input[1]]), amax / 448, rtol=1e-6)
    assert any(inits[n.input[0]].data_type == f8 for n in _nodes(path, "DequantizeLinear") if n.input[0] in inits)
    # onnxruntime runs FP8 Q/DQ on CPU: the result matches PyTorch's scaled_e4m3 fake quantization
    assert res.verified


def test_dynamic_block_quant_activation_is_refused_weights_are_blocked(tmp_path):
    from lq.calibration import calibrate_model

    blk = QuantDescriptor(num_bits=4, block_sizes={-1: 16, "type": "dynamic"})
    model = nn.Sequential(qnn.QuantLinear(32, 8, quant_desc_input=blk))
    model.eval()
    calibrate_model(model, [torch.randn(8, 32)])
    with pytest.raises(ExportError, match=r"'0\._input_quantizer' uses dynamic block quantization"):
        export_onnx(model, torch.randn(4, 32), tmp_path / "blk.onnx", opset=21, dynamo=False, speed_check=False)
    model = nn.Sequential(qnn.QuantLinear(32, 8, quant_desc_weight=blk))
    model.eval()
    calibrate_model(model, [torch.randn(8, 32)])
    with pytest.raises(ExportError, match=r"opset >= 21"):
        export_onnx(model, torch.randn(4, 32), tmp_path / "blk19.onnx", opset=19, dynamo=False, speed_check=False)
    path = str(tmp_path / "blk21.onnx")
    res = export_onnx(model, torch.randn(4, 32), path, opset=21, dynamo=False, check_fusion=False, target="tensorrt")
    dq = [n for n in _nodes(path, "DequantizeLinear") if _attr(n, "block_size")]
    assert len(dq) == 1 and _attr(dq[0], "block_size") == 16
    assert res.verified


def test_tensor_read_by_two_quantizers_still_fuses_exactly(tmp_path):
    # the stem's ReLU output feeds block.conv1 (unsigned quantizer) and the residual add (signed, shared amax):
    # the stem conv is computed once per quantizer so each copy fuses, and numerics stay exact
    torch.manual_seed(0)
    model = SmallNet()
    _randomize_bn(model)
    model = _quantized(model, overrides={"block.conv1": {"input": {"num_bits": 8, "unsigned": True}}})
    path = str(tmp_path / "shared.onnx")
    res = export_onnx(model, _sample(), path, dynamo=False, speed_check=False)
    assert res.max_abs_diff <= 1e-3 * max(1.0, float(np.abs(_ref(model, _sample())).max()))
    ops = optimized_op_counts(path)
    assert ops["QLinearConv"] == 4 and ops.get("Conv", 0) == 0 and ops.get("FusedConv", 0) == 0
    assert not [w for w in res.warnings if "float" in w]


def test_dynamic_amax_quantizer_exports_with_computed_scale(tmp_path):
    dyn = QuantDescriptor(num_bits=8, dynamic=True)
    model = nn.Sequential(qnn.QuantConv2d(3, 4, 3, quant_desc_input=dyn, quant_desc_weight=QuantDescriptor(
        num_bits=8, axis=0, amax=[0.5, 0.6, 0.7, 0.8]))).eval()
    x = torch.randn(4, 3, 8, 8)
    res = export_onnx(model, x, tmp_path / "dyn.onnx", dynamo=False, speed_check=False)
    assert res.max_abs_diff <= 1e-5
    assert {"ReduceMax", "QuantizeLinear"} <= {n.op_type for n in onnx.load(tmp_path / "dyn.onnx").graph.node}


@pytest.mark.parametrize("dynamo", [False, True])
def test_static_block_weights_export_as_blocked_dequantize(tmp_path, dynamo):
    from lq.calibration import calibrate_model

    blk = QuantDescriptor(num_bits=8, block_sizes={-1: 16, "type": "static"})
    model = nn.Sequential(qnn.QuantLinear(32, 8, quant_desc_weight=blk)).eval()
    calibrate_model(model, [torch.randn(8, 32)])
    path = str(tmp_path / "static_blk.onnx")
    res = export_onnx(model, torch.randn(4, 32), path, opset=21, dynamo=dynamo, check_fusion=False)
    assert res.max_abs_diff <= 1e-5  # for onnxruntime: its block kernel (tests/test_int4_export.py)
    (mm,) = _nodes(path, "MatMulNBits")
    assert _attr(mm, "block_size") == 16 and _attr(mm, "bits") == 8
    res = export_onnx(model, torch.randn(4, 32), path, opset=21, dynamo=dynamo, check_fusion=False, target="tensorrt")
    assert res.max_abs_diff <= 1e-5
    (dq,) = [n for n in _nodes(path, "DequantizeLinear") if _attr(n, "block_size")]
    inits = _init(path)
    assert inits[dq.input[0]].shape == (8, 32) and inits[dq.input[0]].dtype == np.int8
    assert inits[dq.input[1]].shape == (8, 2) and _attr(dq, "axis") == 1 and _attr(dq, "block_size") == 16


# =========================================================================== shapes
def _pnet():
    """A fully convolutional face-proposal net shaped like MTCNN's PNet (PReLU, ceil-mode max pool)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 10, 3), nn.PReLU(10), nn.MaxPool2d(2, 2, ceil_mode=True), nn.Conv2d(10, 16, 3),
                      nn.PReLU(16), nn.Conv2d(16, 32, 3), nn.PReLU(32), nn.Conv2d(32, 2, 1))
    with torch.no_grad():
        for p in m.modules():
            if isinstance(p, nn.PReLU):
                p.weight.copy_(torch.linspace(-0.3, 0.5, p.weight.numel()))
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model

    quantize_model(m, quant_desc_input=QuantDescriptor())
    m.eval()
    with torch.no_grad():
        calibrate_model(m, [torch.randn(4, 3, 24, 24) for _ in range(2)], method="max")
    return m


@pytest.mark.parametrize("dynamo", [True, False])
def test_dynamic_spatial_dims_run_on_other_sizes(tmp_path, dynamo):
    model = _pnet()
    path = str(tmp_path / "pnet.onnx")
    res = export_onnx(model, torch.randn(2, 3, 24, 24), path, dynamo=dynamo, dynamic_spatial=True, speed_check=False)
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert [d if isinstance(d, int) else "sym" for d in s.get_inputs()[0].shape] == ["sym", 3, "sym", "sym"]
    for hw in ((24, 24), (37, 51), (12, 16)):
        x = torch.randn(3, 3, *hw)
        out, ref = _run(path, x), _ref(model, x)
        assert out.shape == ref.shape
        # no int32 bias where a conv stays float (its output feeds PReLU): equal up to a rare rounding flip
        assert np.abs(out - ref).max() <= 0.01 * np.abs(ref).max()
    assert res.max_abs_diff <= 1e-5


def test_static_spatial_by_default_and_a_clear_error_for_fixed_size_models(tmp_path):
    path = str(tmp_path / "pnet_static.onnx")
    export_onnx(_pnet(), torch.randn(2, 3, 24, 24), path, speed_check=False)
    assert ort.InferenceSession(path, providers=["CPUExecutionProvider"]).get_inputs()[0].shape[2:] == [24, 24]
    with pytest.raises(ExportError, match="fixes its spatial size.*dynamic_spatial=False"):
        export_onnx(_net(), _sample(), tmp_path / "fixed.onnx", dynamic_spatial=True, speed_check=False)


def test_channels_last_sample_exports(tmp_path):
    # what F.interpolate returns for a channels_last input, and what many data pipelines hand over
    model = _pnet()
    x = torch.nn.functional.interpolate(torch.randn(2, 3, 48, 48).contiguous(memory_format=torch.channels_last),
                                        scale_factor=0.5)
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    path = str(tmp_path / "cl.onnx")
    res = export_onnx(model, x, path, speed_check=False)
    assert res.max_abs_diff <= 1e-5
    assert np.abs(_run(path, x.contiguous()) - _ref(model, x)).max() <= 1e-5


# =========================================================================== verification messages
def test_nan_in_the_sample_or_the_model_is_named(tmp_path):
    model = _net()
    x = _sample()
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(VerificationError, match=r"sample input holds NaN/Inf \(input: 1 NaN, 0 Inf of 1152\)"):
        export_onnx(model, x, tmp_path / "nan_in.onnx", dynamo=False, speed_check=False)
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    with pytest.raises(ExportError, match=r"'head\._weight_quantizer' holds NaN/Inf \(1 of 640 values\).*not finite"):
        export_onnx(model, _sample(), tmp_path / "nan_w.onnx", dynamo=False, speed_check=False)
    assert not (tmp_path / "nan_w.onnx").exists()


def test_a_barely_trained_model_is_judged_in_its_output_steps(tmp_path):
    """A barely trained model's outputs are a few quantization steps, so verification counts in steps, not in a
    fraction of max|output|: the last Linear's input scale times its largest weight row norm (every input one
    step off moves an output by about that)."""
    from lq.export.verify._verify import output_step

    torch.manual_seed(0)
    model = _quantized(nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4)))
    with torch.no_grad():
        model[1].weight.mul_(1e-3)  # outputs of ~1e-3: 5% of them is far below a step
        model[1].bias.zero_()
    from lq.calibration import calibrate_model

    calibrate_model(model, [torch.randn(16, 3, 8, 8)], method="max")
    path = str(tmp_path / "tiny.onnx")
    res = export_onnx(model, _sample(), path, dynamo=False, speed_check=False)
    lin = model[1]
    with torch.no_grad():
        wq = lin._weight_quantizer(lin.weight).double()
    step = float(lin._input_quantizer.amax) / 127 * float(wq.pow(2).sum(1).sqrt().max())
    assert output_step(onnx.load(path)) == pytest.approx(step, rel=1e-5)
    (c,) = res.output_checks
    assert res.tolerance is None and c.step == pytest.approx(step, rel=1e-5) and c.from_graph
    assert c.elements == 6 * 4 and c.rows == 6 and c.beyond_far == 0 and c.max_steps < 1


def test_only_nearest_resize_lets_a_quantizer_move_across_it():
    """Nearest upsampling picks existing values (a grid maps onto itself); linear interpolation does not."""
    from onnx import helper

    from lq.rules import commutes

    assert commutes("Resize", helper.make_node("Resize", ["x", "", "s"], ["y"], mode="nearest"))
    assert commutes("Resize", helper.make_node("Resize", ["x", "", "s"], ["y"]))  # the default mode
    assert not commutes("Resize", helper.make_node("Resize", ["x", "", "s"], ["y"], mode="linear"))
    assert not commutes("Resize")  # no node: unknown mode


def test_a_mean_exports_at_a_requested_opset_17_without_a_warning(tmp_path):
    """``x.mean(-1)`` exports as ReduceMean with ``noop_with_empty_axes`` at opset 18; onnx's version converter
    keeps that attribute on the way to 17, where ReduceMean has none. The export drops it (it is the default), so
    the file is opset 17 as asked, with no warning, and still equals PyTorch. (A mean over both spatial axes is a
    global average pool in the file: not a ReduceMean.)"""
    class MeanNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(14, 4)

        def forward(self, x):
            return self.fc(self.c(x).mean(-1))

    x = torch.randn(4, 3, 16, 16)
    model = MeanNet().eval()
    quantize_model(model, quant_desc_input=QuantDescriptor())
    with torch.no_grad():
        calibrate_model(model, [x], method="max")
    res = export_onnx(model, x, str(tmp_path / "m.onnx"), opset=17, speed_check=False)
    assert res.opset == 17 and not [w for w in res.warnings if "opset" in w], res.warnings
    m = onnx.load(res.path)
    assert [o.version for o in m.opset_import if o.domain in ("", "ai.onnx")] == [17]
    means = [n for n in m.graph.node if n.op_type == "ReduceMean"]
    assert means and not [a.name for mean in means for a in mean.attribute if a.name == "noop_with_empty_axes"]
    onnx.checker.check_model(m)
    assert res.verified


def _calibrated_encoder():
    """A quantized, max-calibrated TransformerEncoderLayer + head and its sample."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), nn.Linear(32, 5)).eval()
    x = torch.randn(4, 7, 32)
    quantize_model(model, quant_desc_input=QuantDescriptor())
    with torch.no_grad():
        calibrate_model(model, [x], method="max")
    return model, x


@pytest.mark.parametrize("dynamo, native", [(True, 18), (False, 17)])
def test_no_opset_asked_gives_the_exporters_own_and_no_opset_warning(tmp_path, dynamo, native):
    """A user who names no opset gets the one the exporter writes, unconverted, and no word about opsets. A
    TransformerEncoderLayer is a graph onnx's version converter cannot take from 18 to 17: with a default of 17
    every such export warned that a conversion nobody asked for had failed."""
    model, x = _calibrated_encoder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = export_onnx(model, x, str(tmp_path / "t.onnx"), dynamo=dynamo, speed_check=False)
    assert res.opset == native
    assert [o.version for o in onnx.load(res.path).opset_import if o.domain in ("", "ai.onnx")] == [native]
    said = [w for w in res.warnings + [str(w.message) for w in caught] if "requested opset" in w]
    assert not said, said


def test_an_asked_opset_that_cannot_be_reached_is_said(tmp_path):
    """The warning stays for what the user asked for: opset 17 from the current exporter on that graph."""
    model, x = _calibrated_encoder()
    res = export_onnx(model, x, str(tmp_path / "t.onnx"), opset=17, speed_check=False)
    assert res.opset == 18 and any("requested opset 17" in w for w in res.warnings), res.warnings


def test_the_default_opset_covers_what_the_quantizers_need():
    from lq.export.prepare._model_checks import model_min_opset
    from lq.export.prepare._inputs import choose_opset
    from lq.tensor_quant import QuantDescriptor

    fp8 = nn.Sequential(qnn.QuantLinear(8, 8, quant_desc_input=QuantDescriptor(num_bits=(4, 3))))
    blocks = nn.Sequential(qnn.QuantLinear(64, 8, quant_desc_weight=QuantDescriptor(
        num_bits=4, block_sizes={-1: 32, "type": "static"})))
    plain = nn.Sequential(qnn.QuantLinear(8, 8))
    assert [model_min_opset(m) for m in (plain, fp8, blocks)] == [13, 19, 21]
    assert choose_opset(None, 13, "dynamo") == 18 and choose_opset(None, 13, "legacy") == 17
    assert choose_opset(None, 19, "legacy") == 19 and choose_opset(None, 21, "dynamo") == 21
    assert choose_opset(15, 13, "dynamo") == 15  # asked for: kept (converted to, or said)
