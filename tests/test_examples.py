"""Every example and the lq-train job run end to end in their fast modes (so they never rot)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _limits import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(args, cwd, timeout=HANG_GUARD_S):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out.stdout + out.stderr


def test_python_api_example(tmp_path):
    log = _run([str(EXAMPLES / "python_api.py"), "--fast", "--out", str(tmp_path)], tmp_path)
    assert "INT8 QAT test accuracy" in log
    assert (tmp_path / "model_int8.onnx").exists()


def test_post_training_example(tmp_path):
    log = _run([str(EXAMPLES / "post_training.py"), "--fast", "--out", str(tmp_path)], tmp_path)
    assert "INT8 PTQ" in log and (tmp_path / "ptq_int8.onnx").exists()


def test_lightning_cli_example(tmp_path):
    cfg = (EXAMPLES / "lightning_cli.yaml").read_text().replace("outputs/lightning_cli", str(tmp_path))
    (tmp_path / "cfg.yaml").write_text(cfg)
    _run([str(EXAMPLES / "lightning_cli.py"), "fit", "--config", str(tmp_path / "cfg.yaml"), "--trainer.max_epochs=1",
          "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false"],
         tmp_path)
    assert (tmp_path / "model_int8.onnx").exists()


def test_hydra_example_and_lq_train(tmp_path):
    fast = ["trainer=fast", "fp32_epochs=1", "qat_epochs=1", "calib.num_batches=2", "calib=entropy", "qat=distill",
            f"hydra.run.dir={tmp_path}"]
    log = _run([str(EXAMPLES / "hydra_app.py"), *fast], tmp_path)
    for row in ("accuracy: FP32", "accuracy: INT8 PTQ", "accuracy: INT8 QAT", "accuracy: INT8 ONNX",
                "latency: int8, batch 32", "size: model_int8.onnx", "lq: QAT distills from a frozen FP32 copy",
                "stem.0._input_quantizer"):  # the per-layer table, whole (output to a pipe is not cut at 80)
        assert row in log, row
    assert (tmp_path / "model_int8.onnx").exists()


def test_lq_train_rejects_bad_values(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "lq.cli", "calib.method=kl", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=HANG_GUARD_S, env=env, cwd=tmp_path)
    assert out.returncode != 0
    assert "CalibConfig.method='kl'" in out.stderr + out.stdout


@pytest.mark.slow
def test_lq_train_default_job_accuracy(tmp_path):
    """The README's main command on its embedded default: ONNX INT8 within 1 point of FP32."""
    from lq.config import JobConfig
    from lq.pipeline import run_job

    res = run_job(JobConfig(output_dir=str(tmp_path), trainer={"enable_progress_bar": False, "logger": False,
                                                                "enable_model_summary": False}),
                  print_table=False)
    acc = res.accuracy
    md = (tmp_path / "results.md").read_text()
    assert "| accuracy: INT8 ONNX (onnxruntime) |" in md and "stem.0._input_quantizer" in md
    import json

    data = json.loads((tmp_path / "results.json").read_text())
    assert data["accuracy"]["onnx_int8"] == acc["onnx_int8"] and data["layers"]
    assert acc["fp32"] > 0.95
    assert acc["onnx_int8"] >= acc["fp32"] - 0.01
    assert acc["qat"] >= acc["fp32"] - 0.01
