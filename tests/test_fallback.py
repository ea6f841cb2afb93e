"""The measured fallback: where the INT8 file is slower than the user's FP32 file, layers go back to float in the
file until it is not, each candidate verified against the model it computes and timed against the same FP32 file.

No test here depends on this machine's speed: the search gets exact speed checks, and the export gets round times
computed from the file it times (a cost model: what the file quantizes decides how slow it is), so each test
knows which file must be kept. The statistics, the exports, the verification and the saved file are real.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from lq import report
from lq.calibration import calibrate_model
from lq.config import ExportConfig
from lq.convert import quantize_model
from lq.export import SlowerThanFP32Warning, export_onnx
from lq.export.timing import _fallback, _timing
from lq.export.verify import _verify

torch.set_flush_denormal(True)
ort = pytest.importorskip("onnxruntime")


class Blocks(nn.Module):
    """A float stem, two dense blocks, a residual add in the model's own forward, a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU())
        self.b1 = nn.Sequential(nn.Conv2d(16, 32, 3, 1, 1), nn.ReLU())
        self.b2 = nn.Sequential(nn.Conv2d(32, 32, 3, 1, 1), nn.ReLU())
        self.b3 = nn.Sequential(nn.Conv2d(32, 32, 3, 1, 1), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        y = self.b1(self.stem(x))
        y = y + self.b2(y)
        # two one-axis means, not a global average pool: b3's conv runs in float between Q/DQ (a float ReLU and
        # ReduceMean read it), the layer the fallback tries first
        return self.head(self.b3(y).mean(-1).mean(-1))


def _quantized(x):
    model = Blocks().eval()
    quantize_model(model)
    calibrate_model(model, [x])
    return model


def _check(ratio: float, noisy: bool = False) -> _timing.SpeedCheck:
    return _timing.SpeedCheck(ratio=ratio, int8_ms=1.0, fp32_ms=ratio, ratio_p25=ratio * 0.995,
                              ratio_p75=ratio * 1.005, rounds=5, noisy=noisy)


def _enabled(model) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ in ("TensorQuantizer", "GlueQuantizer")
            and m.is_enabled]


# =========================================================================== the groups
def test_the_quantizers_come_in_the_order_the_forward_calls_them_and_stages_follow_the_blocks():
    x = torch.randn(2, 3, 16, 16)
    model = _quantized(x)
    order = _fallback.call_order(model, (x,))
    assert set(order) == set(_enabled(model))  # every enabled quantizer, each once
    owners = list(dict.fromkeys(_fallback.owner(q) for q in order))
    assert owners[:3] == ["stem.0", "b1.0", "b2.0"] and owners[-2:] == ["b3.0", "head"]
    assert [q for q in order if "lq_glue" in q], "the residual add has its glue quantizer"
    stages = _fallback.stages(order)
    # one stage per block; the model's own add joins the block before it (b2, whose output it reads)
    assert [sorted({_fallback.owner(q).split(".")[0] for q in s if "lq_glue" not in q}) for s in stages] == \
        [["stem"], ["b1"], ["b2"], ["b3"], ["head"]]
    assert any("lq_glue" in q for q in stages[2])
    assert [q for s in stages for q in s] == order  # consecutive, nothing lost
    groups = _fallback.groups(order, ["b1.0"])
    assert groups[0].label == _fallback.BETWEEN_QDQ and groups[0].layers == ("b1.0",)
    assert [g.layers[0] for g in groups[1:]] == ["head", "b3.0", "b2.0", "b1.0", "stem.0"]  # output backwards


def test_many_blocks_merge_into_at_most_max_stages_consecutive_stages():
    order = [f"features.{i}.conv.{q}" for i in range(20) for q in ("_input_quantizer", "_weight_quantizer")]
    stages = _fallback.stages(order, max_stages=8)
    assert len(stages) == 8 and [q for s in stages for q in s] == order
    assert max(map(len, stages)) - min(map(len, stages)) <= 2  # about equal
    # a flat model: each layer its own stage
    assert len(_fallback.stages(["conv1._input_quantizer", "conv2._input_quantizer", "fc._input_quantizer"])) == 3


# =========================================================================== the search, on exact speed checks
def _groups(*names):
    return [_fallback.Group(label=n, quantizers=(f"{n}._input_quantizer",), layers=(n,)) for n in names]


