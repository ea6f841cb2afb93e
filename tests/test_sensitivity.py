"""lq.sensitivity: per-layer sweeps on a small MLP with one layer made deliberately sensitive."""

import copy
import json

import pytest
import torch
from torch import nn

from lq.calibration import calibrate_model
from lq.callbacks import QuantSwap
from lq.config import Int8PerChannelConfig, QuantConfig, QuantizerConfig
from lq.nn.modules.tensor_quantizer import iter_quantizers
from lq.sensitivity import (
    SensitivityResult,
    fidelity_metric,
    greedy_exclude,
    layer_sensitivity,
    quantized_layers,
    sensitivity_analysis,
)


def _mlp(outlier: float = 300.0) -> nn.Module:
    """fc1 -> relu -> fc2 -> relu -> fc3 -> relu -> fc4; fc3's input gets one huge channel.

    fc2's output channel 0 (and its bias) are scaled by ``outlier`` and fc3's matching input column
    by 1/outlier: the float function is unchanged (ReLU is positive-homogeneous), but a per-tensor
    amax for fc3's input is set by that one channel, so 8 bits leave the others almost no levels.
    """
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                      nn.Linear(64, 10))
    with torch.no_grad():
        m[2].weight[0] *= outlier
        m[2].bias[0] = abs(float(m[2].bias[0])) * outlier + outlier
        m[4].weight[:, 0] /= outlier
    return m


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g)
    return [x[i : i + 64] for i in range(0, 512, 64)]


def _quantized(model, data):
    q = copy.deepcopy(model)
    QuantSwap(Int8PerChannelConfig()).swap(q)
    calibrate_model(q, data, method="max")
    return q


def _flags(model):
    return {n: (q._disabled, q._if_quant, q._if_calib) for n, q in iter_quantizers(model)}


def test_float_function_unchanged_by_outlier_rescaling(data):
    a, b = _mlp(1.0), _mlp(300.0)
    x = torch.cat(data)
    torch.testing.assert_close(a(x), b(x), rtol=1e-4, atol=1e-4)


def test_sensitive_layer_ranks_first_in_both_sweeps(data):
    q = _quantized(_mlp(), data)
    metric = fidelity_metric(q, data, kind="mse")
    before = _flags(q)
    res = layer_sensitivity(q, metric, higher_is_better=False, metric_name="output MSE")
    assert _flags(q) == before  # every switch restored
    assert [r.layer for r in res.layers] == ["0", "2", "4", "6"]
    assert res.ranked("only")[0].layer == "4"
    assert res.ranked("leave_out")[0].layer == "4"
    assert res.ranked("combined")[0].layer == "4"
    assert res.float_metric == pytest.approx(0.0, abs=1e-10)
    top = res.ranked()[0]
    # leaving the outlier layer float recovers most of the damage of quantizing everything
    assert top.leave_out < 0.2 * res.quant_metric
    assert top.only_drop > 0 and top.leave_out_gain > 0
    assert res.exclude(top_k=1) == ["4"]


def test_accuracy_style_metric_and_threshold(data):
    q = _quantized(_mlp(), data)
    metric = fidelity_metric(q, data, kind="cosine")
    res = layer_sensitivity(q, metric, metric_name="cosine")
    assert res.higher_is_better
    assert res.float_metric == pytest.approx(1.0, abs=1e-6)
    assert res.exclude(top_k=1) == ["4"]
    # every layer whose exclusion gains more than a threshold; the outlier layer clears any small one
    assert "4" in res.exclude(threshold=1e-4)
    assert res.exclude(threshold=10.0) == []


def test_exclude_list_goes_into_the_callback_config(data):
    model = _mlp()
    q = _quantized(model, data)
    res = layer_sensitivity(q, fidelity_metric(q, data, kind="mse"), higher_is_better=False)
    base = Int8PerChannelConfig(exclude=["7"])
    cfg = res.apply(base, top_k=1)
    assert isinstance(cfg, Int8PerChannelConfig)
    assert cfg.exclude == ["7", "4"]
    assert base.exclude == ["7"]  # the original is not modified
    assert not cfg.selects("4") and cfg.selects("2")

    # the recipe the callback would use: layer 4 stays float, and the output error drops
    mixed = copy.deepcopy(model)
    summary = QuantSwap(cfg).swap(mixed)
    assert "4" not in summary.quantized and "2" in summary.quantized
    calibrate_model(mixed, data, method="max")
    x = torch.cat(data)
    full = _quantized(model, data)
    with torch.no_grad():
        ref = model(x)
        err_full = float(((full(x) - ref) ** 2).mean())
        err_mixed = float(((mixed(x) - ref) ** 2).mean())
    assert err_mixed < 0.2 * err_full


