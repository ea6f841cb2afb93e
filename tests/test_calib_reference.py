"""lq's histogram calibration against the reference algorithms on real data.

The activations of a small CNN trained on scikit-learn's handwritten digits
(the pixels, a post-ReLU conv input with many zeros and a long tail, the
head's input) are calibrated by lq and by the plain implementation in
``_calib_reference`` (numpy, one candidate at a time) on the reference grid:

* with the range known (what :func:`lq.calibrate_model` does: a range pass,
  then one histogram of all the data on ``[0, absmax]``);
* with ``collect`` called batch by batch and no range (the reference's growing grid);

and lq must choose the same amax, within one bin of the reference grid, for
entropy (KL, also with ``stride``/``start_bin``), mse and percentile.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from _calib_reference import RefHistogram, entropy_amax, kl_at, mse_amax, percentile_amax
from lq import calib
from lq.tensor_quant import QuantDescriptor

pytest.importorskip("sklearn")
torch.set_flush_denormal(True)

LAYERS = ("conv1", "conv2", "fc")  # inputs: pixels, post-ReLU feature map, post-ReLU features
CASES = [
    ("entropy", {}),
    ("entropy", {"stride": 8, "start_bin": 256}),
    ("entropy", {"stride": 3, "start_bin": 1000}),
    ("entropy", {"unsigned": True}),
    ("entropy", {"num_bits": 6}),
    ("mse", {}),
    ("mse", {"stride": 4, "start_bin": 300}),
    ("mse", {"num_bits": 4}),
    ("percentile", {"percentile": 99.0}),
    ("percentile", {"percentile": 99.9}),
    ("percentile", {"percentile": 99.99}),
]


@pytest.fixture(scope="module")
def digits_model():
    """A DigitsCNN trained for a few seconds, its calibration batches and each layer's input activations."""
    from test_ptq_digits import DigitsCNN, digits, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        (xtr, ytr), _ = digits()
        model = train(DigitsCNN(), xtr, ytr, epochs=4)
        batches = list(xtr[:1024].split(128))
        acts = {name: [] for name in LAYERS}
        hooks = [getattr(model, name).register_forward_pre_hook(
            lambda _m, inp, name=name: acts[name].append(inp[0].detach().clone())) for name in LAYERS]
        with torch.no_grad():
            for xb in batches:
                model(xb)
        for h in hooks:
            h.remove()
    finally:
        torch.set_num_threads(threads)
    return model, batches, acts


def _lq(method, kwargs, cal):
    kw = {k: v for k, v in kwargs.items() if k in ("stride", "start_bin", "percentile")}
    return float(cal.compute_amax(method, **kw))


def _ref(method, kwargs, hist, edges):
    bits = {k: v for k, v in kwargs.items() if k in ("num_bits", "unsigned")}
    search = {k: v for k, v in kwargs.items() if k in ("stride", "start_bin")}
    if method == "entropy":
        return entropy_amax(hist, edges, **bits, **search)[0]
    if method == "mse":
        return mse_amax(hist, edges, **bits, **search)[0]
    return percentile_amax(hist, edges, kwargs["percentile"])


def _calibrator(kwargs):
    return calib.HistogramCalibrator(kwargs.get("num_bits", 8), None, kwargs.get("unsigned", False))


def _assert_same_choice(method, kwargs, cal, ref: RefHistogram, top: float):
    got, want = _lq(method, kwargs, cal), min(_ref(method, kwargs, ref.hist, ref.edges), top)
    width = ref.width
    assert abs(got - want) <= width * (1 + 1e-6), (
        f"{method} {kwargs}: lq {got:.6g}, reference {want:.6g} ({(got - want) / width:+.2f} bins of {width:.4g})")
    if method == "entropy":  # and as good by the reference's own objective, on the reference histogram
        bits = dict(num_bits=kwargs.get("num_bits", 8), unsigned=kwargs.get("unsigned", False))
        kl_got = kl_at(ref.hist, int(round(got / width)), **bits)
        kl_best = kl_at(ref.hist, int(round(want / width)), **bits)
        assert np.isfinite(kl_got) and kl_got <= kl_best * (1 + 1e-3) + 1e-9, (kl_got, kl_best)