def _run(first, groups, ratio_of, budget_s=60.0, try_s=0.0, fail=()):
    calls = []

    def export(off):
        calls.append(off)
        if any(f"{f}._input_quantizer" in off for f in fail):
            raise ValueError("does not verify")
        return repr(sorted(off)).encode(), sorted(off)

    return _fallback.search(_check(first), groups, export, lambda data, below: _check(ratio_of(eval(data.decode()))),
                            budget_s, try_s), calls


def test_the_search_keeps_what_is_faster_and_stops_once_the_file_is_not_slower():
    # turning off c helps, b does not, a would help more but the file is already fast enough by then
    gain = {"c._input_quantizer": 0.15, "b._input_quantizer": -0.05, "a._input_quantizer": 0.3}
    (record, kept), calls = _run(0.9, _groups("c", "b", "a", "d"), lambda off: 0.9 + sum(gain[q] for q in off))
    assert kept == ["c._input_quantizer"] and record.layers == ["c"]
    assert [t.kept for t in record.tries] == [True]
    assert record.after.ratio == pytest.approx(1.05) and "at least as fast as FP32" in record.stopped
    assert len(calls) == 1


def test_a_try_that_is_not_faster_is_dropped_and_the_next_builds_on_the_best():
    gain = {"c._input_quantizer": -0.05, "b._input_quantizer": 0.05, "a._input_quantizer": 0.06}
    (record, kept), calls = _run(0.8, _groups("c", "b", "a"), lambda off: 0.8 + sum(gain[q] for q in off))
    c, b, a = "c._input_quantizer", "b._input_quantizer", "a._input_quantizer"
    # a pass keeps b, then its neighbour a on top of b, then tries c again (b's other neighbour) on the new base;
    # the next pass would time that same file again (each candidate is timed once); the float model is timed last
    assert calls == [frozenset({c}), frozenset({b}), frozenset({b, a}), frozenset({b, a, c}), frozenset({b, a, c})]
    assert [t.kept for t in record.tries] == [False, True, True, False, False] and record.layers == ["b", "a"]
    assert [t.group.label for t in record.tries] == ["c", "b", "a", "c", _fallback.EVERY]
    assert record.after.ratio == pytest.approx(0.91) and record.stopped == "every group was tried"
    assert "sent 2 layer(s) back to float" in record.note() and "0.91x" in record.note()


def test_when_no_group_is_enough_the_last_try_is_the_float_model():
    """Every stage alone helps a little; all of them are still slower than FP32, which the float model is not."""
    (record, kept), calls = _run(0.8, _groups("c", "b", "a"), lambda off: 1.02 if len(off) == 3 else 0.8 + 0.03 * len(off))
    # pass 1 keeps c, b and a one by one (0.83, 0.86, then 1.02 with all three off: at least as fast as FP32)
    assert record.layers == ["c", "b", "a"] and record.after.ratio == pytest.approx(1.02) and len(calls) == 3
    (record, kept), calls = _run(0.8, _groups("c", "b", "a"), lambda off: 0.85 if len(off) < 3 else 1.0)
    # c helps (0.85), b and a on top of it do not, and pass 2 neither: the float model does (1.0)
    assert record.tries[-1].group.label == _fallback.EVERY and record.tries[-1].kept
    assert record.layers == ["c", "b", "a"] and record.after.ratio == pytest.approx(1.0)
    assert sorted(kept) == sorted(["c._input_quantizer", "b._input_quantizer", "a._input_quantizer"])


def test_noise_sized_gains_send_nothing_to_float():
    (record, kept), _ = _run(0.9, _groups("c", "b"), lambda off: 0.9 * (1 + 0.004 * len(off)))
    assert kept is None and record.layers == [] and not any(t.kept for t in record.tries)
    assert "none was faster" in record.note()


def _spread(ratio: float, p25: float, p75: float) -> _timing.SpeedCheck:
    return _timing.SpeedCheck(ratio=ratio, int8_ms=1.0, fp32_ms=ratio, ratio_p25=p25, ratio_p75=p75, rounds=11,
                              noisy=p25 < 1.0 < p75 or p75 - p25 > 0.1 * ratio)


