"""Model conversion (lq.convert) and the monkey-patching API (lq.quant_modules)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lq.nn as quant_nn
from lq import quant_modules
from lq import tensor_quant as tq
from lq.convert import (
    DEFAULT_TYPE_MAP,
    ConversionError,
    DescriptorTypeError,
    OverrideError,
    QuantizationSummary,
    UnsupportedModuleTypeError,
    dequantize_model,
    iter_quantizers,
    quantize_model,
    summarize,
)
from lq.tensor_quant import QuantDescriptor

torch.set_flush_denormal(True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        x = self.pool(self.body(self.stem(x))).flatten(1)
        return self.head(x)


def snapshot(model):
    """Everything conversion could change: module objects, parameters, buffers, modes."""
    return (
        [(n, m) for n, m in model.named_modules()],
        [(n, p) for n, p in model.named_parameters()],
        [(n, b, b.clone()) for n, b in model.named_buffers()],
        [m.training for m in model.modules()],
    )


def assert_same(model, snap):
    mods, params, bufs, modes = snapshot(model)
    assert [n for n, _ in mods] == [n for n, _ in snap[0]]
    assert all(a is b for (_, a), (_, b) in zip(mods, snap[0], strict=True))
    assert all(a is b for (_, a), (_, b) in zip(params, snap[1], strict=True))
    assert all(a is b and torch.equal(a, c) for (_, a, _), (_, b, c) in zip(bufs, snap[2], strict=True))
    assert modes == snap[3]
    assert not list(iter_quantizers(model))


# ---------------------------------------------------------------- conversion
def test_quantize_model_converts_in_place_keeping_state():
    model = Net().eval()
    params = {n: p for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    keys = set(model.state_dict())
    summary = quantize_model(model, exclude=["head.2"], quant_desc_input=QuantDescriptor())
    assert isinstance(model.stem[0], quant_nn.QuantConv2d)
    assert isinstance(model.body[2], quant_nn.QuantMaxPool2d)
    assert isinstance(model.pool, quant_nn.QuantAdaptiveAvgPool2d)
    assert isinstance(model.head[0], quant_nn.QuantLinear)
    assert type(model.head[2]) is nn.Linear  # excluded
    assert type(model.stem[1]) is nn.BatchNorm2d  # not a quantizable type
    for n, p in model.named_parameters():
        assert p is params[n]
    for n, b in model.named_buffers():
        if "quantizer" not in n:
            assert b is buffers[n]
    assert keys <= set(model.state_dict())
    assert not any(m.training for m in model.modules())  # eval mode kept, quantizers included
    assert summary.quantized == ["stem.0", "body.0", "body.2", "pool", "head.0"]
    assert summary.skipped == ["head.2"]


def test_excluded_layer_output_bit_identical():
    model = Net().eval()
    x = torch.randn(5, 16)
    ref = model.head[2](x)
    quantize_model(model, exclude=["head.2"], quant_desc_input=QuantDescriptor())
    assert torch.equal(model.head[2](x), ref)
    # excluding a parent leaves everything inside it float
    model = Net()
    quantize_model(model, exclude=["head"], quant_desc_input=QuantDescriptor())
    assert type(model.head[0]) is nn.Linear and type(model.head[2]) is nn.Linear
    assert isinstance(model.stem[0], quant_nn.QuantConv2d)


def test_converted_model_output_equals_fake_quant_reference():
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).eval()
    x = torch.randn(2, 2, 6, 6)
    c, lin = model[0], model[3]
    quantize_model(model, quant_desc_input=QuantDescriptor())

    def fq(t, axis=None):
        amax = t.abs().amax() if axis is None else t.abs().amax(dim=tuple(range(1, t.dim())), keepdim=True)
        return tq.fake_tensor_quant(t, amax, 8, False, False)

    h = F.relu(F.conv2d(fq(x), fq(c.weight, 0), c.bias)).flatten(1)
    expect = F.linear(fq(h), fq(lin.weight, 0), lin.bias)
    assert torch.equal(model(x), expect)


def test_include_globs_and_type_map():
    model = Net()
    summary = quantize_model(model, include=["body.*"], type_map=[nn.Conv2d], quant_desc_input=QuantDescriptor())
    assert summary.quantized == ["body.0"]
    assert type(model.stem[0]) is nn.Conv2d and type(model.body[2]) is nn.MaxPool2d
    # a single string pattern is one glob, not a list of characters
    model = Net()
    assert quantize_model(model, include="head*", quant_desc_input=QuantDescriptor()).quantized == ["head.0", "head.2"]


def test_idempotent_second_call_changes_nothing():
    model = Net()
    quantize_model(model, quant_desc_input=QuantDescriptor())
    mods = [m for m in model.modules()]
    amax_before = [(n, q.amax) for n, q in iter_quantizers(model)]
    s2 = quantize_model(model, quant_desc_input=QuantDescriptor())
    assert [m for m in model.modules()] == mods
    assert [(n, q.amax) for n, q in iter_quantizers(model)] == amax_before
    assert s2.quantized == [] and all(layer.status == "already quantized" for layer in s2)


def test_overrides_and_global_descriptors():
    model = Net()
    quantize_model(
        model,
        quant_desc_input=QuantDescriptor(num_bits=8, calib_method="histogram"),
        overrides={
            "head.*": {"weight": {"num_bits": 4, "axis": None}},
            "head.2": {"input": QuantDescriptor(num_bits=6)},
            "stem": {"input": {"num_bits": 8, "unsigned": True}},
        },
    )
    assert model.head[0]._weight_quantizer.num_bits == 4 and model.head[0]._weight_quantizer.axis is None
    assert model.head[2]._input_quantizer.num_bits == 6
    assert model.head[0]._input_quantizer.num_bits == 8
    assert model.stem[0]._input_quantizer.unsigned
    assert model.body[0]._weight_quantizer.axis == 0  # class default kept
    assert type(model.body[0]._input_quantizer.calibrator).__name__ == "HistogramCalibrator"


def test_shared_module_converted_once_everywhere():
    shared = nn.Linear(4, 4)
    model = nn.ModuleDict({"a": nn.Sequential(shared, nn.ReLU()), "b": nn.Sequential(shared)})
    summary = quantize_model(model, quant_desc_input=QuantDescriptor())
    assert model["a"][0] is model["b"][0]
    assert isinstance(model["a"][0], quant_nn.QuantLinear) and model["a"][0].weight is shared.weight
    assert summary.quantized == ["a.0"]
    with pytest.raises(ConversionError, match="shared"):
        m2 = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
        quantize_model(m2, exclude=["b"], quant_desc_input=QuantDescriptor())


def test_train_mode_and_lstm_mha_conversion():
    model = nn.ModuleDict({"rnn": nn.LSTM(4, 8, batch_first=True), "att": nn.MultiheadAttention(8, 2)}).train()
    quantize_model(model, quant_desc_input=QuantDescriptor())
    assert isinstance(model["rnn"], quant_nn.QuantLSTM) and isinstance(model["att"], quant_nn.QuantMultiheadAttention)
    assert all(m.training for m in model.modules())
    assert isinstance(model["att"].out_proj, quant_nn.QuantLinear)


# ---------------------------------------------------------------- summary
def test_summary_rows_table_and_summarize_after_calibration():
    model = Net()
    summary = quantize_model(model, exclude=["pool"], quant_desc_input=QuantDescriptor())
    assert isinstance(summary, QuantizationSummary)
    rows = summary.rows()
    by = {r["name"]: r for r in rows}
    assert by["stem.0"]["type"] == "QuantConv2d" and by["stem.0"]["status"] == "quantized"
    assert by["stem.0"]["input_bits"] == 8 and by["stem.0"]["input_axis"] is None
    assert by["stem.0"]["weight_bits"] == 8 and by["stem.0"]["weight_axis"] == 0
    assert by["stem.0"]["input_amax"] is None  # not calibrated yet
    assert by["body.2"]["weight_bits"] is None
    assert by["pool"]["status"] == "excluded"
    assert all(isinstance(v, (str, int, float, list, type(None))) for r in rows for v in r.values())
    text = str(summary)
    for name in ("stem.0", "body.0", "head.2", "QuantLinear", "excluded", "axis 0"):
        assert name in text
    from rich.table import Table

    assert isinstance(summary.__rich__(), Table)
    # after calibrating, summarize() reports amax
    model.stem[0]._input_quantizer.amax = 1.25
    after = summarize(model)
    assert after["stem.0"].input_amax == pytest.approx(1.25)
    assert "1.25" in str(after)


def test_iter_quantizers_names():
    model = Net()
    quantize_model(model, quant_desc_input=QuantDescriptor())
    names = [n for n, _ in iter_quantizers(model)]
    assert "stem.0._input_quantizer" in names and "stem.0._weight_quantizer" in names
    assert "pool._input_quantizer" in names
    assert all(isinstance(q, quant_nn.TensorQuantizer) for _, q in iter_quantizers(model))


def test_dequantize_model_restores_float_modules():
    model = Net().eval()
    x = torch.randn(2, 1, 8, 8)
    ref = model(x)
    params = {n: p for n, p in model.named_parameters()}
    keys = set(model.state_dict())
    quantize_model(model, quant_desc_input=QuantDescriptor())
    assert not torch.equal(model(x), ref)
    dequantize_model(model)
    assert type(model.stem[0]) is nn.Conv2d and type(model.pool) is nn.AdaptiveAvgPool2d
    assert set(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert torch.equal(model(x), ref)


# ---------------------------------------------------------------- bad input: named errors, model untouched
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(type_map={nn.GRU: None}), UnsupportedModuleTypeError, "no quantized version of .*GRU"),
        (dict(type_map={nn.Conv2d: quant_nn.QuantLinear}), UnsupportedModuleTypeError, "converts Linear"),
        (dict(type_map={nn.Conv2d: "QuantConv2d"}), UnsupportedModuleTypeError, "not a quantized module class"),
        (dict(type_map={"Conv2d": None}), UnsupportedModuleTypeError, "not an nn.Module class"),
        (dict(overrides={"hed.*": {"weight": {"num_bits": 4}}}), OverrideError, "matches no quantized layer"),
        (dict(overrides={"head.*": {"weights": {"num_bits": 4}}}), OverrideError, "unknown key"),
        (dict(overrides={"head.*": QuantDescriptor()}), OverrideError, "must be a dict"),
        (dict(exclude=["head"], overrides={"head.0": {"input": {}}}), OverrideError, "matches no quantized layer"),
        (dict(quant_desc_input=8), DescriptorTypeError, "quant_desc_input"),
        (dict(quant_desc_weight={"num_bit": 8}), DescriptorTypeError, "quant_desc_weight"),
        (dict(overrides={"head.*": {"input": [8]}}), DescriptorTypeError, "head"),
        (dict(include=[3]), TypeError, "glob"),
    ],
)
def test_bad_input_raises_named_error_and_leaves_model_untouched(kwargs, error, match):
    model = Net()
    snap = snapshot(model)
    with pytest.raises(error, match=match):
        quantize_model(model, **kwargs)
    assert_same(model, snap)
    assert issubclass(UnsupportedModuleTypeError, ConversionError)


def test_failure_while_building_leaves_model_untouched():
    class Boom(quant_nn.QuantLinear):
        @classmethod
        def from_float(cls, module, quant_desc_input=None, quant_desc_weight=None):
            if module.out_features == 3:
                raise RuntimeError("boom")
            return super().from_float(module, quant_desc_input, quant_desc_weight)

    model = Net()
    snap = snapshot(model)
    with pytest.raises(ConversionError, match="'head.2'.*boom"):
        quantize_model(model, type_map={nn.Conv2d: None, nn.Linear: Boom}, quant_desc_input=QuantDescriptor())
    assert_same(model, snap)


def test_root_module_cannot_be_replaced():
    lin = nn.Linear(2, 2)
    with pytest.raises(ConversionError, match="from_float"):
        quantize_model(lin, quant_desc_input=QuantDescriptor())
    assert type(lin) is nn.Linear
    with pytest.raises(TypeError):
        quantize_model("model", quant_desc_input=QuantDescriptor())


def test_default_type_map_covers_every_quant_class():
    assert DEFAULT_TYPE_MAP[nn.Conv2d] is quant_nn.QuantConv2d
    assert DEFAULT_TYPE_MAP[nn.MultiheadAttention] is quant_nn.QuantMultiheadAttention
    assert DEFAULT_TYPE_MAP[quant_nn.FloatAdd] is quant_nn.QuantAdd
    assert len(DEFAULT_TYPE_MAP) == 24
    with pytest.raises(TypeError):
        DEFAULT_TYPE_MAP[nn.GRU] = None  # read-only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_conversion_keeps_cuda_device():
    model = Net().cuda()
    quantize_model(model, quant_desc_input=QuantDescriptor())
    for _, q in iter_quantizers(model):
        q.amax = 1.0
        assert q.amax.is_cuda
    assert model(torch.randn(2, 1, 8, 8, device="cuda")).is_cuda


# ---------------------------------------------------------------- quant_modules (monkey patching)
NAMES = [e.mod_name for e in quant_modules._DEFAULT_QUANT_MAP] + ["MultiheadAttention"]


def torch_nn_state():
    return {n: getattr(torch.nn, n) for n in NAMES}


@pytest.fixture
def clean_torch_nn():
    before = torch_nn_state()
    yield before
    quant_modules.deactivate()
    assert torch_nn_state() == before


def test_initialize_twice_deactivate_once_restores(clean_torch_nn):
    quant_modules.initialize()
    assert torch.nn.Conv2d is quant_nn.QuantConv2d and torch.nn.Linear is quant_nn.QuantLinear
    m = torch.nn.Conv2d(1, 2, 3)
    assert isinstance(m, quant_nn.QuantConv2d)
    quant_modules.initialize(float_module_list=["Linear"])
    assert torch.nn.Linear is clean_torch_nn["Linear"]
    quant_modules.initialize()
    assert quant_modules.is_active()
    quant_modules.deactivate()
    assert torch_nn_state() == clean_torch_nn and not quant_modules.is_active()
    quant_modules.deactivate()  # no-op
    assert torch_nn_state() == clean_torch_nn


def test_initialize_custom_modules(clean_torch_nn):
    quant_modules.initialize(custom_quant_modules=[(torch.nn, "MultiheadAttention", quant_nn.QuantMultiheadAttention)])
    assert torch.nn.MultiheadAttention is quant_nn.QuantMultiheadAttention
    assert isinstance(torch.nn.MultiheadAttention(4, 2), quant_nn.QuantMultiheadAttention)
    assert "torch.nn.MultiheadAttention" in quant_modules.active_patches()


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(float_module_list=["Linaer"]), ValueError),
        (dict(float_module_list=[3]), TypeError),
        (dict(custom_quant_modules=[(torch.nn, "NoSuchModule", quant_nn.QuantLinear)]), ValueError),
        (dict(custom_quant_modules=[(torch.nn, "Linear")]), TypeError),
        (dict(custom_quant_modules=[(torch.nn, "Linear", "QuantLinear")]), TypeError),
    ],
)
def test_initialize_bad_arguments_patch_nothing(clean_torch_nn, kwargs, error):
    with pytest.raises(error):
        quant_modules.initialize(**kwargs)
    assert torch_nn_state() == clean_torch_nn and not quant_modules.is_active()
    # an active patch also survives a failed re-initialize untouched
    quant_modules.initialize()
    active = torch_nn_state()
    with pytest.raises(error):
        quant_modules.initialize(**kwargs)
    assert torch_nn_state() == active


def test_quantized_context_restores_on_exception(clean_torch_nn):
    with pytest.raises(RuntimeError, match="inside"):
        with quant_modules.quantized():
            assert torch.nn.Linear is quant_nn.QuantLinear
            raise RuntimeError("inside")
    assert torch_nn_state() == clean_torch_nn
    # nested: the outer state comes back, not the float one
    quant_modules.initialize(float_module_list=["Conv2d"])
    outer = torch_nn_state()
    with quant_modules.quantized(custom_quant_modules=[(torch.nn, "MultiheadAttention",
                                                         quant_nn.QuantMultiheadAttention)]):
        assert torch.nn.Conv2d is quant_nn.QuantConv2d
    assert torch_nn_state() == outer
    quant_modules.deactivate()
    assert torch_nn_state() == clean_torch_nn


def test_enable_onnx_export_restores_flag():
    TQ = quant_nn.TensorQuantizer
    assert TQ.use_fb_fake_quant is False
    with pytest.raises(KeyError):
        with quant_modules.enable_onnx_export():
            assert TQ.use_fb_fake_quant is True
            raise KeyError("x")
    assert TQ.use_fb_fake_quant is False


def test_models_built_under_initialize_match_conversion(clean_torch_nn):
    torch.manual_seed(0)
    with quant_modules.quantized():
        a = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    torch.manual_seed(0)
    b = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    quantize_model(b, quant_desc_input=QuantDescriptor())
    assert [type(m) for m in a] == [type(m) for m in b]
    x = torch.randn(1, 1, 4, 4)
    assert torch.equal(a(x), b(x))


def test_summary_says_uncalibrated_before_calibration_and_dynamic_for_dynamic_quantizers():
    from lq.tensor_quant import QuantDescriptor

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    summary = quantize_model(model, overrides={"2": {"input": QuantDescriptor(num_bits=8, dynamic=True)}})
    rows = {r[0]: r for r in summary._table_rows()}
    assert rows["0"][4] == "uncalibrated" and rows["2"][4] == "dynamic"
    assert "uncalibrated" in str(summary)
