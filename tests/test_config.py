"""Config dataclasses: validation by name, recipes, Hydra composition, one source of truth."""

from dataclasses import asdict, fields

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from lq import config as C
from lq.tensor_quant import QuantDescriptor


@pytest.mark.parametrize(
    "build,words",
    [
        (lambda: C.CalibConfig(method="kl"), "CalibConfig.method='kl'"),
        (lambda: C.CalibConfig(num_batches=0), "CalibConfig.num_batches"),
        (lambda: C.CalibConfig(percentile=120), "CalibConfig.percentile"),
        (lambda: C.CalibConfig(dataloader="test"), "['train', 'val']"),
        (lambda: C.QATConfig(lr_policy="step"), "['auto', 'none', 'cosine']"),
        (lambda: C.QATConfig(lr_start_fraction=2.0), "lr_start_fraction"),
        (lambda: C.QATConfig(freeze_bn_epoch=-1), "freeze_bn_epoch"),
        (lambda: C.ExportConfig(exporter="tf"), "['dynamo', 'legacy']"),
        (lambda: C.ExportConfig(opset=9), "opset"),
        (lambda: C.ExportConfig(path="model.pt"), ".onnx"),
        (lambda: C.QuantizerConfig(format="int3"), "['int', 'fp8_e4m3']"),
        (lambda: C.QuantizerConfig(num_bits=1), "num_bits"),
        (lambda: C.QuantizerConfig(axis=[0], block_size=32), "axis must be None"),
        (lambda: C.QuantConfig(input={"bitz": 4}), "unknown field"),
        (lambda: C.QuantConfig(overrides={"conv*": {"weight": {"bitz": 4}}}), "unknown field"),
        (lambda: C.QuantConfig(overrides={"conv*": {"bias": {}}}), "overrides"),
        (lambda: C.QuantConfig(include="conv*"), "include"),
        (lambda: C.JobConfig(fp32_epochs=-1), "fp32_epochs"),
    ],
)
def test_invalid_values_name_field_and_allowed(build, words):
    with pytest.raises(ValueError) as info:
        build()
    assert words in str(info.value)


def test_typo_in_field_name_is_rejected():
    with pytest.raises(TypeError, match="methd"):
        C.CalibConfig(methd="max")


def test_quantizer_config_fields_map_onto_descriptor():
    d = C.QuantizerConfig(num_bits=4, axis=[0], unsigned=True, narrow_range=False).to_descriptor("w")
    assert d == QuantDescriptor(num_bits=4, axis=0, unsigned=True, narrow_range=False, name="w")
    assert C.QuantizerConfig(format="fp8_e4m3").to_descriptor().num_bits == (4, 3)
    b = C.QuantizerConfig(num_bits=4, block_size=32, scale_bits=8, block_type="dynamic").to_descriptor()
    assert b.block_sizes == {-1: 32, "type": "dynamic", "scale_bits": 8}


def test_recipes():
    assert C.Int8PerTensorConfig().weight.axis is None
    assert C.Int8PerChannelConfig().weight.axis == [0]
    assert C.FP8Config().input.to_descriptor().num_bits == (4, 3)
    r = C.Int4BlockWeightConfig()
    assert not r.input.enabled and r.weight.num_bits == 4 and r.weight.block_size == 32
    assert C.Int8ReduceRangeConfig().weight.num_bits == 7 and C.Int8ReduceRangeConfig().weight.axis == [0]
    ort = C.Int8OnnxruntimeConfig()
    assert ort.input.asymmetric and not ort.input.narrow_range and ort.weight.num_bits == 7
    assert ort.input.to_descriptor().asymmetric and not ort.weight.to_descriptor().asymmetric
    ov = C.Int8OpenvinoConfig()  # symmetric activations on QuantizeLinear's own range, 7-bit weights (no int16 overflow without VNNI)
    assert not ov.input.asymmetric and not ov.input.narrow_range and ov.weight.num_bits == 7 and ov.weight.axis == [0]
    # average pools among the types only for squeeze-excite blocks (the others stay float: test_export_openvino)
    assert not ov.glue and ov.unsigned_after_relu and ov.shared_inputs and "Conv2d" in ov.types \
        and "AdaptiveAvgPool2d" in ov.types and "BatchNorm2d" not in ov.types
    assert set(C.RECIPES) == {"int8_per_tensor", "int8_per_channel", "int8_reduce_range", "int8_onnxruntime",
                              "int8_openvino", "fp8", "int4_block_weight"}
    with pytest.raises(ValueError, match="asymmetric=True is not allowed.*per tensor"):
        C.QuantizerConfig(asymmetric=True, axis=[0])


def test_overrides_and_globs():
    q = C.QuantConfig(exclude=["head"], overrides={"stem.*": {"weight": {"num_bits": 4}}})
    assert q.selects("stem.0") and not q.selects("head")
    assert q.quantizer_for("stem.0", "weight").num_bits == 4
    assert q.quantizer_for("block.conv1", "weight").num_bits == 8
    c = C.CalibConfig(method="entropy", method_overrides={"head": "max"})
    assert c.method_for("head") == "max" and c.method_for("stem.0") == "entropy"


def _compose(overrides):
    C.register_configs()
    with initialize_config_module(config_module="lq.conf", version_base=None):
        return compose("train", overrides=overrides + ["output_dir=unused"])


@pytest.mark.parametrize("preset,cls", [("int8_per_tensor", C.Int8PerTensorConfig), ("fp8", C.FP8Config),
                                        ("int4_block_weight", C.Int4BlockWeightConfig),
                                        ("int8_per_channel", C.Int8PerChannelConfig),
                                        ("int8_reduce_range", C.Int8ReduceRangeConfig),
                                        ("int8_openvino", C.Int8OpenvinoConfig)])
