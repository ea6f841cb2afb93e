"""The Lightning callback suite on real data (scikit-learn digits), end to end."""

from __future__ import annotations

import copy
import os

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, ModelPruning, StochasticWeightAveraging
from lightning.pytorch.loggers import Logger

import lq
from lq.calibration import CalibrationError, calibrate_model
from lq.convert import quantize_model
from lq.config import CalibConfig, ExportConfig, Int4BlockWeightConfig, Int8ReduceRangeConfig, QATConfig, QuantConfig
from lq.nn.modules.tensor_quantizer import TensorQuantizer, iter_quantizers
from lq.zoo import DigitsDataModule, SmallCNN


def _trainer(tmp_path, callbacks, max_epochs=1, **kw):
    kw.setdefault("limit_train_batches", 4)
    kw.setdefault("limit_val_batches", 2)
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(tmp_path), accelerator="cpu", callbacks=callbacks, **kw)


def _model(seed=0):
    L.seed_everything(seed)
    return SmallCNN(channels=8, max_epochs_hint=2)


def _no_export(**kw):
    return lq.QuantCallback(export=ExportConfig(enabled=False), verbose=False, **kw)


@pytest.fixture(scope="module")
def dm():
    d = DigitsDataModule(batch_size=64)
    d.setup()
    return d


def _amax(model):
    return {n: q.amax.detach().clone() for n, q in iter_quantizers(model) if q.amax is not None}


def test_first_input_amax_is_the_data_max(tmp_path, dm):
    # digits are scaled to [0, 1] and some pixel is 16/16: max calibration over all batches gives exactly 1.0
    model = _model()
    # a symmetric recipe: under int8_onnxruntime this 1-channel stem runs in float and its input is not quantized
    cb = _no_export(quant="int8_reduce_range", calib=CalibConfig(method="max", num_batches=1000))
    _trainer(tmp_path, [cb]).fit(model, datamodule=dm)
    assert model.stem[0]._input_quantizer.amax.item() == 1.0
    # the weight amax is the per-channel max |w| of the weights that calibration saw (frozen since then)
    assert model.stem[0]._weight_quantizer.amax.shape == (8, 1, 1, 1)


def test_swap_before_optimizers_learned_amax_trains(tmp_path, dm):
    model = _model()
    cb = _no_export(qat=QATConfig(learn_amax=True), calib=CalibConfig(method="max", num_batches=2))
    seen = {}

    class Spy(L.Callback):
        def on_train_start(self, trainer, pl_module):
            params = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
            amaxes = [q.amax for _, q in iter_quantizers(pl_module) if q.learn_amax]
            seen["in_optimizer"] = bool(amaxes) and all(id(a) in params for a in amaxes)
            seen["after_calib"] = {n: q.amax.detach().clone() for n, q in iter_quantizers(pl_module) if q.learn_amax}

    _trainer(tmp_path, [cb, Spy()], limit_train_batches=8).fit(model, datamodule=dm)
    assert seen["in_optimizer"], "learned amax parameters must be created before configure_optimizers"
    calibrated = seen["after_calib"]
    assert calibrated["stem.0._input_quantizer"].item() == 1.0  # the data max of digits
    assert all(v.item() != 1.0 for k, v in calibrated.items() if not k.startswith("stem.0")), \
        "calibration must overwrite the initial amax (1.0) of learned quantizers"
    after = {n: q.amax.detach() for n, q in iter_quantizers(model) if q.learn_amax}
    assert any(not torch.equal(after[n], seen["after_calib"][n]) for n in after), "learned amax never moved"


