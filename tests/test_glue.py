"""Glue ops written the ordinary way (``x + y``, ``torch.cat``, ``q @ k.transpose(-2, -1)``) get quantizers
without model changes, and a module lq cannot analyse keeps working, with a note naming it.

Every numeric check compares against the operation written out by hand with ``fake_tensor_quant`` and the
quantizer's calibrated amax, not against lq's own modules.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lq.calibration import calibrate_model
from lq.convert import dequantize_model, quantize_model
from lq.nn.modules import _bias_shift
from lq.export import export_onnx
from lq.glue import GlueQuantized, is_glue_quantized
from lq.tensor_quant import fake_tensor_quant
from lq.tensor_quant import QuantDescriptor

from _models import BNBlock


class Block(nn.Module):
    """A residual block as people write it: plain ``+``."""

    def __init__(self, c=8):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return F.relu(self.conv2(F.relu(self.conv1(x))) + x)

    def channels(self):  # a user method: must survive the rewrite
        return self.conv1.out_channels


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = Block()
        self.side = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.stem(x))
        y = self.block(x)
        z = torch.cat([y, self.side(y)], dim=1)
        return self.fc(z.mean((2, 3)))


class Attention(nn.Module):
    """Single-head attention with the matmuls written as operators, and a parameter added (not glue)."""

    def __init__(self, d=16):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.pos = nn.Parameter(torch.randn(1, 6, d) * 0.1)

    def forward(self, x):
        x = x + self.pos
        n = x.shape[-1]
        scores = self.q(x) @ self.k(x).transpose(-2, -1) / n ** 0.5
        return torch.softmax(scores, dim=-1) @ self.v(x)


def _fq(x, q):
    return fake_tensor_quant(x, q.amax.detach(), q.num_bits, q.unsigned, q.narrow_range)


def test_plain_add_and_cat_are_quantized_without_model_changes():
    torch.manual_seed(0)
    m = Net().eval()
    params = {n: id(p) for n, p in m.named_parameters()}
    summary = quantize_model(m, quant_desc_input=QuantDescriptor())
    assert {n: id(p) for n, p in m.named_parameters()} == params  # the same Parameter objects
    assert isinstance(m.block, Block) and isinstance(m.block, GlueQuantized) and m.block.channels() == 8
    assert {"block.lq_glue.add_0", "lq_glue.cat_0"} <= set(summary.quantized)
    assert summary["block.lq_glue.add_0"].type == "x + y"
    x = torch.randn(4, 3, 12, 12)
    calibrate_model(m, [x])
    # the block's forward equals q_a(conv2(...)) + q_x(x), written out by hand: the conv branch has the add's
    # own quantizer, and x, which conv1 also reads, is quantized by conv1's input quantizer (one scale for x)
    blk = m.block
    assert sorted(blk.lq_glue.keys()) == ["add_0_a"]
    assert summary["block.lq_glue.add_0"].num_quantizers == 2
    h = torch.randn(4, 8, 12, 12)
    with torch.no_grad():
        inner = blk.conv2(F.relu(blk.conv1(h)))
        want = F.relu(_fq(inner, blk.lq_glue.add_0_a) + _fq(h, blk.conv1._input_quantizer))
        torch.testing.assert_close(blk(h), want, rtol=0, atol=0)
        assert float(blk.lq_glue.add_0_a.amax) != float(blk.conv1._input_quantizer.amax)
    assert "block.lq_glue.add_0_a._amax" in m.state_dict() and "lq_glue.cat_0_b._amax" in m.state_dict()
    # the cat's y, which side also reads, is quantized by side's input quantizer; side(y) by the cat's own
    # (the head's z.mean((2, 3)) read by fc is a global average pool: pool_0 quantizes its input, as the module would)
    assert sorted(m.lq_glue.keys()) == ["cat_0_b", "pool_0"] and summary["lq_glue.cat_0"].num_quantizers == 2


def test_attention_matmuls_get_one_quantizer_per_operand_and_parameter_add_stays_float():
    torch.manual_seed(0)
    m = Attention().eval()
    summary = quantize_model(m, quant_desc_input=QuantDescriptor())
    glue = [n for n in summary.quantized if ".lq_glue." in n or n.startswith("lq_glue.")]
    assert glue == ["lq_glue.matmul_0", "lq_glue.matmul_1"]
    assert summary["lq_glue.matmul_0"].num_quantizers == 2 and summary["lq_glue.matmul_0"].type == "a @ b"
    assert sorted(m.lq_glue.keys()) == ["matmul_0_a", "matmul_0_b", "matmul_1_a", "matmul_1_b"]
    assert not hasattr(m.lq_glue, "add_0")  # x + self.pos: a parameter, not a join of activations
    x = torch.randn(2, 6, 16)
    calibrate_model(m, [x])
    g = m.lq_glue
    with torch.no_grad():
        h = x + m.pos
        scores = _fq(m.q(h), g.matmul_0_a) @ _fq(m.k(h).transpose(-2, -1), g.matmul_0_b) / 16 ** 0.5
        want = _fq(torch.softmax(scores, -1), g.matmul_1_a) @ _fq(m.v(h), g.matmul_1_b)
        torch.testing.assert_close(m(x), want, rtol=0, atol=0)


def test_second_call_is_idempotent_and_state_dict_round_trips():
    torch.manual_seed(0)
    m = Net().eval()
    quantize_model(m, quant_desc_input=QuantDescriptor())
    x = torch.randn(4, 3, 12, 12)
    calibrate_model(m, [x])
    again = quantize_model(m, quant_desc_input=QuantDescriptor())
    assert again.quantized == []
    assert {r.name for r in again if r.status == "already quantized"} >= {"block.lq_glue.add_0_a", "lq_glue.cat_0_b"}
    fresh = Net().eval()
    quantize_model(fresh, quant_desc_input=QuantDescriptor())
    fresh.load_state_dict(m.state_dict())  # strict: the same keys, glue quantizers included
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), m(x))


def test_dequantize_restores_the_float_model():
    torch.manual_seed(0)
    m = Net().eval()
    ref = copy.deepcopy(m)
    quantize_model(m, quant_desc_input=QuantDescriptor())
    calibrate_model(m, [torch.randn(2, 3, 12, 12)])
    dequantize_model(m)
    assert type(m.block) is Block and "lq_glue" not in m.block._modules and "lq_glue" not in m._modules
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x))


def test_glue_false_and_exclude_leave_the_forward_alone():
    m = Net().eval()
    quantize_model(m, glue=False, quant_desc_input=QuantDescriptor())
    assert not isinstance(m.block, GlueQuantized) and "lq_glue" not in m._modules
    m2 = Net().eval()
    quantize_model(m2, exclude=["block.lq_glue.*"], quant_desc_input=QuantDescriptor())
    assert not isinstance(m2.block, GlueQuantized) and isinstance(m2, GlueQuantized)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot follow it
            return self.a(x) + self.b(x)
        return self.a(x)


class OptionalArg(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, skip=None):
        return self.a(x) + (x if skip is None else skip)


class TrainingBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return y + x if self.training else y


@pytest.mark.parametrize("cls, why", [(DataDependent, "torch.fx cannot trace"),
                                      (OptionalArg, "optional argument (skip=None)"),
                                      (TrainingBranch, "differs between training and evaluation")])
def test_a_module_lq_cannot_analyse_keeps_working_and_is_named(cls, why):
    torch.manual_seed(0)
    m = cls().eval()
    ref = copy.deepcopy(m)
    summary = quantize_model(m, quant_desc_input=QuantDescriptor())
    assert not isinstance(m, GlueQuantized)
    note = [n for n in summary.notes if "stays float" in n]
    assert len(note) == 1 and f"({cls.__name__})" in note[0] and why in note[0]
    x = torch.randn(3, 4).abs()
    calibrate_model(m, [x])
    for mod in (m, ref):
        for _, q in mod.named_modules():
            if hasattr(q, "disable") and hasattr(q, "amax"):
                q.disable()
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x))  # runs, and computes the float glue as before


def test_export_runs_plain_add_as_integer_add_and_fuses_the_convs(tmp_path):
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    m = Net().eval()
    quantize_model(m, quant_desc_input=QuantDescriptor())
    x = torch.randn(4, 3, 12, 12)
    calibrate_model(m, [x])
    res = export_onnx(m, x, str(tmp_path / "m.onnx"), speed_check=False)  # verified against PyTorch inside
    kernels = {(k.layer, k.op): k.kernel for k in res.layer_kernels}
    assert kernels[("block", "Add")] == "QLinearAdd"
    assert kernels[("block.conv2", "Conv")] == "QLinearConv"  # its output now has a quantizer
    assert kernels[("block.conv1", "Conv")] == "QLinearConv"


class TinyResNet(nn.Module):
    """torchvision-style: BatchNorm blocks with plain ``out + x`` and a functional pool at the end."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(BNBlock(c), BNBlock(c))
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def _trained_bn(m, channels=3, size=12):
    m.train()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(8, channels, size, size))
    return m.eval()


