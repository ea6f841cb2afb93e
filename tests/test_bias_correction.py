"""Bias correction (lq/calib/bias_correction.py, lq/nn/modules/_bias_shift.py): each quantized layer's per-channel
mean output shift, measured here by hand against a float copy of the model, becomes that layer's bias shift, layer
by layer; with quantizers off (and after dequantize_model) the model is the float model; checkpoints carry the
shifts; the file equals the corrected model with no new node; calibrating again does not correct twice; an error
leaves every shift as it was; every DDP rank takes the same corrections."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lq.calib import bias_correction as bc
from lq.calib._fidelity import quantization_disabled
from lq.calibration import calibrate_model, default_forward
from lq.config import CalibConfig
from lq.convert import quantize_model
from lq.glue._at_calls import outside
from lq.nn.modules import _bias_shift as shift
from lq.tensor_quant import QuantDescriptor


def _digits(n: int = 128, seed: int = 0) -> torch.Tensor:
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x[torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:n]]


class Net(nn.Module):
    """conv (no bias) -> BatchNorm in a helper with ``F.relu``, a conv with a bias, a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def stem(self, x):
        return F.relu(self.bn1(self.conv1(x)))

    def forward(self, x):
        x = F.relu(self.conv2(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    m = Net()
    with torch.no_grad():  # BatchNorm statistics a trained net could have
        m.bn1.running_mean.uniform_(-0.2, 0.2)
        m.bn1.running_var.uniform_(0.02, 0.2)
        m.bn1.weight.uniform_(0.5, 1.5)
    return m.eval()


def _quantized(m: nn.Module, x: torch.Tensor, weight_bits: int = 4) -> nn.Module:
    """``m`` quantized (coarse 4-bit weights: a shift well above float noise) and calibrated with max, no
    correction."""
    quantize_model(m, quant_desc_input=QuantDescriptor(num_bits=8),
                   quant_desc_weight=QuantDescriptor(num_bits=weight_bits, axis=(0,)), glue=False)
    calibrate_model(m, list(x.split(32)), method="max", bias_correction=False, progress=False)
    return m


def _site_means(model: nn.Module, modules: list[nn.Module], x: torch.Tensor, quantized: bool) -> list[torch.Tensor]:
    """Per-channel means of each module's output on ``x``, by hooks written here (channel axis 1, or last)."""
    got: dict = {}

    def hook(mod, args, out):
        axis = -1 if isinstance(mod, nn.Linear) else 1
        with outside():  # not among the calls of the forward the glue quantizes at (Residual's mean)
            got[mod] = out.detach().double().movedim(axis, 0).reshape(out.shape[axis], -1).mean(1)

    hs = [mod.register_forward_hook(hook) for mod in modules]
    try:
        with torch.no_grad():
            if quantized:
                model(x)
            else:
                with quantization_disabled(model):
                    model(x)
    finally:
        for h in hs:
            h.remove()
    return [got[mod] for mod in modules]


def test_each_layer_gets_its_shift_layer_by_layer():
    x = _digits(64)
    q = _quantized(_net(), x)
    before = copy.deepcopy(q)
    res = bc.correct_biases(q, [x], default_forward)  # one batch: estimated on it, nothing to judge on
    assert set(res.corrected) == {"conv1", "conv2", "fc"}, res
    assert res.rows == 64 and not res.not_helping and not res.skipped
    # no parameter moved: the shifts are buffers of their own
    for k, v in before.state_dict().items():
        assert torch.equal(q.state_dict()[k], v), k
    assert {k for k in q.state_dict()} - set(before.state_dict()) == {f"{n}.{shift.BUFFER}" for n in res.corrected}
    # the first layer's shift, by hand: float mean minus quantized mean of its output on the same input
    with torch.no_grad():
        w = before.conv1.weight
        want = (F.conv2d(x, w, None, 1, 1) - F.conv2d(before.conv1._input_quantizer(x), before.conv1._weight_quantizer(w),
                                                      None, 1, 1)).double().mean((0, 2, 3))
    assert want.abs().max() > 1e-4  # a shift worth correcting
    torch.testing.assert_close(shift.bias_shift(q.conv1).double(), want, atol=1e-6, rtol=1e-5)
    # layer by layer: every corrected layer's quantized mean equals the float model's, behind corrected layers
    sites_q = [q.conv1, q.conv2, q.fc]
    sites_fp = [before.conv1, before.conv2, before.fc]
    for got, ref in zip(_site_means(q, sites_q, x, True), _site_means(before, sites_fp, x, False)):
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    # the model's output is closer to float than without the corrections
    with torch.no_grad(), quantization_disabled(before):
        ref = before(x)
    with torch.no_grad():
        assert F.mse_loss(q(x), ref) < F.mse_loss(before(x), ref)


def test_with_quantizers_off_it_is_the_float_model_and_checkpoints_carry_the_shifts():
    from lq.convert import dequantize_model

    x = _digits(64)
    fp = _net()
    q = _quantized(copy.deepcopy(fp), x)
    bc.correct_biases(q, [x], default_forward)
    with torch.no_grad():
        want = q(x)
        with quantization_disabled(q):
            torch.testing.assert_close(q(x), fp(x), rtol=0, atol=0)
    fresh = _net()  # a freshly quantized model takes the checkpoint, shifts included
    quantize_model(fresh, quant_desc_input=QuantDescriptor(num_bits=8),
                   quant_desc_weight=QuantDescriptor(num_bits=4, axis=(0,)), glue=False)
    fresh.load_state_dict(q.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), want, rtol=0, atol=0)
    dequantize_model(q)
    assert shift.BUFFER not in q.conv1._buffers and not any(shift.BUFFER in k for k in q.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(q(x), fp(x), rtol=0, atol=0)


def test_calibrating_again_does_not_correct_twice():
    x = _digits(64)
    q = _quantized(_net(), x)
    bc.correct_biases(q, [x], default_forward)
    once = {k: v.clone() for k, v in q.state_dict().items()}
    bc.correct_biases(q, [x], default_forward)
    assert q.state_dict().keys() == once.keys()
    for k, v in q.state_dict().items():
        torch.testing.assert_close(v, once[k], atol=1e-6, rtol=0, msg=k)


def test_an_error_leaves_every_shift_as_it_was():
    x = _digits(64)
    q = _quantized(_net(), x)
    bc.correct_biases(q, [x], default_forward)  # an earlier correction, to be kept
    before = {k: v.clone() for k, v in q.state_dict().items()}
    calls = []

    def forward(model, batch):
        calls.append(1)
        if len(calls) == 2:  # the quantized pass, after the float pass
            raise RuntimeError("boom")
        return model(batch)

    with pytest.raises(RuntimeError, match="boom"):
        bc.correct_biases(q, [x], forward)
    assert q.state_dict().keys() == before.keys()
    for k, v in q.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_judging_batches_refuse_a_correction_that_does_not_carry_over():
    """Estimated on x, judged on -x: a symmetric quantizer's error flips sign with its input, so the layer's
    correction makes the judging batch's mean error three times worse and is taken back."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 16)).eval()
    quantize_model(m, quant_desc_input=QuantDescriptor(num_bits=4), quant_desc_weight=QuantDescriptor(num_bits=4),
                   glue=False)
    x = _digits(64).reshape(64, 64)
    calibrate_model(m, [x, -x], method="max", bias_correction=False, progress=False)
    bias = m[0].bias.clone()
    res = bc.correct_biases(m, [x, -x], default_forward)
    assert res.not_helping == ["0"] and not res.corrected, res
    assert torch.equal(m[0].bias, bias) and shift.bias_shift(m[0]) is None


def test_the_gain_rule_is_the_squared_error_difference():
    """``c^2 - 2 c d0`` summed over channels is (d0 - c)^2 - d0^2: the squared mean error with the shift minus
    without it."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        c, d0 = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
        want = float(((d0 - c) ** 2).sum() - (d0 ** 2).sum())
        assert bc.squared_error_change(c, d0) == pytest.approx(want, rel=1e-12, abs=1e-12)


class Shared(nn.Module):
    """A conv called twice (one bias for two inputs) is left alone; a bias-less conv gets its shift as its bias."""

    def __init__(self):
        super().__init__()
        self.twice = nn.Conv2d(1, 1, 3, padding=1)
        self.bare = nn.Conv2d(1, 4, 3, padding=1, bias=False)

    def forward(self, x):
        return self.bare(self.twice(self.twice(x)))


def test_a_layer_called_twice_is_named_and_left_alone():
    x = _digits(32)
    q = _quantized(Shared().eval(), x, weight_bits=4)
    res = bc.correct_biases(q, [x], default_forward)
    assert set(res.skipped) == {"twice"} and "called 2 times" in res.skipped["twice"], res
    assert set(res.corrected) == {"bare"} and q.bare.bias is None and shift.bias_shift(q.bare) is not None


def test_stacking_keeps_the_structure_and_falls_back_to_the_first_batch():
    a, b = torch.randn(4, 3), torch.randn(5, 3)
    y = torch.arange(9)
    got = bc.stack_batches([(a, y[:4]), (b, y[4:])])
    assert isinstance(got, tuple) and torch.equal(got[0], torch.cat([a, b])) and torch.equal(got[1], y)
    d = bc.stack_batches([{"ids": torch.ones(2, 5)}, {"ids": torch.ones(3, 7)}])  # padded to other lengths
    assert d["ids"].shape == (2, 5)
    assert bc.stack_batches([torch.randn(100, 2)] * 3, rows=128).shape == (128, 2)
    assert bc.stack_batches([torch.randn(64, 1000)] * 4, elements=32_000).shape == (32, 1000)


def test_calibrate_model_corrects_when_asked_and_says_so():
    x = _digits(128)
    q = _net()
    quantize_model(q, quant_desc_input=QuantDescriptor(num_bits=8),
                   quant_desc_weight=QuantDescriptor(num_bits=4, axis=(0,)), glue=False)
    plain = copy.deepcopy(q)
    res = calibrate_model(q, list(x.split(16)), method="max", progress=False, bias_correction=True)
    assert isinstance(res.bias_correction, bc.BiasCorrectionResult) and res.bias_correction.corrected
    assert res.bias_correction.rows == 64  # the even ones of the 8 check batches, stacked
    off = calibrate_model(plain, list(x.split(16)), method="max", progress=False)  # a named method: off
    assert off.bias_correction is None and not any(shift.bias_shift(m) is not None for m in plain.modules()
                                                   if isinstance(m, (nn.Conv2d, nn.Linear)))
    assert CalibConfig().bias_correction is None and CalibConfig(bias_correction=True).bias_correction is True
    assert CalibConfig().calibrate_kwargs()["bias_correction"] is None


def test_the_default_corrects_with_auto_where_it_can_judge():
    """No ``bias_correction`` given: part of what ``auto`` decides (estimated and judged, as when asked), where
    there are two calibration batches or more; ``False`` turns it off; one batch leaves nothing to judge by."""
    x = _digits(128)
    q = _net()
    quantize_model(q, quant_desc_input=QuantDescriptor(num_bits=8),
                   quant_desc_weight=QuantDescriptor(num_bits=4, axis=(0,)), glue=False)
    models = [copy.deepcopy(q) for _ in range(4)]
    default = calibrate_model(models[0], list(x.split(16)), progress=False)
    asked = calibrate_model(models[1], list(x.split(16)), progress=False, bias_correction=True)
    assert isinstance(default.bias_correction, bc.BiasCorrectionResult) and default.bias_correction.rows == 64
    assert default.bias_correction.corrected == asked.bias_correction.corrected
    for a, b in zip(models[0].modules(), models[1].modules()):
        assert (shift.bias_shift(a) is None) == (shift.bias_shift(b) is None)
        if shift.bias_shift(a) is not None:
            assert torch.equal(shift.bias_shift(a), shift.bias_shift(b))
    no = calibrate_model(models[2], list(x.split(16)), progress=False, bias_correction=False)
    one = calibrate_model(models[3], [x[:16]], progress=False)
    for r, m in ((no, models[2]), (one, models[3])):
        assert r.bias_correction is None and not any(shift.bias_shift(k) is not None for k in m.modules())
    with pytest.raises(ValueError, match="bias_correction"):
        CalibConfig(bias_correction="yes")


def test_the_file_is_the_corrected_model(tmp_path):
    """The export verifies the corrected model against its file, whose output moved with the shifts, with the
    nodes of the uncorrected model's file (the shift is in the bias initializer)."""
    from lq.export import export_onnx
    from lq.export.verify._verify import make_session

    x = _digits(64)
    q = _quantized(_net(), x, weight_bits=8)
    plain = copy.deepcopy(q)
    assert bc.correct_biases(q, [x], default_forward).corrected
    p, p0 = str(tmp_path / "bc.onnx"), str(tmp_path / "plain.onnx")
    res = export_onnx(q, x[:8], p, speed_check=False)
    export_onnx(plain, x[:8], p0, speed_check=False)
    assert res.verdict
    import onnx

    assert sorted(n.op_type for n in onnx.load(p).graph.node) == sorted(n.op_type for n in onnx.load(p0).graph.node)
    got = make_session(p).run(None, {make_session(p).get_inputs()[0].name: x.numpy()})[0]
    got0 = make_session(p0).run(None, {make_session(p0).get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = q(x).numpy()
    assert np.abs(got - want).max() < np.abs(got0 - want).max()


def _ddp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x = _digits(128, seed=rank)  # the ranks see different data, in different amounts
        batches = list(x[: 64 if rank == 0 else 96].split(16))
        q = _net()
        quantize_model(q, quant_desc_input=QuantDescriptor(num_bits=8),
                       quant_desc_weight=QuantDescriptor(num_bits=4, axis=(0,)), glue=False)
        res = calibrate_model(q, batches, method="max", progress=False, bias_correction=True)
        torch.save({"state": q.state_dict(), "corrected": res.bias_correction.corrected},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_the_same_corrections(monkeypatch, tmp_path):
    import torch.multiprocessing as mp

    import lq

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed unavailable")
    if not lq.extension_loaded():
        monkeypatch.setenv("LQ_DISABLE_EXT", "1")
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["corrected"] == r1["corrected"] and r0["corrected"]
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k
    assert f"fc.{shift.BUFFER}" in r0["state"]


def test_the_exports_copy_holds_the_shift_in_its_bias():
    """``fold_into_bias`` (the export's copy): the same outputs from the bias parameter alone, the buffer gone; a
    layer whose quantizers are off keeps its own bias. A fallback try (a copy of the export's copy) that turns a
    folded layer's quantizers off gets that layer's own bias back (``unfold_where_float``): it computes what the
    user's model computes with those quantizers off."""
    x = _digits(64)
    q = _quantized(_net(), x)
    bc.correct_biases(q, [x], default_forward)
    work = copy.deepcopy(q)
    work.fc._input_quantizer.disable()
    work.fc._weight_quantizer.disable()  # in float: no shift, its own bias
    with torch.no_grad():
        want = work(x)
    folded = shift.fold_into_bias(work)
    assert set(folded) == {"conv1", "conv2"}  # conv1 had no bias of its own before
    assert not any(shift.BUFFER in k for k in work.state_dict())
    assert torch.equal(work.fc.bias, q.fc.bias)
    assert torch.equal(work.conv1.bias, shift.quant_bias(q.conv1)) and q.conv1.bias is None
    with torch.no_grad():
        torch.testing.assert_close(work(x), want, rtol=0, atol=0)
    tried = copy.deepcopy(work)
    assert shift.unfold_where_float(tried, folded) == {}  # every folded layer still quantizes
    tried.conv1._input_quantizer.disable()
    tried.conv1._weight_quantizer.disable()
    user = copy.deepcopy(q)
    user.conv1._input_quantizer.disable()
    user.conv1._weight_quantizer.disable()
    user.fc._input_quantizer.disable()
    user.fc._weight_quantizer.disable()
    assert list(shift.unfold_where_float(tried, folded)) == ["conv1"]
    assert torch.equal(tried.conv1.bias, torch.zeros(8)) and torch.equal(tried.conv2.bias, work.conv2.bias)
    with torch.no_grad():
        torch.testing.assert_close(tried(x), user(x), rtol=0, atol=0)


class Residual(nn.Module):
    """A residual add and a ReLU written in the forward: the glue quantizes them at those calls (lq.glue._at_calls),
    counted per forward; the correction's own arithmetic in its hooks must not be counted among them."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        y = F.relu(self.conv1(x))
        y = F.relu(self.conv2(y)) + y
        y = F.relu(self.conv3(y)) + y
        return self.fc(y.mean((2, 3)))


def test_the_hooks_arithmetic_is_no_call_of_the_forward():
    from lq.glue import _at_calls

    x = _digits(64)
    torch.manual_seed(0)
    q = Residual().eval()
    quantize_model(q, quant_desc_input=QuantDescriptor(num_bits=8),
                   quant_desc_weight=QuantDescriptor(num_bits=4, axis=(0,)), sample=x[:8])
    assert _at_calls.installed(q)  # the adds are quantized at their calls
    calibrate_model(q, [x], method="max", progress=False)
    before = copy.deepcopy(q)
    bc.correct_biases(q, [x], default_forward)
    layers = [q.conv1, q.conv2, q.conv3, q.fc]
    ref = [before.conv1, before.conv2, before.conv3, before.fc]
    for got, want in zip(_site_means(q, layers, x, True), _site_means(before, ref, x, False)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_the_callback_corrects_when_the_config_says_so(tmp_path):
    """``QuantCallback(calib=CalibConfig(bias_correction=True))``: the calibration it runs sets the shifts (and says
    what it did); the checkpoint's state_dict holds them. Off by default."""
    import lightning as L

    import lq
    from lq.config import ExportConfig
    from lq.zoo import DigitsDataModule, SmallCNN

    results = {}
    for on in (False, True):
        L.seed_everything(0)
        model = SmallCNN(channels=8, max_epochs_hint=1)
        cb = lq.QuantCallback(calib=CalibConfig(method="max", num_batches=4, bias_correction=on),
                              export=ExportConfig(enabled=False), verbose=False)
        L.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                  accelerator="cpu", callbacks=[cb]).fit(model, datamodule=DigitsDataModule(batch_size=32))
        results[on] = (cb.calibrate.last_amax.bias_correction, [k for k in model.state_dict() if shift.BUFFER in k])
    assert results[False] == (None, [])
    res, keys = results[True]
    assert res is not None and res.rows > 0 and len(keys) == len(res.corrected) >= 1, (res, keys)
