"""The float region at the model's input (lq.glue._float_region), under the onnxruntime recipe.

A 1-channel stem, the first block's depthwise conv and its squeeze-excite run in float; the first dense conv
is where the integers begin. References: the float model with the same quantized weights (the region must
compute exactly that), onnxruntime running the file, and the pytorch-quantization recipe, which has no region.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _mobile_blocks import SE, ConvBNAct

from lq.calibration import calibrate_model
from lq.convert import quantize_model

torch.set_flush_denormal(True)


class Block(nn.Module):
    """MBConv: [1x1 expand], depthwise, squeeze-excite, 1x1 project, ``+`` where the shapes allow."""

    def __init__(self, i, o, expand, squeeze=4):
        super().__init__()
        e = i * expand
        self.res = i == o
        self.block = nn.Sequential(*([ConvBNAct(i, e)] if expand > 1 else []), ConvBNAct(e, e, 3, groups=e),
                                   SE(e, squeeze), ConvBNAct(e, o, act=None))

    def forward(self, x):
        y = self.block(x)
        return y + x if self.res else y


class MobileNet(nn.Module):
    def __init__(self, first_out=8, squeeze=4):
        super().__init__()
        self.stem = ConvBNAct(1, 16, 3)
        self.blocks = nn.Sequential(Block(16, first_out, 1), Block(first_out, 16, 4, squeeze))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _input_enabled(layer) -> bool:
    return layer._input_quantizer.is_enabled


def test_the_stem_first_depthwise_block_and_its_squeeze_excite_stay_float_up_to_the_first_dense_conv():
    m = MobileNet()
    summary = quantize_model(m)
    first, second = m.blocks[0].block, m.blocks[1].block
    assert not _input_enabled(m.stem[0]) and not _input_enabled(first[0][0])  # stem, depthwise
    assert type(m.stem[2]) is nn.SiLU and type(first[0][2]) is nn.SiLU  # not swapped: float
    se = first[1]
    assert type(se.pool) is nn.AdaptiveAvgPool2d and type(se.act) is nn.SiLU
    assert not _input_enabled(se.fc1) and not _input_enabled(se.fc2)  # one value per channel: float
    assert not hasattr(se.fc2, "_output_quantizer")
    assert not any(q.is_enabled for q in se.lq_glue.values())  # x * gate in float
    # the first dense conv: the integers begin here, and everything after is placed as before
    assert _input_enabled(first[2][0])
    assert _input_enabled(second[0][0]) and _input_enabled(second[1][0])  # expand, and this depthwise
    assert type(second[0][2]) is not nn.SiLU and hasattr(second[2].fc2, "_output_quantizer")
    assert any(q.is_enabled for q in second[2].lq_glue.values())
    assert "float region" in summary["blocks.0.block.1.pool"].status
    assert "float region" in summary["blocks.0.block.1.lq_glue.mul_0"].status


def test_the_region_computes_the_float_model_with_the_quantized_weights():
    """The project conv's input (where the region ends) against the float model whose conv weights are replaced
    by what their weight quantizers give: equal to float rounding."""
    torch.manual_seed(0)
    fp = MobileNet().eval()
    x = torch.randn(16, 1, 12, 12)
    q = MobileNet().eval()
    q.load_state_dict(fp.state_dict())
    quantize_model(q)
    with torch.no_grad():
        calibrate_model(q, [x])
        for name, layer in q.named_modules():
            if hasattr(layer, "_weight_quantizer") and isinstance(layer, nn.Conv2d):
                fp.get_submodule(name).weight.copy_(layer._weight_quantizer(layer.weight))
    seen = {}
    for tag, model in (("q", q), ("fp", fp)):
        for where, layer in (("project", model.blocks[0].block[2][0]), ("next", model.blocks[1].block[1][0])):
            layer.register_forward_hook(lambda mod, args, out, key=(tag, where): seen.__setitem__(key, args[0]))
        with torch.no_grad():
            model(x)
    torch.testing.assert_close(seen["q", "project"], seen["fp", "project"], rtol=1e-5, atol=1e-6)
    # and not by chance: past the region the quantizers move the values by steps
    assert (seen["q", "next"] - seen["fp", "next"]).abs().max() > 1e-4


def test_the_file_runs_the_region_in_float_and_the_rest_on_integers(tmp_path):
    pytest.importorskip("onnxruntime")
    from lq.export import export_onnx, optimized_op_counts

    from _export_checks import assert_file_matches_pytorch

    torch.manual_seed(0)
    m = MobileNet()
    x = torch.randn(80, 1, 12, 12)
    m.train()
    with torch.no_grad():
        for _ in range(3):
            m(x)
    m.eval()
    quantize_model(m)
    with torch.no_grad():
        calibrate_model(m, list(x[:48].split(16)))
    res = export_onnx(m, x[:8], str(tmp_path / "m.onnx"), speed_check=False)
    assert_file_matches_pytorch(m, res, x[48:])
    kernels = {(k.layer, k.op): k.kernel for k in res.layer_kernels}
    assert kernels[("stem.0", "Conv")] == "Conv" and kernels[("blocks.0.block.0.0", "Conv")] == "Conv", kernels
    assert kernels[("blocks.0.block.2.0", "Conv")] == "QLinearConv", kernels
    assert kernels[("blocks.1.block.0.0", "Conv")] == "QLinearConv", kernels
    assert kernels[("blocks.1.block.1.0", "Conv")] == "QLinearConv", kernels  # this depthwise reads integers
    ops = optimized_op_counts(res.path)
    assert ops.get("QLinearMul") == 1 and ops.get("Mul") == 1, ops  # block 1's product float, block 2's integer
    se = [k for k in res.layer_kernels if k.layer.startswith("blocks.0.block.1.fc")]
    assert len(se) == 2 and all(k.by_choice and "input quantizer is off" in k.reason for k in se), se
    assert not any("conv/gemm/matmul in float" in w for w in res.warnings), res.warnings  # no failed fusion


def test_a_small_conv_reading_integers_runs_float_but_starts_no_region():
    """A squeeze-excite squeezed to 2 channels after the region: its expanding 1x1 conv has a stem's shape and
    runs in float (lq.glue._outputs.float_stem), but its output is no region: the product stays quantized."""
    m = MobileNet(squeeze=2)
    quantize_model(m)
    se = m.blocks[1].block[2]
    assert not _input_enabled(se.fc2) and _input_enabled(se.fc1)
    assert all(q.is_enabled for q in se.lq_glue.values())


def test_a_residual_add_ends_the_region():
    """``y + x`` with ``x`` from the region: the add quantizes both operands (QLinearAdd), as before."""
    m = MobileNet(first_out=16)
    quantize_model(m)
    assert not _input_enabled(m.blocks[0].block[0][0])
    assert all(q.is_enabled for q in m.blocks[0].lq_glue.values())


def test_without_a_float_stem_there_is_no_region():
    """A 4-channel input: the stem is an integer conv, and so is the first depthwise conv after it."""
    m = MobileNet()
    m.stem = ConvBNAct(4, 16, 3)
    quantize_model(m)
    assert _input_enabled(m.stem[0]) and _input_enabled(m.blocks[0].block[0][0])
    assert type(m.blocks[0].block[0][2]) is not nn.SiLU


def test_pytorch_quantizations_recipe_has_no_region():
    m = MobileNet()
    quantize_model(m, target="tensorrt")
    assert _input_enabled(m.stem[0]) and _input_enabled(m.blocks[0].block[0][0])
    assert _input_enabled(m.blocks[0].block[1].pool)


class GroupNormStem(nn.Module):
    """bench.ordinary's depthwise ResNet: stem -> GroupNorm -> SiLU, then ``x + pw(silu(norm(dw(x))))``."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU())
        self.dw, self.norm, self.pw = nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.GroupNorm(4, 16), nn.Conv2d(16, 16, 1)
        self.dw2 = nn.Conv2d(16, 16, 3, padding=1, groups=16)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.pw(nn.functional.silu(self.norm(self.dw(x))))
        return self.dw2(x)