def test_frozen_amax_does_not_drift_and_fit_twice(tmp_path, dm):
    model = _model()
    cb = _no_export()
    _trainer(tmp_path, [cb]).fit(model, datamodule=dm)
    first = _amax(model)
    n_quantizers = len(list(iter_quantizers(model)))
    _trainer(tmp_path, [cb]).fit(model, datamodule=dm)  # same callback, second fit
    second = _amax(model)
    assert second.keys() == first.keys() and len(list(iter_quantizers(model))) == n_quantizers
    assert all(torch.equal(first[k], second[k]) for k in first), "frozen amax changed (or was recalibrated)"
    assert not any(isinstance(m, TensorQuantizer) for q in model.modules() if isinstance(q, TensorQuantizer)
                   for m in q.children())
    assert all(v == 0.0 for v in cb.schedule.last_drift.values())


def test_checkpoint_resume_reproduces_outputs_and_load_quantized(tmp_path, dm):
    model = _model()
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _trainer(tmp_path, [_no_export(), ckpt_cb], enable_checkpointing=True).fit(model, datamodule=dm)
    x = dm.arrays("test")[0][:32]
    model.eval()
    expected = model(x)
    path = ckpt_cb.last_model_path
    assert "lq" in torch.load(path, weights_only=True)

    # 1. with the callback: swap at setup, restore amax from the checkpoint, no recalibration
    fresh = _model(seed=123)
    cb = _no_export()
    _trainer(tmp_path, [cb]).validate(fresh, datamodule=dm, ckpt_path=path, verbose=False)
    fresh.eval()
    assert torch.equal(fresh(x), expected)
    assert cb.calibrate.last_amax == {}, "restored amax must not be recalibrated"

    # 2. one call, no callback
    loaded = lq.load_quantized(SmallCNN, path)
    assert torch.equal(loaded(x), expected)

    # 3. resume fit from the checkpoint: calibration is skipped, amax kept
    resumed = _model(seed=7)
    cb2 = _no_export()
    _trainer(tmp_path, [cb2], max_epochs=2).fit(resumed, datamodule=dm, ckpt_path=path)
    assert all(torch.equal(_amax(resumed)[k], v) for k, v in _amax(model).items())


def test_export_parity_and_training_model_untouched(tmp_path, dm):
    model = _model()
    snap = {}

    class Snap(L.Callback):
        def on_train_end(self, trainer, pl_module):
            snap["state"] = copy.deepcopy(pl_module.state_dict())
            snap["modules"] = [type(m) for m in pl_module.modules()]

    cb = lq.QuantCallback(export=ExportConfig(path="int8.onnx", tolerance=0.2, fallback_seconds=0), verbose=False)
    trainer = _trainer(tmp_path, [Snap(), cb])
    trainer.fit(model, datamodule=dm)
    path = tmp_path / "int8.onnx"
    assert path.exists() and cb.exporter.result.max_abs_diff <= 0.2
    state = model.state_dict()
    assert state.keys() == snap["state"].keys() and all(torch.equal(state[k], snap["state"][k]) for k in state)
    assert [type(m) for m in model.modules()] == snap["modules"]

    import onnxruntime as ort

    x = dm.arrays("test")[0][:64]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    model.eval()
    ref = model(x).detach().numpy()
    assert np.abs(got - ref).max() <= 0.2
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.95
    # the module still tests from the trainer after export, with the quantized model's own accuracy
    from lq.pipeline import accuracy

    tested = trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"]
    assert tested == pytest.approx(accuracy(model, dm.test_dataloader()), abs=1e-6)


def test_export_error_keeps_weights_and_says_what_to_fix(tmp_path, dm, monkeypatch):
    model = _model()
    cb = lq.QuantCallback(export=ExportConfig(path="int8.onnx"), verbose=False)

    def boom(*a, **k):
        raise RuntimeError("unsupported operator Foo.")

    monkeypatch.setattr("lq.export.export_onnx", boom)
    with pytest.raises(lq.callbacks.ExportFailed) as info:
        _trainer(tmp_path, [cb]).fit(model, datamodule=dm)
    msg = str(info.value)
    assert "unsupported operator Foo" in msg and "lq_before_export.ckpt" in msg
    assert ".." not in msg.replace("...", "")  # one full stop between the cause and where the weights are
    saved = torch.load(tmp_path / "lq_before_export.ckpt", weights_only=True)
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())


