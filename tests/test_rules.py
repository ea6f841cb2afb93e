"""Every entry of onnxruntime's rule table (:mod:`lq.rules.onnxruntime`) holds in a file lq exports, and breaking
it on purpose is caught.

Per operator family, a small model written the ordinary way (plain ``torch.nn``, quantized with the default
recipe by ``quantize_model``) is exported; the file must

* compute what the PyTorch fake-quant model computes (the export's verification, judged in output steps against
  PyTorch, which knows nothing of the table), every element within half a step (exact rewrites leave only float
  summation order in these small examples; a quantizer moved across an op it does not commute with rounds twice,
  which the verification's one-step allowance for rounding ties would let through), and
* run the family's integer kernels (``kernels``) in onnxruntime's optimized graph, every quantized layer on an
  integer kernel, and none of the float ops the example forbids.

Then the entry is broken (an op that does not commute declared commuting, or the other way round; a producer
declared not producing) and the same checks must fail: a rule the placement does not depend on, or one that is
wrong, shows up here. A new entry needs an example in :data:`EXAMPLES` (checked).
"""

from __future__ import annotations

import dataclasses

import onnx
import pytest
import torch
from torch import nn

import lq.rules
from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.export import VerificationError, export_onnx
from lq.rules import onnxruntime as ort_rules
from lq.tensor_quant import QuantDescriptor

torch.set_flush_denormal(True)


class _Matmul(nn.Module):
    """Attention-style scores: two Linears' outputs multiplied (``q @ k^T``)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

        self.o = nn.Linear(6, 8)

    def forward(self, x):
        return self.o(torch.relu(self.q(x) @ self.k(x).transpose(-1, -2)))


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(y) + y))


class _Concat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.Conv2d(16, 8, 1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        return self.c(torch.relu(torch.cat([y, self.b(y)], 1)))


class _SqueezeExcite(nn.Module):
    """MobileNetV3/EfficientNet's gate: ``x * sigmoid(conv(relu(conv(pool(x)))))``; ``mean=True``: the pool
    written as timm writes it, ``x.mean((2, 3), keepdim=True)``."""

    def __init__(self, mean: bool = False):
        super().__init__()
        self.mean = mean
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.reduce, self.expand = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.out = nn.Conv2d(8, 8, 1)
        self.pool = None if mean else nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        pooled = y.mean((2, 3), keepdim=True) if self.mean else self.pool(y)
        s = torch.sigmoid(self.expand(torch.relu(self.reduce(pooled))))
        return self.out(y * s)


class _Call(nn.Module):
    """A function call in a module of the user's own (nothing for the swap or the glue to recognize): the export's
    placement alone decides where its quantizers go."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _shifted_conv(shift: float) -> nn.Conv2d:
    """A conv whose outputs sit mostly below ``shift``'s side of 0 (HardSwish's flat part)."""
    conv = nn.Conv2d(8, 8, 3, padding=1)
    with torch.no_grad():
        conv.bias.fill_(shift)
    return conv


def _conv(*between, out=8):
    return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), *between, nn.Conv2d(8, out, 3, padding=1))


@dataclasses.dataclass
class Example:
    build: callable
    shape: tuple
    probe: callable = None  # the model for pytorch-quantization's path, where it differs from ``build``
    allowed_float: str = ""  # a layer left float by design, said in its reason (the table's note names it)
    forbid: tuple = ()  # float ops that must not be in onnxruntime's optimized graph (the head, whose output is
    # the model's, runs in float: no quantizer reads it)


