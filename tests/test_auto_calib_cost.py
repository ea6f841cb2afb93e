"""What ``auto`` costs: no forward it does not need.

The float outputs the check compares with come from the calibration's own range pass (which runs the model in
float), and a quantized model scored on a batch once is not scored on it again (the check reuses what the search
measured on the selection batches). Both must leave the choice exactly as it was: the amaxes are compared with a
run that recomputes everything.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lq.calibration as calibration
from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.nn.modules.tensor_quantizer import TensorQuantizer


def _digits(n=256):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images[:n], dtype=torch.float32).reshape(n, 1, 8, 8) / 16.0
    return list(x.split(32))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        x = torch.nn.functional.gelu(self.c2(x))
        return self.fc(x.mean((2, 3)))


class Recorder:
    """A calibration forward that notes, per call, the batch and the quantization the model ran with."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, batch):
        qs = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
        if all(q._disabled for q in qs):
            mode = "float"
        elif not any(q._if_quant and not q._disabled for q in qs):
            mode = "collect"
        else:
            mode = tuple(bytes(q.amax.detach().double().numpy().tobytes()) for q in qs
                         if q._if_quant and not q._disabled)
        self.calls.append((id(batch), mode))
        return model(batch)


def _calibrated(model, batches, forward):
    torch.manual_seed(0)
    q = copy.deepcopy(model)
    quantize_model(q, sample=batches[0])
    res = calibrate_model(q, batches, forward=forward, progress=False, bias_correction=False)  # its own passes
    return q, res


def test_auto_takes_float_outputs_from_the_range_pass_and_scores_each_state_once(monkeypatch):
    torch.manual_seed(0)
    model = Net().eval()
    batches = _digits()
    fast = Recorder()
    q1, r1 = _calibrated(model, batches, fast)
    assert r1.auto is not None and r1.auto.auto_score is not None  # the search moved off max: the check ran
    assert not [c for c in fast.calls if c[1] == "float"]  # no float forward beyond the collection passes
    assert sum(c[1] == "collect" for c in fast.calls) == 2 * len(batches)  # the range and histogram passes
    scored = [c for c in fast.calls if c[1] not in ("float", "collect")]
    assert len(scored) == len(set(scored))  # no batch scored twice with the same amaxes

    # the same calibration with nothing reused: float forwards of its own, the same search, the same amaxes
    monkeypatch.setattr(calibration, "float_outputs_known", lambda model, quantizers: False)
    slow = Recorder()
    q2, r2 = _calibrated(model, batches, slow)
    assert [c for c in slow.calls if c[1] == "float"]
    assert r2.auto.chosen == r1.auto.chosen and r2.auto.auto_score == r1.auto.auto_score
    assert r2.auto.max_score == r1.auto.max_score
    a1 = {n: m.amax for n, m in q1.named_modules() if isinstance(m, TensorQuantizer) and m.amax is not None}
    a2 = {n: m.amax for n, m in q2.named_modules() if isinstance(m, TensorQuantizer) and m.amax is not None}
    assert a1.keys() == a2.keys() and all(torch.equal(a1[k], a2[k]) for k in a1)


def test_no_float_outputs_are_taken_from_a_pass_that_quantizes():
    """A quantizer calibrated before and left out (only_uncalibrated) quantizes during the range pass: its
    outputs are not the float model's, so the check runs float forwards of its own."""
    torch.manual_seed(0)
    model = Net().eval()
    batches = _digits()
    q = copy.deepcopy(model)
    quantize_model(q, sample=batches[0])
    calibrate_model(q, batches, method="max", progress=False)
    for n, m in q.named_modules():
        if isinstance(m, TensorQuantizer) and n != "c1._input_quantizer" and not n.endswith("weight_quantizer"):
            m._amax = None  # uncalibrated again
    assert not calibration.float_outputs_known(
        q, calibration.select_quantizers(q, include_calibrated=False))
    rec = Recorder()
    calibrate_model(q, batches, only_uncalibrated=True, forward=rec, progress=False)
    assert [c for c in rec.calls if c[1] == "float"]


def test_histogram_amax_is_recomputed_when_the_histogram_changes():
    from lq.calib import HistogramCalibrator

    g = torch.Generator().manual_seed(0)
    c = HistogramCalibrator(8, None, False)
    c.collect(torch.randn(4096, generator=g))
    first = c.compute_amax("percentile", percentile=99.0)
    again = c.compute_amax("percentile", percentile=99.0)
    assert torch.equal(first, again)
    again.mul_(0)  # the caller's copy: the next answer is unchanged
    assert torch.equal(c.compute_amax("percentile", percentile=99.0), first)
    fresh = HistogramCalibrator(8, None, False)
    fresh.collect(torch.randn(4096, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(fresh.compute_amax("mse"), c.compute_amax("mse"))
    c.collect(10 * torch.randn(4096, generator=g))  # more, wider data: a new answer
    assert c.compute_amax("percentile", percentile=99.0) > 2 * first
    c.reset()
    assert c.compute_amax("percentile", percentile=99.0) is None


def test_a_histogram_collected_under_inference_mode_still_gives_its_amax():
    """Lightning's validate() collects under torch.inference_mode, whose tensors keep no version: no memo there,
    the same answers."""
    from lq.calib import HistogramCalibrator

    c = HistogramCalibrator(8, None, False)
    with torch.inference_mode():
        c.collect(torch.randn(4096, generator=torch.Generator().manual_seed(0)))
    ref = HistogramCalibrator(8, None, False)
    ref.collect(torch.randn(4096, generator=torch.Generator().manual_seed(0)))
    for method in ("mse", "percentile", "mse"):
        assert torch.equal(c.compute_amax(method), ref.compute_amax(method))
