"""Verification judges the file in output quantization steps and by top-1 agreement (issue 28, item 1).

The architectures a new user tried (MobileNetV3, a MiniLM-like encoder with padding) export and verify; a
rewrite that puts one scale a few percent off, or a file whose predictions differ on a few percent of the
sample, fails, although its max|diff| is within the 5% of max|output| that verification used to allow.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

import lq
from lq.export import VerificationError
from lq.export.verify import _verify

ort = pytest.importorskip("onnxruntime")

torch.set_flush_denormal(True)


# =========================================================================== models of the kinds
class SqueezeExcite(nn.Module):
    """MobileNetV3's: pool, 1x1 conv, ReLU, 1x1 conv, Hardsigmoid, times the input."""

    def __init__(self, c: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, max(8, c // 4), 1), nn.Conv2d(max(8, c // 4), c, 1)

    def forward(self, x):
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))


class InvertedResidual(nn.Module):
    """Expand 1x1, depthwise kxk, optional squeeze-excite, project 1x1; a plain ``+ x`` when shapes allow."""

    def __init__(self, cin: int, cexp: int, cout: int, k: int, stride: int, se: bool, act: type):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(cin, cexp, 1, bias=False), nn.BatchNorm2d(cexp), act())
        self.dw = nn.Sequential(nn.Conv2d(cexp, cexp, k, stride, k // 2, groups=cexp, bias=False),
                                nn.BatchNorm2d(cexp), act())
        self.se = SqueezeExcite(cexp) if se else nn.Identity()
        self.project = nn.Sequential(nn.Conv2d(cexp, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.se(self.dw(self.expand(x))))
        return y + x if self.residual else y


class MobileNetV3ish(nn.Module):
    """torchvision mobilenet_v3_small's structure, narrow: Hardswish stem, inverted residuals, Hardswish head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.blocks = nn.Sequential(
            InvertedResidual(16, 16, 16, 3, 2, True, nn.ReLU),
            InvertedResidual(16, 72, 24, 3, 2, False, nn.ReLU),
            InvertedResidual(24, 88, 24, 3, 1, False, nn.ReLU),
            InvertedResidual(24, 96, 40, 5, 2, True, nn.Hardswish),
            InvertedResidual(40, 120, 40, 5, 1, True, nn.Hardswish))
        self.last = nn.Sequential(nn.Conv2d(40, 96, 1, bias=False), nn.BatchNorm2d(96), nn.Hardswish())
        self.head = nn.Sequential(nn.Linear(96, 128), nn.Hardswish(), nn.Linear(128, classes))

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.last(self.blocks(self.stem(x))), 1).flatten(1))


class EncoderLayer(nn.Module):
    """BERT's post-norm layer, written out: q/k/v projections, an additive attention mask, GELU feed-forward."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask_bias):
        b, t, d = x.shape

        def heads(y):
            return y.view(b, t, self.h, d // self.h).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.h) + mask_bias, dim=-1)
        x = self.ln1(x + self.o((a @ v).transpose(1, 2).reshape(b, t, d)))
        return self.ln2(x + self.ff2(F.gelu(self.ff1(x))))


class MiniLMish(nn.Module):
    """all-MiniLM-L6-v2's shape, small: token + position embeddings, LayerNorm, encoder layers with an attention
    mask; returns the token states (padding positions included) and the mask-weighted mean embedding."""

    def __init__(self, vocab: int = 200, d: int = 64, heads: int = 4, layers: int = 2, max_len: int = 32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads) for _ in range(layers))

    def forward(self, ids, mask):
        h = self.ln(self.tok(ids) + self.pos.weight[: ids.shape[1]])
        bias = (1.0 - mask[:, None, None, :].float()) * -10000.0
        for layer in self.layers:
            h = layer(h, bias)
        m = mask[..., None].float()
        return h, (h * m).sum(1) / m.sum(1)


class CRNN(nn.Module):
    """easyocr's recognizer, small: a VGG-style conv stack over a text-line image, a bidirectional LSTM over its
    columns, per-column character logits (batch, columns, characters)."""

    def __init__(self, chars: int = 37):
        super().__init__()

        def conv(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

        self.cnn = nn.Sequential(conv(1, 16), nn.MaxPool2d(2), conv(16, 32), nn.MaxPool2d(2), conv(32, 64),
                                 nn.MaxPool2d((2, 1)))
        self.rnn = nn.LSTM(64 * 4, 64, bidirectional=True, batch_first=True)
        self.head = nn.Sequential(nn.Linear(128, chars))

    def forward(self, x):
        return self.head(self.rnn(self.cnn(x).flatten(1, 2).transpose(1, 2))[0])


def _settle(model: nn.Module, batches: list) -> nn.Module:
    """Give a randomly initialized network a trained network's signal: random BatchNorm affines, running
    statistics from ``batches`` (each BatchNorm's output has unit variance, so depth neither drowns the input
    nor lets the head's bias dominate the logits), and no head bias."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(0.5 + torch.rand(m.num_features, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.num_features, generator=g))
                m.reset_running_stats()
                m.momentum = None  # the plain average over the batches
        model.train()
        for b in batches:
            model(b)
        model.head[-1].bias.zero_()
    return model.eval()


def mobilenet(batch: int = 32, classes: int = 10):
    """(the quantized, calibrated model, calibration batches, the sample to export with) on lq's default path."""
    torch.manual_seed(0)
    calib = [torch.randn(batch, 3, 32, 32) for _ in range(4)]
    model = _settle(MobileNetV3ish(classes), calib)
    lq.quantize_model(model)
    with torch.no_grad():
        lq.calibrate_model(model, calib)
    return model, calib, torch.randn(batch, 3, 32, 32)


def _text_batch(g: torch.Generator, batch: int, t: int):
    """Token ids and a mask whose sentences have 4..t tokens: the rest is padding (id 0)."""
    lengths = torch.randint(4, t + 1, (batch,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, 200, (batch, t), generator=g) * mask
    return ids, mask


def minilm(batch: int = 16, t: int = 24):
    torch.manual_seed(0)
    model = MiniLMish().eval()
    g = torch.Generator().manual_seed(1)
    calib = [_text_batch(g, batch, t) for _ in range(4)]
    lq.quantize_model(model)
    with torch.no_grad():
        lq.calibrate_model(model, calib)
    return model, calib, _text_batch(g, batch, t)


def _logits(model, x) -> np.ndarray:
    with torch.no_grad():
        return model(x).numpy()


@pytest.fixture(scope="module")
def mobilenet200():
    """A MobileNetV3-like classifier over 200 classes, quantized and calibrated the default way, with its sample."""
    return mobilenet(batch=64, classes=200)


@pytest.fixture(scope="module")
def mobilenet_file(mobilenet200, tmp_path_factory):
    model, _, x = mobilenet200
    return lq.export_onnx(model, x, str(tmp_path_factory.mktemp("mnv3") / "mnv3.onnx"), speed_check=False)


# =========================================================================== (a) the architectures pass
def test_mobilenet_v3_like_file_verifies_and_reports_its_steps(mobilenet_file):
    """Depthwise convs, squeeze-excite (Hardsigmoid -> Mul), Hardswish, plain residual adds: rounding ties that
    onnxruntime breaks differently cascade through the blocks, so the logits sit a few steps from PyTorch's; the
    file verifies although elements sit more than two steps away (the rule before steps, 5% of max|output|,
    rejected this model's file while lq's placement left more of it float)."""
    res = mobilenet_file
    (c,) = res.output_checks
    assert res.tolerance is None and c.from_graph and c.step > 0
    assert c.elements == 64 * 200 and c.rows == 64 and c.top1_differ == 0
    assert c.frac_far <= _verify.FAR_FRACTION and c.beyond_far <= c.beyond_2 <= c.beyond_1
    assert c.max_diff == pytest.approx(res.max_abs_diff)
    assert res.verdict == c.text() and "top-1 differs on 0 of 64 rows" in res.verdict
    assert "judged in output steps" in res.summary() and c.text() in res.summary()
    assert c.beyond_2 > 0 and c.max_diff > 2 * c.step  # several steps off on ties, and judged good


def test_mobilenet_v3_like_file_verifies_with_int8_reduce_range(tmp_path):
    """The recipe of the issue's efficientnet_b0 (7-bit weights, uint8 after ReLU): its good files are the most
    chaotic measured (up to 0.11% of the logits beyond 6 steps)."""
    from lq.callbacks import QuantSwap
    from lq.config import Int8ReduceRangeConfig

    torch.manual_seed(0)
    calib = [torch.randn(64, 3, 32, 32) for _ in range(4)]
    model = _settle(MobileNetV3ish(200), calib)
    QuantSwap(Int8ReduceRangeConfig()).swap(model)
    with torch.no_grad():
        lq.calibrate_model(model, calib)
    res = lq.export_onnx(model, torch.randn(64, 3, 32, 32), str(tmp_path / "rr.onnx"), speed_check=False)
    (c,) = res.output_checks
    assert c.rows == 64 and c.top1_differ == 0 and c.frac_far <= _verify.FAR_FRACTION


def test_minilm_like_encoder_with_padding_verifies(tmp_path):
    """Token and position embeddings, an additive attention mask, padding (id 0) on a third of the positions, two
    outputs: the token states (LayerNorm: no quantizer, so the step is 1% of max|output|) and the mean over
    the real tokens."""
    model, _, (ids, mask) = minilm()
    assert 0.2 < 1 - mask.float().mean() < 0.5
    res = lq.export_onnx(model, (ids, mask), str(tmp_path / "minilm.onnx"), speed_check=False)
    assert [c.name for c in res.output_checks] == res.output_names == ["output_0", "output_1"]
    tokens, pooled = res.output_checks
    assert tokens.elements == ids.numel() * 64 and not tokens.from_graph and tokens.rows == 0
    assert pooled.rows == ids.shape[0] and pooled.frac_far <= _verify.FAR_FRACTION
    with torch.no_grad():
        want = [o.numpy() for o in model(ids, mask)]
    sess = ort.InferenceSession(res.path, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_0": ids.numpy(), "input_1": mask.numpy()})
    assert res.judge(got, want) == ""  # the same rule on a second session


def test_crnn_text_recognizer_verifies(tmp_path):
    """Conv stack, BiLSTM (exported as Scan loops), per-column logits: 3-D, so no top-1 over rows."""
    torch.manual_seed(0)
    calib = [torch.randn(16, 1, 32, 128) for _ in range(4)]
    model = _settle(CRNN(), calib)
    lq.quantize_model(model)
    with torch.no_grad():
        lq.calibrate_model(model, calib)
    res = lq.export_onnx(model, torch.randn(16, 1, 32, 128), str(tmp_path / "crnn.onnx"), speed_check=False)
    (c,) = res.output_checks
    assert c.from_graph and c.elements == 16 * 32 * 37 and c.rows == 0 and c.frac_far <= _verify.FAR_FRACTION


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_the_step_after_a_linear_is_its_input_scale_times_its_largest_weight_row_norm(tmp_path, target):
    """Int8 weights (onnxruntime) or float weights through QuantizeLinear (TensorRT's qdq): the same step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5)).eval()
    x = torch.randn(64, 16)
    lq.quantize_model(model)
    with torch.no_grad():
        lq.calibrate_model(model, [x], method="max")
        wq = model[2]._weight_quantizer(model[2].weight).double()
    res = lq.export_onnx(model, x, str(tmp_path / "mlp.onnx"), target=target, speed_check=False)
    scale = float(numpy_helper.to_array(next(i for i in onnx.load(res.path).graph.initializer
                                             if "2/_input_quantizer/scale" in i.name.replace(".", "/"))))
    (c,) = res.output_checks
    assert c.from_graph and c.step == pytest.approx(scale * float(wq.pow(2).sum(1).sqrt().max()), rel=1e-3)
    assert c.rows == 64 and c.top1_differ == 0 and c.max_steps < 1


# =========================================================================== (b) a wrong rewrite fails
def _wrong_stem_scale(monkeypatch, factor: float) -> None:
    """Make BatchNorm folding write the first conv's weight scale ``factor`` times too large: a wrong rewrite."""
    from lq.export.passes import _fold_bn

    fold = _fold_bn.fold_batchnorm

    def wrong(g):
        done = fold(g)
        prod = {o: n for n in g.nodes for o in n.output}
        conv = next(n for n in g.nodes if n.op_type == "Conv" and getattr(prod.get(n.input[1]), "op_type", "")
                    == "DequantizeLinear")
        dq = prod[conv.input[1]]
        dq.input[1] = g.add_const("wrong_scale", g.const(dq.input[1]) * factor)
        return done

    monkeypatch.setattr(_fold_bn, "fold_batchnorm", wrong)


def test_a_weight_scale_five_percent_off_fails(mobilenet200, tmp_path, monkeypatch):
    model, _, x = mobilenet200
    _wrong_stem_scale(monkeypatch, 1.05)
    path = tmp_path / "wrong.onnx"
    with pytest.raises(VerificationError, match=r"(?s)output: \d+\.\d\d% of its elements are more than 6 output "
                                                r"steps .* allowed 1%.*\nMeasured: output: step .* beyond 6; max "):
        lq.export_onnx(model, x, str(path), speed_check=False)
    assert not path.exists() and (tmp_path / "wrong.unverified.onnx").exists()
    # a tolerance the user sets wins (here a loose one), and the steps are still measured
    res = lq.export_onnx(model, x, str(path), rtol=1.0, speed_check=False)
    (c,) = res.output_checks
    assert res.tolerance == pytest.approx(np.abs(_logits(model, x)).max()) and c.frac_far > _verify.FAR_FRACTION
    assert "tolerance" in res.summary() and "judged in output steps" not in res.summary()


def test_the_same_rewrite_done_right_passes(mobilenet200, tmp_path, monkeypatch):
    """The hook itself changes nothing else: with the right scale the file verifies (the test above can fail)."""
    model, _, x = mobilenet200
    _wrong_stem_scale(monkeypatch, 1.0)
    right = lq.export_onnx(model, x, str(tmp_path / "right.onnx"), speed_check=False)
    assert right.output_checks[0].frac_far <= _verify.FAR_FRACTION


# =========================================================================== (c) predictions that differ fail
def _bump_class(proto: onnx.ModelProto, cls: int, amount: float) -> None:
    """Add ``amount`` to one class's bias in the Gemm that computes the graph's output."""
    prod = {o: n for n in proto.graph.node for o in n.output}
    inits = {i.name: i for i in proto.graph.initializer}
    gemm = prod[proto.graph.output[0].name]
    assert gemm.op_type == "Gemm" and len(gemm.input) == 3, gemm
    bias = gemm.input[2]
    if bias in prod:  # the int32 bias of onnxruntime's QGemm: DequantizeLinear(q, scale)
        dq = prod[bias]
        q, scale = numpy_helper.to_array(inits[dq.input[0]]).copy(), numpy_helper.to_array(inits[dq.input[1]])
        q[cls] += np.int32(round(amount / float(np.broadcast_to(scale, q.shape)[cls])))
        inits[dq.input[0]].CopyFrom(numpy_helper.from_array(q, dq.input[0]))
    else:
        b = numpy_helper.to_array(inits[bias]).copy()
        b[cls] += amount
        inits[bias].CopyFrom(numpy_helper.from_array(b, bias))


def test_a_file_whose_predictions_differ_on_a_few_percent_fails(mobilenet200, mobilenet_file, tmp_path, monkeypatch):
    """One class's logit raised in the file by more than a tie: it becomes the top-1 class on 2-4 of 64 rows
    (3-6%), one logit column in 200 moves (0.5% of the elements, under FAR_FRACTION), and max|diff| is below the
    5% of max|output| that passed the issue's efficientnet_b0 file (a class the model never predicts makes the
    logit range wide, as efficientnet's 151-wide one)."""
    import copy

    from lq.export.finish import _finish

    model, _, x = mobilenet200
    model = copy.deepcopy(model)
    logits = _logits(model, x)
    step = mobilenet_file.output_checks[0].step
    with torch.no_grad():
        model.head[-1].bias[199] = -60 * float(np.abs(logits).max())  # never predicted: a wide logit range
    logits = _logits(model, x)
    need = logits.max(1, keepdims=True) - logits  # how much a class must rise to become a row's top-1
    beyond_tie = need > _verify.TIE_STEPS * step
    choice = None
    for amount in np.linspace(_verify.TIE_STEPS * step, 0.04 * np.abs(logits).max(), 60):
        flips = ((need <= amount) & beyond_tie).sum(0)
        cls = int(np.argmax(np.where((flips >= 2) & (flips <= 4), flips, 0)))
        if 2 <= flips[cls] <= 4:
            choice = cls, float(amount)
            break
    assert choice is not None, "no class a small bias change moves onto a few rows"
    cls, amount = choice
    remove = _finish.remove_placeholder_opset

    def bumped(proto):
        remove(proto)
        _bump_class(proto, cls, amount)

    monkeypatch.setattr(_finish, "remove_placeholder_opset", bumped)
    # judged on 256 rows (the sample's 64 and rows mixed from them): the bumped class takes a few percent of them
    with pytest.raises(VerificationError, match=r"the top-1 class differs from PyTorch's on \d+ of 256 rows") as e:
        lq.export_onnx(model, x, str(tmp_path / "flips.onnx"), speed_check=False)
    assert "output steps" not in str(e.value).split("Measured")[0]  # the elements alone would have passed
    # the rule before steps passed it
    res = lq.export_onnx(model, x, str(tmp_path / "flips.onnx"), rtol=0.05, speed_check=False)
    assert res.output_checks[0].top1_differ >= 2


# =========================================================================== (d) the judging function
def _check(got, want, step):
    return _verify.compare_output("y", np.asarray(got, np.float32), np.asarray(want, np.float32), step)


def test_counts_in_steps_and_ties_at_one_step_pass():
    want = np.linspace(-5, 5, 1000).reshape(10, 10, 10)  # no class axis: 3-D
    off = np.zeros(1000)
    off[:50] = 0.1  # exactly one step: a tie, not beyond 1
    off[50:80] = 0.15
    off[80:100] = -0.3
    off[100:108] = 0.7  # 0.8% beyond 6 steps
    c = _check(want + off.reshape(want.shape), want, 0.1)
    assert (c.elements, c.beyond_1, c.beyond_2, c.beyond_far, c.rows) == (1000, 58, 28, 8, 0)
    assert c.max_steps == pytest.approx(7, rel=1e-5) and _verify.step_verdict([c]) == ""
    off[108:113] = 0.7  # 1.3% beyond 6 steps
    c = _check(want + off.reshape(want.shape), want, 0.1)
    assert _verify.step_verdict([c]) == ("y: 1.30% of its elements are more than 6 output steps (0.6) from "
                                         "PyTorch's, allowed 1%")


def test_a_few_elements_far_off_pass_a_padding_like_fraction():
    want = np.random.default_rng(0).normal(size=(8, 50, 16))
    got = want.copy()
    got[:, -1, :4] += 1000.0  # one padding position per sequence, far off: 0.5% of the elements
    c = _check(got, want, 0.01)
    assert c.frac_far == pytest.approx(0.005) and c.max_steps > 1e4 and _verify.step_verdict([c]) == ""


def test_top1_disagreement_beyond_a_tie_fails_ties_do_not():
    rng = np.random.default_rng(1)
    want = rng.normal(size=(100, 10)).astype(np.float32)
    want[np.arange(100), rng.integers(0, 10, 100)] += 5.0  # a clear winner per row: margin >> 12 steps of 0.01
    top = want.argmax(1)
    got = want.copy()
    got[np.arange(3), (top[:3] + 1) % 10] += 10.0  # 3% of the predictions change
    c = _check(got, want, 0.01)
    assert (c.rows, c.top1_differ, c.top1_ties) == (100, 3, 0) and c.top1_agreement == pytest.approx(0.97)
    assert _verify.step_verdict([c]) == ("y: the top-1 class differs from PyTorch's on 3 of 100 rows (3.0%; ties "
                                         "within 12 steps not counted), allowed 1%")
    one = want.copy()
    one[0, (top[0] + 1) % 10] += 10.0  # 1%: allowed (elements: 1 in 1000 off)
    assert _verify.step_verdict([_check(one, want, 0.01)]) == ""
    tied = want.copy()
    runner = np.argsort(want, 1)[:, -2]
    tied[np.arange(100), runner] = want[np.arange(100), top] - 0.05  # PyTorch's two classes 5 steps apart ...
    flipped = tied.copy()
    flipped[np.arange(100), runner] += 0.03  # ... and the file, each 3 steps off, prefers the other one on
    flipped[np.arange(100), top] -= 0.03  # every row: ties
    c = _check(flipped, tied, 0.01)
    assert (c.top1_differ, c.top1_ties) == (0, 100) and _verify.step_verdict([c]) == ""


def test_one_or_two_rows_never_decide_and_a_small_sample_asks_for_more_rows():
    """A 32-row sample with one row's class changed (3.1%) is not refused on that row: the verdict needs at least
    TOP1_MIN_DIFFER rows, and first asks for TOP1_MIN_ROWS rows in all (the export adds rows mixed from the
    sample's); 3 rows of 32 still fail."""
    rng = np.random.default_rng(2)
    want = rng.normal(size=(32, 10)).astype(np.float32)
    want[np.arange(32), rng.integers(0, 10, 32)] += 5.0
    top = want.argmax(1)
    one = want.copy()
    one[0, (top[0] + 1) % 10] += 10.0
    c = _check(one, want, 0.01)
    assert (c.rows, c.top1_differ) == (32, 1) and _verify.step_verdict([c]) == ""
    assert _verify.needs_rows([c]) == _verify.TOP1_MIN_ROWS - 32
    assert _verify.needs_rows([_check(want, want, 0.01)]) == 0  # nothing differs: nothing to add
    three = want.copy()
    three[np.arange(3), (top[:3] + 1) % 10] += 10.0
    assert "on 3 of 32 rows" in _verify.step_verdict([_check(three, want, 0.01)])


def test_rows_mixed_from_the_sample_are_new_points_near_the_data():
    from lq.export.prepare import _inputs

    x = torch.randn(16, 3, 8, 8)
    ids = torch.randint(0, 100, (16, 5))
    a, b = _inputs.perturbed((x, ids), seed=1, dims=[{0: "batch"}, {0: "batch"}])
    a2, _ = _inputs.perturbed((x, ids), seed=1, dims=[{0: "batch"}, {0: "batch"}])
    assert torch.equal(a, a2) and b is ids  # deterministic; token ids kept
    half_step = float(x.abs().max()) / 127  # the noise is at most half an 8-bit step of the mixed tensor's range
    # every row lies within the box of the sample's values (a convex mix of two rows) plus that noise
    assert float(a.max()) <= float(x.max()) + half_step and float(a.min()) >= float(x.min()) - half_step
    assert not any(torch.allclose(a[i], x[j], atol=half_step) for i in range(16) for j in range(16))


def test_an_output_without_a_quantizer_counts_in_one_percent_of_its_range():
    want = np.array([[0.0, 4.0, -8.0]])  # max|output| 8: one step 0.08
    c = _check(want + np.array([[0.1, 0.2, 0.5]]), want, 0.0)
    assert not c.from_graph and c.step == pytest.approx(0.08) and (c.beyond_1, c.beyond_2, c.beyond_far) == (3, 2, 1)
    assert "no quantizer" in c.text()


def test_counts_add_up_over_the_sample_and_its_grown_copy():
    want = np.zeros((4, 3, 5)) + 1.0
    c = _check(want + 0.7, want, 0.1)
    c = _verify.compare_output("y", np.ones((4, 3, 10)), np.ones((4, 3, 10)), 0.1, into=c)
    assert (c.elements, c.beyond_far) == (180, 60) and c.frac_far == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="shape differs"):
        _check(np.zeros(3), np.zeros(4), 0.1)
