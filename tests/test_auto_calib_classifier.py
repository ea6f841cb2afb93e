"""``method="auto"`` on a classifier: the R2-chosen ranges tried against NNCF's per-sample ranges by top-1 agreement.

The case: a digits classifier calibrated on scans among which a few are corrupted (every pixel saturated
hundreds of times over). Their logits dominate the float output's variance, so output R2 keeps the ranges that
hold them (max) while the grid this leaves on ordinary images rounds most pixels away; the mean of each sample's
largest ``|x|`` clips the corrupted scans and keeps the digits. Every value below is checked against a
computation of its own: the per-sample means from the float model's activations, the agreement from the two
models' argmaxes, the p-value from scipy's binomial test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lq import auto_calib
from lq.calib._fidelity import output_rows
from lq.calib._forward import default_forward
from lq.calibration import calibrate_model
from lq.convert import quantize_model

torch.set_flush_denormal(True)


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).reshape(-1, 64) / 16.0
    return x, torch.tensor(d.target)


@pytest.fixture(scope="module")
def classifier():
    """An MLP trained on the first 1,200 digits (held out: the rest)."""
    x, y = _digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        for idx in torch.randperm(1200, generator=g).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def _calibration(corrupted: bool) -> list[torch.Tensor]:
    x, _ = _digits()
    c = x[:256].clone()
    if corrupted:
        c[[5, 133]] *= 400.0  # two corrupted scans among 256
    return list(c.split(32))


def _per_sample_mean(rows: torch.Tensor) -> float:
    return float(rows.reshape(len(rows), -1).abs().amax(1).double().mean())


def _quantized(model):
    q = copy.deepcopy(model)
    quantize_model(q, sample=_digits()[0][:8])
    return q


def _agreement(a, b, xs) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([a(x).argmax(1) == b(x).argmax(1) for x in xs])


def test_mcnemar_p_is_the_one_sided_binomial_test():
    from scipy.stats import binomtest

    for better, worse in [(0, 0), (5, 0), (3, 3), (10, 2), (2, 10), (30, 14), (120, 90)]:
        want = 1.0 if better + worse == 0 else binomtest(better, better + worse, 0.5, alternative="greater").pvalue
        assert auto_calib.mcnemar_p(better, worse) == pytest.approx(want, rel=1e-9), (better, worse)


def test_a_classifier_takes_the_per_sample_ranges_where_they_agree_significantly_more(classifier):
    batches = _calibration(corrupted=True)
    q = _quantized(classifier)
    res = calibrate_model(q, batches, progress=False)
    a = res.auto
    assert a is not None and a.alternative == "sample_mean" and a.judged_by == "top1"
    assert a.p_value < auto_calib.SIGNIFICANCE
    # every input quantizer holds the mean of each calibration sample's largest |input|, from the float model
    x = torch.cat(batches)
    with torch.no_grad():
        hidden = torch.relu(classifier[0](x))
    assert float(q[0]._input_quantizer.amax) == pytest.approx(_per_sample_mean(x), rel=1e-5)
    assert float(q[2]._input_quantizer.amax) == pytest.approx(_per_sample_mean(hidden), rel=1e-5)
    assert getattr(q[0]._input_quantizer, auto_calib.CHOICE_ATTR) == "sample_mean"
    # the reported agreement is the model's own on the check rows (all 8 batches)
    assert a.agreement[1] == pytest.approx(float(_agreement(q, classifier, batches).double().mean()))
    assert a.agreement[1] > a.agreement[0] and a.agreement[1] >= a.agreement[2]
    assert "took sample_mean instead" in str(a)
    # on held-out digits it agrees with float more often than max's ranges do
    held = [_digits()[0][1200:]]
    at_max = _quantized(classifier)
    calibrate_model(at_max, batches, method="max", progress=False)
    assert _agreement(q, classifier, held).double().mean() > _agreement(at_max, classifier, held).double().mean() + 0.05
    # the bias correction is judged as the ranges were: by top-1 agreement, not by the R2 these ranges give up
    assert res.bias_correction is not None and res.bias_correction.judge == "top1"


def test_clean_calibration_keeps_the_choice_and_its_ranges(classifier, monkeypatch):
    batches = _calibration(corrupted=False)
    q = _quantized(classifier)
    a = calibrate_model(q, batches, progress=False).auto
    assert a.alternative is None and a.judged_by == "r2" and a.agreement is not None
    assert a.p_value >= auto_calib.SIGNIFICANCE and "kept the choice" in str(a)
    # the same amaxes as with the alternative never tried
    monkeypatch.setattr(auto_calib, "_classifier_alternative", lambda *args, **kw: None)
    ref = _quantized(classifier)
    calibrate_model(ref, batches, progress=False)
    for (n, qa), (_, qb) in zip(q.named_modules(), ref.named_modules()):
        if hasattr(qa, "amax") and qa.amax is not None and n:
            assert torch.equal(qa.amax, qb.amax), n


class _Scores(nn.Module):
    """The classifier's logits as one row of a sequence: not one row of class scores per sample."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).unsqueeze(1)