@pytest.mark.parametrize("method", ["max", "auto"])
def test_residual_operand_shares_the_next_conv_quantizer_and_the_pool_is_quantized(tmp_path, method):
    """``x`` of ``f(x) + x`` is quantized by conv1's own input quantizer (whatever the calibration method, one
    scale: the export does not copy x's producer), and ``F.adaptive_avg_pool2d`` gets an input quantizer, so
    onnxruntime runs the whole tail (last add, pool, fc) in INT8."""
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    m = _trained_bn(TinyResNet())
    summary = quantize_model(m, quant_desc_input=QuantDescriptor())
    blk = m.blocks[1]
    assert sorted(blk.lq_glue.keys()) == ["add_0_a"]
    assert summary["blocks.1.lq_glue.add_0"].num_quantizers == 2
    assert summary["lq_glue.pool_0"].type == "average pooling"
    x = torch.randn(16, 3, 12, 12)
    calibrate_model(m, [x[:8], x[8:]], method=method)
    h = torch.randn(4, 8, 12, 12)
    with torch.no_grad():  # the block and the model's tail written out by hand
        inner = blk.bn2(blk.conv2(F.relu(blk.bn1(blk.conv1(h)))))
        want = F.relu(_fq(inner, blk.lq_glue.add_0_a) + _fq(h, blk.conv1._input_quantizer))
        torch.testing.assert_close(blk(h), want, rtol=0, atol=0)
        feat = m.blocks(m.stem(x[:4]))
        want = m.fc(torch.flatten(F.adaptive_avg_pool2d(_fq(feat, m.lq_glue.pool_0), 1), 1))
        torch.testing.assert_close(m(x[:4]), want, rtol=0, atol=0)
    res = export_onnx(m, x[:4], str(tmp_path / "m.onnx"), speed_check=False)  # verified against PyTorch inside
    import onnx

    names = [n.name for n in onnx.load(str(tmp_path / "m.onnx")).graph.node]
    assert not [n for n in names if "_copy" in n]  # no producer had to be copied for a second scale
    kernels = {(k.layer, k.op): k.kernel for k in res.layer_kernels}
    assert all(v == "QLinearConv" for (layer, op), v in kernels.items() if op == "Conv"), kernels
    assert kernels[("blocks.1", "Add")] == "QLinearAdd"
    from lq.export import optimized_op_counts

    ops = optimized_op_counts(str(tmp_path / "m.onnx"))
    assert ops.get("QLinearGlobalAveragePool") == 1 and "GlobalAveragePool" not in ops and "Add" not in ops, ops


