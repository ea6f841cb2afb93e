"""AWQ's ``1 / s`` folded into the op before the Linear where exact (lq.calib._awq_fold), so the file holds no Mul.

A transformer layer, pre-LN (every LayerNorm output read by Linears only) and post-LN (BERT, MiniLM: read again
as the residual), attention by ``scaled_dot_product_attention`` or by hand. Pre-LN: Q/K/V (one shared scale) and
the FFN's first Linear fold into their LayerNorm; post-LN: they keep one Mul (shared by Q/K/V); both: the output
projection folds into V's output rows; the FFN's second Linear (after GELU) keeps its Mul. The reference for "the
fold changes nothing" is the same search left unfolded (and the float model before AWQ).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lq.calib._awq_fold import _quantizers_off, fold_awq_scales
from lq.calib._block_search import search_awq
from lq.calibration import calibrate_model, default_forward
from lq.callbacks.swap import QuantSwap
from lq.export import export_onnx

torch.set_flush_denormal(True)
D = 64


class Block(nn.Module):
    def __init__(self, post: bool, sdpa: bool, heads: int = 2, ff: int = 128):
        super().__init__()
        self.post, self.sdpa, self.heads = post, sdpa, heads
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, ff), nn.Linear(ff, D)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # loud channels (up to ~30x apart) and a few 4x louder again: what AWQ is for
            for ln in (self.ln1, self.ln2):
                ln.weight.copy_(torch.exp(torch.randn(D, generator=g) * 1.2))
                ln.weight[torch.arange(3, D, D // 4)] *= 4
                ln.bias.copy_(torch.randn(D, generator=g) * 0.1)

    def attn(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v) if self.sdpa else \
            torch.softmax(q @ k.transpose(-1, -2) / 8, -1) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, D))

    def forward(self, x):
        if self.post:
            x = self.ln1(x + self.attn(x))
            return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _data(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 16, D, generator=torch.Generator().manual_seed(seed)) * 2


def _quantized(post: bool, sdpa: bool = True):
    torch.manual_seed(0)
    float_model = nn.Sequential(Block(post, sdpa), Block(post, sdpa)).eval()
    m = copy.deepcopy(float_model)
    QuantSwap("int4_block_weight").swap(m)
    calib = [_data(4, s) for s in range(2)]
    calibrate_model(m, calib, block_method="max")  # the search is what these tests run, after
    return float_model, m, calib


def _awq(post: bool, sdpa: bool = True, fold: bool = True):
    float_model, m, calib = _quantized(post, sdpa)
    choices = search_awq(m, calib, default_forward, fold=fold)
    return float_model, m, {c.layer: c for c in choices}


def _float_out(m, x):
    with torch.no_grad(), _quantizers_off(m):
        return m(x)


@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "matmul"])
@pytest.mark.parametrize("post", [False, True], ids=["pre_ln", "post_ln"])
def test_fold_changes_nothing_and_goes_where_exact(post, sdpa):
    float_model, m, choices = _awq(post, sdpa)
    _, unfolded, same = _awq(post, sdpa, fold=False)
    assert not any(c.folded for c in same.values())
    for i in range(2):
        q, k, v = (choices[f"{i}.{n}"] for n in "qkv")
        assert q.alpha == k.alpha == v.alpha and q.group == [f"{i}.q", f"{i}.k", f"{i}.v"]
        assert choices[f"{i}.o"].alpha == 0 or choices[f"{i}.o"].folded == f"QuantLinear '{i}.v' output rows"
        assert choices[f"{i}.fc2"].folded == ""  # after GELU: no exact fold
        if post:  # the LayerNorm output is the residual too
            assert q.folded == k.folded == v.folded == choices[f"{i}.fc1"].folded == ""
            qs = [getattr(m, str(i)).__getattr__(n)._input_quantizer.pre_quant_scale for n in "qkv"]
            assert qs[0] is None or all(torch.equal(qs[0], s) for s in qs[1:])
        else:
            assert q.alpha > 0 and q.folded == k.folded == v.folded == f"LayerNorm '{i}.ln1'"
            assert choices[f"{i}.fc1"].alpha == 0 or choices[f"{i}.fc1"].folded == f"LayerNorm '{i}.ln2'"
    assert any(choices[f"{i}.o"].folded for i in range(2))
    x = _data(3, 11)
    want = float_model(x).detach()
    torch.testing.assert_close(_float_out(m, x), _float_out(unfolded, x), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(_float_out(m, x), want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the fake-quant model too (a rescaled block may round one code the other way)
        got, ref = m(x), unfolded(x)
    assert float((got - ref).abs().max()) < 1e-3 * float(ref.abs().max())


def _file(m, tmp_path, dynamo: bool):
    res = export_onnx(m, _data(2, 3), str(tmp_path / "awq.onnx"), opset=21, dynamo=dynamo, dynamic_dims=(1,),
                      check_fusion=False)
    assert res.verified
    return res.path


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "legacy"])
@pytest.mark.parametrize("post", [False, True], ids=["pre_ln", "post_ln"])
def test_file_has_no_mul_after_a_layernorm_it_could_fold_and_equals_the_fake_quant_model(tmp_path, post, dynamo):
    _, m, choices = _awq(post)
    path = _file(m, tmp_path, dynamo)
    g = onnx.load(path).graph
    prod = {o: n for n in g.node for o in n.output}
    nbits = [n for n in g.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 12 and not [n for n in g.node if n.op_type in ("Gemm", "DequantizeLinear")]
    muls = [prod[n.input[0]] for n in nbits if n.input[0] in prod and prod[n.input[0]].op_type == "Mul"]
    from_norm = {m_.output[0] for m_ in muls if prod.get(m_.input[0]) is not None
                 and prod[m_.input[0]].op_type == "LayerNormalization"}
    kept = {tuple(c.group) for c in choices.values() if c.alpha > 0 and not c.folded}
    assert len({mm.output[0] for mm in muls}) == len(kept)  # one Mul per input that keeps its 1 / s
    if post:
        assert from_norm  # the residual reads the LayerNorm output: Q/K/V's one Mul stays
    else:
        assert not from_norm
    import onnxruntime as ort

    x = _data(3, 12)
    with torch.no_grad():
        want = m(x).numpy()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    # float32 sums in another order (onnxruntime's kernels): differences ~1e-6 of the output's scale
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_readers_with_different_scales_are_not_folded_and_stay_exact(tmp_path):
    float_model, m, choices = _awq(post=False, fold=False)
    q = m[0].q
    inv = q._input_quantizer.pre_quant_scale.clone()
    other = inv * torch.linspace(0.5, 2.0, D)  # Q alone gets another scale: x * other @ (W s')^T, same function
    with torch.no_grad():
        q.weight.mul_((inv / other)[None, :])
    q._input_quantizer.pre_quant_scale = other
    x = _data(3, 13)
    before = _float_out(m, x)
    where = fold_awq_scales(m, _data(4, 0))
    assert not {"0.q", "0.k", "0.v"} & set(where)  # the LayerNorm's readers disagree: nothing moves into it
    assert where["1.q"] == where["1.k"] == "LayerNorm '1.ln1'" and where["0.o"] == "QuantLinear '0.v' output rows"
    assert torch.equal(m[0].q._input_quantizer.pre_quant_scale, other)
    torch.testing.assert_close(_float_out(m, x), before, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(_float_out(m, x), float_model(x).detach(), rtol=1e-4, atol=1e-4)
    path = _file(m, tmp_path, dynamo=False)
    import onnxruntime as ort

    with torch.no_grad():
        want = m(x).numpy()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0], want, rtol=1e-5,
                               atol=1e-5)


def test_a_fold_the_check_rejects_is_undone(monkeypatch):
    from lq.calib import _awq_fold

    float_model, m, _ = _awq(post=False, fold=False)
    scales = {n: layer._input_quantizer.pre_quant_scale for n, layer in m.named_modules()
              if getattr(layer, "_input_quantizer", None) is not None}
    x = _data(3, 14)
    before, fq = _float_out(m, x), m(x).detach()
    monkeypatch.setattr(_awq_fold, "_scaled_by", lambda *a: False)  # no fold passes the check: each is put back
    assert fold_awq_scales(m, _data(4, 0)) == {}
    for n, layer in m.named_modules():
        if n in scales:
            s = layer._input_quantizer.pre_quant_scale
            assert (s is None) == (scales[n] is None) and (s is None or torch.equal(s, scales[n]))
    assert torch.equal(_float_out(m, x), before) and torch.equal(m(x).detach(), fq)


def test_a_fold_that_changes_the_output_is_undone():
    """Post-LN: the LayerNorm output is the residual too. Were Q/K/V's 1 / s folded into it anyway (a reader the
    trace missed), the layer's own inputs would check out but the model's output would not: every fold is undone."""
    from lq.calib import _awq_fold

    _, m, _ = _awq(post=True, fold=False)
    names = [n for n, layer in m.named_modules() if getattr(layer, "_input_quantizer", None) is not None]
    flow = _awq_fold.trace(m, names, _data(4, 0), default_forward)
    assert not flow.norm_of and flow.source_of  # the residual reads it: no LayerNorm fold
    assert ["1.q", "1.k", "1.v"] in flow.groups and m[1].q._input_quantizer.pre_quant_scale is not None
    flow.norm_of = {"1.q": "0.ln2"}  # the LayerNorm that made layer 1's input
    x = _data(3, 15)
    before = _float_out(m, x)
    assert _awq_fold.fold(m, flow, _data(4, 0), default_forward) == {}
    assert torch.equal(_float_out(m, x), before)


@pytest.mark.parametrize("post", [False, True], ids=["pre_ln", "post_ln"])
def test_without_muls_only_foldable_scales_are_searched_and_the_file_has_no_mul(tmp_path, post):
    """``keep_muls=False``: the Linears whose 1 / s would stay a Mul (post-LN Q/K/V and FFN input: the LayerNorm
    output is the residual too; the FFN's second Linear: after GELU) are not scaled; the rest fold as before."""
    float_model, m, calib = _quantized(post)
    choices = {c.layer: c for c in search_awq(m, calib, default_forward, keep_muls=False)}
    for c in choices.values():
        assert c.alpha == 0 or c.folded, c  # scaled only where the scale found its place
        assert c.error <= c.unscaled_error <= c.rtn_error, c
    for i in range(2):
        assert choices[f"{i}.fc2"].alpha == 0
        if post:
            assert choices[f"{i}.q"].alpha == choices[f"{i}.fc1"].alpha == 0
    assert any(c.alpha > 0 for c in choices.values())  # V's rows (and pre-LN: the LayerNorms) still take scales
    assert all(layer._input_quantizer.pre_quant_scale is None for n, layer in m.named_modules()
               if getattr(layer, "_input_quantizer", None) is not None)
    path = _file(m, tmp_path, dynamo=True)
    g = onnx.load(path).graph
    prod = {o: n for n in g.node for o in n.output}
    assert not [n for n in g.node if n.op_type == "MatMulNBits" and n.input[0] in prod
                and prod[n.input[0]].op_type == "Mul"]
    import onnxruntime as ort

    x = _data(3, 16)
    with torch.no_grad():
        want = m(x).numpy()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    torch.testing.assert_close(_float_out(m, x), float_model(x).detach(), rtol=1e-4, atol=1e-4)
