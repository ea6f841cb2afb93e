"""Progress for the long steps (lq.progress): calibration batches, auto's search, the export's stages; shown on a
terminal, through a given reporter, and not at all when turned off or when stderr is not a terminal.

Each test counts what the step did independently (batches given, stages the export ran) and compares it with what
was reported.
"""

from __future__ import annotations

import io
import sys
import warnings

import pytest
import torch
from torch import nn

from lq import progress
from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.export import export_onnx

pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    x = torch.randn(4, 3, 16, 16)
    quantize_model(m, sample=x)
    return m, x


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 16, 16, generator=g) for _ in range(n)]


def test_calibration_reports_every_batch_of_each_pass_and_auto_search():
    m, _ = _model()
    rec = progress.Recorder()
    calibrate_model(m, _batches(5), progress=rec)  # auto: a range pass, a histogram pass, then the search
    opened = rec.opened()
    assert opened[:2] == ["Calibrating", "Calibrating: histograms"], opened
    assert any(d.startswith("Calibration 'auto'") for d in opened), opened
    per_step: dict = {}
    for kind, d, v in rec.events:
        if kind == "open":
            per_step[d] = {"total": v, "done": 0}
        elif kind == "advance" and d in per_step:
            per_step[d]["done"] += v
    assert per_step["Calibrating"] == {"total": 5, "done": 5}
    assert per_step["Calibrating: histograms"] == {"total": 5, "done": 5}
    assert [k for k, *_ in rec.events].count("open") == [k for k, *_ in rec.events].count("close")


def test_num_batches_is_the_total_and_max_is_one_pass():
    m, _ = _model()
    rec = progress.Recorder()
    calibrate_model(m, _batches(6), method="max", num_batches=3, progress=rec)
    assert rec.opened() == ["Calibrating"]
    assert rec.events[0] == ("open", "Calibrating", 3)
    assert sum(v for k, _, v in rec.events if k == "advance") == 3


def test_bias_correction_reports_its_two_passes():
    m, _ = _model()
    rec = progress.Recorder()
    calibrate_model(m, _batches(6), method="max", progress=rec, bias_correction=True)
    assert rec.opened() == ["Calibrating", "Bias correction: float pass", "Bias correction: quantized pass"]


def test_export_reports_each_stage_and_keeps_their_seconds(tmp_path):
    m, x = _model()
    calibrate_model(m, _batches(2), method="max", progress=False)
    rec = progress.Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = export_onnx(m, x, tmp_path / "m.onnx", progress=rec, fallback_seconds=0)
    (first,) = [e for e in rec.events if e[0] == "open"]
    assert first[1].startswith("Exporting m.onnx") and first[2] == 8
    ran = list(res.stage_seconds)
    assert ran == ["prepare", "trace", "rewrite", "verify", "report", "fp32 reference", "speed check"], ran
    assert sum(v for k, _, v in rec.events if k == "advance") == len(ran)
    assert all(v >= 0 for v in res.stage_seconds.values())
    assert "seconds: prepare" in res.summary()


def test_nothing_is_drawn_when_off_or_when_stderr_is_not_a_terminal(tmp_path, capsys, monkeypatch):
    m, x = _model()
    monkeypatch.delenv("LQ_PROGRESS", raising=False)
    calibrate_model(m, _batches(2), method="max")  # pytest's captured stderr is not a terminal
    calibrate_model(m, _batches(2), method="max", progress=False)
    assert capsys.readouterr().err == ""


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_a_display_unless_lq_progress_is_0(monkeypatch):
    m, _ = _model()
    fake = _Terminal()
    monkeypatch.setattr(sys, "stderr", fake)
    monkeypatch.delenv("LQ_PROGRESS", raising=False)
    calibrate_model(m, _batches(3), method="max")
    assert "Calibrating" in fake.getvalue()
    fake2 = _Terminal()
    monkeypatch.setattr(sys, "stderr", fake2)
    monkeypatch.setenv("LQ_PROGRESS", "0")
    calibrate_model(m, _batches(3), method="max")
    assert fake2.getvalue() == ""


def test_a_bad_progress_value_is_refused_in_one_line():
    m, _ = _model()
    with pytest.raises(TypeError, match="progress must be None, True, False or an lq.progress.Reporter"):
        calibrate_model(m, _batches(1), method="max", progress="yes")
