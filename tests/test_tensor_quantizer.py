"""TensorQuantizer: numerics per mode, calibration, state_dict, learned amax, export, errors."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
from _limits import HANG_GUARD_S
import torch
from torch import nn

from lq import calib
from lq import tensor_quant as tq
from lq.nn.modules.clip import Clip
from lq.nn.modules.tensor_quantizer import (
    AmaxShapeError,
    TensorQuantizer,
    iter_quantizers,
    load_calib_amax,
    name_quantizers,
    quantizers_without_data,
    uncalibrated_quantizers,
)
from lq.tensor_quant import QuantDescriptor

torch.set_flush_denormal(True)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def calibrated(desc, *batches, method=None, **kw):
    q = TensorQuantizer(desc)
    q.disable_quant()
    q.enable_calib()
    for b in batches:
        assert torch.equal(q(b), b)  # calibration alone never changes the data
    q.load_calib_amax(method, **kw)
    q.disable_calib()
    q.enable_quant()
    return q


# ====================================================================== numerics per mode
def test_documented_example_through_quantizer():
    torch.manual_seed(12345)
    x = torch.rand(10)
    q = TensorQuantizer(QuantDescriptor(num_bits=8, fake_quant=False, narrow_range=True))
    out = q(x)
    assert out.tolist() == [126, 113, 127, 59, 11, 23, 47, 73, 43, 27]
    assert float(q.scale) == pytest.approx(128.0057, abs=1e-4)


def test_per_tensor_static_and_dynamic():
    x = rand(4, 8)
    q = TensorQuantizer(QuantDescriptor(amax=2.0))
    assert torch.equal(q(x), tq.fake_tensor_quant(x, torch.tensor(2.0), 8, False, False))
    d = TensorQuantizer(QuantDescriptor())
    assert d.amax is None
    assert torch.equal(d(x), tq.fake_tensor_quant(x, x.abs().amax(), 8, False, False))


@pytest.mark.parametrize("axis,dims", [(0, (1, 2)), (1, (0, 2)), (-1, (0, 1)), ((0, 2), (1,))])
def test_per_channel_dynamic_and_calibrated(axis, dims):
    x = rand(3, 5, 4)
    q = TensorQuantizer(QuantDescriptor(num_bits=6, axis=axis))
    amax = x.abs().amax(dim=dims, keepdim=True)
    assert torch.equal(q(x), tq.fake_tensor_quant(x, amax, 6, False, False))
    c = calibrated(QuantDescriptor(num_bits=6, axis=axis), x, x * 0.5)
    assert torch.equal(c.amax, amax)
    y = rand(3, 5, 4, seed=1)
    assert torch.equal(c(y), tq.fake_tensor_quant(y, amax, 6, False, False))


def test_descriptor_amax_list_per_channel():
    x = rand(3, 4)
    q = TensorQuantizer(QuantDescriptor(axis=0, amax=[1.0, 2.0, 3.0]))
    expect = tq.fake_tensor_quant(x, torch.tensor([[1.0], [2.0], [3.0]]), 8, False, False)
    assert torch.equal(q(x), expect)


def test_unsigned_and_narrow_range():
    x = rand(64).abs()
    q = TensorQuantizer(QuantDescriptor(unsigned=True, amax=1.5))
    assert torch.equal(q(x), tq.fake_tensor_quant(x, torch.tensor(1.5), 8, True, False))
    with pytest.raises(ValueError, match="unsigned"):
        q(-x)
    big = torch.tensor([-3.0, 3.0])
    wide = TensorQuantizer(QuantDescriptor(amax=1.0))
    narrow = TensorQuantizer(QuantDescriptor(amax=1.0, narrow_range=True))
    assert wide(big)[0] == pytest.approx(-128 / 127)
    assert narrow(big)[0] == -1.0


def test_fp8():
    x = rand(32) * 3
    q = TensorQuantizer(QuantDescriptor(num_bits=(4, 3), amax=2.5))
    assert torch.equal(q(x), tq.scaled_e4m3(x, torch.tensor(2.5)))
    assert q.maxbound == 448.0
    d = TensorQuantizer(QuantDescriptor(num_bits=(4, 3)))
    assert torch.equal(d(x), tq.scaled_e4m3(x, x.abs().amax()))
    assert "fp8" in repr(q)


def test_block_dynamic_and_static():
    x = rand(4, 64)
    bs = {-1: 16}
    dyn = TensorQuantizer(QuantDescriptor(num_bits=4, block_sizes=dict(bs, type="dynamic")))
    assert torch.equal(dyn(x), tq.fake_block_quant(x, bs, 4, narrow_range=False))
    st = calibrated(QuantDescriptor(num_bits=4, block_sizes=bs), x)
    assert st.amax.shape == (4, 4)
    assert torch.equal(st.amax, tq.block_amax(x, bs))
    y = rand(4, 64, seed=3)
    assert torch.equal(st(y), tq.fake_block_quant(y, bs, 4, amax=st.amax, narrow_range=False))
    fp8 = TensorQuantizer(QuantDescriptor(num_bits=(4, 3), block_sizes=dict(bs, type="dynamic")))
    assert torch.equal(fp8(x), tq.fake_block_quant(x, bs, (4, 3)))
    with pytest.raises(ValueError, match="divide"):
        dyn(rand(4, 60))
    with pytest.raises(ValueError, match="static block"):
        TensorQuantizer(QuantDescriptor(block_sizes=bs, calib_method="histogram"))


def test_real_quant_scale_amax_and_dynamic_flag():
    x = rand(16)
    q = TensorQuantizer(QuantDescriptor(fake_quant=False, amax=2.0))
    out = q(x)
    assert torch.equal(out, tq.tensor_quant(x, torch.tensor(2.0), 8, False, False)[0])
    assert float(q.scale) == pytest.approx(127 / 2.0)
    s = TensorQuantizer(QuantDescriptor(amax=2.0, scale_amax=0.5))
    assert torch.equal(s(x), tq.fake_tensor_quant(x, torch.tensor(1.0), 8, False, False))
    dyn = TensorQuantizer(QuantDescriptor(amax=100.0, dynamic=True))
    assert torch.equal(dyn(x), tq.fake_tensor_quant(x, x.abs().amax(), 8, False, False))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_keep_dtype(dtype):
    x = rand(8, 4).to(dtype)
    q = TensorQuantizer(QuantDescriptor(axis=1))
    out = q(x)
    assert out.dtype == dtype
    c = calibrated(QuantDescriptor(axis=1), x)
    assert c.amax.dtype == torch.float32


def test_switches_and_repr():
    x = rand(8)
    q = TensorQuantizer(QuantDescriptor(amax=1.0))
    q.disable()
    assert q(x) is x and not q.is_enabled and repr(q).endswith("(disabled)")
    q.enable()
    q.disable_quant()
    assert torch.equal(q(x), x)
    q.enable_quant()
    r = repr(q)
    assert "8bit" in r and "per-tensor" in r and "amax=1.0000" in r and "quant" in r
    pc = calibrated(QuantDescriptor(axis=0), rand(3, 4))
    assert "axis=0" in repr(pc) and "](3)" in repr(pc)
    assert "dynamic" in repr(TensorQuantizer(QuantDescriptor()))
    learned = TensorQuantizer(QuantDescriptor(amax=1.0, learn_amax=True))
    assert "learned" in repr(learned) and "clip" in repr(learned)
    with pytest.raises(ValueError, match="learn_amax is False"):
        q.enable_clip()
    assert q.num_bits == 8 and q.maxbound == 127 and q.axis is None and q.fake_quant
    assert float(q.step_size) == pytest.approx(1 / 127)
    assert TensorQuantizer(QuantDescriptor(unsigned=True)).maxbound == 255


# ====================================================================== amax set / validation
def test_amax_setter_validates():
    q = TensorQuantizer(QuantDescriptor(axis=0))
    q.amax = [[1.0], [2.0]]
    assert q.amax.dtype == torch.float32 and q.amax.shape == (2, 1)
    with pytest.raises(AmaxShapeError, match=r"\(2, 1\).*\(3, 1\)"):
        q.amax = [[1.0], [2.0], [3.0]]
    with pytest.raises(TypeError):  # also a TypeError, like the reference toolkit
        q.amax = [[1.0], [2.0], [3.0]]
    with pytest.raises(ValueError, match="finite"):
        q.amax = [[float("nan")], [1.0]]
    with pytest.raises(ValueError, match=">= 0"):
        q.amax = [[-1.0], [1.0]]
    q.amax = None
    assert q.amax is None
    with pytest.raises(TypeError, match="QuantDescriptor"):
        TensorQuantizer({"num_bits": 8})


# ====================================================================== calibration through the quantizer
@pytest.mark.parametrize("method,kw", [(None, {}), ("entropy", {}), ("mse", {}), ("percentile", {"percentile": 99.9})])
def test_same_load_call_for_every_calibrator(method, kw):
    x = rand(4000, seed=5)
    for calib_method in ("max", "histogram"):
        desc = QuantDescriptor(calib_method=calib_method)
        if calib_method == "histogram" and method is None:
            with pytest.raises(ValueError, match="needs a method"):
                calibrated(desc, x, method=method, **kw)
            continue
        q = calibrated(desc, x, method=method, **kw)
        cal = q.calibrator
        expect = cal.compute_amax(method, **kw)
        assert torch.equal(q.amax, expect)
        assert torch.equal(q(x), tq.fake_tensor_quant(x, expect, 8, False, False))
    for name in ("ema", "minmax"):
        q = TensorQuantizer(QuantDescriptor(), calibrator=name)
        q.enable_calib()
        q(x)
        q.load_calib_amax(method, **kw)
        assert q.amax is not None


def test_histogram_per_channel_via_quantizer():
    x = rand(6, 500, seed=2)
    q = calibrated(QuantDescriptor(axis=0, calib_method="histogram"), x, method="percentile", percentile=99.0)
    assert q.amax.shape == (6, 1)
    assert torch.equal(q(x), tq.fake_tensor_quant(x, q.amax, 8, False, False))


def test_no_data_is_reported_by_name(caplog):
    model = nn.Sequential(nn.Linear(3, 3))
    model[0].input_quantizer = TensorQuantizer(QuantDescriptor())
    model.add_module("unused", TensorQuantizer(QuantDescriptor()))
    for _, q in iter_quantizers(model):
        q.enable_calib()
    model[0].input_quantizer(torch.ones(2, 3))
    assert quantizers_without_data(model) == ["unused"]
    with pytest.raises(RuntimeError, match="unused"):
        load_calib_amax(model)
    with caplog.at_level(logging.WARNING):
        load_calib_amax(model, strict=False)
    assert "unused" in caplog.text
    assert uncalibrated_quantizers(model) == ["unused"]
    with pytest.raises(RuntimeError, match="unused.*saw no data"):
        model.unused.load_calib_amax()
    model.unused.load_calib_amax(strict=False)
    assert model.unused.amax is None


def test_all_zero_batch_calibrates_to_zero():
    q = calibrated(QuantDescriptor(calib_method="histogram"), torch.zeros(16), method="entropy")
    assert float(q.amax) == 0.0
    assert torch.equal(q(torch.ones(4)), torch.zeros(4))


def test_affine_minmax_quantizer():
    x = rand(256).abs() * 3 - 0.5  # asymmetric
    q = TensorQuantizer(QuantDescriptor(), calibrator="minmax")
    q.enable_calib()
    q(x)
    q.load_calib_amax()
    lo, hi = float(x.min()), float(x.max())
    assert float(q.min_range) == lo and float(q.max_range) == hi and q.is_affine
    assert torch.equal(q(x), tq.fake_affine_tensor_quant(x, torch.tensor(lo), torch.tensor(hi), 8))
    fresh = TensorQuantizer(QuantDescriptor())
    fresh.load_state_dict(q.state_dict())
    assert fresh.is_affine and torch.equal(fresh(x), q(x))
    with pytest.raises(ValueError, match="per tensor"):
        TensorQuantizer(QuantDescriptor(axis=0), calibrator="minmax")


# ====================================================================== state_dict
@pytest.mark.filterwarnings("ignore:for _amax. copying from a non-meta")
def test_state_dict_into_uncalibrated_quantizer():
    x = rand(4, 6)
    q = calibrated(QuantDescriptor(axis=1), x)
    sd = q.state_dict()
    assert set(sd) == {"_amax"} and sd["_amax"].dtype == torch.float32
    fresh = TensorQuantizer(QuantDescriptor(axis=1))
    assert "_amax" not in fresh.state_dict()
    fresh.load_state_dict(sd)
    assert fresh.amax.device.type == "cpu"
    assert torch.equal(fresh.amax, q.amax) and torch.equal(fresh(x), q(x))
    on_meta = TensorQuantizer(QuantDescriptor(axis=1)).to("meta")
    on_meta.load_state_dict(sd)
    assert on_meta.amax.device.type == "meta"  # created where the quantizer lives


def test_float_weights_into_a_calibrated_model_strict_and_not():
    """Pretrained FP32 weights (no quantizer keys) load into a calibrated quantized model with strict=False and
    keep its amax; strict=True names the missing amax."""
    x = rand(4, 6)
    model = nn.Sequential(nn.Identity())
    model.add_module("q", calibrated(QuantDescriptor(axis=1), x))
    amax = model.q.amax.clone()
    result = model.load_state_dict({}, strict=False)
    assert result.missing_keys == ["q._amax"] and torch.equal(model.q.amax, amax)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*q\._amax"):
        model.load_state_dict({})


def test_state_dict_shape_mismatch_names_quantizer_and_shapes():
    model = nn.Sequential(nn.Identity())
    model.add_module("q", TensorQuantizer(QuantDescriptor(axis=0)))
    model.q.amax = torch.ones(3, 1)
    other = nn.Sequential(nn.Identity())
    other.add_module("q", TensorQuantizer(QuantDescriptor(axis=0)))
    other.q.amax = torch.ones(4, 1)
    with pytest.raises(RuntimeError, match=r"q: amax in the checkpoint has shape \(4, 1\).*shape \(3, 1\)"):
        model.load_state_dict(other.state_dict())
    assert torch.equal(model.q.amax, torch.ones(3, 1))  # nothing half-loaded
    uncal = nn.Sequential(nn.Identity())
    uncal.add_module("q", TensorQuantizer(QuantDescriptor(axis=0)))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*q\._amax"):  # strict: the calibrated amax is missing
        model.load_state_dict(uncal.state_dict())
    bad = {"q._amax": torch.tensor([[float("nan")], [1.0], [1.0]])}
    with pytest.raises(RuntimeError, match="finite"):
        model.load_state_dict(bad)


def test_half_and_to_keep_amax_float32():
    m = nn.Sequential(nn.Linear(4, 4))
    m.add_module("q", TensorQuantizer(QuantDescriptor(amax=1.2345678)))
    m.half()
    assert m[0].weight.dtype == torch.float16
    assert m.q.amax.dtype == torch.float32 and float(m.q.amax) == pytest.approx(1.2345678, rel=1e-7)
    m.double()
    assert m.q.amax.dtype == torch.float32


def test_state_dict_new_process_identical_outputs(tmp_path):
    x = rand(8, 3, 5, 5)
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    model.add_module("wq", TensorQuantizer(QuantDescriptor(axis=0)))
    model.add_module("aq", TensorQuantizer(QuantDescriptor(calib_method="histogram")))
    torch.manual_seed(0)
    model.aq.enable_calib()
    model.aq.disable_quant()
    y = model[0](x)
    model.aq(y)
    model.aq.load_calib_amax("entropy")
    model.aq.enable_quant()
    model.aq.disable_calib()
    model.wq.amax = model[0].weight.detach().abs().amax(dim=(1, 2, 3), keepdim=True)
    expect = model.aq(nn.functional.conv2d(x, model.wq(model[0].weight), model[0].bias))
    torch.save({"state": model.state_dict(), "x": x}, tmp_path / "ckpt.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from torch import nn
        from lq.nn.modules.tensor_quantizer import TensorQuantizer
        from lq.tensor_quant import QuantDescriptor
        ck = torch.load({str(tmp_path / 'ckpt.pt')!r})
        model = nn.Sequential(nn.Conv2d(3, 4, 3))
        model.add_module("wq", TensorQuantizer(QuantDescriptor(axis=0)))
        model.add_module("aq", TensorQuantizer(QuantDescriptor(calib_method="histogram")))
        model.load_state_dict(ck["state"])
        x = ck["x"]
        out = model.aq(nn.functional.conv2d(x, model.wq(model[0].weight), model[0].bias))
        torch.save(out, {str(tmp_path / 'out.pt')!r})
        """
    )
    import lq

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not lq.extension_loaded():  # the child uses the same kernels as this process (and never tries a build)
        env["LQ_DISABLE_EXT"] = "1"
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=REPO, timeout=HANG_GUARD_S)
    assert torch.equal(torch.load(tmp_path / "out.pt"), expect)


