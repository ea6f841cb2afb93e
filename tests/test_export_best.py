"""QAT's default LR policy (fine-tuning from the calibrated model) and the callback's PTQ-vs-QAT export choice.

A QAT that fine-tunes a trained model at its full training LR undoes the training, and a QAT that ends worse than
the calibrated model must not be exported without a word (issue 40, item 4)."""

from __future__ import annotations

import itertools
import os

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lq
from lq.callbacks.export_best import PTQ_CHECKPOINT
from lq.config import CalibConfig, ExportConfig, QATConfig
from lq.zoo import DigitsDataModule, SmallCNN


def _trainer(tmp_path, callbacks, **kw):
    from test_callbacks import _trainer as quiet_trainer  # no logger, bar or checkpoints; 4 training batches

    return quiet_trainer(tmp_path, callbacks, limit_val_batches=4, **kw)


class SabotagedQAT(SmallCNN):
    """A classifier whose QAT steps climb the loss (a QAT that hurts), at the module's own LR."""

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
        quantized = any(type(m).__name__ == "TensorQuantizer" for m in self.modules())
        return -loss if quantized else loss


@pytest.fixture(scope="module")
def dm():
    d = DigitsDataModule(batch_size=64)
    d.setup()
    return d


@pytest.fixture(scope="module")
def trained(dm, tmp_path_factory):
    """A SmallCNN trained in FP32 (the state QAT fine-tunes from)."""
    L.seed_everything(0)
    m = SmallCNN(channels=8, max_epochs_hint=3)
    _trainer(tmp_path_factory.mktemp("fp32"), [], max_epochs=3, limit_train_batches=None).fit(m, datamodule=dm)
    return m.state_dict()


def _lrs():
    seen = []

    class LR(L.Callback):
        def on_train_batch_end(self, trainer, *a):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    return seen, LR()


def _accuracy(model, loader, batches: int = 4) -> float:
    """Top-1 on the first ``batches`` batches: the ones the validation loop runs (limit_val_batches=4)."""
    model.eval()
    with torch.no_grad():
        pairs = [(model(x).argmax(1) == y) for x, y in itertools.islice(loader, batches)]
    return float(torch.cat(pairs).double().mean())


class _AtFirstStep(L.Callback):
    """A copy of the module as QAT starts from it (after the QuantCallback's calibration)."""

    def on_train_start(self, trainer, pl_module):
        import copy

        self.model = copy.deepcopy(pl_module)


def test_auto_fine_tunes_a_calibrated_model_at_a_fraction_of_its_lr(tmp_path, dm, trained):
    m = SmallCNN(channels=8, max_epochs_hint=3)
    m.load_state_dict(trained)
    cb = lq.QuantCallback(export=ExportConfig(enabled=False), verbose=False)
    lrs, spy = _lrs()
    first = _AtFirstStep()
    _trainer(tmp_path, [cb, spy, first], max_epochs=2).fit(m, datamodule=dm)
    base = m.hparams.lr
    assert cb.qat.lr_policy == "auto" and cb.schedule.policy == "cosine"
    # the calibrated model's top-1 on the validation loop's batches, against an independent count
    assert cb.schedule.start_score.top1 == pytest.approx(_accuracy(first.model, dm.val_dataloader()))
    assert cb.schedule.start_score.top1 > 0.5
    assert lrs[0] == pytest.approx(base * 0.01)
    assert lrs[-1] == pytest.approx(cb.schedule.lr_at(base, 7 / 8))


@pytest.mark.parametrize("calibrated", [True, False])
def test_auto_keeps_the_module_schedule_for_a_model_trained_from_scratch(tmp_path, dm, calibrated):
    """`lq-cli fit --model SmallCNN ...` (the README's line) trains a freshly built model with the callback: it is
    calibrated at chance level, so QAT must train it at the module's own LR; with calibration off too."""
    L.seed_everything(0)
    m = SmallCNN(channels=8, max_epochs_hint=3)
    cb = lq.QuantCallback(calib=CalibConfig(enabled=calibrated), export=ExportConfig(enabled=False), verbose=False)
    lrs, spy = _lrs()
    _trainer(tmp_path, [cb, spy]).fit(m, datamodule=dm)
    assert cb.schedule.policy == "none"
    if calibrated:  # scored at chance: the most frequent digit's share
        s = cb.schedule.start_score
        assert s.top1 < s.chance + 0.1 and 0.08 < s.chance < 0.15, s
    assert lrs[0] == pytest.approx(m.hparams.lr)  # the module's own cosine schedule steps per epoch


def test_a_resumed_fit_goes_on_with_the_policy_it_started_with(tmp_path, dm, trained):
    m = SmallCNN(channels=8, max_epochs_hint=3)
    m.load_state_dict(trained)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    cb = lq.QuantCallback(export=ExportConfig(enabled=False), verbose=False)
    _trainer(tmp_path, [cb, ckpt], enable_checkpointing=True).fit(m, datamodule=dm)
    m2 = SmallCNN(channels=8, max_epochs_hint=3)
    cb2 = lq.QuantCallback(export=ExportConfig(enabled=False), verbose=False)
    lrs, spy = _lrs()
    _trainer(tmp_path, [cb2, spy], max_epochs=2).fit(m2, datamodule=dm, ckpt_path=os.path.join(tmp_path, "last.ckpt"))
    assert cb2.schedule.policy == "cosine"
    assert lrs[0] == pytest.approx(cb2.schedule.lr_at(m.hparams.lr, 4 / 8))


