"""The capture of the whole model and the quantizers applied at its calls (issue 39).

lq runs the float model once on a sample and records each module's forward as it ran (:mod:`lq.capture`), then
places quantizers on those graphs and applies them at the named calls while the forward runs
(:mod:`lq.glue._at_calls`). Each test compares with an independent reference: the graph's ops with what the
forward calls, the quantized model with the same arithmetic written out by hand, the file with PyTorch."""

from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from lq.calibration import calibrate_model
from lq.capture import capture
from lq.convert import dequantize_model, quantize_model
from lq.glue import _at_calls, is_glue_quantized


class Dense(nn.Module):
    """torchvision's dense layer: a list or a tensor in, ``isinstance`` and ``requires_grad`` checks."""

    def __init__(self, c: int):
        super().__init__()
        self.norm, self.conv = nn.BatchNorm2d(c), nn.Conv2d(c, 4, 3, padding=1)

    def forward(self, x):
        prev = [x] if isinstance(x, torch.Tensor) else x
        if any(t.requires_grad for t in prev) and not self.training:
            prev = [t.detach() for t in prev]  # not taken on the sample (no gradients in the capture)
        return self.conv(F.relu(self.norm(torch.cat(prev, 1))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.d1, self.d2 = Dense(8), Dense(12)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 10)
        self.unused = nn.Linear(16, 16)

    def forward(self, x):
        feats = [self.stem(x)]
        for layer in (self.d1, self.d2):
            feats.append(layer(feats))
        h = torch.cat(feats, 1).mean((2, 3))  # (N, 16): read by the F.linear below, not by a layer
        q = F.linear(h, self.qkv.weight, self.qkv.bias)[:, :16]
        return self.head(q + h)


def test_the_capture_records_each_forward_as_it_ran_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    m = Net().train()
    bn = m.d1.norm.running_mean.clone()
    cap = capture(m, (torch.randn(2, 3, 8, 8),), training=True)
    assert m.training and torch.equal(m.d1.norm.running_mean, bn)  # mode and statistics put back
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in m.modules())
    assert not _get_current_function_mode_stack()
    root = cap.graphs[id(m)]
    calls = [(n.op, n.target) for n in root.nodes if n.op in ("call_module", "call_function", "call_method")]
    # the loop over a tuple, the list of tensors, F.linear on qkv's weight: what ran, in order
    assert calls == [("call_module", "stem"), ("call_module", "d1"), ("call_module", "d2"),
                     ("call_function", torch.cat), ("call_method", "mean"), ("call_module", "qkv"),
                     ("call_function", operator.getitem), ("call_function", operator.add), ("call_module", "head")]
    d2 = [n for n in root.nodes if n.target == "d2"][0]
    assert [a.target for a in d2.args[0]] == ["stem", "d1"]  # the list argument, element by element
    dense = [(n.op, n.target) for n in cap.graphs[id(m.d2)].nodes if n.op != "placeholder"]
    assert ("call_function", torch.cat) in dense and ("call_module", "norm") in dense
    assert cap.functional_layers == [("", "qkv")] and not cap.ran(m.unused) and cap.calls[id(m.d1)] == 1


def _quantized(x):
    torch.manual_seed(0)
    m = Net().eval()
    summary = quantize_model(m, sample=x[:2])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        calibrate_model(m, [x])
    return m, summary, [str(i.message) for i in w]