#: one model per family of onnxruntime's table
EXAMPLES = {
    "conv": Example(lambda: _conv(nn.ReLU()), (4, 8, 12, 12)),
    "conv_transpose": Example(lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                                    nn.ConvTranspose2d(8, 8, 2, stride=2), nn.ReLU(),
                                                    nn.Conv2d(8, 8, 3, padding=1)), (4, 8, 8, 8)),
    "gemm": Example(lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), (8, 16),
                    forbid=("Relu", "Gemm", "FusedGemm")),
    "matmul": Example(_Matmul, (4, 6, 16), forbid=("MatMul", "FusedMatMul")),
    "add": Example(_Residual, (4, 8, 10, 10), forbid=("Add", "Relu")),
    "concat": Example(_Concat, (4, 8, 10, 10), forbid=("Concat",)),
    "average_pool": Example(lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                                  nn.Flatten(), nn.Linear(8, 4)), (4, 8, 12, 12),
                            forbid=("AveragePool", "GlobalAveragePool"),
                            probe=lambda: _conv(nn.ReLU(), nn.AvgPool2d(2), nn.ReLU())),
    "relu": Example(lambda: _conv(nn.ReLU()), (4, 8, 12, 12), forbid=("Relu",)),
    "clip": Example(lambda: _conv(nn.ReLU6()), (4, 8, 12, 12), forbid=("Clip",)),
    "max_pool": Example(lambda: _conv(nn.ReLU(), nn.MaxPool2d(2)), (4, 8, 12, 12),
                        probe=lambda: _conv(nn.ReLU(), _Call(lambda x: nn.functional.max_pool2d(x, 2)))),
    "data_movement": Example(lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                                   nn.Linear(8 * 6 * 6, 4)), (4, 8, 6, 6),
                             ),
    # 4 channels: below ORT_NHWC_UPSAMPLE_MIN_CHANNELS the upsample stays a Resize
    "resize": Example(lambda: nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU(),
                                            nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(4, 8, 3, padding=1)),
                      (4, 8, 6, 6),
                      ),
    "prelu": Example(lambda: _conv(nn.PReLU(8)), (4, 8, 12, 12), allowed_float="PReLU/LeakyReLU"),
    "leaky_relu": Example(lambda: _conv(nn.LeakyReLU(0.1)), (4, 8, 12, 12), allowed_float="PReLU/LeakyReLU"),
    "sigmoid": Example(_SqueezeExcite, (4, 8, 10, 10), forbid=("Sigmoid",), probe=lambda: _conv(_Call(torch.sigmoid))),
    "hardswish": Example(lambda: _conv(nn.Hardswish()), (4, 8, 12, 12), 
                       probe=lambda: nn.Sequential(_shifted_conv(-2.0), _Call(nn.functional.hardswish),
                                                   nn.Conv2d(8, 8, 3, padding=1))),
}


def calibrated_example(family: str, descriptors: bool = False) -> nn.Module:
    """The family's example quantized with the default recipe, or (``descriptors``) on pytorch-quantization's path
    (symmetric activations, no output quantizers from the glue: the export's own placement does the work), and
    calibrated (max) on four seeded batches."""
    ex = EXAMPLES[family]
    torch.manual_seed(0)
    model = (ex.probe if descriptors and ex.probe else ex.build)().eval()
    if descriptors:
        quantize_model(model, quant_desc_input=QuantDescriptor())
    else:
        quantize_model(model)
    with torch.no_grad():
        calibrate_model(model, sample_batches(family), method="max")
    return model


def sample_batches(family: str, n: int = 4, seed: int = 1) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(EXAMPLES[family].shape, generator=gen) for _ in range(n)]


def _export(family: str, tmp_path, descriptors: bool = False):
    model = calibrated_example(family, descriptors)
    return export_onnx(model, sample_batches(family)[0], tmp_path / f"{family}{'_pq' if descriptors else ''}.onnx",
                       speed_check=False)


def _on_integers(family: str, path) -> tuple[int, int]:
    """How many ops of the family are in the file, and how many of them read only dequantized values and are read
    only by QuantizeLinear (``DQ -> op -> Q``: what the runtime fuses into an integer kernel, or runs on the
    integers)."""
    model = onnx.load(path)
    rule = next(r for r in ort_rules.RULES if r.family == family)
    made = {o: n for n in model.graph.node for o in n.output}
    consts = {i.name for i in model.graph.initializer}
    readers: dict = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    present = on_integers = 0
    for n in model.graph.node:
        if n.op_type not in rule.ops:
            continue
        present += 1
        data = [i for i in n.input[:1 if n.op_type not in ("Add", "Concat", "MatMul") else None] if i and i not in consts]
        if data and all(made.get(i) is not None and made[i].op_type == "DequantizeLinear" for i in data) and \
                readers.get(n.output[0]) and all(r.op_type == "QuantizeLinear" for r in readers[n.output[0]]):
            on_integers += 1
    return present, on_integers