def test_composes_with_pruning_and_other_callbacks(tmp_path, dm):
    model = _model()
    cbs = [
        _no_export(),
        ModelPruning("l1_unstructured", amount=0.5, use_global_unstructured=False, verbose=0),
        EarlyStopping(monitor="val_loss", patience=3),
        ModelCheckpoint(dirpath=tmp_path / "c"),
    ]
    _trainer(tmp_path, cbs, max_epochs=2, enable_checkpointing=True).fit(model, datamodule=dm)
    w = model.stem[0].weight
    assert float((w == 0).float().mean()) >= 0.4, "pruning did not apply to the quantized conv"
    assert isinstance(model.stem[0], lq.nn.QuantConv2d)


def test_composes_with_stochastic_weight_averaging(tmp_path, dm):
    model = _model()
    swa = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)
    _trainer(tmp_path, [_no_export(), swa], max_epochs=3).fit(model, datamodule=dm)
    assert swa._average_model is not None and swa.n_averaged.item() >= 1
    # the averaged weights were written back into the quantized model, which still quantizes
    assert isinstance(model.head, lq.nn.QuantLinear) and model.head._input_quantizer.amax is not None
    x = dm.arrays("test")[0][:8]
    model.eval()
    assert torch.isfinite(model(x)).all()


class _ImageLogger(Logger):
    """A logger that takes tables and images (like W&B's), recording what it gets."""

    def __init__(self):
        super().__init__()
        self.tables, self.images, self.metrics = [], [], []

    name = property(lambda self: "images")
    version = property(lambda self: 0)

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))

    def log_table(self, key, columns, data):
        self.tables.append((key, columns, data))

    def log_image(self, key, images, **kwargs):
        self.images.append((key, images))


def test_summary_table_and_histogram_figures_reach_the_logger(tmp_path, dm):
    model = _model()
    logger = _ImageLogger()
    cb = _no_export(quant="int8_reduce_range", calib=CalibConfig(method="entropy", num_batches=2))
    L.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=1, logger=logger, enable_progress_bar=False,
              enable_checkpointing=False, default_root_dir=str(tmp_path), callbacks=[cb]).fit(model, datamodule=dm)
    key, columns, data = logger.tables[0]
    assert columns == ["quantizer", "bits", "axis", "amax", "method", "state"]
    rows = {r[0]: r for r in data}
    assert rows["stem.0._input_quantizer"][4] == "entropy" and rows["stem.0._weight_quantizer"][4] == "max"
    assert rows["stem.0._weight_quantizer"][2] == "0"
    amax_metrics = {k: v for m in logger.metrics for k, v in m.items() if k.startswith("lq/amax/")}
    assert amax_metrics["lq/amax/stem.0._input_quantizer"] == pytest.approx(
        float(model.stem[0]._input_quantizer.amax), rel=1e-3)
    assert logger.images and logger.images[0][0].startswith("lq/calib_hist/")
    fig = logger.images[0][1][0]
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [lbl.split(":")[0] for lbl in labels] == ["max", "entropy", "mse", "percentile"]
    drift = [m for m in logger.metrics if any(k.startswith("lq/amax_drift/") for k in m)]
    assert drift and all(v == 0.0 for m in drift for k, v in m.items() if k.startswith("lq/amax_drift/"))


def test_weight_only_recipe_disables_input_quantizers(tmp_path, dm):
    model = _model()
    with pytest.raises(ValueError, match="does not divide") as info:  # head has 16 input features
        lq.QuantSwap(Int4BlockWeightConfig()).swap(model)
    assert "head" in str(info.value)
    assert not list(iter_quantizers(model)), "a failed swap must leave the model untouched"
    recipe = Int4BlockWeightConfig(weight={"num_bits": 4, "block_size": 8})
    cb = lq.QuantCallback(quant=recipe, export=ExportConfig(enabled=False), verbose=False)
    _trainer(tmp_path, [cb]).fit(model, datamodule=dm)
    q = dict(iter_quantizers(model))
    assert set(q) == {"head._input_quantizer", "head._weight_quantizer"}, "int4 blocks: Linear layers only"
    assert not q["head._input_quantizer"].is_enabled
    assert q["head._weight_quantizer"].is_enabled and q["head._weight_quantizer"].num_bits == 4


