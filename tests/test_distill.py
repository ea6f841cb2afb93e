"""Quantization-aware distillation (QATConfig.distill_weight / lq.callbacks.QuantDistill).

The injected gradient is checked against torch.autograd of the loss it stands for,
``(1 - w) * L_task + w * T^2 * KL(p_teacher || p_student)``, and the callback end to end on
the digits data.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

import lq
from lq.callbacks.distill import QuantDistill, distill_gradient
from lq.config import CalibConfig, ExportConfig, QATConfig
from lq.nn.modules.tensor_quantizer import iter_quantizers
from lq.zoo import DigitsDataModule, SmallCNN


def _kl_reference(student, teacher, t):
    """T^2 * KL(p_teacher || p_student), averaged over the rows (every dim but the last)."""
    c = student.shape[-1]
    s, te = student.reshape(-1, c) / t, teacher.reshape(-1, c) / t
    return F.kl_div(F.log_softmax(s, -1), F.log_softmax(te, -1), reduction="batchmean", log_target=True) * t * t


@pytest.mark.parametrize("shape", [(8, 10), (3, 5, 7)])
@pytest.mark.parametrize("t", [1.0, 2.5])
def test_distill_gradient_is_the_gradient_of_the_kl(shape, t):
    student = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(shape, dtype=torch.float64)
    diff, kl = distill_gradient(student, teacher, t)
    ref = _kl_reference(student, teacher, t)
    (grad,) = torch.autograd.grad(ref, student)
    torch.testing.assert_close(kl.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(diff.double(), grad, rtol=1e-5, atol=1e-7)


class _Net(L.LightningModule):
    """A two-layer MLP whose forward takes a keyword argument, to check it reaches the teacher."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x, *, shift: float = 0.0):
        return self.head(self.body(x + shift))


def _fake_trainer(accumulate=1, scale=None):
    scaler = None if scale is None else SimpleNamespace(is_enabled=lambda: True, get_scale=lambda: scale)
    return SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler), accumulate_grad_batches=accumulate)


@pytest.mark.parametrize("w,t,accumulate,scale", [(0.5, 1.0, 1, None), (1.0, 2.0, 1, None), (0.25, 1.5, 4, None),
                                                   (0.7, 1.0, 2, 1024.0)])