def test_greedy_exclude_reaches_target(data):
    q = _quantized(_mlp(), data)
    metric = fidelity_metric(q, data, kind="mse")
    res = layer_sensitivity(q, metric, higher_is_better=False)
    target = res.quant_metric * 0.2
    excluded, values = greedy_exclude(q, metric, res, target=target)
    assert excluded[0] == "4"
    assert values[-1] <= target
    assert len(values) == len(excluded) + 1
    # already met: nothing excluded
    excluded, values = greedy_exclude(q, metric, res, target=res.quant_metric * 2)
    assert excluded == [] and len(values) == 1


def test_sensitivity_analysis_quantizes_a_copy(data):
    model = _mlp()
    ref = copy.deepcopy(model)

    def metric(m):
        with torch.no_grad():
            return float(((m(data[0]) - ref(data[0])) ** 2).mean())

    res = sensitivity_analysis(model, data, metric, quant=Int8PerChannelConfig(), modes=("leave_out",),
                               higher_is_better=False)
    assert not any(True for _ in iter_quantizers(model))  # the user's model stays float
    assert res.ranked()[0].layer == "4"
    assert all(r.only is None for r in res.layers)
    assert res.exclude(top_k=1) == ["4"]  # ranks by leave_out (the only sweep that ran)


def test_only_sweep_subset_of_layers(data):
    q = _quantized(_mlp(), data)
    res = layer_sensitivity(q, fidelity_metric(q, data, kind="mse"), higher_is_better=False,
                            modes=("only",), layers=["2", "4"])
    assert [r.layer for r in res.layers] == ["2", "4"]
    assert res.ranked()[0].layer == "4"
    assert all(r.leave_out is None for r in res.layers)


def test_disabled_quantizers_stay_disabled_and_weight_only_layers_count(data):
    cfg = QuantConfig(input=QuantizerConfig(enabled=False))
    q = copy.deepcopy(_mlp())
    QuantSwap(cfg).swap(q)
    calibrate_model(q, data, method="max")
    layers = quantized_layers(q)
    assert list(layers) == ["0", "2", "4", "6"]
    assert all(len(v) == 1 for v in layers.values())  # the weight quantizer only
    before = _flags(q)
    layer_sensitivity(q, fidelity_metric(q, data, kind="mse"), higher_is_better=False)
    assert _flags(q) == before


def test_outputs_table_figure_json(data, tmp_path):
    q = _quantized(_mlp(), data)
    res = layer_sensitivity(q, fidelity_metric(q, data, kind="mse"), higher_is_better=False,
                            metric_name="output MSE")
    md = res.markdown()
    assert md.count("\n| ") == 4 + 1  # header + 4 layers
    assert "| 1 | `4` |" in md
    text = str(res)
    assert "output MSE" in text and "4" in text
    fig = res.figure()
    fig.savefig(tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000
    back = SensitivityResult.from_dict(json.loads(json.dumps(res.to_dict())))
    assert back.exclude(top_k=2) == res.exclude(top_k=2)
    assert res.rows()[0]["rank"] == 1 and res.rows()[0]["layer"] == "4"


def test_errors_are_clear(data):
    model = _mlp()
    with pytest.raises(ValueError, match="no enabled lq quantizers"):
        layer_sensitivity(model, lambda m: 0.0)
    q = _quantized(model, data)
    with pytest.raises(ValueError, match="modes"):
        layer_sensitivity(q, lambda m: 0.0, modes=("sideways",))
    with pytest.raises(ValueError, match="match no quantized layer"):
        layer_sensitivity(q, lambda m: 0.0, layers=["nope*"])
    with pytest.raises(TypeError, match="callable"):
        layer_sensitivity(q, 3.0)
    res = layer_sensitivity(q, lambda m: 0.0, modes=("only",))
    with pytest.raises(ValueError, match="top_k"):
        res.exclude()
    with pytest.raises(TypeError, match="QuantConfig"):
        res.apply({"exclude": []}, top_k=1)
    before = _flags(q)

    def boom(m):
        raise RuntimeError("metric failed")

    with pytest.raises(RuntimeError, match="metric failed"):
        layer_sensitivity(q, boom)
    assert _flags(q) == before  # restored on error


def test_glob_special_characters_are_escaped():
    import fnmatch

    from lq.sensitivity import _glob_escape

    name = "blocks[0].fc"
    assert fnmatch.fnmatchcase(name, _glob_escape(name))
    assert not fnmatch.fnmatchcase("blocks0.fc", _glob_escape(name))