class Joined(nn.Module):
    """Glue in a forward fx cannot trace: a list built in a loop, an ``isinstance`` check, ``y += z``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.Conv2d(8, 4, 1),
                                          nn.Conv2d(3, 4, 1))

    def forward(self, x):
        feats = [conv(x) for conv in (self.a, self.b)]
        y = torch.cat(feats, 1) if isinstance(x, torch.Tensor) else feats[0]
        y = self.c(y)
        y += self.d(x)
        return y


def test_quantizers_are_applied_at_the_captured_calls_as_written_out_by_hand():
    x = torch.randn(8, 3, 6, 6)
    m = Joined().eval()
    summary = quantize_model(m, sample=x[:2])
    calibrate_model(m, [x])
    assert not [n for n in summary.notes if "torch.fx" in n] and type(m) is Joined
    g = m.lq_glue
    assert sorted(g.keys()) == ["add_0_a", "add_0_b", "cat_0_a", "cat_0_b"]
    with torch.no_grad():
        want = m.c(torch.cat([g.cat_0_a(m.a(x)), g.cat_0_b(m.b(x))], 1))
        want = g.add_0_a(want) + g.add_0_b(m.d(x))  # y += z: the in-place add on quantized operands
        torch.testing.assert_close(m(x), want, rtol=0, atol=0)


class Traceable(nn.Module):
    """A forward torch.fx traces: the fx path and the capture must place the same quantizers."""

    def __init__(self):
        super().__init__()
        self.stem, self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.stem(x))
        y = F.relu(self.a(x) + x)
        z = torch.cat([y, self.b(y)], 1)
        return self.head(F.adaptive_avg_pool2d(z, 1).flatten(1))


def test_the_capture_and_torch_fx_place_the_same_quantizers_where_fx_can_trace():
    x = torch.randn(8, 3, 8, 8)
    torch.manual_seed(0)
    traced = Traceable().eval()
    captured = copy.deepcopy(traced)
    fx_summary = quantize_model(traced)
    cap_summary = quantize_model(captured, sample=x[:2])
    assert any("torch.fx" in n for n in fx_summary.notes) and not any("torch.fx" in n for n in cap_summary.notes)
    assert list(traced.state_dict()) == list(captured.state_dict())
    calibrate_model(traced, [x])
    captured.load_state_dict(traced.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(captured(x), traced(x), rtol=0, atol=0)


def test_a_layer_called_as_a_function_on_its_weight_is_quantized_as_the_layer():
    x = torch.randn(8, 3, 8, 8)
    m, _, _ = _quantized(x)
    assert float(m.qkv._input_quantizer.amax) > 0 and float(m.qkv._weight_quantizer.amax.max()) > 0
    seen = []
    h = m.qkv.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        m(x)
        h.remove()
        (inp, out), = seen  # the F.linear call ran the quantized layer: its own quantizers, its own arithmetic
        w = m.qkv._weight_quantizer(m.qkv.weight)
        torch.testing.assert_close(out, F.linear(m.qkv._input_quantizer(inp), w, m.qkv.bias), rtol=0, atol=0)


def test_a_layer_that_never_runs_is_named_turned_off_and_not_an_error(tmp_path):
    pytest.importorskip("onnxruntime")
    from lq.export import export_onnx

    x = torch.randn(8, 3, 8, 8)
    m, summary, warned = _quantized(x)
    assert any("unused never ran on the sample" in n for n in summary.notes), summary.notes
    assert any("turned off" in w and "unused._input_quantizer" in w for w in warned), warned
    assert not m.unused._input_quantizer.is_enabled and m.qkv._input_quantizer.is_enabled
    res = export_onnx(m, x, str(tmp_path / "m.onnx"), fallback_seconds=0, speed_check=False)
    assert res.verified and res.kernel_of("qkv") in ("QGemm", "MatMulIntegerToFloat")


def test_the_call_table_survives_deepcopy_and_state_dict_and_is_removed_with_the_quantizers():
    x = torch.randn(8, 3, 8, 8)
    m, _, _ = _quantized(x)
    twin = copy.deepcopy(m)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), m(x), rtol=0, atol=0)
        for q in twin.lq_glue.values():
            q.disable()  # the copy quantizes with its own quantizers
        assert not torch.equal(twin(x), m(x))
    fresh = Net().eval()
    quantize_model(fresh, sample=x[:2])
    fresh.load_state_dict(m.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), m(x), rtol=0, atol=0)
    dequantize_model(m)
    assert not any(_at_calls.installed(mod) or "lq_glue" in mod._modules for mod in m.modules())
    assert not any(h in (_at_calls._enter, _at_calls._leave) for mod in m.modules()
                   for h in (*mod._forward_pre_hooks.values(), *mod._forward_hooks.values()))
    with torch.no_grad():
        torch.testing.assert_close(m(x), Net.__call__(m, x))


def test_an_error_inside_a_forward_leaves_no_mode_behind():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)
            self.fail = False

        def forward(self, x):
            y = self.a(x) + self.b(x)
            if self.fail:
                raise ValueError("boom")
            return y

    m = Boom().eval()
    quantize_model(m, sample=torch.randn(2, 3, 4, 4))
    calibrate_model(m, [torch.randn(4, 3, 4, 4)])
    assert _at_calls.installed(m)
    m.fail = True
    with pytest.raises(ValueError, match="boom"):
        m(torch.randn(2, 3, 4, 4))
    assert not _get_current_function_mode_stack() and not _at_calls._calls.frames
    plain = nn.Conv2d(3, 4, 1)  # a model of someone else's: untouched by lq's global hooks
    assert torch.equal(plain(torch.ones(1, 3, 2, 2)), nn.functional.conv2d(torch.ones(1, 3, 2, 2), plain.weight, plain.bias))
    assert not _at_calls._calls.frames


def test_a_forward_that_runs_other_ops_in_training_keeps_its_glue_float_and_says_why():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)

        def forward(self, x):
            y = self.a(x)
            if self.training:
                y = y * 1.0 + 0.0
            return y + self.b(x)

    m = Branchy().eval()
    summary = quantize_model(m, sample=torch.randn(2, 3, 4, 4))
    assert not is_glue_quantized(m)
    assert any("other ops in training" in n for n in summary.notes), summary.notes


def test_the_quantized_model_trains_and_every_quantizer_gets_gradients_through_its_call():
    x = torch.randn(8, 3, 8, 8)
    m, _, _ = _quantized(x)
    m.train()
    loss = m(x).square().mean()
    loss.backward()
    assert m.qkv.weight.grad is not None and m.stem.weight.grad is not None and m.d2.conv.weight.grad is not None
    assert not _get_current_function_mode_stack()


def test_both_exporters_see_the_quantizers_at_the_calls(tmp_path):
    pytest.importorskip("onnxruntime")
    import onnx

    from lq.export import export_onnx

    x = torch.randn(8, 3, 8, 8)
    m, _, _ = _quantized(x)
    for dynamo in (True, False):
        res = export_onnx(m, x, str(tmp_path / f"m{dynamo}.onnx"), dynamo=dynamo, fallback_seconds=0,
                          speed_check=False)
        assert res.verified
        ops = [n.op_type for n in onnx.load(res.path).graph.node]
        assert ops.count("QuantizeLinear") >= 4 and "lq.export" not in {n.domain for n in onnx.load(res.path).graph.node}


def test_torch_compile_runs_the_quantizers_at_calls_without_graph_breaks():
    import torch._dynamo

    x = torch.randn(4, 3, 6, 6)
    m = Joined().eval()
    quantize_model(m, sample=x[:2])
    calibrate_model(m, [x])
    with torch.no_grad():
        want = m(x)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        got = torch.compile(m)(x)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