def test_cosine_lr_recipe(tmp_path, dm):
    model = _model()
    cb = _no_export(qat=QATConfig(lr_policy="cosine"))
    lrs = []

    class LR(L.Callback):
        def on_train_batch_end(self, trainer, *a):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    _trainer(tmp_path, [cb, LR()], max_epochs=2).fit(model, datamodule=dm)
    base = model.hparams.lr
    assert lrs[0] == pytest.approx(base * 0.01)
    assert all(a >= b for a, b in zip(lrs, lrs[1:])), "cosine schedule must decrease"
    assert lrs[-1] == pytest.approx(cb.schedule.lr_at(base, 7 / 8))


def test_freeze_bn_epoch(tmp_path, dm):
    model = _model()
    cb = _no_export(qat=QATConfig(freeze_bn_epoch=1))
    stats = {}

    class Spy(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            stats[trainer.current_epoch] = pl_module.stem[1].running_mean.clone()

    _trainer(tmp_path, [cb, Spy()], max_epochs=3).fit(model, datamodule=dm)
    assert not torch.equal(stats[0], torch.zeros_like(stats[0]))
    assert torch.equal(stats[1], stats[2]), "BatchNorm statistics kept changing after freeze_bn_epoch"


def test_empty_calibration_dataloader(tmp_path):
    class EmptyVal(DigitsDataModule):
        def val_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.empty(0, 1, 8, 8)))

    model = _model()
    cb = _no_export(calib=CalibConfig(dataloader="val"))
    with pytest.raises(CalibrationError, match="no batches"):
        _trainer(tmp_path, [cb], limit_val_batches=None).fit(model, datamodule=EmptyVal())
    with pytest.raises(CalibrationError, match="no batches"):
        q = copy.deepcopy(_model())
        lq.QuantSwap().swap(q)
        calibrate_model(q, [])


def test_ptq_only_through_validate(tmp_path, dm):
    model = _model()
    L.Trainer(max_epochs=3, logger=False, enable_progress_bar=False, enable_checkpointing=False,
              enable_model_summary=False, default_root_dir=str(tmp_path)).fit(model, datamodule=dm)
    fp32 = copy.deepcopy(model)
    cb = lq.QuantCallback(calib=CalibConfig(method="percentile", num_batches=4), export=ExportConfig(enabled=False),
                          verbose=False)
    trainer = _trainer(tmp_path, [cb], limit_val_batches=None)
    first = trainer.validate(model, datamodule=dm, verbose=False)[0]["val_acc"]
    assert cb.calibrate.calibrated
    second = trainer.validate(model, datamodule=dm, verbose=False)[0]["val_acc"]
    fp32_acc = L.Trainer(logger=False, enable_progress_bar=False).validate(fp32, datamodule=dm, verbose=False)[0][
        "val_acc"]
    assert first == pytest.approx(fp32_acc)  # the calibrating pass ran in floating point
    assert abs(second - fp32_acc) <= 0.05
    assert all(q.amax is not None for _, q in iter_quantizers(model) if q.is_enabled)


def _shard(x, rank, world):
    """Uneven, differently distributed shards: rank 0 every other sample, rank 1 every fourth, scaled by 2."""
    return x[0::2] if rank == 0 else x[1::4] * 2.0


#: a recipe that quantizes the stem's input, whose reduced range the DDP tests check (under int8_onnxruntime a
#: 1-channel stem runs in float on the unquantized input)
_DDP_RECIPE = Int8ReduceRangeConfig


