"""Every Python snippet and command the README shows runs as written (a README line is a promise)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


PYTHON_BLOCKS = _blocks("python")


def test_the_readme_has_the_snippets_this_file_runs():
    assert len(PYTHON_BLOCKS) >= 4  # quick look, configuration, post-training, sensitivity
    assert any("QuantCallback()" in b for b in PYTHON_BLOCKS)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_snippet_runs_as_written(tmp_path, index):
    code = "import torch\ntorch.set_flush_denormal(True)\n" + PYTHON_BLOCKS[index]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 0, f"README snippet {index} failed:\n{PYTHON_BLOCKS[index]}\n{out.stderr[-4000:]}"
    if "export" in PYTHON_BLOCKS[index] or "QuantCallback" in PYTHON_BLOCKS[index]:
        assert list(tmp_path.glob("**/*.onnx")), "the snippet promises an ONNX file"


@pytest.mark.slow
def test_lightning_cli_command_runs_as_written(tmp_path):
    (cmd,) = [b for b in _blocks("bash") if b.startswith("lq-cli fit")]
    args = cmd.replace("\\\n", " ").split()[1:]
    assert "--trainer.max_epochs=3" in args  # finishes in the time a reader expects (Lightning's default: 1000)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    exe = shutil.which("lq-cli")  # the console script, as the README has it
    launcher = [exe] if exe else [sys.executable, "-c", "from lq.cli import lightning_cli; lightning_cli()"]
    out = subprocess.run([*launcher, *args, "--trainer.enable_progress_bar=false"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert list(tmp_path.glob("**/model_int8.onnx"))