def _problems(family: str, res) -> list[str]:
    """What is wrong with the exported example: no op of a family that runs on integers between DQ and Q in the
    file, the family's kernels absent, a quantized layer on a float kernel, a forbidden float op in onnxruntime's
    graph."""
    rule = next(r for r in ort_rules.RULES if r.family == family)
    out = []
    present, on_integers = _on_integers(family, res.path)
    if (rule.produces or rule.kernels) and not on_integers:  # a producer: at least one (the head's output is float)
        out.append(f"no {'/'.join(rule.ops)} between DequantizeLinear and QuantizeLinear in the file")
    elif rule.commutes and on_integers < present:  # a commuting op runs on the integers (or is dropped there)
        out.append(f"{present - on_integers} {'/'.join(rule.ops)} in float in the file")
    if rule.kernels and not any(res.ort_ops.get(k, 0) for k in rule.kernels):
        out.append(f"none of {rule.kernels} in onnxruntime's graph: {dict(res.ort_ops)}")
    floats = {op for r in ort_rules.RULES if not r.kernels and r.produces for op in r.ops}  # no integer kernel
    ok = ("model output",) + ((EXAMPLES[family].allowed_float,) if EXAMPLES[family].allowed_float else ())
    out += [f"{k.layer} runs {k.kernel}: {k.reason}" for k in res.layer_kernels  # the head's output: float
            if not k.integer and not k.by_choice and k.op not in floats and not any(s in (k.reason or "") for s in ok)]
    out += [f"float {op} in onnxruntime's graph" for op in EXAMPLES[family].forbid if res.ort_ops.get(op, 0)]
    out += [f"{c.name} off by up to {c.max_steps:.2f} steps" for c in res.output_checks if c.max_steps > 0.5]
    return out


def test_a_squeeze_excite_written_with_mean_runs_like_the_pooled_one(tmp_path, monkeypatch):
    """timm's squeeze-excite averages with ``x.mean((2, 3), keepdim=True)``: the conv before it runs integer
    and the mean as onnxruntime's integer global average pool, as with ``nn.AdaptiveAvgPool2d``."""
    monkeypatch.setitem(EXAMPLES, "sigmoid", dataclasses.replace(EXAMPLES["sigmoid"], build=lambda: _SqueezeExcite(True)))
    res = _export("sigmoid", tmp_path)
    assert res.verified and _problems("sigmoid", res) == []
    assert res.ort_ops.get("QLinearGlobalAveragePool", 0) == 1 and res.ort_ops.get("QLinearMul", 0) == 1


def test_every_family_has_an_example():
    assert sorted(r.family for r in ort_rules.RULES) == sorted(EXAMPLES)
    ops = [op for r in ort_rules.RULES for op in r.ops]
    assert len(ops) == len(set(ops)), "an op in two families"


#: (family, descriptors) -> the intact example's problems, measured once per session (each export takes seconds)
_INTACT: dict = {}


@pytest.mark.parametrize("family", sorted(EXAMPLES))
def test_the_rule_holds_in_the_exported_file(family, tmp_path):
    res = _export(family, tmp_path)
    assert res.verified
    _INTACT[(family, False)] = _problems(family, res)
    assert _INTACT[(family, False)] == []