#: the calibrations the DDP tests check, as (rank whose loader is empty or -1, method): all run in ONE pair of
#: processes (each 2-process spawn costs ~20 s of the suite, most of it importing torch and Lightning twice)
_DDP_RUNS = [(-1, "max"), (-1, "entropy"), (1, "max"), (1, "entropy"), (-1, "auto"), (1, "auto")]


def _ddp_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_flush_denormal(True)
    try:
        x, _ = DigitsDataModule().arrays("train")
        for empty_rank, method in _DDP_RUNS:
            model = _model()
            lq.QuantSwap(_DDP_RECIPE()).swap(model)
            shard = _shard(x, rank, world)
            if rank == empty_rank:
                shard = shard[:0]  # this rank's loader yields no batch at all
            calibrate_model(model, torch.utils.data.DataLoader(shard, batch_size=64), method=method, num_bins=256)
            torch.save(_amax(model), os.path.join(out_dir, f"amax{rank}_{empty_rank}_{method}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_amax(tmp_path_factory):
    """``(empty rank, method) -> (rank 0's amax, rank 1's amax)`` of every run of :data:`_DDP_RUNS`."""
    out = tmp_path_factory.mktemp("ddp")
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return {(e, m): tuple(torch.load(out / f"amax{r}_{e}_{m}.pt") for r in (0, 1)) for e, m in _DDP_RUNS}


# max reduces amax across ranks, entropy the histograms (percentile and mse read the same reduced histogram, and
# their single-process amax is tested in tests/test_calib.py: two more 2-process runs added ~45 s to the suite)
@pytest.mark.parametrize("method", ["max", "entropy"])
def test_ddp_two_processes_agree_on_global_amax(ddp_amax, method):
    a0, a1 = ddp_amax[-1, method]
    assert a0.keys() == a1.keys() and all(torch.equal(a0[k], a1[k]) for k in a0)  # bitwise, every rank
    # the same statistics gathered in one process over both shards give the same amax
    x, _ = DigitsDataModule().arrays("train")
    both = torch.cat([_shard(x, 0, 2), _shard(x, 1, 2)])
    model = _model()
    lq.QuantSwap(_DDP_RECIPE()).swap(model)
    calibrate_model(model, torch.utils.data.DataLoader(both, batch_size=64), method=method, num_bins=256)
    single = _amax(model)
    if method == "max":
        assert single["stem.0._input_quantizer"].item() == 2.0  # rank 1's doubled range reached everybody
    for k in single:
        torch.testing.assert_close(a0[k], single[k], rtol=1e-5, atol=1e-6)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("method", ["max", "entropy"])
def test_ddp_rank_without_calibration_batches_joins_the_sync(ddp_amax, method):
    """Rank 1's loader is empty: it contributes nothing, and both ranks end with rank 0's amax (it used to
    raise before the sync and kill the other rank)."""
    a0, a1 = ddp_amax[1, method]
    assert a0.keys() == a1.keys() and all(torch.equal(a0[k], a1[k]) for k in a0)
    x, _ = DigitsDataModule().arrays("train")
    model = _model()
    lq.QuantSwap(_DDP_RECIPE()).swap(model)
    calibrate_model(model, torch.utils.data.DataLoader(_shard(x, 0, 2), batch_size=64), method=method,
                    num_bins=256)
    single = _amax(model)
    for k in single:
        torch.testing.assert_close(a0[k], single[k], rtol=1e-5, atol=1e-6)


class _SaveAmax(L.Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module):
        torch.save(_amax(pl_module), os.path.join(self.out_dir, f"amax{trainer.global_rank}.pt"))


class _RankShiftedDigits(DigitsDataModule):
    """Rank r sees its own shard (the sampler) scaled by 1 + r, so the ranks' ranges differ."""

    def train_dataloader(self):
        loader = super().train_dataloader()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        x, y = self._sets["train"].tensors
        ds = torch.utils.data.TensorDataset(x * (1.0 + rank), y)
        return torch.utils.data.DataLoader(ds, batch_size=loader.batch_size, shuffle=False)


def _spawn_trainer(tmp_path, cb):
    return L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, limit_train_batches=1,
                     limit_val_batches=0, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path),
                     callbacks=[cb, _SaveAmax(str(tmp_path))])