def test_a_candidate_is_timed_against_the_best_ratio_so_far():
    """The search hands the timing the best ratio at each try, so a try whose first rounds all fall short of it can
    stop early: the first file's 0.8x, then 0.85x once b is kept."""
    gain = {"c._input_quantizer": -0.05, "b._input_quantizer": 0.05, "a._input_quantizer": 0.06}
    belows = []

    def measure(data, below):
        belows.append(below)
        return _check(0.8 + sum(gain[q] for q in eval(data.decode())))

    _fallback.search(_check(0.8), _groups("c", "b", "a"), lambda off: (repr(sorted(off)).encode(), sorted(off)),
                     measure, 60.0, 0.0)
    assert belows == pytest.approx([0.8, 0.8, 0.85, 0.91, 0.91])  # the last: the float model


def test_the_float_model_replaces_a_slower_file_where_it_reaches_fp32():
    """The last resort computes what the FP32 file does, so its rounds straddle 1.0: 1.01x in rounds of 0.99-1.03x
    (noisy, its lower quartile short of what a stage needs) replaces a 0.985x file; a float model timed below FP32
    does not (noise-sized gains send nothing to float)."""
    best = _spread(0.985, 0.98, 0.99)
    assert not _fallback.faster(_spread(1.01, 0.99, 1.03), best)  # as a stage it would not be kept
    for every, want in ((_spread(1.01, 0.99, 1.03), True), (_spread(0.995, 0.97, 1.02), False)):
        def measure(data, below, every=every):
            n = len(eval(data.decode()))
            return best if n == 1 else every if n == 3 else _check(0.9)

        record, kept = _fallback.search(_check(0.8), _groups("c", "b", "a"),
                                        lambda off: (repr(sorted(off)).encode(), sorted(off)), measure, 60.0, 0.0)
        assert [t.group.label for t in record.tries] == ["c", "b", "a", _fallback.EVERY]
        assert record.tries[-1].kept is want
        assert record.after.ratio == pytest.approx(1.01 if want else 0.985)


@pytest.mark.parametrize("ratios, want", [
    ([0.9, 0.9, 0.9], True),  # three rounds below, median below
    ([0.9, 0.9, 1.1], False),  # two below
    ([0.9, 0.9, 0.9, 1.1, 1.1, 1.1, 1.1], False),  # three below, median above
    ([0.9, 1.1, 0.9, 0.9, 0.99], True),
    ([1.0, 1.0, 1.0], False),  # at the best ratio is not below it
])
def test_hopeless_rounds(ratios, want):
    int8 = [1.0] * len(ratios)
    assert _timing.hopeless(int8, ratios, 1.0) is want
    assert _timing.hopeless([2.0 * q for q in int8], [2.0 * r for r in ratios], 1.0) is want  # ratios, not times
    assert _timing.hopeless(int8, ratios, None) is False


def _tiny_files():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    data = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]).SerializeToString()
    return data, [np.ones((1, 4), np.float32)]


@pytest.mark.parametrize("below, rounds", [(1e9, 3), (0.0, 11), (None, 11)])
def test_the_timing_stops_after_three_rounds_that_rule_a_candidate_out(below, rounds):
    """``below`` above any ratio: three rounds (min_rounds) and out; below any ratio, or none: every round."""
    data, feeds = _tiny_files()
    int8_s, fp32_s, _ = _timing.time_rounds(data, data, feeds, rounds=11, budget_s=60.0, min_round_s=0.001,
                                            below=below)
    assert len(int8_s) == len(fp32_s) == rounds


