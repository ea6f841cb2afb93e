"""``unsigned_after_relu``: input quantizers that only see a ReLU's output use the unsigned grid, found by
following the forwards (:mod:`lq.glue._nonneg`), and the export then has no ReLU left for onnxruntime.

The expected sets are written out per model by reading its forward; the numeric check quantizes by hand on
the unsigned grid ``[0, 255]`` with the calibrated amax.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lq.calibration import calibrate_model
from lq.config import Int8ReduceRangeConfig, QuantConfig
from lq.convert import quantize_model
from lq.export import export_onnx
from lq.tensor_quant import fake_tensor_quant
from lq.tensor_quant import QuantDescriptor

from _models import BNBlock

torch.set_flush_denormal(True)


class ResNet(nn.Module):
    """Stem in an nn.Sequential ending in ReLU, blocks whose input is the previous ReLU (across modules), a
    MaxPool in between, a functional pool, and a GELU branch that must stay signed."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.blocks = nn.Sequential(BNBlock(c), BNBlock(c))
        self.gelu_conv = nn.Conv2d(c, c, 1)
        self.side = nn.Conv2d(c, c, 1)
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        h = self.blocks(self.stem(x))
        g = self.side(F.gelu(self.gelu_conv(h)))  # side reads a GELU: may be negative
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)) + g.mean((2, 3)).sum(1, keepdim=True)


def _trained(m):
    m.train()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(8, 3, 16, 16))
    return m.eval()


def _unsigned(m):
    return sorted(n for n, q in m.named_modules() if getattr(q, "unsigned", False))


def test_quantizers_after_relu_are_unsigned_across_modules_and_pools():
    torch.manual_seed(0)
    m = _trained(ResNet())
    quantize_model(m, unsigned_after_relu=True, quant_desc_input=QuantDescriptor())
    # read from the forwards: the stem's MaxPool and the blocks' input are the stem's ReLU (through MaxPool,
    # across nn.Sequential and module boundaries), conv2 reads a ReLU, gelu_conv and the pool read the last block's ReLU, fc reads the
    # flattened pool of it; signed: the stem (the image), side (a GELU), the adds' own operands
    want = ["blocks.0.conv1._input_quantizer", "blocks.0.conv2._input_quantizer",
            "blocks.1.conv1._input_quantizer", "blocks.1.conv2._input_quantizer",
            "fc._input_quantizer", "gelu_conv._input_quantizer", "lq_glue.pool_0", "stem.3._input_quantizer"]
    assert _unsigned(m) == want
    x = torch.randn(16, 3, 16, 16)
    calibrate_model(m, [x[:8], x[8:]])
    blk = m.blocks[1]
    h = F.relu(torch.randn(4, 8, 8, 8))
    with torch.no_grad():  # conv1 of a block, by hand on the unsigned grid: 255 steps up to amax
        q = blk.conv1._input_quantizer
        assert q.unsigned and q.num_bits == 8
        xq = fake_tensor_quant(h, q.amax.detach(), 8, True, q.narrow_range)
        steps = xq / (q.amax / 255)
        assert float((steps - steps.round()).abs().max()) < 1e-3 and 0 <= float(steps.min())
        assert float(steps.max()) <= 255 and len(torch.unique(steps.round())) > 128  # more than a signed grid has
        want_out = blk.conv1._conv_forward(xq, blk.conv1._weight_quantizer(blk.conv1.weight), blk.conv1.bias)
        torch.testing.assert_close(blk.conv1(h), want_out, rtol=0, atol=0)


def test_a_layer_also_called_on_signed_values_stays_signed():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.conv(F.relu(x)) + self.conv(x)

    m = Twice().eval()
    quantize_model(m, unsigned_after_relu=True, quant_desc_input=QuantDescriptor())
    assert "conv._input_quantizer" not in _unsigned(m)