def test_outputs_that_are_not_class_scores_are_not_judged_by_top1(classifier):
    q = _Scores(copy.deepcopy(classifier))
    quantize_model(q, sample=_digits()[0][:8])
    a = calibrate_model(q, _calibration(corrupted=True), progress=False).auto
    assert a.agreement is None and a.alternative is None and a.judged_by == "r2"


def test_a_correction_forced_on_behind_named_per_sample_ranges_is_judged_by_top1(classifier):
    q = _quantized(classifier)
    res = calibrate_model(q, _calibration(corrupted=True), method="sample_mean", bias_correction=True, progress=False)
    assert res.auto is None and res.bias_correction.judge == "top1"
    s = _Scores(copy.deepcopy(classifier))  # no class scores: top-1 means nothing there, R2 judges
    quantize_model(s, sample=_digits()[0][:8])
    res = calibrate_model(s, _calibration(corrupted=True), method="sample_mean", bias_correction=True, progress=False)
    assert res.bias_correction.judge == "r2"


class _Residual(nn.Module):
    """A classifier with a residual add: the add's operands get quantizers of their own (glue), outside the
    quantized layers the per-role search moves."""

    def __init__(self, model):
        super().__init__()
        self.fc1, self.fc2, self.head = model[0], nn.Linear(64, 64), model[2]
        with torch.no_grad():
            self.fc2.weight.mul_(0.1)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.head(h + self.fc2(h))


def test_the_alternative_moves_every_auto_quantizer_as_the_named_method_does(classifier):
    batches = _calibration(corrupted=True)
    torch.manual_seed(3)
    model = _Residual(copy.deepcopy(classifier)).eval()
    auto, named = copy.deepcopy(model), copy.deepcopy(model)
    for m in (auto, named):
        quantize_model(m, sample=_digits()[0][:8])
    a = calibrate_model(auto, batches, progress=False, bias_correction=False).auto
    calibrate_model(named, batches, method="sample_mean", progress=False)
    assert a.alternative == "sample_mean"
    qa = {n: m for n, m in auto.named_modules() if hasattr(m, "amax") and m.amax is not None and n}
    qn = dict(named.named_modules())
    assert any("lq_glue" in n for n in qa), sorted(qa)  # the add's quantizers are there to move
    for n, q in qa.items():
        assert torch.equal(q.amax, qn[n].amax), n
        if "weight" not in n.rsplit(".", 1)[-1]:
            assert getattr(q, auto_calib.CHOICE_ATTR) == "sample_mean", n


def test_max_replaces_a_choice_that_agrees_significantly_less_often(classifier, monkeypatch):
    """The same judge for max everywhere: a choice (and per-sample ranges) that clip nearly everything, against max."""
    batches = _calibration(corrupted=False)
    q = _quantized(classifier)
    calibrate_model(q, batches, progress=False, bias_correction=False)
    names = [n for n, m in q.named_modules() if n.endswith("_input_quantizer")]
    members = auto_calib.group_members(q, auto_calib.groups(q, names))
    moving = [m for qs in members.values() for m in qs]
    monkeypatch.setattr(auto_calib, "PERCENTILE", 5.0)  # a "choice" clipping at the 5th percentile ...
    for m in moving:  # ... and per-sample ranges a twentieth of what the samples reached
        m.calibrator._sample_absmax_sum = m.calibrator._sample_absmax_sum / 20
    result = auto_calib.AutoResult({g: "percentile" for g in members}, {g: "percentile" for g in members})
    auto_calib._load(members, result.methods)
    with torch.no_grad():
        known = {id(b): output_rows(classifier(b), b) for b in batches}
    auto_calib._classifier_alternative(q, members, [], result, batches, default_forward,
                                       lambda m: auto_calib._amax_key(moving), {}, known, None)
    at_max = _quantized(classifier)
    calibrate_model(at_max, batches, method="max", progress=False)
    assert result.alternative == "max" and set(result.methods.values()) == {"max"}
    assert result.agreement[2] > result.agreement[0] and result.p_value < auto_calib.SIGNIFICANCE
    assert result.agreement[2] == pytest.approx(float(_agreement(at_max, classifier, batches).double().mean()))
    for m in moving:  # the model holds max's ranges
        name = next(n for n, x in q.named_modules() if x is m)
        assert torch.equal(m.amax, dict(at_max.named_modules())[name].amax), name
