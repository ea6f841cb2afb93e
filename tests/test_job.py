"""The lq-train job (lq.pipeline.run_job) with the DataModules and QAT runs users bring: a DataModule with no test
loader (or no held-out loader at all), a QAT that makes the model worse, and errors after training."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from lq.config import ExportConfig, JobConfig
from lq.pipeline import defined_splits, ort_accuracy, run_job

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class DigitsMLP(L.LightningModule):
    """A plain classifier; with ``sabotage_qat`` its QAT steps climb the loss instead (a QAT that hurts)."""

    def __init__(self, sabotage_qat: bool = False):
        super().__init__()
        self.sabotage_qat = sabotage_qat
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self(*batch[:1]), batch[1])
        quantized = any(type(m).__name__ == "TensorQuantizer" for m in self.modules())
        return -loss if self.sabotage_qat and quantized else loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 2e-2)


class TrainOnly(L.LightningDataModule):
    """What many DataModules are: a train loader and nothing else."""

    def setup(self, stage=None):
        d = load_digits()
        x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
        g = torch.Generator().manual_seed(0)
        idx = torch.randperm(len(x), generator=g)
        self.train_set = torch.utils.data.TensorDataset(x[idx[:1400]], torch.tensor(d.target)[idx[:1400]])
        self.val_set = torch.utils.data.TensorDataset(x[idx[1400:]], torch.tensor(d.target)[idx[1400:]])

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=64, shuffle=True)


class TrainVal(TrainOnly):
    """Train and val loaders, no test loader: the most common DataModule."""

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val_set, batch_size=256)


def _job(tmp_path, data: type, **kw) -> JobConfig:
    model = {"_target_": f"{__name__}.DigitsMLP", "sabotage_qat": kw.pop("sabotage_qat", False)}
    trainer = {"enable_progress_bar": False, "logger": False, "enable_model_summary": False,
               "limit_train_batches": 8, "limit_val_batches": 2, "accelerator": "cpu", "devices": 1}
    return JobConfig(output_dir=str(tmp_path), model=model, data={"_target_": f"{__name__}.{data.__name__}"},
                     trainer=trainer, fp32_epochs=kw.pop("fp32_epochs", 3), qat_epochs=kw.pop("qat_epochs", 1),
                     calib={"method": "max", "num_batches": 2}, **kw)


def test_the_splits_a_datamodule_defines_are_read_before_training():
    """Lightning's base class has test_dataloader/val_dataloader that raise: only the DataModule's own count."""
    from lq.zoo import DigitsDataModule

    assert defined_splits(TrainOnly()) == []
    assert defined_splits(TrainVal()) == ["val"]
    assert defined_splits(DigitsDataModule()) == ["test", "val"]


def test_a_datamodule_without_a_test_loader_gives_an_exported_verified_model(tmp_path):
    """`lq-train data._target_=...` with a train/val DataModule trained for minutes, then died in
    dm.test_dataloader() with Lightning's MisconfigurationException and left no ONNX file. The job now measures
    on val and exports."""
    torch.set_flush_denormal(True)
    res = run_job(_job(tmp_path, TrainVal), print_table=False)
    assert res.eval_split == "val" and res.exported in ("qat", "ptq")  # the better of the two on val
    assert (tmp_path / "model_int8.onnx").exists() and (tmp_path / "fp32.ckpt").exists()
    assert (tmp_path / "qat.ckpt").exists()
    assert res.accuracy["fp32"] > 0.8 and res.accuracy["onnx_int8"] > 0.8
    md = (tmp_path / "results.md").read_text()
    assert "accuracy: INT8 ONNX (onnxruntime) [val]" in md


def test_a_datamodule_with_only_a_train_loader_says_nothing_is_measured(tmp_path):
    torch.set_flush_denormal(True)
    res = run_job(_job(tmp_path, TrainOnly, fp32_epochs=1), print_table=False)
    assert res.eval_split is None and all(v is None for v in res.accuracy.values())
    assert (tmp_path / "model_int8.onnx").exists()
    assert any("no test_dataloader or val_dataloader" in n for n in res.notes)
    assert "not measured" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("export_best", [True, False])
def test_a_qat_that_makes_the_model_worse_is_said_and_not_exported(tmp_path, export_best):
    """`lq-train quant=int8_per_tensor calib=entropy qat=cosine fp32_epochs=4` went from PTQ 97.77% to QAT 77.16%
    and exported the worse model without a word. Here QAT climbs the loss on purpose: the job says so, and
    exports the PTQ model (export_best, the default) whose onnxruntime accuracy is PTQ's, not QAT's."""
    torch.set_flush_denormal(True)
    with pytest.warns(UserWarning, match="QAT ended less accurate than PTQ on the val data"):
        # the file must compute the model the job chose, every quantizer kept (no measured fallback: the tiny MLP
        # can be slower than FP32 in onnxruntime, and the fallback would then put layers back in float)
        res = run_job(_job(tmp_path, TrainVal, sabotage_qat=True, qat={"lr_policy": "none"},  # at the module's LR
                           export=ExportConfig(fallback_seconds=0, export_best=export_best)), print_table=False)
    assert res.selection["qat"] < res.selection["ptq"] - 0.05, res.selection
    assert res.exported == ("ptq" if export_best else "qat")
    assert any("QAT ended less accurate than PTQ" in n for n in res.notes)
    acc = res.accuracy
    assert abs(acc["onnx_int8"] - acc["ptq" if export_best else "qat"]) <= 0.01, acc
    md = (tmp_path / "results.md").read_text()
    assert ("PTQ (QAT was less accurate)" in md) == export_best
    if export_best:  # the exported model's checkpoint loads like the QAT one
        import lq

        m = lq.load_quantized(DigitsMLP, str(tmp_path / "ptq.ckpt"))
        x, y = TrainVal(), None
        x.setup()
        xs, ys = x.val_set.tensors
        with torch.no_grad():
            torch_acc = float((m(xs).argmax(1) == ys).float().mean())
        onnx_acc, _ = ort_accuracy(str(tmp_path / "model_int8.onnx"), xs, ys)
        assert abs(torch_acc - onnx_acc) <= 0.01 and abs(torch_acc - res.selection["ptq"]) <= 1e-6


def test_nothing_trained_is_lost_when_onnxruntime_fails_after_training(tmp_path, monkeypatch):
    """Whatever fails after training (here the FP32 export for the latency table), the FP32 and QAT checkpoints
    and the INT8 file are already on disk."""
    import lq.pipeline

    def broken(*a, **k):
        raise RuntimeError("onnxruntime is unhappy")

    monkeypatch.setattr(lq.pipeline, "faster_fp32", broken)
    with pytest.raises(RuntimeError, match="unhappy"):
        run_job(_job(tmp_path, TrainVal, fp32_epochs=1), print_table=False)
    for f in ("fp32.ckpt", "qat.ckpt", "model_int8.onnx"):
        assert (tmp_path / f).exists(), f
    assert np.isfinite(torch.load(tmp_path / "qat.ckpt", weights_only=True)["state_dict"]["net.1.weight"]).all()


def test_an_openvino_target_is_measured_in_openvino(tmp_path):
    """``lq-train export.target=openvino``: the file is verified in OpenVINO by the export, and the job's accuracy,
    latency and table are OpenVINO's too; the accuracy is the file's as OpenVINO computes it (read here)."""
    pytest.importorskip("openvino")
    from lq.export.verify import _openvino

    torch.set_flush_denormal(True)
    res = run_job(_job(tmp_path, TrainVal, export=ExportConfig(target="openvino", fallback_seconds=0)),
                  print_table=False)
    assert res.runtime == "OpenVINO" and res.accuracy["onnx_int8"] > 0.8
    md = (tmp_path / "results.md").read_text()
    assert "accuracy: INT8 ONNX (OpenVINO) [val]" in md and "latency: int8, batch 32" in md
    dm = TrainVal()
    dm.setup()
    x, y = dm.val_set.tensors
    cm = _openvino.compile_model(str(tmp_path / "model_int8.onnx"), threads=1)
    pred = np.concatenate([np.asarray(cm([x[i:i + 64].numpy()])[0]).argmax(1) for i in range(0, len(x), 64)])
    assert res.accuracy["onnx_int8"] == pytest.approx(float((pred == y.numpy()).mean()))