# ====================================================================== learned amax
def test_learned_amax_gets_gradient_and_optimizer_moves_it():
    q = TensorQuantizer(QuantDescriptor(amax=1.0, learn_amax=True))
    assert isinstance(q.amax, nn.Parameter) and [n for n, _ in q.named_parameters()] == ["_amax"]
    x = torch.tensor([-3.0, -0.5, 0.25, 2.0], requires_grad=True)
    q(x).sum().backward()
    assert float(q.amax.grad) == 0.0  # sign(x) outside: -1 + 1
    q.amax.grad = None
    q(x.detach() * torch.tensor([0.1, 1.0, 1.0, 1.0])).sum().backward()
    assert float(q.amax.grad) == 1.0  # only 2.0 > amax
    opt = torch.optim.SGD(q.parameters(), lr=0.1)
    opt.step()
    assert float(q.amax.detach()) == pytest.approx(0.9)  # gradient descent on sum(out) lowers amax
    q.disable_clip()
    assert not q.amax.requires_grad
    q.enable_clip()
    # calibration then init_learn_amax starts learning from the calibrated value
    q.enable_calib()
    q(torch.tensor([0.5, -4.0]))
    q.load_calib_amax()
    q.init_learn_amax()
    assert float(q.amax.detach()) == 4.0 and q.amax.requires_grad
    sd = q.state_dict()
    fresh = TensorQuantizer(QuantDescriptor(learn_amax=True))
    fresh.load_state_dict(sd)
    assert float(fresh.amax.detach()) == 4.0