def test_hook_gives_the_gradient_of_the_mixed_loss(w, t, accumulate, scale):
    """One training step by hand, with Lightning's loss scaling (accumulation, AMP scale) applied to the task
    loss as Lightning applies it: the parameter gradients equal autograd of the mixed loss, scaled the same way."""
    student = _Net().double()
    cb = QuantDistill(QATConfig(distill_weight=w, distill_temperature=t))
    trainer = _fake_trainer(accumulate, scale)
    cb.setup(trainer, student, "fit")
    teacher_ref = copy.deepcopy(student)
    with torch.no_grad():  # the student moves away from its teacher, as QAT makes it
        for p in student.parameters():
            p.add_(0.3 * torch.randn_like(p))
    probe = copy.deepcopy(student)
    x, y = torch.randn(12, 6, dtype=torch.float64), torch.randint(0, 4, (12,))
    factor = (scale or 1.0) / accumulate

    cb.on_train_batch_start(trainer, student, None, 0)
    (F.cross_entropy(student(x, shift=0.5), y) * factor).backward()
    cb._active = False
    assert len(cb._kl) == 1

    z = probe(x, shift=0.5)
    mixed = (1 - w) * F.cross_entropy(z, y) + w * _kl_reference(z, teacher_ref(x, shift=0.5).detach(), t)
    (mixed * factor).backward()
    for (name, p), q in zip(student.named_parameters(), probe.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
    torch.testing.assert_close(cb._kl[0].double(), _kl_reference(z, teacher_ref(x, shift=0.5), t).detach())


def test_distillation_only_drops_a_nan_task_gradient():
    student = _Net()
    cb = QuantDistill(QATConfig(distill_weight=1.0))
    cb.setup(_fake_trainer(), student, "fit")
    cb.on_train_batch_start(_fake_trainer(), student, None, 0)
    (student(torch.randn(4, 6)).sum() * float("nan")).backward()
    assert all(torch.isfinite(p.grad).all() for p in student.parameters())


def test_the_teacher_does_not_run_the_students_hooks():
    student = _Net()
    calls = []
    student.register_forward_hook(lambda m, a, o: calls.append(o.shape))
    cb = QuantDistill(QATConfig(distill_weight=0.5))
    cb.setup(_fake_trainer(), student, "fit")
    cb.on_train_batch_start(_fake_trainer(), student, None, 0)
    student(torch.randn(4, 6))
    assert calls == [torch.Size([4, 4])], "a user's hook ran for the teacher too"


def test_the_teacher_keeps_forward_pre_hooks():
    """Modules use pre-hooks to work (old-style weight_norm, lq's attention fast-path guard): the teacher must
    compute what the model computed."""
    student = _Net()
    student.body.register_forward_pre_hook(lambda m, args: (2.0 * args[0],))
    x = torch.randn(4, 6)
    expected = student(x).detach()
    cb = QuantDistill(QATConfig(distill_weight=0.5))
    cb.setup(_fake_trainer(), student, "fit")
    with torch.no_grad():
        torch.testing.assert_close(cb.teacher(x), expected)


def test_outside_a_training_batch_the_hook_changes_nothing():
    student = _Net()
    cb = QuantDistill(QATConfig(distill_weight=0.5))
    cb.setup(_fake_trainer(), student, "fit")
    x = torch.randn(4, 6)
    out = student(x)  # no on_train_batch_start: validation, predict, a user's own call
    assert out.grad_fn is not None and "TeacherGradient" not in type(out.grad_fn).__name__
    assert cb._kl == []


class _DictNet(_Net):
    def forward(self, x, *, shift: float = 0.0):
        return {"logits": super().forward(x, shift=shift), "features": x}


class _TupleNet(_Net):
    def forward(self, x, *, shift: float = 0.0):
        return super().forward(x), x


def test_mapping_output_and_a_clear_error_for_a_tuple():
    student = _DictNet()
    cb = QuantDistill(QATConfig(distill_weight=1.0))
    cb.setup(_fake_trainer(), student, "fit")
    cb.on_train_batch_start(_fake_trainer(), student, None, 0)
    out = student(torch.randn(4, 6))
    assert set(out) == {"logits", "features"} and "TeacherGradient" in type(out["logits"].grad_fn).__name__

    bad = _TupleNet()
    cb = QuantDistill(QATConfig(distill_weight=1.0))
    cb.setup(_fake_trainer(), bad, "fit")
    cb.on_train_batch_start(_fake_trainer(), bad, None, 0)
    with pytest.raises(TypeError, match="distill_module"):
        bad(torch.randn(4, 6))


def test_distill_module_path():
    student = _Net()
    cb = QuantDistill(QATConfig(distill_weight=1.0, distill_module="head"))
    cb.setup(_fake_trainer(), student, "fit")
    assert isinstance(cb.teacher, nn.Linear) and cb.teacher.weight is not student.head.weight
    with pytest.raises(ValueError, match="not a submodule.*head"):
        QuantDistill(QATConfig(distill_weight=1.0, distill_module="nope")).setup(_fake_trainer(), _Net(), "fit")


@pytest.mark.parametrize("field,value", [("distill_weight", 1.5), ("distill_weight", -0.1), ("distill_weight", True),
                                         ("distill_temperature", 0.0), ("distill_module", 3)])
def test_bad_distill_config_says_what_is_allowed(field, value):
    with pytest.raises(ValueError, match=f"{field}.*not allowed"):
        QATConfig(**{field: value})


def test_off_by_default_and_when_qat_is_disabled():
    for qat in (QATConfig(), QATConfig(enabled=False, distill_weight=1.0)):
        cb = QuantDistill(qat)
        student = _Net()
        cb.setup(_fake_trainer(), student, "fit")
        assert cb.teacher is None and not student._forward_hooks_with_kwargs and cb.state_dict() == {}


# ---------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def dm():
    d = DigitsDataModule(batch_size=64)
    d.setup()
    return d


def _trainer(tmp_path, callbacks, **kw):
    kw.setdefault("max_epochs", 1)
    kw.setdefault("limit_train_batches", 6)
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     num_sanity_val_steps=0, default_root_dir=str(tmp_path), accelerator="cpu", callbacks=callbacks,
                     **kw)


