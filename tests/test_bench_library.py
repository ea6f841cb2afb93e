"""Smoke run of the library-models bench: ``python -m bench.library --fast`` as a user runs it (a subprocess,
started with the test session beside the other benches: tests/_bench_runs.py), writing its markdown and JSON into
a temporary folder; every model's row must be there with sane values.

The numbers of a fast run are not the published ones (512 training images, one epoch, truncated MobileNetV3 and
EfficientNet, batch 1 and 8 only, few repeats); docs/results/library.md holds those. What lq's files do (speed,
verification) is the bench's finding, not checked here: a file that fails lq's verification is a row with the
error text, which is what this test asks for.
"""

from __future__ import annotations

import json
import math

import pytest


@pytest.fixture(scope="module")
def run(bench_runs):
    """The bench's smoke run (started with the session, side by side with the other benches and the rest of the
    suite: tests/_bench_runs.py): its JSON, its markdown, its output."""
    r = bench_runs["library"]
    if isinstance(r, str):
        pytest.skip(r)
    r.check()
    json_path = r.out / "library" / "library.json"
    assert json_path.exists(), r.log[-4000:]
    return json.loads(json_path.read_text()), (r.out / "library" / "library.md").read_text(), r.log


def _ratio_ok(s: dict) -> bool:
    return all(isinstance(s[k], (int, float)) and math.isfinite(s[k]) and s[k] > 0 for k in ("median", "p25", "p75")) \
        and s["p25"] <= s["median"] <= s["p75"]


def test_every_model_has_its_row(run):
    from bench import library as L

    FAST = (L.LQ_ORT, L.ORT_QS, L.NNCF)  # the files of a --fast run besides FP32's
    assert L.lq_recipes(True) == ((L.LQ_ORT, "int8_onnxruntime"),) and L.lq_recipes(False) == L.LQ_RECIPES
    res, _, _ = run
    assert res["fast"] is True
    assert [r["model"] for r in res["rows"]] == [s.label for s in L.MODELS]
    for r in res["rows"]:
        name = r["model"]
        assert r["metric"] in ("accuracy", "IoU"), name
        # every file was made and measured: FP32, lq's recipes, onnxruntime's quantize_static, NNCF's quantize
        # (--fast: lq's file is the default recipe's, int8_onnxruntime, the one the targets judge)
        assert set(r["quality"]) == {L.FP32, L.FP32_LEGACY, *FAST}, (name, r["quality"], r["verified"], r["notes"])
        for k, v in [*r["quality"].items(), *r["quality_torch"].items()]:
            assert isinstance(v, float) and 0.0 <= v <= 1.0, (name, k, v)
        assert set(r["speedup"]) == {"1", "8"}, name  # --fast: batch 1 and 8
        for b, sp in r["speedup"].items():
            assert set(sp) == {L.FP32_LEGACY, *FAST}, (name, b, sp)
            assert all(_ratio_ok(s) for s in sp.values()), (name, b, sp)
            assert r["ms_fp32"][b]["median"] > 0, (name, b)
        # the FP32 file is the trained model: its onnxruntime quality is PyTorch's (two test images may differ)
        allowed = 0.01 if r["metric"] == "IoU" else 2 / r["test_images"] + 1e-9
        for f in (L.FP32, L.FP32_LEGACY):
            assert abs(r["quality"][f] - r["quality_torch"]["FP32"]) <= allowed, (name, f, r["quality"])
        # lq's verification is recorded either way, with the error text when it failed
        assert set(r["verified"]) == {L.LQ_ORT}, (name, r["verified"])
        for c, _ in L.lq_recipes(True):
            v = r["verified"][c]
            assert isinstance(v["verified"], bool) and (v["verified"] or v["error"]), (name, c, v)
        # conv/gemm kernels counted in the graph onnxruntime runs, and lq's report of its own layers
        k = r["ort_kernels"]
        for f in (L.FP32, L.FP32_LEGACY):
            assert k[f]["integer"] == 0 and k[f]["float"] >= 1, (name, f, k[f])
        assert k[L.ORT_QS]["integer"] >= 1, (name, k[L.ORT_QS])
        # NNCF's own PTQ file (issue 40's accuracy peer) is quantized (made for OpenVINO: onnxruntime may run it float)
        assert any(op.startswith(("QuantizeLinear", "QLinear")) for op in k[L.NNCF]["ops"]), (name, k[L.NNCF])
        for c in FAST:
            assert 0 <= k[c]["integer"] and k[c]["integer"] + k[c]["float"] >= 1, (name, c, k[c])
        for c, _ in L.lq_recipes(True):
            lk = r["kernels"][c]
            assert 1 <= lk["layers"] and 0 <= lk["integer"] <= lk["layers"], (name, c, lk)
            assert len(lk["float"]) == lk["layers"] - lk["integer"], (name, c, lk)


def test_cpu_named_with_every_table(run):
    res, md, stdout = run
    cpu = res["machine"]["cpu"]
    assert cpu and res["machine"]["isa"] and res["machine"]["isa"] != "unknown"
    assert all(r["isa"] == res["machine"]["isa"] for r in res["rows"])
    assert md.startswith("# Library-style models") and "Reproduce: `python -m bench.library`" in md.splitlines()[2]
    tables = [line for line in md.splitlines() if line.startswith("## ") and line != "## Run"]
    assert tables and all(f"(CPU: {cpu}" in t and f"{res['machine']['isa']})" in t for t in tables[:3]), tables
    assert f"CPU: {cpu}" in stdout and "load average" in md
    assert "Command: `python -m bench.library --fast" in md


def test_qat_bench_exports_what_it_chose(bench_runs):
    """``python -m bench.qat --fast``: QuantCallback()'s defaults fine-tune the trained O-Net shape (the fine-tuning
    LR: the model is calibrated first) and the exported file computes the model the callback chose: its accuracy
    in onnxruntime is that model's in PyTorch (PTQ's from an independent calibration, or QAT's) within two test
    images."""
    r = bench_runs["qat"]
    if isinstance(r, str):
        pytest.skip(r)
    r.check()
    res = json.loads((r.out / "qat" / "qat.json").read_text())
    assert res["fast"] is True and res["machine"]["isa"] != "unknown"
    (row,) = res["rows"]
    a = row["auto"]
    assert a["policy"] == "cosine", a
    assert a["chosen"] in ("ptq", "qat") and set(a["val_scores"]) == {"ptq", "qat"}, a
    assert (a["chosen"] == "ptq") == (a["val_scores"]["qat"] < a["val_scores"]["ptq"]), a
    reference = row["ptq_torch"] if a["chosen"] == "ptq" else a["qat_torch"]
    assert abs(a["file"] - reference) <= 2 / row["test_images"] + 1e-9, (a, row["ptq_torch"])
    md = (r.out / "qat" / "qat.md").read_text()
    assert md.startswith("# QAT with the callback's defaults") and f"CPU: {res['machine']['isa']}" in md