def test_clip_stage_without_quant_and_clip_module():
    q = TensorQuantizer(QuantDescriptor(amax=1.0, learn_amax=True))
    q.disable_quant()
    x = torch.tensor([-2.0, 0.5, 3.0])
    assert q(x).tolist() == [-1.0, 0.5, 1.0]
    c = Clip(-1.0, 1.0, learn_min=True, learn_max=True)
    c(x).sum().backward()
    assert float(c.clip_value_max.grad) == 1.0 and float(c.clip_value_min.grad) == 1.0


# ====================================================================== export / tracing
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.input_quantizer = TensorQuantizer(QuantDescriptor(calib_method="histogram"))
        self.weight_quantizer = TensorQuantizer(QuantDescriptor(axis=0))

    def forward(self, x):
        return nn.functional.linear(self.input_quantizer(x), self.weight_quantizer(self.fc.weight), self.fc.bias)


def _calibrated_net():
    torch.manual_seed(0)
    net = _Net()
    name_quantizers(net)
    x = rand(16, 8)
    for _, q in iter_quantizers(net):
        q.disable_quant()
        q.enable_calib()
    net(x)
    load_calib_amax(net, "percentile", percentile=99.9)
    for _, q in iter_quantizers(net):
        q.enable_quant()
        q.disable_calib()
    return net, x


