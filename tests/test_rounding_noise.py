"""Verification judges a deep model's file against the model's own rounding noise (lq.export.verify._rounding_noise).

A 16-block EfficientNet-style net trained on padded digits failed the fixed count (7-24% of its logits beyond 6
steps) although its file computes what PyTorch does up to rounding: PyTorch itself, with every activation
quantizer's input moved by 1% of a step, moves as far. These tests check the noise (what it moves and by how
much), that the verdict uses it only where a model needs it, and that a wrong file still fails on such a model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import lq
from lq.callbacks import QuantSwap
from lq.config import Int8OnnxruntimeConfig
from lq.export import VerificationError
from lq.export.verify import _rounding_noise as noise
from lq.export.verify import _verify
from lq.nn import TensorQuantizer

torch.set_flush_denormal(True)


def _small(recipe_cfg) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    # 4 input channels: not a stem that runs in float on its unquantized input under int8_onnxruntime
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).eval()
    x = torch.randn(16, 4, 8, 8)
    QuantSwap(recipe_cfg).swap(model)
    with torch.no_grad():
        lq.calibrate_model(model, [x])
    return model, x


@pytest.mark.parametrize("recipe", ["int8_onnxruntime", "int8_per_channel"])
def test_each_activation_quantizer_input_moves_by_at_most_its_share_of_a_step(recipe):
    from lq.config import RECIPES

    model, x = _small(RECIPES[recipe]())
    seen: dict[str, list] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, TensorQuantizer):  # registered first: sees the input as called, before the noise
            handles.append(m.register_forward_pre_hook(
                lambda mod, i, name=name: seen.setdefault(name, []).append(i[0].detach().clone())))
            handles.append(m.register_forward_hook(  # sees what the quantizer computed with
                lambda mod, i, o, name=name: seen[name].append(i[0].detach().clone())))
    with noise.rounding_noise(model, seed=1) as n, torch.no_grad():
        model(x)
    acts = [k for k in seen if not k.endswith("weight_quantizer")]
    assert n == len(acts) == 3
    for name, (called, used) in seen.items():
        d = (used - called).abs()
        if name.endswith("weight_quantizer"):
            assert d.max() == 0, name  # the file holds the same integer weights: never moved
            continue
        q = model.get_submodule(name)
        lo, hi = q._min_range, q._max_range  # the step, from the grid's own definition
        step = float((hi - lo) / 255) if lo is not None else float(q.amax.max() / q.maxbound)
        assert 0 < float(d.max()) <= noise.NOISE_STEPS * step + 1e-6 * float(called.abs().max()), name  # + float32
        assert float(d.mean()) > 0.3 * noise.NOISE_STEPS * step  # uniform in +-NOISE_STEPS: mean |u| is half
    for h in handles:
        h.remove()


def test_the_noise_is_seeded_and_removed_on_exit_and_on_error():
    model, x = _small(Int8OnnxruntimeConfig())
    with torch.no_grad():
        clean = model(x)
        with noise.rounding_noise(model, seed=5):
            a = model(x)
        with noise.rounding_noise(model, seed=5):
            b = model(x)
        assert torch.equal(a, b) and not torch.equal(a, clean)
        with pytest.raises(RuntimeError, match="boom"), noise.rounding_noise(model):
            raise RuntimeError("boom")
        assert torch.equal(model(x), clean)  # no hook left behind
    assert all(not m._forward_pre_hooks for m in model.modules())


# =========================================================================== a deep net's file
def _deep(stages: int):
    """EfficientNet-style (MBConv, SiLU, sigmoid squeeze-excite) on real padded MNIST digits: large flat
    backgrounds repeat one boundary value over thousands of elements, so a flipped rounding tie is not rare."""
    from bench import library as L
    from test_verify_steps import _settle

    torch.manual_seed(0)
    x = L.as_32(L.mnist5k()[0][:192])
    model = L.EfficientNetSmall(classes=10, stages=stages)
    model.head = model.classifier  # what _settle zeroes the bias of
    _settle(model, list(x[:128].split(32)))
    QuantSwap(Int8OnnxruntimeConfig()).swap(model)
    with torch.no_grad():
        lq.calibrate_model(model, list(x[:128].split(32)))
    return model, x[128:]


@pytest.fixture(scope="module")
def deep():
    return _deep(stages=7)


def test_a_deep_nets_good_file_verifies_against_its_own_rounding_noise(deep, tmp_path):
    model, x = deep
    res = lq.export_onnx(model, x, str(tmp_path / "deep.onnx"), speed_check=False)
    (c,) = res.output_checks
    # the fixed count alone fails this file, and the model's own noise is what explains it
    assert c.frac_far > _verify.FAR_FRACTION and c.noise_elements == c.elements == 10 * c.rows
    # 64 rows, or TOP1_MIN_ROWS where a class differed on one of them (CPU-dependent: on an AVX2-only EPYC one did)
    assert c.rows in (len(x), _verify.TOP1_MIN_ROWS) and c.noise_rows == c.rows
    assert c.noise_frac_far > _verify.FAR_FRACTION and c.frac_far <= c.allowed_far
    assert c.allowed_far == pytest.approx(_verify.FAR_FRACTION + _verify.NOISE_FACTOR * c.noise_frac_far)
    assert "PyTorch itself under rounding-level noise" in res.verdict
    # judge() on the same inputs applies the measured noise too
    sess = _verify.make_session(str(tmp_path / "deep.onnx"))
    with torch.no_grad():
        want = model(x).numpy()
    assert res.judge(_verify.run(sess, [x.numpy()]), [want]) == ""


def test_a_wrong_scale_still_fails_on_the_deep_net(deep, tmp_path, monkeypatch):
    from test_verify_steps import _wrong_stem_scale

    model, x = deep
    _wrong_stem_scale(monkeypatch, 1.05)
    with pytest.raises(VerificationError, match="that PyTorch itself moves under rounding-level noise"):
        lq.export_onnx(model, x, str(tmp_path / "wrong.onnx"), speed_check=False)


def test_a_shallow_nets_file_is_judged_without_noise(tmp_path):
    model, x = _deep(stages=3)
    (c,) = lq.export_onnx(model, x, str(tmp_path / "shallow.onnx"), speed_check=False).output_checks
    assert c.frac_far <= _verify.FAR_FRACTION and c.noise_elements == 0 and c.allowed_far == _verify.FAR_FRACTION


def test_the_noise_widens_the_allowance_by_its_own_measure():
    want = np.zeros((100, 10))
    want[:, 0] = 10.0  # a decided classifier: class 0 on every row
    got = want.copy()
    got[:, 1:4] += 0.7  # 30% of the elements 7 steps off, no prediction changes
    c = _verify.compare_output("y", got, want, 0.1)
    assert c.frac_far == pytest.approx(0.3) and "allowed 1%" in _verify.step_verdict([c])
    noisy = want.copy()
    noisy[:, 1:3] += 0.7  # PyTorch itself: 20% beyond 6 steps under the noise
    _verify.add_noise(c, noisy, want)
    assert c.noise_frac_far == pytest.approx(0.2) and c.allowed_far == pytest.approx(0.41)
    assert _verify.step_verdict([c]) == ""
    c2 = _verify.compare_output("y", got, want, 0.1)
    _verify.add_noise(c2, want + (np.arange(10) == 1) * 0.7, want)  # 10% under noise: allowed 21% < 30%
    assert "allowed 21%" in _verify.step_verdict([c2])