def test_lightning_ddp_two_processes_same_global_amax(tmp_path):
    model = _model()
    quantize_model(model, recipe="int8_reduce_range")  # before fit: the same modules in the parent and every rank
    cb = _no_export(calib=CalibConfig(method="max", num_batches=1000))
    _spawn_trainer(tmp_path, cb).fit(model, datamodule=_RankShiftedDigits(batch_size=64))
    a0, a1 = torch.load(tmp_path / "amax0.pt"), torch.load(tmp_path / "amax1.pt")
    assert a0.keys() == a1.keys() and all(torch.equal(a0[k], a1[k]) for k in a0), "ranks disagree on amax"
    # each rank's shard is the sampler's half of the data, scaled by 1 + rank: the global max of the
    # first layer's input is 2 x the data max (rank 1), which rank 0 never saw itself
    assert a0["stem.0._input_quantizer"].item() == 2.0
    # and the model this process holds came back quantized and calibrated (rank 0's state)
    mine = _amax(model)
    assert mine.keys() == a0.keys() and all(torch.equal(mine[k], a0[k]) for k in a0)


def test_ddp_spawn_with_a_model_the_swap_must_change_is_refused(tmp_path):
    """ddp_spawn copies rank 0's weights back with strict=False: the parent's plain model would silently come
    back FP32, so the fit is refused with what to do instead."""
    model = _model()
    with pytest.raises(Exception, match=r"cannot train under strategy=DDPStrategy\('spawn'\).*strategy='ddp'"):
        _spawn_trainer(tmp_path, _no_export()).fit(model, datamodule=DigitsDataModule(batch_size=64))
    assert not any(isinstance(m, TensorQuantizer) for m in model.modules())


def test_lightning_cli_with_callback(tmp_path):
    from lq.cli import lightning_cli

    cli_args = [
        "fit", "--model=lq.zoo.SmallCNN", "--model.channels=8", "--data=lq.zoo.DigitsDataModule",
        "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
        "--trainer.logger=false", "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=lq.QuantCallback", "--trainer.callbacks.calib.method=percentile",
        "--trainer.callbacks.export.enabled=false", "--trainer.callbacks.verbose=false",
    ]
    lightning_cli(cli_args)
    cfg = (tmp_path / "lightning_logs").rglob("config.yaml")
    text = next(iter(sorted(cfg))).read_text() if any(True for _ in (tmp_path / "lightning_logs").rglob("config.yaml")) \
        else (tmp_path / "config.yaml").read_text()
    assert "lq.QuantCallback" in text and "percentile" in text


def test_bad_callback_config_fails_at_construction():
    with pytest.raises(ValueError, match="CalibConfig.method='kl'"):
        lq.QuantCallback(calib={"method": "kl"})
    with pytest.raises(ValueError, match="unknown field"):
        lq.QuantCallback(quant={"inputs": {}})
    assert isinstance(lq.QuantCallback(quant=QuantConfig()).quant, QuantConfig)


def test_heavy_clipping_is_reported_by_name():
    """A histogram method that clips far below the data max is named in one warning."""
    import lq.nn as qnn
    from lq.tensor_quant import QuantDescriptor

    model = torch.nn.Sequential(qnn.QuantLinear(4, 2, quant_desc_input=QuantDescriptor(calib_method="histogram")))
    torch.manual_seed(0)
    spiky = torch.cat([torch.rand(4000, 4) * 0.1, torch.full((2, 4), 10.0)])
    with pytest.warns(RuntimeWarning, match=r"0\._input_quantizer") as rec:
        calibrate_model(model, [spiky], method="percentile", percentile=99.0)
    assert "method_overrides" in str(rec[0].message)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibrate_model(model, [spiky], method="max")  # max never clips: no warning