def test_torch_export_calibrated_quantizers():
    net, x = _calibrated_net()
    ep = torch.export.export(net, (x,))
    assert torch.equal(ep.module()(x), net(x))
    y = rand(16, 8, seed=9)
    assert torch.equal(ep.module()(y), net(y))


def test_use_fb_fake_quant_export_mode():
    net, x = _calibrated_net()
    lq_out = net(x)
    TensorQuantizer.use_fb_fake_quant = True
    try:
        fb_out = net(x)
        q = net.weight_quantizer
        w = net.fc.weight.detach()
        ref = torch.fake_quantize_per_channel_affine(w, (q.amax / 127).flatten(), torch.zeros(6, dtype=torch.int32),
                                                     0, -128, 127)
        assert torch.equal(q(w), ref)
        ep = torch.export.export(net, (x,))
        ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert any("fake_quantize_per_tensor" in o for o in ops) and any("per_channel" in o for o in ops)
    finally:
        TensorQuantizer.use_fb_fake_quant = False
    torch.testing.assert_close(fb_out, lq_out, atol=1e-5, rtol=0)


def test_errors_are_clear():
    q = TensorQuantizer(QuantDescriptor(axis=3))
    with pytest.raises(ValueError, match="out of range"):
        q(rand(2, 3))
    with pytest.raises(ValueError, match="num_bits"):
        TensorQuantizer(QuantDescriptor(num_bits=1))
    with pytest.raises(TypeError, match="bool"):
        TensorQuantizer(QuantDescriptor(), disabled="yes")
    with pytest.raises(ValueError, match="calibrator"):
        TensorQuantizer(QuantDescriptor(), calibrator="kl")
    q = TensorQuantizer(QuantDescriptor())
    q.calibrator = None
    with pytest.raises(ValueError, match="no calibrator"):
        q.enable_calib()