def test_a_real_gain_in_noisy_rounds_is_kept_and_noise_in_them_is_not():
    """The float model timed 0.99x in rounds of 0.84-1.19x against a best file of 0.84x (0.71-1.01x): its
    lower quartile does not clear the best's median, but its median is far above and its quartile above the
    best's, so it is kept (MobileNetV3-style at 224x224 saved the 0.84x file). A 3% median gain in such rounds
    is not enough, nor a median gain whose lower quartile falls below the best's."""
    best = _spread(0.84, 0.71, 1.01)
    assert _fallback.faster(_spread(0.99, 0.84, 1.19), best)
    assert not _fallback.faster(_spread(0.865, 0.74, 1.02), best)  # +3%: noise
    assert not _fallback.faster(_spread(0.95, 0.70, 1.20), best)  # a wider spread below the best's
    assert _fallback.faster(_check(0.9), _check(0.88))  # quiet rounds: the lower quartile clears the median
    first = _spread(0.57, 0.49, 0.62)
    # stage c helps (0.84x), b or a on top of it do not (0.80x), the float model does (0.99x, noisy)
    measured = {1: _spread(0.84, 0.71, 1.01), 3: _spread(0.99, 0.84, 1.19)}
    record, kept = _fallback.search(first, _groups("c", "b", "a"), lambda off: (repr(sorted(off)).encode(), sorted(off)),
                                    lambda data, _: measured.get(len(eval(data.decode())), _spread(0.80, 0.70, 0.95)),
                                    60.0, 0.0)
    # c kept, then b (its neighbour) and a on top of it; the second pass would time those same files again
    assert [t.kept for t in record.tries] == [True, False, False, True]
    assert [t.group.label for t in record.tries] == ["c", "b", "a", _fallback.EVERY]
    assert record.tries[-1].group.label == _fallback.EVERY
    assert record.after.ratio == pytest.approx(0.99) and len(kept) == 3


def test_a_copy_that_does_not_verify_is_skipped_and_said():
    (record, kept), _ = _run(0.9, _groups("c", "b"), lambda off: 0.9 + 0.2 * len(off), fail=("c",))
    assert record.tries[0].check is None and "does not verify" in record.tries[0].text()
    assert kept == ["b._input_quantizer"] and record.layers == ["b"]


def test_the_time_budget_bounds_the_search():
    (record, kept), calls = _run(0.9, _groups("c", "b"), lambda off: 1.2, budget_s=5.0, try_s=10.0)
    assert calls == [] and kept is None and "time budget" in record.stopped


def test_the_budget_keeps_one_try_for_the_float_model(monkeypatch):
    """Each try takes 10 s of a 35 s budget and no stage is enough: the passes stop while one try still fits, and
    that one is the float model (a file left slower than FP32 when the budget ran out is what the search prevents)."""
    clock = [0.0]
    monkeypatch.setattr(_fallback.time, "perf_counter", lambda: clock[0])

    def ratio(off):
        clock[0] += 10.0  # the export, verification and timing of this try
        return 1.0 if len(off) == 3 else 0.8 + 0.02 * len(off)

    (record, kept), calls = _run(0.8, _groups("c", "b", "a"), ratio, budget_s=35.0, try_s=10.0)
    assert [t.group.label for t in record.tries] == ["c", "b", _fallback.EVERY], record.tries
    assert record.after.ratio == pytest.approx(1.0) and sorted(kept) == sorted(f"{n}._input_quantizer" for n in "cba")
    assert "time budget" in record.stopped and "float model was tried last" in record.stopped


# =========================================================================== through export_onnx
def _quantized_gemm(proto: onnx.ModelProto) -> bool:
    """The head's Gemm/MatMul reads a dequantized weight (the linear is quantized in this file)."""
    made_by = {o: n.op_type for n in proto.graph.node for o in n.output}
    inits = {i.name for i in proto.graph.initializer}
    return any(n.op_type in ("Gemm", "MatMul") and made_by.get(n.input[1]) == "DequantizeLinear"
               and n.input[1] not in inits for n in proto.graph.node)


class _Timed(list):
    """Whether the head was quantized in each INT8 file timed at the sample's batch; ``batch1``: the same at batch 1."""

    batch1: list


def _cost_model(monkeypatch, fp32_ms=1.5, slow_head_ms=1.0, batch1=None):
    """Round times from the file: the INT8 file takes 1 ms, plus ``slow_head_ms`` when its head is quantized; at
    batch 1 ``batch1 = (fp32_ms, slow_head_ms)`` instead where given."""
    timed = _Timed()
    timed.batch1 = []

    def rounds(int8_model, fp32_model, feeds, providers=None, **kw):
        m = onnx.load_from_string(int8_model)
        if not any(n.op_type == "QuantizeLinear" for n in m.graph.node):  # the user's two FP32 files, compared
            return [1e-3] * 5, [1e-3] * 5, 3
        head = _quantized_gemm(m)
        one = feeds[0].shape[0] == 1
        (timed.batch1 if one else timed).append(head)
        fp32, slow = batch1 if one and batch1 is not None else (fp32_ms, slow_head_ms)
        t = 1e-3 * (1.0 + (slow if head else 0.0))
        return [t] * 5, [fp32 * 1e-3] * 5, 3

    monkeypatch.setattr(_timing, "time_rounds", rounds)
    return timed