class LitResidual(__import__("lightning").LightningModule):
    """A LightningModule whose own forward holds a plain ``+`` (the root module is rewritten in place)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.block = Block()
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = self.block(h) + h
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_quant_callback_trains_checkpoints_and_exports_a_model_with_plain_adds(tmp_path):
    pytest.importorskip("onnxruntime")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lq
    from lq.config import ExportConfig
    from lq.zoo import DigitsDataModule

    dm = DigitsDataModule(batch_size=64)
    dm.setup()
    L.seed_everything(0)
    model = LitResidual()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    cb = lq.QuantCallback(export=ExportConfig(path="int8.onnx", speed_check=False), verbose=False)
    L.Trainer(max_epochs=1, limit_train_batches=4, limit_val_batches=2, logger=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=str(tmp_path), accelerator="cpu",
              callbacks=[cb, ckpt]).fit(model, datamodule=dm)
    assert isinstance(model, LitResidual) and is_glue_quantized(model) and type(model) is LitResidual  # no class swap
    assert float(model.lq_glue.add_0_a.amax) > 0 and float(model.block.lq_glue.add_0_a.amax) > 0
    kernels = {(k.layer, k.op): k.kernel for k in cb.exporter.result.layer_kernels}
    assert kernels[("block", "Add")] == "QLinearAdd" and kernels[("block.conv2", "Conv")] == "QLinearConv"
    x = dm.arrays("test")[0][:16]
    model.eval()
    with torch.no_grad():
        expected = model(x)
    loaded = lq.load_quantized(LitResidual, ckpt.last_model_path)  # glue quantizers and amax come back
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), expected)


class NormAfterConv(nn.Module):
    """A conv read by GroupNorm in the module's forward, and a Linear read by GELU inside an nn.Sequential."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)  # >= 4 input channels: an integer conv in onnxruntime
        self.norm = nn.GroupNorm(2, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 10))

    def forward(self, x):
        return self.mlp(F.silu(self.norm(self.conv(x))).mean((2, 3)))