# ====================================================================== learned amax: clip stage, clip view
def _ref_fake_quant(x, amax, num_bits=8, unsigned=False, narrow_range=False):
    """The fake-quantization formula written out: round(x * s) on the integer grid, then / s."""
    bound = 2 ** (num_bits - 1 + int(unsigned)) - 1
    low = 0 if unsigned else (-bound if narrow_range else -bound - 1)
    s = torch.tensor(float(bound)) / torch.as_tensor(amax, dtype=torch.float32)  # one division, as the reference
    return torch.clamp(torch.round(x.float() * s), low, bound) / s


def test_learned_amax_clips_before_quantizing():
    """The clip stage runs before quantization: nothing lands on -maxbound-1 (-2.0 -> -1.0, not -128/127)."""
    amax = 1.0
    q = TensorQuantizer(QuantDescriptor(amax=amax, learn_amax=True))  # narrow_range=False by default
    x = torch.tensor([-2.0, -1.0, -1.003, -0.4, 0.3, 0.9961, 1.5], requires_grad=True)
    out = q(x)
    assert out[0] == -1.0
    ref_x = x.detach().clone().requires_grad_(True)
    ref_amax = torch.tensor(amax, requires_grad=True)
    clipped = torch.clamp(ref_x, -ref_amax, ref_amax)  # the clip stage, with its PACT gradient for amax
    expect = _ref_fake_quant(clipped.detach(), amax)
    assert torch.equal(out.detach(), expect)
    grad = torch.linspace(0.5, 2.0, x.numel())
    out.backward(grad)
    clipped.backward(grad)  # quantization's STE passes the gradient of the clipped values through
    assert torch.equal(x.grad, ref_x.grad)
    assert torch.allclose(q.amax.grad, ref_amax.grad)
    # with the clip stage off the raw input is quantized on the descriptor's (wide) grid
    q.disable_clip()
    assert torch.equal(q(x.detach()), _ref_fake_quant(x.detach(), amax))
    assert q(x.detach())[0] == pytest.approx(-128 / 127)