def test_a_slower_file_is_replaced_by_the_copy_timing_says_is_faster(tmp_path, monkeypatch):
    x = torch.randn(4, 3, 16, 16)
    model = _quantized(x)
    before = _enabled(model)
    timed = _cost_model(monkeypatch)
    res = export_onnx(model, x, tmp_path / "m.onnx")
    # the first file; the copy with b3.0 (a conv onnxruntime runs in float between Q/DQ: a float ReLU reads it)
    # in float: not faster, dropped; the copy with the last stage (the head) in float: kept, and fast enough
    assert timed == [True, True, False]
    assert [(t.group.label, t.group.layers, t.kept) for t in res.fallback.tries] == [
        (_fallback.BETWEEN_QDQ, ("b3.0",), False), ("stage head", ("head",), True)]
    assert res.float_fallback == ["head"] and res.fallback.before.ratio == pytest.approx(0.75)
    assert res.speed_check.ratio == pytest.approx(1.5) and res.speedup == pytest.approx(1.5)
    assert "sent 1 layer(s) back to float" in " ".join(res.warnings)
    assert "sent back to float after timing (0.75x -> 1.50x at batch 4): head" in res.summary()
    row = next(r for r in report.kernel_rows(res) if r[0] == "head")
    assert row[2] == "float" and "sent back to float after timing" in row[3] and "0.75x" in row[3]
    assert res.kernel_of("head") == "float (sent back to float after timing)"
    assert res.kernel_of("b1.0") == "QLinearConv"
    assert _enabled(model) == before  # the user's model keeps every quantizer
    saved = onnx.load(str(tmp_path / "m.onnx"))
    assert not _quantized_gemm(saved) and res.path == str(tmp_path / "m.onnx")
    assert any(n.op_type == "QuantizeLinear" for n in saved.graph.node)  # the rest stays INT8
    assert not list(tmp_path.glob("*.unverified.onnx"))
    # the file computes the model with the head's quantizers off (independent reference: PyTorch on that copy),
    # and not the model with every quantizer
    assert res.fallback.quantizers == ["head._input_quantizer", "head._weight_quantizer"]
    ref = copy.deepcopy(model)
    ref.head._input_quantizer.disable()
    ref.head._weight_quantizer.disable()
    documented = copy.deepcopy(model)  # what docs/reference.md tells a user to do
    for q in res.fallback.quantizers:
        documented.get_submodule(q).disable()
    assert _enabled(documented) == _enabled(ref)
    with torch.no_grad():
        want, full = ref(x).numpy(), model(x).numpy()
    got = _verify.run(_verify.make_session(str(tmp_path / "m.onnx")), [x.numpy()])[0]
    assert res.judge([got], [want]) == ""
    assert np.abs(got - want).max() < 0.25 * np.abs(got - full).max()


def test_a_file_that_is_not_slower_or_is_timed_in_noisy_rounds_is_kept_as_it_is(tmp_path, monkeypatch):
    x = torch.randn(4, 3, 16, 16)
    model = _quantized(x)
    timed = _cost_model(monkeypatch, fp32_ms=2.5)  # 1.25x: nothing to do
    res = export_onnx(model, x, tmp_path / "a.onnx")
    assert timed == [True] and res.fallback is None and res.float_fallback == []
    assert _quantized_gemm(onnx.load(str(tmp_path / "a.onnx")))

    def noisy(int8_model, fp32_model, feeds, providers=None, **kw):
        return [1e-3] * 5, [0.7e-3, 0.8e-3, 0.9e-3, 1.1e-3, 1.3e-3], 3

    monkeypatch.setattr(_timing, "time_rounds", noisy)
    res = export_onnx(model, x, tmp_path / "b.onnx")
    assert res.speed_check.noisy and res.speed_check.slower and res.fallback is None
    assert any("measurement is noisy" in w for w in res.warnings)