def test_layers_read_by_float_ops_get_output_quantizers_and_fuse(tmp_path):
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    m = NormAfterConv().eval()
    summary = quantize_model(m, quant_desc_input=QuantDescriptor())
    assert "conv._output_quantizer" in summary.quantized
    # a Linear keeps its integer kernel with a float output (onnxruntime's QGemm / MatMulIntegerToFloat)
    assert "mlp.0._output_quantizer" not in summary.quantized
    assert "mlp.2._output_quantizer" not in summary.quantized  # a model output: nothing float reads it
    assert summary["conv._output_quantizer"].type == "output -> GroupNorm"
    assert [type(c).__name__ for c in m.mlp] == ["QuantLinear", "GELU", "QuantLinear"]  # indexing untouched
    x = torch.randn(4, 4, 10, 10)
    calibrate_model(m, [x])
    with torch.no_grad():  # the conv's output, quantized by hand with the output quantizer's amax
        want = _fq(m.conv._conv_forward(m.conv._input_quantizer(x), m.conv._weight_quantizer(m.conv.weight),
                                        m.conv.bias), m.conv._output_quantizer)
        torch.testing.assert_close(m.conv(x), want, rtol=0, atol=0)
    res = export_onnx(m, x, str(tmp_path / "m.onnx"), speed_check=False)
    kernels = {k.layer: k.kernel for k in res.layer_kernels}
    assert kernels["conv"] == "QLinearConv" and kernels["mlp.0"] in ("QGemm", "MatMulIntegerToFloat"), kernels
    dequantize_model(m)
    assert not m.conv._forward_hooks and "_output_quantizer" not in m.conv._modules


class SlopeAfterConv(nn.Module):
    """Convs read by PReLU, nn.LeakyReLU and F.leaky_relu, each feeding another quantized conv."""

    def __init__(self):
        super().__init__()
        self.c1, self.a1 = nn.Conv2d(4, 8, 3, padding=1), nn.PReLU(8)
        self.c2, self.a2 = nn.Conv2d(8, 8, 3, padding=1), nn.LeakyReLU(0.1)
        self.c3, self.c4 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c4(F.leaky_relu(self.c3(self.a2(self.c2(self.a1(self.c1(x))))), 0.2))


def test_convs_read_by_prelu_or_leaky_relu_get_no_output_quantizer(tmp_path):
    """A short slope (0.25, 0.1) times a value on the conv's output grid lands on a rounding tie of the next
    quantizer (same amax under max calibration), which PyTorch and onnxruntime break differently (measured:
    8-20% of the outputs one step apart), so these convs stay float and the report says why."""
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    m = SlopeAfterConv().eval()
    summary = quantize_model(m, quant_desc_input=QuantDescriptor())
    assert not [n for n in summary.quantized if n.endswith("_output_quantizer")], summary.quantized
    x = torch.randn(4, 4, 10, 10)
    calibrate_model(m, [x], method="max")
    res = export_onnx(m, x, str(tmp_path / "m.onnx"), speed_check=False)
    kernels = {k.layer: k for k in res.layer_kernels}
    for layer, reader in (("c1", "PRelu"), ("c2", "LeakyRelu"), ("c3", "LeakyRelu")):
        assert not kernels[layer].integer and reader in kernels[layer].reason, kernels[layer]
    assert res.verified