def test_a_qat_worse_than_post_training_exports_the_post_training_model(tmp_path, dm, trained):
    m = SabotagedQAT(channels=8, max_epochs_hint=3)
    m.load_state_dict(trained)
    cb = lq.QuantCallback(qat=QATConfig(lr_policy="none"), calib=CalibConfig(method="max"), verbose=False,
                          export=ExportConfig(speed_check=False, fallback_seconds=0))
    with pytest.warns(UserWarning, match="QAT ended less accurate than post-training"):
        _trainer(tmp_path, [cb], limit_train_batches=8).fit(m, datamodule=dm)
    assert cb.best.chosen == "ptq"
    val = dm.val_dataloader()
    assert cb.best.scores["qat"] < cb.best.scores["ptq"] - 0.05, cb.best.scores
    # the module keeps the QAT weights: its accuracy is the QAT score
    assert _accuracy(m, val) == pytest.approx(cb.best.scores["qat"])
    # the PTQ model saved beside them loads with lq.load_quantized and scores what the comparison said
    ptq = lq.load_quantized(SabotagedQAT, str(tmp_path / PTQ_CHECKPOINT))
    assert _accuracy(ptq, val) == pytest.approx(cb.best.scores["ptq"])
    # and the file computes the PTQ model, not the QAT one
    import onnxruntime as ort

    sess = ort.InferenceSession(cb.exporter.path, providers=["CPUExecutionProvider"])
    x = torch.cat([b[0] for b in val])
    file_pred = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0].argmax(1)
    with torch.no_grad():
        ptq_pred, qat_pred = ptq(x).argmax(1).numpy(), m(x).argmax(1).numpy()
    assert np.mean(file_pred == ptq_pred) >= 0.99
    assert np.mean(file_pred == qat_pred) < 0.95


def test_a_better_qat_is_exported_and_export_best_off_always_exports_qat(tmp_path, dm, trained):
    for best in (True, False):
        # best: the briefly trained model trained on at its LR for two more epochs, quantizers on: QAT gains points
        m = (SmallCNN if best else SabotagedQAT)(channels=8, max_epochs_hint=3)
        m.load_state_dict(trained)
        cb = lq.QuantCallback(calib=CalibConfig(method="max"), verbose=False, qat=QATConfig(lr_policy="none"),
                              export=ExportConfig(speed_check=False, fallback_seconds=0, export_best=best,
                                                  path=f"best_{best}.onnx"))
        _trainer(tmp_path, [cb], max_epochs=2 if best else 1, limit_train_batches=None if best else 8).fit(
            m, datamodule=dm)
        if best:
            assert cb.best.chosen == "qat", cb.best.scores
            assert cb.best.scores["qat"] > cb.best.scores["ptq"] + 0.03, cb.best.scores
            assert _accuracy(m, dm.val_dataloader()) == pytest.approx(cb.best.scores["qat"])
        else:
            assert cb.best.chosen is None and cb.best.scores is None  # no comparison asked for
        assert not (tmp_path / PTQ_CHECKPOINT).exists()
        import onnxruntime as ort

        sess = ort.InferenceSession(cb.exporter.path, providers=["CPUExecutionProvider"])
        x = torch.cat([b[0] for b in dm.val_dataloader()])
        out = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        with torch.no_grad():
            ref = m.eval()(x).numpy()  # the file computes the module's (QAT) weights
        assert np.abs(out - ref).mean() < 0.05 * np.abs(ref).mean()


class DigitRegressor(L.LightningModule):
    """Not a classifier: one output, the digit's value, trained by squared error on the same (image, digit) batches."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self(batch[0]).squeeze(1), batch[1].float())

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]).squeeze(1), batch[1].float()))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 1e-2)


def test_a_model_that_is_not_a_classifier_is_fine_tuned_and_its_qat_model_exported(tmp_path, dm):
    """Its batches say nothing of whether it was trained: QAT's usual start is a trained model, so the fine-tuning
    recipe; and no PTQ-vs-QAT comparison (it would need class logits): the QAT model is exported."""
    L.seed_everything(0)
    m = DigitRegressor()
    _trainer(tmp_path, [], max_epochs=2, limit_train_batches=None).fit(m, datamodule=dm)
    cb = lq.QuantCallback(calib=CalibConfig(method="max"), verbose=False,
                          export=ExportConfig(speed_check=False, fallback_seconds=0))
    lrs, spy = _lrs()
    _trainer(tmp_path, [cb, spy]).fit(m, datamodule=dm)
    assert cb.schedule.policy == "cosine" and cb.schedule.start_score is None
    assert lrs[0] == pytest.approx(1e-2 * 0.01)
    assert cb.best.chosen == "qat" and cb.best.scores is None
    assert not (tmp_path / PTQ_CHECKPOINT).exists() and os.path.exists(cb.exporter.path)