def test_every_positional_input_of_a_block_keeps_its_sign():
    """A U-Net decoder block ``forward(deep, skip)``: both are ReLU outputs, so the cat of the upsampled ``deep`` and
    ``skip`` is too, and the conv reading it quantizes on [0, 255]; a block given a signed ``skip`` stays signed.
    (On a signed grid there OpenVINO without VNNI computed the concat and the conv after it wrong: a U-Net's score
    maps 6-8% off in output steps with its kernels capped at AVX2.)"""

    class Up(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 4, 1)

        def forward(self, deep, skip):
            return self.conv(torch.cat([F.interpolate(deep, scale_factor=2, mode="nearest"), skip], 1))

    class Net(nn.Module):
        def __init__(self, skip_relu: bool):
            super().__init__()
            self.enc, self.deep = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, stride=2, padding=1)
            self.up, self.skip_relu = Up(), skip_relu

        def forward(self, x):
            e = self.enc(x)
            e = F.relu(e) if self.skip_relu else e
            return self.up(F.relu(self.deep(F.relu(e))), e)

    for skip_relu in (True, False):
        m = Net(skip_relu).eval()
        quantize_model(m, unsigned_after_relu=True, quant_desc_input=QuantDescriptor())
        assert ("up.conv._input_quantizer" in _unsigned(m)) == skip_relu


def test_untraceable_module_counts_as_possibly_negative():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent: fx cannot follow
                x = F.relu(x)
            return self.conv(F.relu(x))

    m = nn.Sequential(nn.ReLU(), Branchy()).eval()
    quantize_model(m, unsigned_after_relu=True, quant_desc_input=QuantDescriptor())
    assert _unsigned(m) == []


def test_off_by_default_and_on_in_the_reduce_range_recipe():
    torch.manual_seed(0)
    m = _trained(ResNet())
    quantize_model(m, quant_desc_input=QuantDescriptor())
    assert _unsigned(m) == []
    assert Int8ReduceRangeConfig().unsigned_after_relu is True and QuantConfig().unsigned_after_relu is False
    with pytest.raises(ValueError, match="unsigned_after_relu"):
        QuantConfig(unsigned_after_relu="yes")


def test_export_drops_every_relu_and_matches_pytorch(tmp_path):
    """onnxruntime runs the ResNet with no ReLU and no integer Max left (the conv before each ReLU writes the
    unsigned grid), and the file equals PyTorch fake-quant (export_onnx verifies it)."""
    pytest.importorskip("onnxruntime")
    from lq.export import optimized_op_counts

    torch.manual_seed(0)
    m = _trained(ResNet())
    quantize_model(m, quant_desc_weight=Int8ReduceRangeConfig().weight.to_descriptor(), unsigned_after_relu=True)
    x = torch.randn(16, 3, 16, 16)
    calibrate_model(m, [x[:8], x[8:]], method="max")
    res = export_onnx(m, x[:4], str(tmp_path / "m.onnx"), speed_check=False)
    ops = optimized_op_counts(str(tmp_path / "m.onnx"))
    assert "Relu" not in ops and "Max" not in ops, ops
    assert "NhwcMaxPool" in ops and "MaxPool" not in ops, ops  # the stem's pool runs on the uint8 NHWC kernel
    kernels = {(k.layer, k.op): k for k in res.layer_kernels}
    assert all(k.kernel == "QLinearConv" for (layer, op), k in kernels.items() if op == "Conv" and layer != "side")
    assert kernels[("side", "Conv")].by_choice  # a 1x1 conv read by a mean: runs on the mean, and the report says so
    assert res.verified


def test_a_tensor_a_signed_quantizer_also_reads_stays_on_one_grid(tmp_path):
    """``lq.nn.FloatAdd`` quantizes both operands with one (signed: a conv output is one of them) quantizer;
    its ReLU operand is also the next conv's input. Both stay signed, so the export computes the ReLU's
    producer once (an unsigned conv input would need a second copy of it, one per grid)."""
    pytest.importorskip("onnxruntime")
    import onnx

    from lq.nn import FloatAdd

    class Residual(nn.Module):
        def __init__(self, c=8):
            super().__init__()
            self.conv1, self.conv2, self.add = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1), FloatAdd()

        def forward(self, x):
            return F.relu(self.add(self.conv2(F.relu(self.conv1(x))), x))

    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), Residual(), Residual()).eval()
    quantize_model(m, quant_desc_weight=Int8ReduceRangeConfig().weight.to_descriptor(), unsigned_after_relu=True)
    assert _unsigned(m) == ["2.conv2._input_quantizer", "3.conv2._input_quantizer"]
    x = torch.randn(8, 3, 12, 12)
    calibrate_model(m, [x], method="max")
    export_onnx(m, x[:4], str(tmp_path / "m.onnx"), speed_check=False)
    assert not [n.name for n in onnx.load(str(tmp_path / "m.onnx")).graph.node if "_copy" in n.name]