class SDPABlock(nn.Module):
    """Attention written with F.scaled_dot_product_attention (a causal mask, two heads)."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def test_scaled_dot_product_attention_gets_both_matmuls_quantized(tmp_path):
    torch.manual_seed(0)
    m = SDPABlock().eval()
    ref = copy.deepcopy(m)
    summary = quantize_model(m, quant_desc_input=QuantDescriptor())
    assert summary["lq_glue.attention_0"].type == "scaled_dot_product_attention"
    assert sorted(m.lq_glue.keys()) == ["attention_0_k", "attention_0_probs", "attention_0_q", "attention_0_v"]
    x = torch.randn(3, 5, 16)
    with torch.no_grad():  # quantizers off: the written-out attention is PyTorch's op
        for mod in m.modules():
            if hasattr(mod, "disable") and hasattr(mod, "amax"):
                mod.disable()
        torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-6)
        for mod in m.modules():
            if hasattr(mod, "enable") and hasattr(mod, "amax"):
                mod.enable()
    calibrate_model(m, [x], method="max")
    g = m.lq_glue
    with torch.no_grad():  # the quantized attention, written out by hand
        b, t, d = x.shape
        qkv_in = m.qkv(x)
        q, k, v = qkv_in.reshape(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        s = _fq(q, g.attention_0_q) @ _fq(k, g.attention_0_k).transpose(-2, -1) / (d // 2) ** 0.5
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        y = _fq(torch.softmax(s, -1), g.attention_0_probs) @ _fq(v, g.attention_0_v)
        want = m.out(y.transpose(1, 2).reshape(b, t, d))
        torch.testing.assert_close(m(x), want, rtol=0, atol=0)
    pytest.importorskip("onnxruntime")
    res = export_onnx(m, x, str(tmp_path / "sdpa.onnx"), speed_check=False)
    attention = [k for k in res.layer_kernels if k.op == "MatMul" and k.layer not in ("qkv", "out")]
    assert len(attention) == 2 and all(k.integer for k in attention), res.layer_kernels  # q @ k^T and p @ v


class PreNorm(nn.Module):
    """A pre-norm residual stream: each add is read by the next LayerNorm and the next add; the last one by
    ``mean`` (``pool=True``) or by a Linear."""

    def __init__(self, d=16, pool=True):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.f1, self.f2 = nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, 4)
        self.pool = pool

    def forward(self, x):
        h = x + self.f1(self.n1(x))
        h = h + self.f2(self.n2(h))
        return self.head(h.mean(1)) if self.pool else self.head(h)


def test_adds_only_float_ops_read_stay_float(tmp_path):
    """A residual stream that only LayerNorm, mean and further such adds read gets no quantizers (no integer
    kernel could take it: they would only add Q/DQ pairs); one a quantized Linear reads is quantized."""
    torch.manual_seed(0)
    m = PreNorm().eval()
    ref = copy.deepcopy(m)
    summary = quantize_model(m, quant_desc_input=QuantDescriptor())
    assert not [n for n in summary.quantized if "lq_glue" in n] and not isinstance(m, GlueQuantized)
    x = torch.randn(4, 6, 16)
    calibrate_model(m, [x])
    with torch.no_grad():  # the adds are the float ones: only the Linears' own quantizers act
        h = x + m.f1(ref.n1(x))
        h = h + m.f2(ref.n2(h))
        torch.testing.assert_close(m(x), m.head(h.mean(1)), rtol=0, atol=0)
    res = export_onnx(m, x, str(tmp_path / "m.onnx"), speed_check=False)
    kernels = {k.layer: k.kernel for k in res.layer_kernels}
    assert all(kernels[n] in ("QGemm", "MatMulIntegerToFloat") for n in ("f1", "f2", "head")), kernels
    m2 = PreNorm(pool=False).eval()
    summary = quantize_model(m2, quant_desc_input=QuantDescriptor())
    # the last add feeds the head (a quantized Linear), and the first one feeds that add's operand quantizer
    assert [n for n in summary.quantized if "lq_glue" in n] == ["lq_glue.add_0", "lq_glue.add_1"]
    assert sorted(m2.lq_glue.keys()) == ["add_0_a", "add_0_b", "add_1_a", "add_1_b"]


@pytest.mark.parametrize("method", ["max", "auto"])
def test_unet_skip_tensor_has_one_grid_and_every_conv_is_integer(tmp_path, method):
    """A U-Net's skip tensor is max-pooled into the next encoder conv and concatenated in the decoder: its cat
    operand is quantized by that conv's own input quantizer (through the max pool and the nn.Sequential), so
    the tensor has one grid whatever the calibration, the conv writing it fuses, nearest upsampling runs on
    integers and the concat is QLinearConcat. Only the 1x1 head is float: the mean that read it now runs first
    and the head on one pixel per image (lq.export.passes._mean_first), and the report says so."""
    pytest.importorskip("onnxruntime")
    from bench.ordinary import UNet

    from lq.config import Int8ReduceRangeConfig
    from lq.export import optimized_op_counts

    torch.manual_seed(0)
    m = _trained_bn(UNet(c=8), channels=1, size=16)
    summary = quantize_model(m, quant_desc_weight=Int8ReduceRangeConfig().weight.to_descriptor(),
                             unsigned_after_relu=True)
    assert sorted(m.lq_glue.keys()) == ["cat_0_a", "cat_1_a"]  # the upsampled operands; the skips are tied
    assert summary["lq_glue.cat_0"].num_quantizers == 2
    x = torch.randn(16, 1, 16, 16)
    calibrate_model(m, [x[:8], x[8:]], method=method)
    h = torch.randn(2, 1, 16, 16)
    with torch.no_grad():  # the decoder's first cat, written out: the skip e2 through enc3.0's input quantizer
        e1 = m.enc1(h)
        e2 = m.enc2(F.max_pool2d(e1, 2))
        e3 = m.enc3(F.max_pool2d(e2, 2))
        up = F.interpolate(e3, scale_factor=2, mode="nearest")
        want = m.dec2(torch.cat([_fq(up, m.lq_glue.cat_0_a), _fq(e2, m.enc3[0]._input_quantizer)], 1))
        d2 = m.dec2(torch.cat([m.lq_glue.cat_0_a(up), m.enc3[0]._input_quantizer(e2)], 1))
        torch.testing.assert_close(d2, want, rtol=0, atol=0)
    res = export_onnx(m, x[:4], str(tmp_path / "unet.onnx"), speed_check=False)  # verified against PyTorch inside
    import onnx

    assert not [n.name for n in onnx.load(res.path).graph.node if "_copy" in n.name]
    kernels = {k.layer: k for k in res.layer_kernels if k.op == "Conv"}
    assert all(k.kernel == "QLinearConv" for name, k in kernels.items() if name != "head"), kernels
    assert kernels["head"].by_choice and "average of its input" in kernels["head"].reason, kernels["head"]
    ops = optimized_op_counts(res.path)
    assert ops.get("QLinearConcat") == 2 and "Concat" not in ops and "Relu" not in ops and "Max" not in ops, ops


class UpBlock(nn.Module):
    """A decoder block as library code writes it: the cat of the upsampled map and the skip is in its own forward."""

    def __init__(self, deep: int, skip: int, o: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(deep + skip, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

    def forward(self, deep, skip):
        return self.conv(torch.cat([F.interpolate(deep, scale_factor=2, mode="nearest"), skip], 1))


class BlockUNet(nn.Module):
    """The skip tensors cross a module boundary: the model max-pools them into the next stage and passes them to
    the decoder blocks, whose forward concatenates them (bench.library's VGG-BN U-Net)."""

    def __init__(self, c: int = 8):
        super().__init__()
        cbr = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())  # noqa: E731
        self.stage1, self.stage2, self.stage3 = cbr(1, c), cbr(c, 2 * c), cbr(2 * c, 4 * c)
        self.up2, self.up1 = UpBlock(4 * c, 2 * c, 2 * c), UpBlock(2 * c, c, c)
        self.head = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        e1 = self.stage1(x)
        e2 = self.stage2(F.max_pool2d(e1, 2))
        e3 = self.stage3(F.max_pool2d(e2, 2))
        return self.head(self.up1(self.up2(e3, skip=e2), e1))