def _callback(w, **qat):
    return lq.QuantCallback(calib=CalibConfig(num_batches=2), qat=QATConfig(distill_weight=w, **qat),
                            export=ExportConfig(enabled=False), verbose=False, log_histograms=False)


class _RandomLabels(DigitsDataModule):
    """Labels that disagree with what the FP32 model learned: the task loss pulls QAT away from it."""

    def setup(self, stage=None):
        if self._sets is not None:
            return
        super().setup(stage)
        g = torch.Generator().manual_seed(1)
        x, y = self._sets["train"].tensors
        self._sets["train"] = TensorDataset(x, torch.randint(0, 10, y.shape, generator=g).to(y.dtype))


def _kl_to(model, teacher, x):
    model.eval()
    with torch.no_grad():
        return float(_kl_reference(model(x), teacher(x), 1.0))


def test_fit_distills_from_the_fp32_model_and_cleans_up(tmp_path, dm):
    L.seed_everything(0)
    fp32 = SmallCNN(channels=8, lr=1e-2)
    _trainer(tmp_path, [], max_epochs=2, limit_train_batches=None).fit(fp32, datamodule=dm)
    fp32.eval()
    noisy = _RandomLabels(batch_size=64)
    noisy.setup()
    x = dm.arrays("test")[0][:256]

    kl = {}
    for w in (0.0, 1.0):
        model = copy.deepcopy(fp32).train()
        cb = _callback(w, lr_policy="none")
        seen = {}

        class _Probe(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, *a):
                seen["teacher_quantizers_on"] = any(q.is_enabled for _, q in iter_quantizers(cb.distill.teacher or nn.Module()))
                seen["teacher_is_fp32"] = cb.distill.teacher is not None and torch.equal(
                    cb.distill.teacher.stem[0].weight, fp32.stem[0].weight)

        trainer = _trainer(tmp_path, [cb, _Probe()], max_epochs=2)
        trainer.fit(model, datamodule=noisy)
        kl[w] = _kl_to(model, fp32, x)
        if w:
            assert "lq/distill_kl" in trainer.callback_metrics
            assert seen == {"teacher_quantizers_on": False, "teacher_is_fp32": True}
            assert cb.distill.teacher is None and not model._forward_hooks_with_kwargs, "teardown releases the teacher"
    assert kl[1.0] < 0.25 * kl[0.0], kl


def test_a_second_fit_keeps_the_first_teacher(tmp_path, dm):
    L.seed_everything(0)
    model = SmallCNN(channels=8)
    fp32_weight = model.stem[0].weight.detach().clone()
    cb = _callback(1.0)
    _trainer(tmp_path, [cb]).fit(model, datamodule=dm)
    assert not torch.equal(model.stem[0].weight, fp32_weight), "QAT did not move the weights"
    got = {}

    class _Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            got["w"] = cb.distill.teacher.stem[0].weight.detach().clone()

    _trainer(tmp_path, [cb, _Probe()], max_epochs=2).fit(model, datamodule=dm)
    assert torch.equal(got["w"], fp32_weight)


def test_resume_keeps_the_teacher_it_started_with(tmp_path, dm):
    L.seed_everything(0)
    model = SmallCNN(channels=8)
    teacher_weight = model.stem[0].weight.detach().clone()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _trainer(tmp_path, [_callback(0.5), ckpt], enable_checkpointing=True).fit(model, datamodule=dm)
    saved = torch.load(ckpt.last_model_path, weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("QuantCallback")]
    assert torch.equal(state["QuantDistill"]["teacher"]["stem.0.weight"], teacher_weight)

    L.seed_everything(5)
    fresh = SmallCNN(channels=8)  # built with other weights: the teacher must come from the checkpoint
    cb = _callback(0.5)
    got = {}

    class _Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            got["w"] = cb.distill.teacher.stem[0].weight.detach().clone()

    _trainer(tmp_path, [cb, _Probe()], max_epochs=2).fit(fresh, datamodule=dm, ckpt_path=ckpt.last_model_path)
    assert torch.equal(got["w"], teacher_weight)