def _broken(family: str, monkeypatch) -> None:
    """Break the family's entry: flip ``commutes``; for a producer, declare it not producing."""
    rule = next(r for r in ort_rules.RULES if r.family == family)
    if rule.produces:
        monkeypatch.setattr(ort_rules, "RULES", tuple(
            dataclasses.replace(r, produces=False) if r is rule else r for r in ort_rules.RULES))
        return
    ops = set(lq.rules.COMMUTING_OPS)
    ops = ops - set(rule.ops) if rule.commutes else ops | set(rule.ops)
    monkeypatch.setattr(lq.rules, "COMMUTING_OPS", frozenset(ops))


def _outcomes(family: str, tmp_path, cache: dict | None = None) -> list:
    """Per quantization path, the problems of the exported example, or "wrong numbers" when verification fails;
    ``cache``: outcomes already measured (the intact table's)."""
    out = []
    for descriptors in (False, True):
        if cache is not None and (family, descriptors) in cache:
            out.append(cache[(family, descriptors)])
            continue
        try:
            out.append(_problems(family, _export(family, tmp_path, descriptors)))
        except VerificationError:
            out.append("wrong numbers")
    return out


@pytest.mark.parametrize("family", sorted(EXAMPLES))
def test_a_broken_rule_is_caught(family, tmp_path, monkeypatch):
    """With the entry broken, one of the two quantization paths computes wrong numbers (a quantizer moved across
    an op it does not commute with) or has more problems than with the entry intact (a layer that lost its
    integer kernel, a float op the example forbids)."""
    intact = _outcomes(family, tmp_path, _INTACT)
    assert "wrong numbers" not in intact
    _broken(family, monkeypatch)
    broken = _outcomes(family, tmp_path)
    assert any(b == "wrong numbers" or len(b) > len(i) for b, i in zip(broken, intact)), (intact, broken)


def test_the_float_conv_rule_follows_its_measurement():
    """``ort_prefers_float_conv`` against the measurement it cites (``python -m bench.conv_kernels``, the committed
    docs/results/conv_kernels.json): where it picks the integer kernel, that kernel was not slower (>= 0.9x, within
    timing noise); where it picks float, it gives up at most a modest win (<= 1.5x: the rule is conservative for 1-D
    convs of 32-127 taps, and for heads of 1-2 output channels, whose conv alone ran 0.87-0.90x as QLinearConv on an
    AVX-512 VNNI Xeon and 1.03-1.20x on an AMX one, before the Q/DQ pair the integer head needs)."""
    import json
    from pathlib import Path

    rows = json.loads((Path(__file__).resolve().parents[1] / "docs/results/conv_kernels.json").read_text())["rows"]
    assert len(rows) >= 10
    for r in rows:
        if r.get("head"):  # a conv writing a model output: the head rule picks float only where float was faster
            head_float = ort_rules.ort_prefers_float_head(r["out_channels"])
            assert (r["speedup"] <= 1.5) if head_float else (r["speedup"] >= 0.9), r
            continue
        cpg, products = r["channels_per_group"], r["products"]
        float_chosen = ort_rules.ort_prefers_float_conv(cpg, (products // cpg,))
        assert (r["speedup"] <= 1.5) if float_chosen else (r["speedup"] >= 0.9), r
    assert any(r.get("head") and ort_rules.ort_prefers_float_head(r["out_channels"]) for r in rows)


def test_the_channel_padding_rule_follows_its_measurement():
    """``ort_padded_input_channels`` against ``python -m bench.conv_kernels`` (the committed
    docs/results/conv_kernels.json), which times each 2-D dense conv with too few or unaligned input channels both
    ways: where lq pads, the padded conv was not slower than the unpadded one (within 5%), and where it does not,
    padding would not have been faster."""
    import json
    from pathlib import Path

    rows = json.loads((Path(__file__).resolve().parents[1] / "docs/results/conv_kernels.json").read_text())["rows"]
    timed = [r for r in rows if r.get("other_ms") is not None]
    assert sum(r["padded_by_lq"] for r in timed) >= 4 and sum(not r["padded_by_lq"] for r in timed) >= 2
    for r in timed:
        assert r["int8_ms"] <= 1.05 * r["other_ms"], r  # lq's choice (padded or not) at least as fast as the other