@pytest.mark.parametrize("method", ["max", "auto"])
def test_a_skip_passed_to_a_decoder_block_has_the_grid_of_the_conv_that_pools_it(tmp_path, method):
    """The decoder block's cat operand for ``skip`` is the caller's next-stage conv input quantizer (one module under
    two names, lq.glue._argument_ties), positional or keyword; so with any calibration the convs writing the skips
    end in one QuantizeLinear and run as QLinearConv (before: float under ``auto``, two readers on two grids)."""
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    m = _trained_bn(BlockUNet(), channels=1, size=16)
    quantize_model(m)  # the callback's default recipe (int8_onnxruntime)
    assert m.up2.lq_glue["cat_0_b"] is m.stage3[0]._input_quantizer  # skip=e2, a keyword
    assert m.up1.lq_glue["cat_0_b"] is m.stage2[0]._input_quantizer  # e1, positional
    assert m.up1.lq_glue["cat_0_a"] is not m.stage2[0]._input_quantizer  # the upsampled operand keeps its own
    x = torch.rand(16, 1, 16, 16)
    calibrate_model(m, [x[:8], x[8:]], method=method)
    res = export_onnx(m, x[:4], str(tmp_path / "unet.onnx"), speed_check=False)  # verified against PyTorch inside
    kernels = {k.layer: k.kernel for k in res.layer_kernels if k.op == "Conv"}
    assert all(k == "QLinearConv" for name, k in kernels.items() if name != "head"), kernels
    # the 1-channel stem stays integer: a max pool reads it (lq.glue._outputs.pooled_stems)
    assert m.stage1[0]._input_quantizer.is_enabled
    state = m.state_dict()  # one module under two names: both keys, the same calibrated range
    assert torch.equal(state["up1.lq_glue.cat_0_b._amax"], state["stage2.0._input_quantizer._amax"])