def test_hydra_presets_build_the_dataclasses(preset, cls):
    job = OmegaConf.to_object(_compose([f"quant={preset}", "calib=percentile", "qat=cosine"]))
    assert isinstance(job, C.JobConfig) and type(job.quant) is cls
    assert job.quant == cls()
    assert job.calib.method == "percentile" and job.qat.lr_policy == "cosine"


@pytest.mark.parametrize("preset,expected", [("default", C.QATConfig()),
                                             ("cosine", C.QATConfig(lr_policy="cosine")),
                                             ("learned_amax", C.QATConfig(learn_amax=True, freeze_amax_epoch=2)),
                                             ("distill", C.QATConfig(lr_policy="cosine", distill_weight=1.0))])
def test_hydra_qat_presets(preset, expected):
    assert OmegaConf.to_object(_compose([f"qat={preset}"])).qat == expected


@pytest.mark.parametrize("method", ["max", "entropy", "percentile", "mse"])
def test_hydra_calib_presets(method):
    assert OmegaConf.to_object(_compose([f"calib={method}"])).calib.method == method


def test_hydra_rejects_bad_values_and_typos():
    with pytest.raises(ValueError, match="CalibConfig.method"):
        OmegaConf.to_object(_compose(["calib.method=kl"]))
    with pytest.raises(Exception, match="methd"):
        _compose(["calib.methd=max"])
    with pytest.raises(Exception, match="int8_per_tensor"):  # the error lists the presets
        _compose(["quant=int5"])


def test_hydra_defaults_equal_dataclass_defaults():
    job = OmegaConf.to_object(_compose([]))
    assert job.calib == C.CalibConfig() and job.qat == C.QATConfig() and job.export == C.ExportConfig()
    # the job's recipe (onnxruntime's own grids) is the same from Hydra and from Python
    assert type(job.quant) is C.Int8OnnxruntimeConfig
    assert asdict(job.quant) == asdict(C.JobConfig().quant) == asdict(C.Int8OnnxruntimeConfig())


def test_lightning_cli_parses_callback_config(tmp_path):
    from jsonargparse import ArgumentParser

    import lq

    p = ArgumentParser()
    p.add_class_arguments(lq.QuantCallback, "cb")
    cfg = p.parse_args(["--cb.calib.method=entropy", "--cb.qat.lr_policy=cosine", "--cb.quant.weight.num_bits=4"])
    cb = p.instantiate(cfg).cb
    assert cb.calib.method == "entropy" and cb.qat.lr_policy == "cosine" and cb.quant.weight.num_bits == 4
    with pytest.raises(ValueError, match="CalibConfig.method='kl'"):
        p.instantiate(p.parse_args(["--cb.calib.method=kl"]))
    names = {f.name for f in fields(C.CalibConfig)}
    assert {"method", "num_batches", "percentile"} <= names


def test_docs_config_reference_is_current():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "update_reference.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_job_seed_reaches_the_datamodule_split_and_shuffle():
    from lq.pipeline import _data_spec, _instantiate

    assert _instantiate(_data_spec(C.JobConfig(seed=3))).hparams.seed == 3
    explicit = C.JobConfig(seed=3, data={"_target_": "lq.zoo.DigitsDataModule", "seed": 5})
    assert _instantiate(_data_spec(explicit)).hparams.seed == 5  # data.seed wins
    job = OmegaConf.to_object(_compose(["seed=7"]))
    assert _instantiate(_data_spec(job)).hparams.seed == 7  # through Hydra too


def test_recipe_names_are_accepted_from_python():
    import lq

    cb = lq.QuantCallback(quant="int8_per_tensor", verbose=False)
    assert type(cb.quant) is C.Int8PerTensorConfig
    assert type(lq.QuantCallback(quant="int8_reduce_range").quant) is C.Int8ReduceRangeConfig
    with pytest.raises(ValueError, match=r"'int8' is not a recipe: choose one of \['int8_per_tensor'"):
        lq.QuantCallback(quant="int8")


def test_typos_get_the_closest_field_and_config_errors_speak_config():
    from lq.cli import unknown_override

    assert "did you mean 'calib.method'" in unknown_override(["calib.methd=max"])
    assert "did you mean 'fp32_epochs'" in unknown_override(["fp32_epoch=3"])
    assert "did you mean 'quant.weight.num_bits'" in unknown_override(["quant.weight.num_bit=7"])
    assert unknown_override(["calib.method=max", "trainer.max_epochs=2", "model._target_=x.Y", "+qat.foo=1",
                             "quant=int8_per_tensor", "hydra.run.dir=out", "seed=3"]) == ""
    with pytest.raises(ValueError, match=r"num_bits=20 is not supported: .*or format='fp8_e4m3' for FP8"):
        C.QuantizerConfig(num_bits=20)


def test_export_dynamic_dims_validated_and_passed_to_the_export(monkeypatch, tmp_path):
    import lightning as L

    import torch

    import lq.export as lq_export
    from lq.callbacks import QuantExport
    from lq.config import ExportConfig

    with pytest.raises(ValueError, match="dynamic_dims"):
        ExportConfig(dynamic_dims=[0])
    with pytest.raises(ValueError, match="dynamic_dims"):
        ExportConfig(dynamic_dims="1")
    seen = {}

    def fake_export(model, sample, path, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(lq_export, "export_onnx", fake_export)
    cb = QuantExport(ExportConfig(dynamic_dims=[2, 3]), sample_input=lambda t, m: torch.zeros(1, 1, 8, 8))
    from lq.zoo import SmallCNN

    trainer = L.Trainer(logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    with pytest.raises(Exception, match="stop here"):
        cb.run(trainer, SmallCNN())
    assert seen["config"].dynamic_dims == [2, 3]
