"""``sample_mean`` calibration (NNCF's default activation range): the mean over samples of each sample's largest
``|x|``, per tensor. Each value is checked against a computation of its own from the raw tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lq.calib import HistogramCalibrator
from lq.calibration import calibrate_model
from lq.config import CalibConfig
from lq.convert import quantize_model


def _per_sample_mean(*xs: torch.Tensor) -> float:
    rows = torch.cat([x.reshape(len(x), -1) for x in xs])
    rows = torch.where(torch.isfinite(rows), rows, torch.zeros(()))
    return float(rows.abs().amax(1).double().mean())


def test_amax_is_the_mean_of_each_samples_absmax_over_every_batch():
    torch.manual_seed(0)
    a, b = torch.randn(5, 3, 4, 4), 3 * torch.randn(7, 3, 4, 4)
    b[2, 1, 0, 0] = float("nan")  # skipped, as every calibrator skips it
    cal = HistogramCalibrator(num_bits=8).track_samples()
    cal.collect(a)
    cal.collect(b)
    got = float(cal.compute_amax("sample_mean"))
    assert got == pytest.approx(_per_sample_mean(a, b), rel=1e-6)
    assert got < float(cal.compute_amax("max"))  # a clipped range: below the largest |x|


def test_merged_calibrators_give_the_amax_of_all_their_data():
    torch.manual_seed(1)
    xs = [torch.randn(4, 8) * (i + 1) for i in range(4)]
    one, left, right = (HistogramCalibrator(num_bits=8).track_samples() for _ in range(3))
    for x in xs:
        one.collect(x)
    for x in xs[:2]:
        left.collect(x)
    for x in xs[2:]:
        right.collect(x)
    left.merge(right)
    assert float(left.compute_amax("sample_mean")) == pytest.approx(_per_sample_mean(*xs), rel=1e-6)
    assert float(one.compute_amax("sample_mean")) == pytest.approx(_per_sample_mean(*xs), rel=1e-6)


def test_per_channel_calibrators_refuse_it_and_old_states_still_load():
    cal = HistogramCalibrator(num_bits=8, axis=0)
    cal.collect(torch.randn(4, 3))
    with pytest.raises(ValueError, match="sample_mean.*per tensor"):
        cal.compute_amax("sample_mean")
    per_tensor = HistogramCalibrator(num_bits=8).track_samples()
    per_tensor.collect(torch.randn(4, 3))
    state = {k: v for k, v in per_tensor.state_dict().items() if not k.startswith("_sample_")}  # an older file
    fresh = HistogramCalibrator(num_bits=8).track_samples()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.compute_amax("max"), per_tensor.compute_amax("max"))
    plain = HistogramCalibrator(num_bits=8)  # collected without the per-sample maxima: said, not guessed
    plain.collect(torch.randn(4, 3))
    with pytest.raises(ValueError, match="track_samples"):
        plain.compute_amax("sample_mean")


def test_calibrate_model_sets_input_ranges_to_the_per_sample_mean():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).eval()
    x = torch.randn(32, 4, 6, 6)
    x[3] *= 20  # one sample with an outlier-sized range: max keeps it, the per-sample mean does not
    q = copy.deepcopy(model)
    quantize_model(q, glue=False)
    calibrate_model(q, list(x.split(8)), method="sample_mean", progress=False)
    assert CalibConfig(method="sample_mean").method == "sample_mean"
    with torch.no_grad():
        hidden = torch.relu(model[0](x)).flatten(1)
    assert float(q[0]._input_quantizer.amax) == pytest.approx(_per_sample_mean(x), rel=1e-5)
    assert float(q[3]._input_quantizer.amax) == pytest.approx(_per_sample_mean(hidden), rel=1e-5)
    assert float(q[0]._input_quantizer.amax) < 0.5 * float(x.abs().max())