def test_the_region_reaches_through_group_norm_and_ends_at_the_residual_add():
    m = GroupNormStem()
    quantize_model(m)
    assert not _input_enabled(m.stem[0]) and not _input_enabled(m.dw)  # float: GroupNorm keeps the region
    assert _input_enabled(m.pw) and all(q.is_enabled for k, q in m.lq_glue.items() if k.startswith("add"))
    assert not m.lq_glue.act_0.is_enabled  # F.silu in the region stays float, as nn.SiLU does there
    assert _input_enabled(m.dw2)  # reads the add's integers


class Untraceable(nn.Module):
    """A forward fx cannot follow (a branch on a value): the walk cannot see what reads the stem, so only the
    stem's own Sequential is followed."""

    def __init__(self):
        super().__init__()
        self.stem = ConvBNAct(1, 16, 3)
        self.dw = ConvBNAct(16, 16, 3, groups=16)

    def forward(self, x):
        y = self.stem(x)
        if float(y.abs().sum()) > 0:
            y = self.dw(y)
        return y


def test_an_untraceable_forward_keeps_the_stem_and_its_activation_float_and_nothing_more():
    m = Untraceable()
    quantize_model(m)
    assert not _input_enabled(m.stem[0]) and type(m.stem[2]) is nn.SiLU
    assert _input_enabled(m.dw[0]) and type(m.dw[2]) is not nn.SiLU


def test_a_checkpoint_of_an_lq_that_quantized_the_region_loads():
    """An earlier lq quantized the region's activations and pool and put an output quantizer on the gate's conv:
    their entries are dropped on load (those layers run in float now); any other unexpected entry still fails."""
    m = MobileNet()
    quantize_model(m)
    old = dict(m.state_dict())
    for path in ("blocks.0.block.0.2._input_quantizer", "blocks.0.block.1.pool._input_quantizer",
                 "blocks.0.block.1.act._input_quantizer", "blocks.0.block.1.fc2._output_quantizer"):
        old[f"{path}._amax"] = torch.tensor(2.0)
    fresh = MobileNet()
    quantize_model(fresh)
    fresh.load_state_dict(old)  # strict
    for k, v in m.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v)
    with pytest.raises(RuntimeError, match="blocks.1.block.1.2._input_quantizer._nonsense"):
        fresh.load_state_dict({**old, "blocks.1.block.1.2._input_quantizer._nonsense": torch.tensor(1.0)})
