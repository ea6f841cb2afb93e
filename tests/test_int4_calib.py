"""Block calibration better than round-to-nearest (lq.calib._block_search), exact in the exported file.

MSE never gives a larger weight error than round-to-nearest (RTN), AWQ never a larger output error on the
calibration rows, and on data with a few loud input channels (what makes AWQ worth it) AWQ beats RTN on held-out
rows too. The searched model exports to MatMulNBits (AWQ's ``1 / s`` as one Mul before it) and the file equals the
fake-quant model. ``CalibConfig.block_method`` reaches the search through the callback's calibration.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from lq.calib._block_search import block_layers, search_block_scales
from lq.calibration import calibrate_model
from lq.callbacks.swap import QuantSwap
from lq.config import CalibConfig
from lq.export import export_onnx

torch.set_flush_denormal(True)


def _loud_inputs(n: int, k: int = 128, seed: int = 0) -> torch.Tensor:
    """Activations whose input channels differ in magnitude by up to ~30x, and a few outlier channels ~30x louder
    again (as in transformers' hidden states)."""
    g = torch.Generator().manual_seed(seed)
    gain = torch.exp(torch.randn(k, generator=torch.Generator().manual_seed(99)) * 1.2)
    gain[torch.arange(5, k, k // 4)] *= 30
    return torch.randn(n, k, generator=g) * gain


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 192), nn.GELU(), nn.Linear(192, 64))
    QuantSwap("int4_block_weight").swap(m)
    return m.eval()


def _errors(m, x, ref_model):
    with torch.no_grad():
        return float(((m(x) - ref_model(x)) ** 2).mean())


def _float_twin(m):
    import copy

    f = copy.deepcopy(m)
    for _, layer in block_layers(f):
        layer._weight_quantizer.disable()
    return f


@pytest.mark.parametrize("method", ["mse", "awq", "gptq"])
def test_search_is_never_worse_than_round_to_nearest(method):
    m = _model()
    calib = [_loud_inputs(256, seed=s) for s in range(2)]
    calibrate_model(m, calib, block_method="max")
    float_model = _float_twin(m)
    rtn_out = _errors(m, calib[0], float_model)
    weights = {name: layer.weight.detach().clone() for name, layer in block_layers(m)}
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choices = search_block_scales(m, method, calib)
    assert len(choices) == 2
    for c in choices:
        assert c.error <= c.rtn_error, c
        assert 0.5 <= c.shrink <= 1.0
    if method == "mse":  # weight error per layer, recomputed from the model itself
        for c in choices:
            assert c.error < c.rtn_error
        assert all(torch.equal(weights[n], layer.weight) for n, layer in block_layers(m))
    elif method == "gptq":  # no op before either Linear takes 1 / s (the input, a GELU): clipping and rounding alone
        assert all(c.alpha == 0 and c.folded == "" for c in choices), choices
        # 512 calibration rows: enough for the first Linear's 128 input features, not for the second one's 192
        # (GPTQ_MIN_ROWS_PER_FEATURE), which keeps round-to-nearest on its grid and is named in a warning
        assert [c.gptq for c in choices] == [True, False], choices
        assert [str(w.message) for w in caught if "block_method='gptq'" in str(w.message) and "(2)" in str(w.message)]
    else:  # the outlier channels make the activation scaling worth it, and it beats the weight-only search
        assert any(c.alpha > 0 for c in choices)
        mse = _rtn()
        search_block_scales(mse, "mse")
        held = _loud_inputs(256, seed=8)
        assert _errors(m, held, float_model) < _errors(mse, held, float_model)
    held_out = _loud_inputs(256, seed=7)
    assert _errors(m, held_out, float_model) < _errors(_rtn(), held_out, float_model)
    assert _errors(m, calib[0], float_model) < rtn_out


def _rtn():
    m = _model()
    calibrate_model(m, [_loud_inputs(256, seed=s) for s in range(2)], block_method="max")
    return m


def _gptq_reference(w: torch.Tensor, amax: torch.Tensor, h: torch.Tensor, tq, block: int) -> torch.Tensor:
    """GPTQ written the slow way, from its definition (Optimal Brain Quantization, one column at a time): round
    column j, spread its error over the columns not yet rounded with the inverse Hessian of those columns,
    ``w[:, j+1:] -= e * Hinv[j, j+1:] / Hinv[j, j]``, then drop column j from the inverse (Gauss elimination), with
    the damping of lq's kernel."""
    from lq.calib._block_search import GPTQ_DAMP, _fake_quant

    h = h.double().clone()
    h.diagonal().add_(GPTQ_DAMP * float(h.diagonal().mean()) + 1e-12)
    hinv = torch.linalg.inv(h)
    w = w.double().clone()
    q = torch.empty_like(w)
    n, k = w.shape
    for j in range(k):
        qc = _fake_quant(w[:, j].float().reshape(n, 1, 1).contiguous(), amax[:, j // block].reshape(n, 1), tq)
        q[:, j] = qc.reshape(n).double()
        e = (w[:, j] - q[:, j]) / hinv[j, j]
        w[:, j + 1:] -= e.unsqueeze(1) * hinv[j, j + 1:].unsqueeze(0)
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return q.float()


def test_gptq_rounding_equals_its_definition_and_beats_nearest_on_the_outputs():
    """lq's GPTQ (Cholesky form, columns rounded in groups) gives the codes of the one-column-at-a-time definition,
    every value a level of its block's grid, and a smaller output error ``trace(dW H dW^T)`` than rounding to
    nearest on the same grid."""
    from lq.calib._block_search import _fake_quant, gptq_round

    m = _model()
    tq, block = m[0]._weight_quantizer, 32
    g = torch.Generator().manual_seed(1)  # correlated input channels (a few directions), as hidden states are
    x = torch.randn(512, 16, generator=g) @ torch.randn(16, 128, generator=g) + 0.1 * torch.randn(512, 128, generator=g)
    h = (x.T @ x / len(x)).float()
    w = m[0].weight.detach().float()
    amax = w.reshape(w.shape[0], -1, block).abs().amax(-1)
    got = gptq_round(w, amax, h, tq, block)
    want = _gptq_reference(w, amax, h, tq, block)
    steps = (amax / 7).repeat_interleave(block, dim=1)  # one level of each weight's block
    assert ((got - want).abs() <= 1e-3 * steps).float().mean() >= 0.995  # float order may flip a rare tie
    assert torch.equal(_fake_quant(got.reshape(w.shape[0], -1, block), amax, tq).reshape(w.shape), got)
    nearest = _fake_quant(w.reshape(w.shape[0], -1, block), amax, tq).reshape(w.shape)

    def output_error(q):
        d = (q - w).double()
        return float(((d @ h.double()) * d).sum())

    assert output_error(got) < 0.8 * output_error(nearest), (output_error(got), output_error(nearest))


@pytest.mark.parametrize("dynamo", [True, False])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_searched_model_exports_exactly_to_matmul_nbits(tmp_path, method, dynamo):
    """The searched weights, amax and scales are the model's, so the file holds the same codes and equals the
    fake-quant model. ``awq``: its ``1 / s`` as a Mul before MatMulNBits where it folds nowhere; ``gptq``: no
    activation scale stays behind as a Mul (only where 1 / s folds)."""
    import onnxruntime as ort

    m = _model()
    calib = [_loud_inputs(256, seed=s) for s in range(2)]
    calibrate_model(m, calib, block_method="max")
    search_block_scales(m, method, calib)
    x = _loud_inputs(6, seed=3).reshape(2, 3, 128)
    res = export_onnx(m, x, str(tmp_path / f"{method}.onnx"), opset=21, dynamo=dynamo, dynamic_dims=(1,),
                      check_fusion=False)
    assert res.verified
    nodes = onnx.load(res.path).graph.node
    ops = [n.op_type for n in nodes]
    assert ops.count("MatMulNBits") == 2 and "MatMul" not in ops and "DequantizeLinear" not in ops, ops
    if method == "gptq":
        made = {o: n.op_type for n in nodes for o in n.output}
        assert all(made.get(n.input[0]) != "Mul" for n in nodes if n.op_type == "MatMulNBits"), ops
    x2 = _loud_inputs(40, seed=4).reshape(2, 20, 128)
    with torch.no_grad():
        want = m(x2).numpy()
    got = ort.InferenceSession(res.path, providers=["CPUExecutionProvider"]).run(None, {"input": x2.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_block_method_is_a_calib_config_field_the_callback_uses():
    from lq.callbacks.calibrate import QuantCalibrate

    with pytest.raises(ValueError, match=r"block_method='hqq'.*\['auto', 'max', 'mse', 'awq', 'gptq'\]"):
        CalibConfig(block_method="hqq")
    m = _model()
    loader = [(_loud_inputs(64, seed=s), torch.zeros(64)) for s in range(2)]
    cb = QuantCalibrate(CalibConfig(method="max", block_method="awq", num_batches=2))

    class _Trainer:  # what QuantCalibrate.run reads of a Trainer
        class strategy:
            class precision_plugin:
                convert_input = staticmethod(lambda b: b)

                @staticmethod
                def forward_context():
                    import contextlib
                    return contextlib.nullcontext()

            batch_to_device = staticmethod(lambda b: b)

        progress_bar_callback = None

    cb.run(_Trainer(), m, loader)
    assert cb.block_choices and all(c.error <= c.rtn_error for c in cb.block_choices)
    assert any(layer._input_quantizer.pre_quant_scale is not None for _, layer in block_layers(m))


def test_calibrate_model_defaults_search_blocks_as_gptq_without_its_warning():
    """``calibrate_model``'s default ``block_method="auto"`` gives exactly what ``gptq`` gives after a plain max
    calibration (the same choices, the same weights), says per layer whether GPTQ's rounding ran and warns about
    nothing; with too few rows GPTQ's rounding is skipped, with enough it runs; ``max`` leaves the weights alone."""
    import warnings

    for rows, gptq_ran in ((64, False), (2048, True)):
        calib = [_loud_inputs(rows, seed=s) for s in range(2)]
        auto, ref, rtn = _model(), _model(), _model()
        w0 = [p.detach().clone() for n, p in rtn.named_parameters() if n.endswith("weight")]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning from auto, whatever the rows
            res = calibrate_model(auto, calib)
        calibrate_model(ref, calib, block_method="max")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # gptq warns about too few rows
            want = search_block_scales(ref, "gptq", calib)
        assert [(c.layer, c.alpha, c.gptq) for c in res.block_choices] == [(c.layer, c.alpha, c.gptq) for c in want]
        assert all(c.gptq == gptq_ran for c in res.block_choices), res.block_choices
        for (_, a), (_, b) in zip(block_layers(auto), block_layers(ref)):
            assert torch.equal(a.weight, b.weight) and torch.equal(a._weight_quantizer.amax, b._weight_quantizer.amax)
        calibrate_model(rtn, calib, block_method="max")
        assert all(torch.equal(p, w) for p, w in zip([p for n, p in rtn.named_parameters() if n.endswith("weight")], w0))