def test_rounds_that_all_say_slower_start_the_fallback_however_noisy_their_spread(tmp_path, monkeypatch):
    """RNet's rounds were 0.50-0.63x, noisy by their spread, and nothing happened: the fallback starts when at
    least three rounds of four say slower (the per-round ratios' upper quartile below 1.0), and the saved file's
    slowness, if any is left, is a Python warning."""
    x = torch.randn(4, 3, 16, 16)
    model = _quantized(x)
    seen = []

    def spread(int8_model, fp32_model, feeds, providers=None, **kw):
        m = onnx.load_from_string(int8_model)
        if not any(n.op_type == "QuantizeLinear" for n in m.graph.node):
            return [1e-3] * 5, [1e-3] * 5, 3
        seen.append(_quantized_gemm(m))
        return [1e-3] * 5, [0.50e-3, 0.52e-3, 0.55e-3, 0.60e-3, 0.63e-3], 3  # every round slower, a wide spread

    monkeypatch.setattr(_timing, "time_rounds", spread)
    with pytest.warns(SlowerThanFP32Warning, match="runs at 0.55x the speed of the plain FP32 export"):
        res = export_onnx(model, x, tmp_path / "c.onnx", fallback_seconds=0)  # no search: the slow file, said
    assert res.speed_check.noisy and res.speed_check.clearly_slower and res.fallback is None
    seen.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowerThanFP32Warning)  # the saved file is not slower: no warning
        res = export_onnx(model, x, tmp_path / "d.onnx", fallback_seconds=30)
    first = res.fallback.before
    assert first.noisy and first.clearly_slower and len(res.fallback.tries) >= 1  # the search ran
    # every copy with quantizers left timed 0.55x: the last try, every quantizer off, ran as fast as FP32 (the fake
    # times a file without QuantizeLinear like the FP32 one) and was kept
    assert len(seen) == len(res.fallback.tries) and res.speed_check.ratio == pytest.approx(1.0)


def test_a_copy_that_moves_the_outputs_is_not_used(tmp_path, monkeypatch):
    """A model trained quantized (QAT from a random start) can compute something else without its quantizers: a
    copy whose outputs move beyond FIDELITY from the quantized model's is refused, whatever its speed."""
    got, want = [np.array([1.0, 2.0, 2.0])], [np.array([1.0, 2.0, 2.1])]
    assert _fallback.check_fidelity(got, want) == pytest.approx(0.1 / np.sqrt(1 + 4 + 2.1 ** 2))
    with pytest.raises(ValueError, match="move 33.3% from the quantized model's"):
        _fallback.check_fidelity([np.array([1.0, 2.0, 3.0])], [np.array([1.0, 2.0, 2.0])])
    x = torch.randn(4, 3, 16, 16)
    model = _quantized(x)
    _train_a_step(model, x)  # trained since calibration (QAT): its float self may compute something else
    timed = _cost_model(monkeypatch)
    monkeypatch.setattr(_fallback, "FIDELITY", 0.0)  # every quantizer matters: no copy is close enough
    res = export_onnx(model, x, tmp_path / "m.onnx")
    assert timed == [True]  # no copy was even timed
    assert res.float_fallback == [] and res.fallback.tries and all(t.check is None for t in res.fallback.tries)
    assert "from the quantized model's" in res.fallback.tries[0].error
    assert _quantized_gemm(onnx.load(str(tmp_path / "m.onnx")))