@pytest.mark.parametrize("fake_quant", [True, False])
def test_learned_amax_clip_on_every_path(fake_quant):
    x = torch.tensor([-3.0, -0.5, 0.25, 2.0])
    q = TensorQuantizer(QuantDescriptor(amax=2.0, learn_amax=True, fake_quant=fake_quant))
    if fake_quant:
        expect = _ref_fake_quant(torch.clamp(x, -2.0, 2.0), 2.0)
    else:
        expect = torch.clamp(torch.round(torch.clamp(x, -2.0, 2.0) * (127 / 2.0)), -128, 127)
    assert torch.equal(q(x).detach(), expect)
    if fake_quant:  # the export-mode path (lq.enable_onnx_export) clips too
        TensorQuantizer.use_fb_fake_quant = True
        try:
            fb = q(x)
        finally:
            TensorQuantizer.use_fb_fake_quant = False
        ref = torch.fake_quantize_per_tensor_affine(torch.clamp(x, -2.0, 2.0), 2.0 / 127, 0, -128, 127)
        assert torch.equal(fb, ref) and fb[0] == -2.0


def test_clip_view_of_learned_amax():
    q = TensorQuantizer(QuantDescriptor(amax=0.75, learn_amax=True))
    assert q.clip.clip_value_max is q.amax  # the one learned amax: the optimizer and in-place updates reach it
    assert float(q.clip.clip_value_min) == -0.75
    assert [p is q.amax for p in q.clip.parameters()] == [True]
    x = torch.tensor([-1.0, 0.5, 2.0])
    assert torch.equal(q.clip(x).detach(), torch.clamp(x, -0.75, 0.75))
    with torch.no_grad():
        q.clip.clip_value_max.copy_(torch.tensor(0.5))
    assert float(q.amax) == 0.5 and float(q.clip.clip_value_min) == -0.5
    assert not hasattr(TensorQuantizer(QuantDescriptor(amax=1.0)), "clip")  # no clip stage without learn_amax
    assert [n for n, _ in q.named_parameters()] == ["_amax"]  # the view adds nothing to the state