@pytest.mark.parametrize("layer", LAYERS)
def test_known_range_matches_the_reference(digits_model, layer):
    """set_range(global absmax) then every batch: the reference algorithms on one histogram of all the data."""
    _, _, acts = digits_model
    top = max(float(a.abs().max()) for a in acts[layer])
    ref = RefHistogram(2048, start=top)
    for a in acts[layer]:
        ref.collect(a.numpy())
    total = int(ref.hist.sum())
    for method, kwargs in CASES:
        cal = _calibrator(kwargs).set_range(top)
        for a in acts[layer]:
            cal.collect(a)
        assert cal._calib_hist.shape == ref.hist.shape
        # the same bins: only values on a bin edge (float32 vs float64 binning) may sit one bin apart
        assert np.abs(cal._calib_hist.numpy() - ref.hist).sum() <= max(4, total // 10000)
        _assert_same_choice(method, kwargs, cal, ref, top)


@pytest.mark.parametrize("layer", LAYERS)
def test_batch_by_batch_matches_the_reference_growing_grid(digits_model, layer):
    """No range: the first batch starts the grid and later, larger batches append bins, as in the reference."""
    _, _, acts = digits_model
    batches = sorted(acts[layer], key=lambda a: float(a.abs().max()))  # every batch reaches further
    ref = RefHistogram(2048)
    cal = calib.HistogramCalibrator(8)
    for a in batches:
        ref.collect(a.numpy())
        cal.collect(a)
    top = float(batches[-1].abs().max())
    if layer != "conv1":  # the pixels all reach 1.0
        assert len(ref.hist) > 2048
    assert cal._calib_hist.shape == ref.hist.shape
    assert np.abs(cal._calib_hist.numpy() - ref.hist).sum() <= max(4, int(ref.hist.sum()) // 10000)
    for method, kwargs in CASES:
        if "num_bits" in kwargs or "unsigned" in kwargs:
            continue
        _assert_same_choice(method, kwargs, cal, ref, top)


@pytest.mark.parametrize("method", ["entropy", "mse", "percentile"])
def test_calibrate_model_bins_all_the_data_on_the_global_range(digits_model, method):
    """lq.calibrate_model: range pass, then the histogram pass (with every quantizer passing its input through)."""
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model

    model, batches, acts = digits_model
    q = copy.deepcopy(model)
    quantize_model(q, quant_desc_input=QuantDescriptor())
    amax = calibrate_model(q, batches, method=method, percentile=99.99)
    from_generator = copy.deepcopy(model)
    quantize_model(from_generator, quant_desc_input=QuantDescriptor())
    again = calibrate_model(from_generator, (b for b in batches), method=method, percentile=99.99)  # one-shot
    kwargs = {"percentile": 99.99} if method == "percentile" else {}
    for layer in LAYERS:
        name = f"{layer}._input_quantizer"
        top = max(float(a.abs().max()) for a in acts[layer])
        ref = RefHistogram(2048, start=top)
        for a in acts[layer]:
            ref.collect(a.numpy())
        cal = q.get_submodule(name).calibrator
        assert cal._calib_hist.shape == ref.hist.shape and float(cal._absmax) == top, name  # no grown grid
        want = min(_ref(method, kwargs, ref.hist, ref.edges), top)
        assert abs(float(amax[name]) - want) <= ref.width * (1 + 1e-6), (name, float(amax[name]), want)
        assert torch.equal(again[name], amax[name]), name


def test_calibrate_model_keeps_a_users_histogram_settings(digits_model):
    """A quantizer that already holds a HistogramCalibrator with the engine's num_bins keeps it (skip_zeros here)."""
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model

    model, batches, acts = digits_model
    q = copy.deepcopy(model)
    quantize_model(q, quant_desc_input=QuantDescriptor())
    quantizer = q.get_submodule("conv2._input_quantizer")
    mine = calib.HistogramCalibrator(8, skip_zeros=True)
    quantizer.calibrator = mine
    calibrate_model(q, batches, method="percentile", percentile=99.0)
    assert quantizer.calibrator is mine
    nonzero = sum(int((a != 0).sum()) for a in acts["conv2"])
    assert int(mine._calib_hist.sum()) == nonzero < sum(a.numel() for a in acts["conv2"])  # post-ReLU zeros left out
    top = max(float(a.abs().max()) for a in acts["conv2"])
    ref = RefHistogram(2048, start=top, skip_zeros=True)
    for a in acts["conv2"]:
        ref.collect(a.numpy())
    assert abs(float(quantizer.amax) - percentile_amax(ref.hist, ref.edges, 99.0)) <= ref.width
