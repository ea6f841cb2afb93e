"""lq.enable_onnx_export(): quantized models through a plain torch.onnx.export (default exporter), as in the
reference toolkit, and the export-mode numerics (lq.nn.modules._export_mode) against written-out references."""

from __future__ import annotations

import io

import onnx
import pytest
import torch
from torch import nn

import lq
from lq.nn import QuantLinear, TensorQuantizer
from lq.nn.modules import _export_mode
from lq.tensor_quant import QuantDescriptor

ort = pytest.importorskip("onnxruntime")

torch.set_flush_denormal(True)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# =========================================================================== numerics of the export mode
def _e4m3_reference(v: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value, saturating at ±448: PyTorch's own float8 cast after the saturation."""
    return torch.clamp(v, -448.0, 448.0).to(torch.float8_e4m3fn).float()


def test_round_to_e4m3_is_the_float8_cast_bit_for_bit():
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # ties: half to even
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    v = torch.cat([grid, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), rand(200_000) * 150,
                   rand(20_000, seed=1) * 2**-7, torch.tensor([0.0, 447.9, 448.0, 463.9, 464.0, 465.0, 1e30, -1e30,
                                                           float("inf"), -float("inf")])])
    assert torch.equal(_export_mode.round_to_e4m3(v), _e4m3_reference(v))
    assert torch.isnan(_export_mode.round_to_e4m3(torch.tensor([float("nan")]))).all()


def test_scaled_e4m3_matches_lq():
    x = rand(64, 16) * 3
    for amax in (torch.tensor(2.5), torch.tensor(0.0), rand(64, 1).abs() + 0.1):
        assert torch.equal(_export_mode.scaled_e4m3(x, amax), lq.tensor_quant.scaled_e4m3(x, amax))


@pytest.mark.parametrize("narrow_range", [False, True])
@pytest.mark.parametrize("unsigned", [False, True])
def test_fake_int_quant_is_pytorch_fake_quantize_with_the_grid(narrow_range, unsigned):
    """Narrow range is exact as a clip: same result as PyTorch's fake quantize on [-127, 127]."""
    x = rand(32, 6) * 2
    x = x.abs() if unsigned else x
    bound = 255 if unsigned else 127
    low = 0 if unsigned else (-127 if narrow_range else -128)
    amax = torch.tensor(1.5)
    out = _export_mode.fake_int_quant(x, amax, 8, unsigned, narrow_range, None)
    assert torch.equal(out, torch.fake_quantize_per_tensor_affine(x, 1.5 / bound, 0, low, bound))
    per_channel = rand(6, seed=2).abs() + 0.5
    out = _export_mode.fake_int_quant(x, per_channel.reshape(1, 6), 8, unsigned, narrow_range, 1)
    ref = torch.fake_quantize_per_channel_affine(x, per_channel / bound, torch.zeros(6, dtype=torch.int32), 1, low,
                                                 bound)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_int_quant_low_precision_in_float32(dtype):
    x = (rand(8, 8) * 2).to(dtype)
    out = _export_mode.fake_int_quant(x, torch.tensor(1.0), 8, False, False, None)
    assert out.dtype == dtype
    assert torch.equal(out, torch.fake_quantize_per_tensor_affine(x.float(), 1.0 / 127, 0, -128, 127).to(dtype))


# =========================================================================== end to end: torch.onnx.export
class _Net(nn.Module):
    def __init__(self, desc_in, desc_w):
        super().__init__()
        self.fc1 = QuantLinear(16, 24, quant_desc_input=desc_in, quant_desc_weight=desc_w)
        self.fc2 = QuantLinear(24, 8, quant_desc_input=desc_in, quant_desc_weight=desc_w)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _calibrated(desc_in, desc_w, x):
    torch.manual_seed(0)
    net = _Net(desc_in, desc_w).eval()
    quantizers = [m for m in net.modules() if isinstance(m, TensorQuantizer)]
    for q in quantizers:
        q.disable_quant()
        q.enable_calib()
    net(x)
    for q in quantizers:
        q.load_calib_amax()
        q.disable_calib()
        q.enable_quant()
    return net


def _export(net, x) -> bytes:
    f = io.BytesIO()
    with lq.enable_onnx_export():
        torch.onnx.export(net, (x,), f, opset_version=17, input_names=["x"], output_names=["y"])
    model = onnx.load_from_string(f.getvalue())
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 17
    return f.getvalue()


def _run(blob: bytes, x: torch.Tensor) -> torch.Tensor:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the graph as written
    sess = ort.InferenceSession(blob, opts, providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, {"x": x.numpy()})[0])


def test_int8_narrow_range_exports_as_qdq_and_runs():
    x = rand(32, 16)
    net = _calibrated(QuantDescriptor(narrow_range=True), QuantDescriptor(axis=0, narrow_range=True), x)
    wide = 3 * rand(32, 16, seed=5)  # beyond the calibrated range: narrow vs full grid shows on the low end
    with lq.enable_onnx_export(), torch.no_grad():
        expect = net(wide)  # the export-mode numerics (PyTorch's fake quantize)
    assert TensorQuantizer.use_fb_fake_quant is False
    blob = _export(net, x)
    ops = [n.op_type for n in onnx.load_from_string(blob).graph.node]
    assert ops.count("QuantizeLinear") == 4 and ops.count("DequantizeLinear") == 4
    torch.testing.assert_close(_run(blob, wide), expect, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # and the export mode computes what lq computes
        torch.testing.assert_close(expect, net(wide), atol=1e-5, rtol=1e-5)
        amax = net.fc1.input_quantizer.amax
        low_end = (wide < -amax).any()
    assert low_end


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_exports_at_opset_17_and_matches_lq(dtype):
    """FP8 E4M3 quantizers export as exact elementwise arithmetic, valid at any opset."""
    x = rand(32, 16)
    fp8 = QuantDescriptor(num_bits=(4, 3))
    net = _calibrated(fp8, fp8, x).to(dtype)
    x = x.to(dtype)
    blob = _export(net, x)
    with torch.no_grad():
        expect = net(x)  # lq's own scaled_e4m3 kernels
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(_run(blob, x), expect, atol=tol, rtol=tol)


def test_uncalibrated_quantizer_is_refused_by_name():
    net = _Net(QuantDescriptor(), QuantDescriptor(axis=0))
    net.fc2.input_quantizer.name = "fc2.input_quantizer"
    net.fc1.input_quantizer.amax = 1.0
    net.fc1.weight_quantizer.amax = net.fc1.weight.detach().abs().amax(dim=1, keepdim=True)
    net.fc2.weight_quantizer.amax = net.fc2.weight.detach().abs().amax(dim=1, keepdim=True)
    with lq.enable_onnx_export(), pytest.raises(RuntimeError, match="fc2.input_quantizer: no amax to export"):
        net(rand(2, 16))
    dynamic = _Net(QuantDescriptor(dynamic=True), QuantDescriptor(axis=0, dynamic=True))
    with lq.enable_onnx_export():
        assert dynamic(rand(2, 16)).shape == (2, 8)  # dynamic quantizers need no amax


def test_top_level_names_of_the_reference_package():
    assert lq.enable_onnx_export is lq.quant_modules.enable_onnx_export
    assert lq.initialize is lq.quant_modules.initialize and lq.deactivate is lq.quant_modules.deactivate