# ====================================================================== pre_quant_scale
def test_pre_quant_scale_scales_before_quantizing():
    x = rand(3, 4)
    q = TensorQuantizer(QuantDescriptor(amax=2.0))
    assert q.pre_quant_scale is None and "_pre_quant_scale" not in q.state_dict()
    q.pre_quant_scale = 0.5
    assert torch.equal(q(x), _ref_fake_quant(x * 0.5, 2.0))
    per_channel = TensorQuantizer(QuantDescriptor(amax=2.0))
    s = [1.0, 2.0, 0.5, 3.0]
    per_channel.pre_quant_scale = s
    assert per_channel.pre_quant_scale.dtype == torch.float32
    assert torch.equal(per_channel(x), _ref_fake_quant(x * torch.tensor(s), 2.0))
    per_channel.pre_quant_scale = torch.tensor([1.0, 1.0, 1.0, 4.0])  # same shape: updated in place
    assert torch.equal(per_channel(x), _ref_fake_quant(x * torch.tensor([1.0, 1.0, 1.0, 4.0]), 2.0))
    # the scale is part of the model: a disabled quantizer (float model) still applies it
    per_channel.disable()
    assert torch.equal(per_channel(x), x * torch.tensor([1.0, 1.0, 1.0, 4.0]))
    # low-precision inputs keep their dtype
    xb = x.to(torch.bfloat16)
    assert q(xb).dtype == torch.bfloat16
    q.pre_quant_scale = None
    assert q.pre_quant_scale is None and torch.equal(q(x), _ref_fake_quant(x, 2.0))


def test_pre_quant_scale_errors_and_state():
    q = TensorQuantizer(QuantDescriptor(amax=1.0))
    q.pre_quant_scale = [1.0, 2.0]
    with pytest.raises(AmaxShapeError, match=r"pre_quant_scale shape from \(2,\) to \(3,\)"):
        q.pre_quant_scale = [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="pre_quant_scale must be finite"):
        q.pre_quant_scale = [1.0, float("inf")]
    assert q.pre_quant_scale.tolist() == [1.0, 2.0]
    sd = q.state_dict()
    assert set(sd) == {"_amax", "_pre_quant_scale"}
    fresh = TensorQuantizer(QuantDescriptor(amax=1.0))
    fresh.load_state_dict(sd)  # created on load, like an amax
    x = rand(5, 2)
    assert torch.equal(fresh(x), q(x))
    m = nn.Sequential(nn.Linear(2, 2))
    m.add_module("q", fresh)
    m.half()
    assert m.q.pre_quant_scale.dtype == torch.float32
    bad = TensorQuantizer(QuantDescriptor(amax=1.0))
    with pytest.raises(RuntimeError, match="pre_quant_scale in the checkpoint must be finite"):
        bad.load_state_dict({"_amax": torch.tensor(1.0), "_pre_quant_scale": torch.tensor([float("nan"), 1.0])})
    assert bad.pre_quant_scale is None  # nothing of the bad entry was loaded
    assert "pre_quant_scale=[1.0000, 2.0000](2)" in repr(q)