class TwoHeads(nn.Module):
    """Two score-map heads read one feature map (bench.library's U-Net: ``self.region(d), self.link(d)``)."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(4, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.refine = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.region, self.link = nn.Conv2d(c, 1, 1), nn.Conv2d(c, 2, 1)

    def forward(self, x):
        d = self.refine(self.body(x))
        return self.region(d), self.link(d)


@pytest.mark.parametrize("method", ["max", "auto"])
def test_layers_reading_one_tensor_share_its_grid_and_its_producer_is_not_copied(tmp_path, method):
    """Each head had its own input quantizer, calibrated apart under ``auto``: two QuantizeLinear on one tensor,
    and the export ran the refine conv twice (one copy per grid). lq.glue._one_tensor: one quantizer."""
    pytest.importorskip("onnxruntime")
    import onnx

    torch.manual_seed(0)
    m = _trained_bn(TwoHeads(), channels=4, size=12)
    quantize_model(m)  # the callback's default recipe (int8_onnxruntime)
    assert m.link._input_quantizer is m.region._input_quantizer
    x = torch.rand(16, 4, 12, 12)
    calibrate_model(m, [x[:8], x[8:]], method=method)
    with torch.no_grad():  # PyTorch itself quantizes d once for both heads: the heads' own float convs on it
        dq = m.region._input_quantizer(m.refine(m.body(x[:4])))
        region, link = m(x[:4])
        bias = _bias_shift.quant_bias(m.link)  # with bias correction's shift where ``auto`` made one
        torch.testing.assert_close(link, F.conv2d(dq, m.link._weight_quantizer(m.link.weight), bias),
                                   rtol=0, atol=1e-6)
    res = export_onnx(m, x[:4], str(tmp_path / "heads.onnx"), output_names=["region", "link"],
                      speed_check=False)  # verified inside
    nodes = onnx.load(res.path).graph.node
    assert not [n.name for n in nodes if "_copy" in n.name] and sum(n.op_type == "Conv" for n in nodes) == 4
    kernels = {k.layer: k.kernel for k in res.layer_kernels if k.op == "Conv"}
    assert kernels["refine.0"] == "QLinearConv" and kernels["body.0"] == "QLinearConv", kernels
    state = m.state_dict()
    assert torch.equal(state["region._input_quantizer._amax"], state["link._input_quantizer._amax"])