def _train_a_step(model, x):
    """One optimizer step with the quantizers on, as QAT takes: the weights change in place."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model.train()
    model(x).square().mean().backward()
    opt.step()
    model.eval()


def test_a_model_not_trained_since_calibration_may_lose_its_quantizers_however_far_its_outputs_move(tmp_path,
                                                                                                    monkeypatch):
    """Post-training quantization: with its quantizers off the model is the user's own float model, so the fidelity
    gate does not refuse the copies (a MobileNetV3-style net moved 12% and its float model was refused: the file
    ran at 0.68x FP32). A training step after calibration brings the gate back (previous test)."""
    from lq.calib import _stamp

    x = torch.randn(4, 3, 16, 16)
    model = _quantized(x)
    assert _stamp.untouched(model)
    timed = _cost_model(monkeypatch)
    monkeypatch.setattr(_fallback, "FIDELITY", 0.0)
    res = export_onnx(model, x, tmp_path / "m.onnx")
    assert res.float_fallback == ["head"] and res.speed_check.ratio == pytest.approx(1.5), res.fallback.note()
    assert timed == [True, True, False]
    assert _stamp.untouched(model)  # the export changed nothing of the user's model
    moved = copy.deepcopy(model)
    assert not _stamp.untouched(moved)  # a copy is not known to be as calibrated
    _train_a_step(model, x)
    assert not _stamp.untouched(model)


def test_fallback_seconds_zero_only_warns(tmp_path, monkeypatch):
    x = torch.randn(4, 3, 16, 16)
    model = _quantized(x)
    timed = _cost_model(monkeypatch)
    res = export_onnx(model, x, tmp_path / "m.onnx", fallback_seconds=0)
    assert timed == [True] and res.fallback is None and res.speed_check.slower
    assert any("0.75x the speed of the plain FP32 export" in w for w in res.warnings)
    assert _quantized_gemm(onnx.load(str(tmp_path / "m.onnx")))
    for bad in (-1, "1", True):
        with pytest.raises(ValueError, match="fallback_seconds"):
            ExportConfig(fallback_seconds=bad)


def test_when_no_copy_is_faster_the_file_stays_and_the_warning_lists_the_tries(tmp_path, monkeypatch):
    x = torch.randn(4, 3, 16, 16)
    model = _quantized(x)
    monkeypatch.setattr(_timing, "time_rounds",  # every file 2 ms against FP32's 1.5 ms
                        lambda int8_model, fp32_model, feeds, providers=None, **kw: ([2e-3] * 5, [1.5e-3] * 5, 3))
    res = export_onnx(model, x, tmp_path / "m.onnx")
    assert res.fallback is not None and res.float_fallback == [] and len(res.fallback.tries) >= 5
    assert all(not t.kept for t in res.fallback.tries) and res.fallback.stopped == "every group was tried"
    text = " ".join(res.warnings)
    assert "0.75x the speed of the plain FP32 export" in text and "none was faster" in text
    assert _quantized_gemm(onnx.load(str(tmp_path / "m.onnx")))
    assert "sent back to float" not in res.summary()


def test_the_callback_warns_when_layers_went_back_to_float(monkeypatch, tmp_path):
    """The fallback's note is a warning in the callback's report, like a slower file's: the file no longer
    computes every quantizer the trained model has."""
    from types import SimpleNamespace

    import lq.export
    from lq.callbacks.export import QuantExport

    record = _fallback.Fallback(layers=["head"], quantizers=["head._input_quantizer"], before=_check(0.8),
                                after=_check(1.1), tries=[], stopped="done")
    monkeypatch.setattr(lq.export, "export_onnx", lambda model, sample, path, **kw: SimpleNamespace(
        max_abs_diff=None, speedup=1.1, speed_check=record.after, layer_kernels=[], fallback=record,
        warnings=["an ordinary note", record.note()]))
    model = nn.Linear(3, 2)
    model.device = torch.device("cpu")
    cb = QuantExport(ExportConfig(path=str(tmp_path / "m.onnx")), sample_input=lambda t, m: torch.ones(2, 3))
    with pytest.warns(UserWarning, match="sent 1 layer\\(s\\) back to float") as caught:
        cb.run(SimpleNamespace(default_root_dir=str(tmp_path)), model)
    assert not any("an ordinary note" in str(w.message) for w in caught)


# =========================================================================== the search at batch 1
def test_the_batch_one_search_starts_from_the_kept_file_and_keeps_nothing_slower_at_the_checks_batch():
    """At batch 1 turning off c or a is faster; at the check's batch c costs (1.2x -> 1.05x) and a does not. The
    search starts from the file a search before it kept (b float), refuses c (said so), keeps a, and its record
    names every float layer, b first."""
    base = _fallback.Fallback(layers=["b"], quantizers=["b._input_quantizer"], before=_check(0.9), after=_check(1.2),
                              tries=[], stopped="")
    at_one = {"c._input_quantizer": 0.1, "a._input_quantizer": 0.1}
    at_sample = {"c._input_quantizer": -0.15, "a._input_quantizer": 0.0}
    sample_timed = []

    def at_check_batch(data):
        off = eval(data.decode())
        sample_timed.append(off)
        return _check(1.2 + sum(at_sample.get(q, 0.0) for q in off))

    guard = _fallback.batch_guard(_check(1.2), at_check_batch)
    record, kept = _fallback.search(
        _check(0.85), _groups("c", "a"), lambda off: (repr(sorted(off)).encode(), sorted(off)),
        lambda data, below: _check(0.85 + sum(at_one.get(q, 0.0) for q in eval(data.decode()))), 60.0, 0.0,
        base=base, guard=guard)
    c, a, b = "c._input_quantizer", "a._input_quantizer", "b._input_quantizer"
    assert [(t.group.label, t.kept) for t in record.tries][:2] == [("c", False), ("a", True)]
    assert "faster but not kept: 1.05x" in record.tries[0].text()
    assert kept == sorted([b, a]) and record.layers == ["b", "a"] and record.started_from == ["b"]
    assert sample_timed[:2] == [sorted([b, c]), sorted([b, a])]  # only tries faster at batch 1 are timed there
    assert guard.best().ratio == pytest.approx(1.2)
    assert "the file with 1 layer(s) in float ran at 0.85x" in record.note()


def test_the_guard_refuses_what_falls_below_fp32_at_the_checks_batch_and_lets_noise_through():
    guard = _fallback.batch_guard(_check(1.02), lambda data: _check(float(data)))
    assert guard(b"0.99")  # below FP32 where the best was not
    assert guard(b"1.01") is None and guard.best().ratio == pytest.approx(1.01)  # within the best's rounds
    assert guard(b"0.9")


def test_a_file_slower_only_at_batch_1_gets_the_batch_one_search(tmp_path, monkeypatch):
    """At the sample's batch (4) the file is faster than FP32 with its head quantized (1.5 ms against 1.0); at batch
    1 slower (0.75x), where the head in float is faster. Where the head in float is not slower at batch 4 the copy is
    kept; where it is, the file stays and a note says so. The user's model keeps its quantizers."""
    x = torch.randn(4, 3, 16, 16)
    model = _quantized(x)
    before = _enabled(model)
    # batch 4: head quantized 1.5 ms / 1.0 ms = 1.5x; head float 1.5 / 1.0 = 1.5x too (slow_head_ms=0)
    timed = _cost_model(monkeypatch, fp32_ms=1.5, slow_head_ms=0.0, batch1=(1.5, 1.0))
    res = export_onnx(model, x, tmp_path / "m.onnx")
    assert res.fallback is None and res.batch1_fallback is not None
    assert res.float_fallback == ["head"] and res.batch1_check.ratio == pytest.approx(1.5)
    assert res.speed_check.batch == 4 and res.speed_check.ratio == pytest.approx(1.5)
    assert timed.batch1[0] is True and timed.batch1[-1] is False  # the file, then the copy with the head float
    assert not _quantized_gemm(onnx.load(str(tmp_path / "m.onnx")))
    assert "speed at batch 1: 1.50x" in res.summary() and "at batch 1): head" in res.summary()
    row = next(r for r in report.kernel_rows(res) if r[0] == "head")
    assert row[2] == "float" and "0.75x" in row[3] and "at batch 1" in row[3]
    assert _enabled(model) == before

    # now the head in float costs at batch 4 (3.0x quantized against 2.0x float): refused, the file stays
    _cost_model(monkeypatch, fp32_ms=2.0, slow_head_ms=-1 / 3, batch1=(1.5, 1.0))
    res = export_onnx(model, x, tmp_path / "n.onnx")
    assert res.float_fallback == [] and res.batch1_check.ratio == pytest.approx(0.75)
    assert any(t.refused for t in res.batch1_fallback.tries)
    assert _quantized_gemm(onnx.load(str(tmp_path / "n.onnx")))
    assert any("at batch 1 the file runs at 0.75x" in w and "kept nothing faster there" in w for w in res.warnings)

    # a batch the user names is the one batch the check times
    timed = _cost_model(monkeypatch, fp32_ms=1.5, slow_head_ms=0.0, batch1=(1.5, 1.0))
    res = export_onnx(model, x, tmp_path / "o.onnx", speed_batch=4)
    assert res.batch1_check is None and res.batch1_fallback is None and timed.batch1 == []