def test_double_precision_is_refused_up_front(tmp_path, dm):
    model = _model()
    with pytest.raises(ValueError, match=r"precision='64-true'\) is not supported: use '32-true', 'bf16-true'"):
        _trainer(tmp_path, [lq.QuantCallback(verbose=False)], precision="64-true").fit(model, datamodule=dm)
    assert not any(isinstance(m, TensorQuantizer) for m in model.modules())  # nothing half-swapped


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_lower_precision_calibrates_trains_and_exports(tmp_path, dm, precision):
    """Calibration runs its batches through the precision plugin, as training does (bf16-true failed with a
    float input against bf16 weights)."""
    model = _model()
    cb = lq.QuantCallback(export=ExportConfig(fallback_seconds=0), verbose=False)  # the model's own file
    _trainer(tmp_path, [cb], precision=precision).fit(model, datamodule=dm)
    amax = _amax(model)
    assert amax and all(torch.isfinite(a.float()).all() and (a > 0).all() for a in amax.values())
    assert cb.exporter.result is not None and cb.exporter.result.verified


class _NaNAtStep(lq.zoo.SmallCNN):
    """A model whose third training batch is all NaN (a corrupt record, an overflow upstream)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == 2:
            x = torch.full_like(x, float("nan"))
        return super().training_step((x, y), batch_idx)


def test_a_nan_batch_mid_qat_is_skipped_and_named(tmp_path, dm):
    L.seed_everything(0)
    model = _NaNAtStep(channels=8, max_epochs_hint=2)
    cb = lq.QuantCallback(qat=QATConfig(learn_amax=True), export=ExportConfig(fallback_seconds=0), verbose=False)
    with pytest.warns(UserWarning, match=r"step 2 .*non-finite gradients in \d+ parameter\(s\) \(stem.*skipped"):
        _trainer(tmp_path, [cb], limit_train_batches=6).fit(model, datamodule=dm)
    assert cb.schedule.skipped_steps == 1
    for name, t in list(model.state_dict().items()):
        if t.is_floating_point():
            assert torch.isfinite(t).all(), name  # weights, learned amax and BatchNorm statistics
    learned = [q for _, q in iter_quantizers(model) if q.learn_amax]
    assert learned and all(float(q.amax) > 0 for q in learned)
    assert cb.exporter.result is not None  # the run went on to its export


def test_export_into_an_unwritable_place_keeps_the_weights_and_leaves_no_partial_file(tmp_path, dm):
    """Running as root makes a read-only folder writable, so the folder here cannot exist at all (its parent
    is a file): the export must fail with the safe checkpoint named, and write nothing."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the export folder should be")
    model = _model()
    cb = lq.QuantCallback(export=ExportConfig(path=str(blocker / "model_int8.onnx")), verbose=False)
    with pytest.raises(lq.callbacks.ExportFailed, match=r"lq_before_export\.ckpt"):
        _trainer(tmp_path, [cb]).fit(model, datamodule=dm)
    assert blocker.read_text().startswith("a file")
    assert not list(tmp_path.glob("**/*.onnx")) and not list(tmp_path.glob("**/.lq-export-*"))
    saved = torch.load(tmp_path / "lq_before_export.ckpt", weights_only=True)
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("empty_rank", [-1, 1])
def test_ddp_auto_calibration_takes_the_same_decisions_on_every_rank(ddp_amax, empty_rank):
    """method='auto' compares the model on each rank's own batches: the metric is averaged over the ranks
    before every decision, so the chosen amax are bitwise equal (and a rank without batches does not hang)."""
    a0, a1 = ddp_amax[empty_rank, "auto"]
    assert a0.keys() == a1.keys() and all(torch.equal(a0[k], a1[k]) for k in a0)