def test_invalid_amax_is_not_loaded_into_an_uncalibrated_quantizer():
    q = TensorQuantizer(QuantDescriptor())
    with pytest.raises(RuntimeError, match="amax in the checkpoint must be finite and >= 0"):
        q.load_state_dict({"_amax": torch.tensor(float("nan"))})
    assert q.amax is None


# ====================================================================== setters
def test_setters_change_the_grid_and_validate():
    x = rand(64)
    q = TensorQuantizer(QuantDescriptor(amax=1.5))
    q.num_bits = 5
    assert q.num_bits == 5 and q.maxbound == 15 and q.quant_desc.num_bits == 5
    assert torch.equal(q(x), _ref_fake_quant(x, 1.5, num_bits=5))
    q.narrow_range = True
    assert torch.equal(q(x), _ref_fake_quant(x, 1.5, num_bits=5, narrow_range=True))
    q.unsigned = True
    assert q.unsigned and q.maxbound == 31
    assert torch.equal(q(x.abs()), _ref_fake_quant(x.abs(), 1.5, num_bits=5, unsigned=True))
    with pytest.raises(ValueError, match="num_bits"):
        q.num_bits = 40
    with pytest.raises(TypeError, match="bool"):
        q.unsigned = "yes"
    assert q.num_bits == 5  # a rejected value changes nothing
    h = TensorQuantizer(QuantDescriptor(calib_method="histogram"))
    h.num_bits = 6
    assert isinstance(h.calibrator, calib.HistogramCalibrator) and h.calibrator._num_bits == 6


def test_no_data_message_names_the_cause():
    q = TensorQuantizer(QuantDescriptor())
    q.enable_calib()
    with pytest.raises(RuntimeError, match="Calibrator returned None.*saw no data"):
        q.load_calib_amax()
    # a quantizer a recipe turned off saw no data on purpose: nothing to load, amax stays as it was
    q.disable()
    q.load_calib_amax()
    assert q.amax is None and not q.is_enabled
    q.enable()
    with pytest.raises(RuntimeError, match="saw no data"):
        q.load_calib_amax()


def test_descriptor_amax_equals_the_quantizers_float32_amax():
    desc = QuantDescriptor(amax=[3.142, 2.718])
    q = TensorQuantizer(desc)
    q.load_state_dict(q.state_dict())
    assert q.amax.tolist() == desc.amax.tolist()  # the float32 values on both sides (3.142 is not a float32)
    assert desc.amax.tolist() == [float(torch.tensor(3.142, dtype=torch.float32)), float(torch.tensor(2.718))]
    assert QuantDescriptor(**desc.dict()) == desc
    with pytest.raises(ValueError, match="fit float32"):
        QuantDescriptor(amax=1e300)


@pytest.mark.parametrize("num_bits", [(5, 2), (7, 3)])
def test_unsupported_float_format_is_value_and_type_error(num_bits):
    for exc in (ValueError, TypeError):  # TypeError as the reference toolkit raises it
        with pytest.raises(exc, match=r"takes \(4, 3\)"):
            TensorQuantizer(QuantDescriptor(num_bits=num_bits))


def test_dynamic_amax_ignores_non_finite_values():
    """Uninitialized or corrupted data (an Inf, a NaN) does not make a dynamic scale infinite: amax comes from
    the finite values, the finite values quantize normally, Inf saturates and NaN stays NaN."""
    q = TensorQuantizer(QuantDescriptor(num_bits=8))
    x = torch.tensor([0.5, -1.0, 2.0, float("inf"), float("nan")])
    out = q(x)
    scale = 127 / 2.0
    want = torch.clamp(torch.round(x[:3] * scale), -127, 127) / scale
    assert torch.equal(out[:3], want) and out[3] == 2.0 and torch.isnan(out[4])
