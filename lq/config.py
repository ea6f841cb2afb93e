"""Typed configuration: the one source of truth for every option of the callback suite.

The same dataclasses serve three front ends:

* Python: ``QuantCallback(quant=Int8PerChannelConfig(), calib=CalibConfig(method="entropy"))``;
* Hydra: registered in the ConfigStore (:func:`register_configs`) and mirrored
  by the YAML presets in ``conf/``;
* LightningCLI: the callback's ``__init__`` is typed with these classes, so
  jsonargparse builds ``--trainer.callbacks.calib.method=entropy`` from them.

Every value is checked in ``__post_init__``: a bad value raises ``ValueError``
naming the field and the allowed values (Hydra and the CLI construct the
dataclasses, so they fail the same way, before any training starts).
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field, fields
from collections.abc import Mapping
from typing import Any, Dict, List, Optional

from lq.tensor_quant import QuantDescriptor

FORMATS = ("int", "fp8_e4m3")
BLOCK_TYPES = ("static", "dynamic")
CALIB_METHODS = ("auto", "max", "entropy", "percentile", "mse", "sample_mean")
CALIB_DATALOADERS = ("train", "val")
BLOCK_METHODS = ("auto", "max", "mse", "awq", "gptq")
LR_POLICIES = ("auto", "none", "cosine")
EXPORTERS = ("dynamo", "legacy")
EXPORT_TARGETS = ("onnxruntime", "tensorrt", "openvino")
WEIGHT_FORMATS = ("int8", "qdq")
#: files an export path must not overwrite: what a user trained
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")
RECURRENT_MODES = ("scan", "dynamic")
#: the layers :class:`Int8OpenvinoConfig` quantizes: those with weights, whose inputs OpenVINO runs on int8, max
#: pools (OpenVINO pools the integers and moves the quantizer across) and a squeeze-excite's pool (its input is
#: also the product's: :mod:`lq.glue._join_ties`; other average pools stay float); norms and lq's explicit
#: add/cat modules stay float there: their quantizers ran as separate FakeQuantizes, which cost more than they saved
OPENVINO_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
                  "MaxPool1d", "MaxPool2d", "MaxPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
                  "LSTM", "LSTMCell", "MultiheadAttention")


def _choice(owner: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name}={value!r} is not allowed: choose one of {list(allowed)}")


def _positive(owner: str, name: str, value, *, allow_none: bool = False, strict: bool = True) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value > 0 if strict else value >= 0)
    if not ok:
        kind = "a positive number" if strict else "a number >= 0"
        raise ValueError(f"{owner}.{name}={value!r} is not allowed: expected {kind}" + (" or None" if allow_none else ""))


def _fraction(owner: str, name: str, value, *, zero_means: str = "") -> None:
    """A number in (0, 1], or in [0, 1] when ``zero_means`` says what 0 does."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and (0 <= value <= 1 if zero_means else 0 < value <= 1)):
        allowed = f"[0, 1] (0 = {zero_means})" if zero_means else "(0, 1]"
        raise ValueError(f"{owner}.{name}={value!r} is not allowed: expected a fraction in {allowed}")


@dataclass
class QuantizerConfig:
    """One tensor quantizer (a layer's input or its weight); becomes a :class:`QuantDescriptor`.

    Attributes:
        enabled: quantize this tensor at all (False: leave it in floating point).
        format: ``"int"`` (integer grid of ``num_bits``) or ``"fp8_e4m3"``.
        num_bits: integer bits, 2..16 (ignored for FP8).
        axis: None for one amax per tensor, else the axes that keep their own amax
            (``[0]``: per output channel of a Conv/Linear weight).
        unsigned: unsigned range (non-negative data only, e.g. after ReLU).
        narrow_range: signed range ``[-(2^(b-1)-1), 2^(b-1)-1]`` (TensorRT's choice for weights).
        block_size: quantize in blocks of this many elements along ``block_axis``.
        block_axis: the axis of the blocks.
        block_type: ``"static"`` (calibrated block amax) or ``"dynamic"`` (from each input).
        scale_bits: quantize the block amax too with this many bits (double quantization).
        learn_amax: learn amax during QAT (PACT-style), per tensor only.
        dynamic: compute amax from every input instead of calibrating.
        asymmetric: an affine range from calibration (a zero point from the data, all ``2^num_bits`` levels),
            the observed min and max each clipped by the calibration method's amax; per tensor, activations.
    """

    enabled: bool = True
    format: str = "int"
    num_bits: int = 8
    axis: Optional[List[int]] = None
    unsigned: bool = False
    narrow_range: bool = True
    block_size: Optional[int] = None
    block_axis: int = -1
    block_type: str = "static"
    scale_bits: Optional[int] = None
    learn_amax: bool = False
    dynamic: bool = False
    asymmetric: bool = False

    def __post_init__(self):
        owner = type(self).__name__
        _choice(owner, "format", self.format, FORMATS)
        _choice(owner, "block_type", self.block_type, BLOCK_TYPES)
        if self.axis is not None:
            self.axis = [self.axis] if isinstance(self.axis, int) else list(self.axis)
        _positive(owner, "block_size", self.block_size, allow_none=True)
        self.to_descriptor()  # every combination QuantDescriptor rejects is rejected here, by name

    def to_descriptor(self, name: Optional[str] = None) -> QuantDescriptor:
        kwargs: Dict[str, Any] = dict(
            num_bits=(4, 3) if self.format == "fp8_e4m3" else self.num_bits,
            name=name,
            unsigned=self.unsigned,
            narrow_range=self.narrow_range,
            learn_amax=self.learn_amax,
            dynamic=self.dynamic,
        )
        if self.asymmetric:
            kwargs["asymmetric"] = True
        if self.axis is not None:
            kwargs["axis"] = tuple(self.axis) if len(self.axis) > 1 else self.axis[0]
        if self.block_size is not None:
            bs: Dict[Any, Any] = {self.block_axis: self.block_size, "type": self.block_type}
            if self.scale_bits is not None:
                bs["scale_bits"] = self.scale_bits
            kwargs["block_sizes"] = bs
        try:
            return QuantDescriptor(**kwargs)
        except (TypeError, ValueError) as e:
            # the descriptor's hint is in its own terms; a config chooses FP8 with a field of its own
            msg = str(e).replace("use num_bits=(4, 3) for FP8 E4M3", "or format='fp8_e4m3' for FP8 E4M3")
            raise ValueError(f"{type(self).__name__}: {msg}") from None


def _weight_per_channel() -> QuantizerConfig:
    return QuantizerConfig(axis=[0])


@dataclass
class QuantConfig:
    """Which layers are quantized and how (a recipe).

    Attributes:
        input: the quantizer of every quantized layer's input (activations).
        weight: the quantizer of every quantized layer's weight.
        include: module-name globs to quantize (``["*"]``: all supported layers).
        exclude: module-name globs to leave in floating point (wins over include).
        overrides: per-layer changes, ``{glob: {"input": {field: value}, "weight": {...}}}``.
        types: only quantize layers of these torch.nn class names (e.g. ``["Linear"]``); None: every
            type lq has a quantized version of.
        glue: also quantize ``x + y``, ``torch.cat`` and ``a @ b`` written in the modules' own forwards
            (:mod:`lq.glue`): residual adds run as integer adds and the layers feeding them fuse.
        unsigned_after_relu: 8-bit input quantizers that only see a ReLU's output use the unsigned grid
            ``[0, 255]`` (twice the steps; onnxruntime drops the ReLU). onnxruntime only (TensorRT takes
            int8): on in :class:`Int8ReduceRangeConfig`.
        activations: also quantize the input of ``nn.SiLU`` and ``nn.Hardswish`` (:mod:`lq.nn.modules.quant_activation`),
            so the conv before them runs integer and they run as one float kernel between Q/DQ (SiLU as
            onnxruntime's QuickGelu; not after a 1-3 channel stem that runs in float; a SiLU on a large map,
            :func:`lq.rules.onnxruntime.ort_gates_silu`, quantizes its gate too and runs as QLinearSigmoid +
            QLinearMul); ``x * gate`` of two
            activations (squeeze-excite) as QLinearSigmoid/QLinearMul; a conv -> ReLU ->
            BatchNorm gets its output quantizer on the ReLU (the conv runs integer with the ReLU fused); and a conv
            read by PReLU/LeakyReLU gets one too (the activation runs in float between Q/DQ).
        shared_inputs: quantized layers that read the same tensor (two heads on one feature map) use one input
            quantizer, and so do a max pool and the layer reading its output (a pool maps a grid onto itself):
            one grid, one QuantizeLinear in the file, which the runtime fuses into the layer producing the
            tensor. On in :class:`Int8OpenvinoConfig` (two grids around a pool ran in OpenVINO as a separate
            FakeQuantize with layout reorders: a fifth of CREPE's time at batch 8); the onnxruntime recipe gets it
            from ``glue`` with ``activations``. Also the layers reading one tensor through max pools, nearest
            upsampling and ``torch.cat`` (a U-Net's skip, pooled into the next stage and concatenated for the
            decoder: the concat's members and readers take one grid, as NNCF's unified scales do), which the
            OpenVINO export then quantizes once, at the producer, the pool and the concat on the integers. Without
            ``glue``, a residual ``x + f(x)`` and a squeeze-excite ``gate(pool(x)) * x`` read ``x`` through the
            quantizer of the layer (or pool) that also reads it, and only that operand is quantized.
        recurrent: how ``nn.LSTM`` layers quantize their activations: ``"scan"`` (their input quantizers,
            calibrated; exported as an ONNX Scan loop, any runtime) or ``"dynamic"`` (onnxruntime's fused
            ``DynamicQuantizeLSTM``: each layer's input and every step's h quantized from themselves, the
            weights as calibrated; one kernel per layer; onnxruntime only, no ``proj_size``).
    """

    input: QuantizerConfig = field(default_factory=QuantizerConfig)
    weight: QuantizerConfig = field(default_factory=_weight_per_channel)
    include: List[str] = field(default_factory=lambda: ["*"])
    exclude: List[str] = field(default_factory=list)
    overrides: Dict[str, Dict[str, Dict[str, Any]]] = field(default_factory=dict)
    types: Optional[List[str]] = None
    glue: bool = True
    unsigned_after_relu: bool = False
    activations: bool = False
    recurrent: str = "scan"
    shared_inputs: bool = False

    def __post_init__(self):
        owner = type(self).__name__
        _choice(owner, "recurrent", self.recurrent, RECURRENT_MODES)
        for flag in ("glue", "unsigned_after_relu", "activations", "shared_inputs"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{owner}.{flag}={getattr(self, flag)!r} is not allowed: expected true or false")
        if self.types is not None:
            if isinstance(self.types, str) or not all(isinstance(t, str) for t in self.types):
                raise ValueError(f"{owner}.types={self.types!r} is not allowed: expected None or a list of class names")
            self.types = list(self.types)
        self.input = _coerce(self.input, QuantizerConfig, f"{owner}.input")
        self.weight = _coerce(self.weight, QuantizerConfig, f"{owner}.weight")
        for name in ("include", "exclude"):
            v = getattr(self, name)
            if isinstance(v, str) or not all(isinstance(g, str) for g in v):
                raise ValueError(f"{owner}.{name}={v!r} is not allowed: expected a list of module-name globs")
            setattr(self, name, list(v))
        for glob, per in self.overrides.items():
            if not isinstance(per, dict) or not set(per) <= {"input", "weight"}:
                raise ValueError(
                    f"{owner}.overrides[{glob!r}]={per!r} is not allowed: expected {{'input': {{...}}, 'weight': {{...}}}}"
                )
            for role in per:
                self.override_for(role, glob)

    def override_for(self, role: str, glob: str) -> QuantizerConfig:
        """The quantizer config of ``role`` with the override of ``glob`` applied."""
        base = asdict(getattr(self, role))
        changes = dict(self.overrides[glob][role] or {})
        unknown = set(changes) - {f.name for f in fields(QuantizerConfig)}
        if unknown:
            raise ValueError(
                f"{type(self).__name__}.overrides[{glob!r}][{role!r}] has unknown field(s) {sorted(unknown)}; "
                f"allowed: {[f.name for f in fields(QuantizerConfig)]}"
            )
        base.update(changes)
        return QuantizerConfig(**base)

    def quantizer_for(self, layer: str, role: str) -> QuantizerConfig:
        """The config of ``role`` ("input" or "weight") for the layer named ``layer`` (last matching override wins)."""
        cfg = getattr(self, role)
        for glob, per in self.overrides.items():
            if role in per and fnmatch.fnmatchcase(layer, glob):
                cfg = self.override_for(role, glob)
        return cfg

    def selects(self, layer: str) -> bool:
        inc = any(fnmatch.fnmatchcase(layer, g) for g in self.include)
        return inc and not any(fnmatch.fnmatchcase(layer, g) for g in self.exclude)


@dataclass
class Int8PerTensorConfig(QuantConfig):
    """INT8, one amax per tensor for inputs and weights."""

    weight: QuantizerConfig = field(default_factory=QuantizerConfig)


@dataclass
class Int8PerChannelConfig(QuantConfig):
    """INT8 per-tensor inputs, per-output-channel weights (TensorRT's default recipe)."""


@dataclass
class Int8ReduceRangeConfig(QuantConfig):
    """INT8 per-tensor inputs, 7-bit per-channel weights (``|q| <= 63``): onnxruntime's fastest CPU kernels.

    onnxruntime's x86 uint8 x int8 kernels add pairs of products in a saturating int16 on CPUs without
    VNNI (AVX2, AVX-512 without VNNI); 7-bit weights keep every pair within it, so the export runs those
    kernels on every CPU. With full 8-bit weights lq stores the weights as uint8 (zero point 128) instead:
    the same values, exact everywhere, on the slower uint8 x uint8 kernels. The weight grid is part of the
    recipe, so calibration, QAT and the ONNX file all use 7 bits. Inputs that only see a ReLU's output
    quantize on the unsigned grid ``[0, 255]`` (``unsigned_after_relu``): onnxruntime then fuses the ReLU
    into the kernel before it, as in its own ``quantize_static`` files. LSTMs run as onnxruntime's fused
    ``DynamicQuantizeLSTM`` (``recurrent="dynamic"``): faster than the Scan loop at every size measured
    (``bench.lstm_export``: 1.25x FP32 where the loop gives 0.90x on a small LSTM, 2.0x vs 1.7x on a CRNN).
    """

    weight: QuantizerConfig = field(default_factory=lambda: QuantizerConfig(num_bits=7, axis=[0]))
    unsigned_after_relu: bool = True
    recurrent: str = "dynamic"


@dataclass
class Int8OnnxruntimeConfig(QuantConfig):
    """INT8 on onnxruntime's CPU kernels' own grids: asymmetric uint8 activations, 7-bit per-channel weights.

    Activations: one scale and zero point per tensor from calibration (the data's min and max, each clipped by
    the method's amax), all 256 levels, stored as uint8: what onnxruntime's ``quantize_static`` writes, so the
    file needs no clamping op (a ReLU's output gets zero point 0 and the ReLU fuses away); SiLU and HardSwish
    quantize their input (``activations``): the conv before them runs integer, they run as one float kernel
    between Q/DQ, and squeeze-excite products as QLinearMul. Weights: symmetric
    7-bit per output channel (``|q| <= 63``): every u8 x s8 pair fits the int16 that the kernels of CPUs without
    VNNI add in, so one file is exact on every x86 CPU. LSTMs as onnxruntime's ``DynamicQuantizeLSTM``.
    """

    input: QuantizerConfig = field(default_factory=lambda: QuantizerConfig(asymmetric=True, narrow_range=False))
    weight: QuantizerConfig = field(default_factory=lambda: QuantizerConfig(num_bits=7, axis=[0]))
    activations: bool = True
    recurrent: str = "dynamic"


@dataclass
class Int8OpenvinoConfig(QuantConfig):
    """INT8 on OpenVINO's CPU plugin: symmetric activations (zero point 0), 7-bit symmetric per-channel weights.

    OpenVINO runs a Q/DQ file's convolutions and matmuls on int8 where their input and weights are quantized,
    and fuses the quantizer after a layer into it. Measured (``python -m bench.openvino``): an activation grid
    with a non-zero zero point runs a third to half slower than with none (depthwise convs most), so every
    activation is symmetric; a ReLU's output quantizes on ``[0, 255]`` (``unsigned_after_relu``), the rest on
    ``[-128, 127]`` (``narrow_range=False``: QuantizeLinear's own range, no clamping op). Only the layers' inputs
    and weights are quantized, and max pools' inputs (``glue=False``, :data:`OPENVINO_TYPES`): a quantizer on a
    tensor that a float op also reads runs as a separate FakeQuantize, which costs more than the integer op saves.
    So a residual add's operand and a squeeze-excite product's input, which a layer (or the block's pool) also
    reads, are read through that layer's quantizer (``shared_inputs``: :mod:`lq.glue._join_ties`): the tensor is
    quantized once and the FakeQuantize fuses into the op that writes it, as in NNCF's files.
    Weights on 7 bits (``|q| <= 63``), stored as int8: on a CPU without VNNI (AVX2, and AVX-512 before Cascade
    Lake) OpenVINO's int8 convolutions and matmuls add pairs of u8 x s8 products in a saturating int16, as
    onnxruntime's do; with 8-bit weights a conv of 16 channels came out 49% off there (OpenVINO 2026.4 with
    ``ONEDNN_MAX_CPU_ISA=AVX2`` on a Xeon; exact with VNNI), with 7-bit ones exact on every CPU.
    Standard ONNX ops only (no com.microsoft kernels): LSTMs as Scan loops.
    """

    input: QuantizerConfig = field(default_factory=lambda: QuantizerConfig(narrow_range=False))
    weight: QuantizerConfig = field(default_factory=lambda: QuantizerConfig(num_bits=7, axis=[0]))
    types: Optional[List[str]] = field(default_factory=lambda: list(OPENVINO_TYPES))
    glue: bool = False
    unsigned_after_relu: bool = True
    shared_inputs: bool = True


@dataclass
class FP8Config(QuantConfig):
    """FP8 E4M3 inputs (per tensor) and weights (per channel)."""

    input: QuantizerConfig = field(default_factory=lambda: QuantizerConfig(format="fp8_e4m3"))
    weight: QuantizerConfig = field(default_factory=lambda: QuantizerConfig(format="fp8_e4m3", axis=[0]))


@dataclass
class Int4BlockWeightConfig(QuantConfig):
    """Weight-only INT4 of Linear layers in blocks of 32 along the input features (inputs stay floating point).

    The full signed grid [-8, 7] (``narrow_range=False``): with round-to-nearest on each block's max it is the
    same as [-7, 7]; a block scale search (``CalibConfig.block_method``) can use the 16th level (MiniLM, MSE
    search: cosine to FP32 0.962 instead of 0.955). Exported for onnxruntime as ``MatMulNBits`` (codes ``q + 8``).
    """

    input: QuantizerConfig = field(default_factory=lambda: QuantizerConfig(enabled=False))
    weight: QuantizerConfig = field(
        default_factory=lambda: QuantizerConfig(num_bits=4, block_size=32, block_axis=-1, block_type="static",
                                                narrow_range=False)
    )
    types: Optional[List[str]] = field(default_factory=lambda: ["Linear"])


RECIPES = {
    "int8_per_tensor": Int8PerTensorConfig,
    "int8_per_channel": Int8PerChannelConfig,
    "int8_reduce_range": Int8ReduceRangeConfig,
    "int8_onnxruntime": Int8OnnxruntimeConfig,
    "int8_openvino": Int8OpenvinoConfig,
    "fp8": FP8Config,
    "int4_block_weight": Int4BlockWeightConfig,
}


@dataclass
class CalibConfig:
    """Calibration: how activation amax is chosen before QAT (or for PTQ alone).

    Attributes:
        enabled: run calibration (skipped anyway when a restored checkpoint holds amax).
        method: ``auto`` (per layer group, whichever of max / percentile / mse / entropy keeps the model's
            output closest to float on the first calibration batches, checked against ``max`` on up to 8 batches:
            never worse than ``max`` on the model's output; a classifier's choice is then tried against
            ``sample_mean`` and ``max`` everywhere by top-1 agreement with float on those batches, and replaced
            where a paired test says one agrees more often: a briefly trained EfficientNetV2-S 48.9% -> 52.1%, NNCF
            50.9%), or
            ``max``, ``entropy`` (TensorRT's KL),
            ``percentile``, ``mse`` or ``sample_mean`` (NNCF's default activation range: the mean over samples of
            each sample's largest |x|, per tensor) for every layer.
        num_batches: batches of the calibration dataloader to collect.
        dataloader: ``train`` or ``val``: which of the datamodule's loaders calibrates.
        percentile: for ``method="percentile"``.
        num_bins: histogram bins for the histogram methods.
        weight_method: how weights get their amax (``max`` per channel is exact and cheap).
        method_overrides: ``{layer glob: method}`` for layers that need another method.
        skip_if_calibrated: keep amax already present (e.g. restored from a checkpoint).
        bias_correction: after calibration, give each quantized conv / linear a per-channel shift that puts its
            mean output back on float's, layer by layer; kept per layer where it lowers the error on calibration
            batches it was not estimated from, and only where the model's output gets closer to float
            (lq/calib/bias_correction.py). The file holds it in the layer's bias (no new node). ``null`` (the
            default): on with ``method: auto`` when there are at least two calibration batches, off with a method
            named (that method's ranges alone, as the reference toolkit computes them); ``true`` / ``false``:
            always / never. Measured on a briefly trained EfficientNetV2-S (FP32 63.8%): ``auto`` alone 55.0%,
            with the correction 59.1%; on well-trained models the judge keeps little or nothing. Behind
            ``sample_mean`` ranges (named, or ``auto``'s choice) a classifier's corrections are judged by top-1
            agreement with float: those clipped ranges put the output R² near 0, and an R² judge let a correction
            through that took a model from 88.7% to 38.6%.
        block_method: block-quantized Linear weights (``int4_block_weight``): ``auto`` (the default: the best the
            calibration data supports, ``gptq``'s path, where GPTQ's rounding runs only on layers that saw enough
            rows and the others keep the searched grids, without ``gptq``'s warning about them), ``max``
            (round-to-nearest with each block's max), ``mse`` (per block, the fraction of its max with the smallest weight error) or ``awq``
            (activation-aware: input channels scaled by their mean magnitude^alpha, alpha per layer on its output
            error over the calibration batches, one alpha for Linears reading one input; MSE blocks). The inverse
            goes into the LayerNorm before (when only those Linears read it) or into the output rows of the Linear
            whose output reaches the layer through reshapes and attention (V for the attention output), else it
            stays one Mul before the layer(s); or ``gptq``: AWQ's scaling only where it folds (no Mul: the file
            runs at round-to-nearest's speed), then GPTQ's error-compensating rounding on the chosen grids. All
            are in the model, so the exported file computes the same (lq/calib/_block_search.py,
            lq/calib/_awq_fold.py).
    """

    enabled: bool = True
    method: str = "auto"
    num_batches: int = 16
    dataloader: str = "train"
    percentile: float = 99.99
    num_bins: int = 2048
    weight_method: str = "max"
    method_overrides: Dict[str, str] = field(default_factory=dict)
    skip_if_calibrated: bool = True
    bias_correction: Optional[bool] = None
    block_method: str = "auto"

    def __post_init__(self):
        owner = type(self).__name__
        _choice(owner, "method", self.method, CALIB_METHODS)
        _choice(owner, "block_method", self.block_method, BLOCK_METHODS)
        _choice(owner, "weight_method", self.weight_method, tuple(m for m in CALIB_METHODS if m != "auto"))
        _choice(owner, "dataloader", self.dataloader, CALIB_DATALOADERS)
        if isinstance(self.num_batches, bool) or not isinstance(self.num_batches, int) or self.num_batches < 1:
            raise ValueError(f"{owner}.num_batches={self.num_batches!r} is not allowed: expected an int >= 1")
        if not isinstance(self.percentile, (int, float)) or not 0 < self.percentile <= 100:
            raise ValueError(f"{owner}.percentile={self.percentile!r} is not allowed: expected a number in (0, 100]")
        if isinstance(self.num_bins, bool) or not isinstance(self.num_bins, int) or self.num_bins < 16:
            raise ValueError(f"{owner}.num_bins={self.num_bins!r} is not allowed: expected an int >= 16")
        for glob, m in self.method_overrides.items():
            _choice(owner, f"method_overrides[{glob!r}]", m, CALIB_METHODS)
        if self.bias_correction is not None and not isinstance(self.bias_correction, bool):
            raise ValueError(f"{owner}.bias_correction={self.bias_correction!r} is not allowed: expected true, false "
                             "or null (on with method auto)")

    def method_for(self, layer: str) -> str:
        m = self.method
        for glob, override in self.method_overrides.items():
            if fnmatch.fnmatchcase(layer, glob):
                m = override
        return m

    def calibrate_kwargs(self) -> Dict[str, Any]:
        """The keyword arguments of :func:`lq.calibrate_model` this config sets (one place for every caller)."""
        return {"method": self.method, "weight_method": self.weight_method,
                "method_overrides": dict(self.method_overrides), "num_batches": self.num_batches,
                "percentile": self.percentile, "num_bins": self.num_bins, "bias_correction": self.bias_correction,
                "block_method": self.block_method}

    def compute_amax_kwargs(self, method: str) -> Dict[str, Any]:
        return {"percentile": self.percentile} if method == "percentile" else {}


@dataclass
class QATConfig:
    """Quantization-aware fine-tuning.

    Attributes:
        enabled: keep quantizers on while training (False: calibrate/export only).
        learn_amax: make input amax a learned parameter (PACT-style clip); otherwise amax is frozen.
        freeze_bn_epoch: from this epoch on, BatchNorm uses and keeps its running statistics.
        freeze_amax_epoch: from this epoch on, learned amax stops changing.
        lr_policy: ``auto``: ``cosine`` when QAT fine-tunes a trained model, calibrated before its first step
            (its top-1 on the validation batches beats the most frequent class by 10 points, or the batches are not
            a classifier's: the module's own LR was chosen to train it, not to fine-tune it), ``none`` for a model
            at chance (trained from scratch with quantizers on) or uncalibrated quantizers; ``none`` (keep the
            module's schedule) or ``cosine`` (the reference toolkit's recipe: start at ``lr_start_fraction`` of the
            configured LR, cosine-anneal to ``lr_end_fraction`` of that). A resumed fit keeps its policy.
        lr_start_fraction: fraction of the original LR that QAT starts at (default 1%).
        lr_end_fraction: fraction of the starting QAT LR that it ends at (default 1%).
        distill_weight: quantization-aware distillation: the share of the gradient at the distilled output
            that comes from matching a frozen FP32 copy of the model (taken before quantization) instead of
            the training loss; 0 = off, 1 = distillation only (the labels no longer steer QAT).
        distill_temperature: softmax temperature of the distillation loss (KL divergence times T^2).
        distill_module: the submodule whose output are the logits to distill (a Tensor, or a mapping with
            ``logits``); empty = the LightningModule's own forward.
    """

    enabled: bool = True
    learn_amax: bool = False
    freeze_bn_epoch: Optional[int] = None
    freeze_amax_epoch: Optional[int] = None
    lr_policy: str = "auto"
    lr_start_fraction: float = 0.01
    lr_end_fraction: float = 0.01
    distill_weight: float = 0.0
    distill_temperature: float = 1.0
    distill_module: str = ""

    def __post_init__(self):
        owner = type(self).__name__
        _choice(owner, "lr_policy", self.lr_policy, LR_POLICIES)
        _fraction(owner, "lr_start_fraction", self.lr_start_fraction)
        _fraction(owner, "lr_end_fraction", self.lr_end_fraction)
        _fraction(owner, "distill_weight", self.distill_weight, zero_means="off")
        _positive(owner, "distill_temperature", self.distill_temperature)
        if not isinstance(self.distill_module, str):
            raise ValueError(f"{owner}.distill_module={self.distill_module!r} is not allowed: expected a submodule "
                             "path such as 'model.classifier', or '' for the LightningModule itself")
        for name in ("freeze_bn_epoch", "freeze_amax_epoch"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{owner}.{name}={v!r} is not allowed: expected None or an epoch number >= 0")


@dataclass
class ExportConfig:
    """ONNX export: the one set of options of :func:`lq.export.export_onnx` and of the export at the end of fit.

    ``export_onnx(model, sample, path, config)`` takes it; ``export_onnx(model, sample, path, opset=17)`` sets
    single fields (``dynamo=False`` is ``exporter="legacy"``, ``atol`` is ``tolerance``).

    Attributes:
        enabled: export at ``on_fit_end`` (rank zero; the callback's switch, ignored by ``export_onnx``).
        export_best: after QAT, score the post-training (calibrated, before the first step) and the QAT model on
            the validation data (top-1 accuracy of ``(inputs, class targets)`` batches) and export whichever is
            more accurate, saying so; a QAT model that lost to PTQ keeps its weights in the module and its
            checkpoint, and the PTQ one is saved beside it (``ptq.ckpt``). False: always export the QAT model.
            Ignored by ``export_onnx``.
        path: output file, ending in ``.onnx``; in the callback a relative path goes under the trainer's
            ``default_root_dir``.
        opset: ONNX opset, 13..23 (>= 19 for FP8, >= 21 for blocks); None: the one the exporter writes (18 for
            ``dynamo``, 17 for ``legacy``), raised to what the quantizers need.
        exporter: ``dynamo`` (the current torch.onnx exporter) or ``legacy`` (TorchScript based).
        fold_bn: fold BatchNorm into the preceding conv/linear in the exported copy.
        check: run ``onnx.checker.check_model`` on the file.
        verify: run the exported model in onnxruntime on the sample and compare with PyTorch.
        tolerance: largest allowed max-abs difference between onnxruntime and PyTorch outputs (None: judged in
            output quantization steps and top-1 agreement, see ``export_onnx``).
        rtol: with ``tolerance``, also allow ``rtol * max|output|``.
        target: ``onnxruntime`` (uint8 activations, 8-bit weights: what its QLinear kernels fuse, encoded so
            no CPU's int16 intermediates saturate), ``tensorrt`` (int8 zero-point-0 Q/DQ everywhere, as
            TensorRT expects) or ``openvino`` (standard ONNX Q/DQ with zero point 0, int8 weights; verified and
            timed in OpenVINO's CPU plugin with the f32 precision hint: ``pip install lq[openvino]``).
        weight_format: ``int8`` (int8 initializers + DequantizeLinear; onnxruntime's and OpenVINO's default) or
            ``qdq`` (float weights + QuantizeLinear + DequantizeLinear; TensorRT's default); None: the target's
            default.
        input_names, output_names: graph input/output names (None: ``input``/``output``, numbered when several).
        dynamic_batch: make dim 0 of inputs and outputs dynamic.
        dynamic_spatial: make the inputs' spatial dims (H, W) dynamic as well as the batch, for fully
            convolutional models run on several sizes (image pyramids); verified on a second size.
        dynamic_dims: more dynamic axes of every input that has them (axes >= 1), e.g. ``[1]`` for the time
            axis of batch-first sequences (recurrent models export as loops); verified on a longer input.
        providers: onnxruntime execution providers for verification (None: CPU, or CUDA for a model on a GPU).
        check_fusion: build onnxruntime's optimized graph and report the kernels each layer runs.
        keep_metadata: keep the exporter's per-node metadata (PyTorch stack traces, module names).
        speed_check: time the file against the plain FP32 export of the same model (onnxruntime, verified).
        speed_batch: the batch size at which the export's speed check times the INT8 file against the plain FP32
            export of the same model (None: the sample batch's size, and where that is above 1 and the batch axis
            dynamic, batch 1 too: the fallback then also searches there, keeping nothing slower at the sample's).
        fallback_seconds: where the speed check finds the INT8 file slower than FP32, the seconds the export may
            spend exporting, verifying and timing copies with layers sent back to float, to save the fastest
            (0: keep the file and only warn).
    """

    enabled: bool = True
    export_best: bool = True
    path: str = "model_int8.onnx"
    opset: Optional[int] = None
    exporter: str = "dynamo"
    fold_bn: bool = True
    check: bool = True
    verify: bool = True
    tolerance: Optional[float] = None
    rtol: float = 0.0
    target: str = "onnxruntime"
    weight_format: Optional[str] = None
    input_names: Optional[List[str]] = None
    output_names: Optional[List[str]] = None
    dynamic_batch: bool = True
    dynamic_spatial: bool = False
    dynamic_dims: List[Any] = field(default_factory=list)
    providers: Optional[List[str]] = None
    check_fusion: bool = True
    keep_metadata: bool = False
    speed_check: bool = True
    speed_batch: Optional[int] = None
    fallback_seconds: float = 60.0

    def __post_init__(self):
        owner = type(self).__name__
        if not isinstance(self.export_best, bool):
            raise ValueError(f"{owner}.export_best={self.export_best!r} is not allowed: expected true or false")
        _positive(owner, "fallback_seconds", self.fallback_seconds, strict=False)
        if self.speed_batch is not None and (isinstance(self.speed_batch, bool) or not isinstance(self.speed_batch, int)
                                             or self.speed_batch < 1):
            raise ValueError(f"{owner}.speed_batch={self.speed_batch!r} is not allowed: expected an int >= 1 or None "
                             "(the sample's batch)")
        if isinstance(self.dynamic_dims, (str, bytes)) or not all(
                (isinstance(d, int) and not isinstance(d, bool) and d >= 1) or _axis_names(d)
                for d in self.dynamic_dims):
            raise ValueError(f"{owner}.dynamic_dims={self.dynamic_dims!r} is not allowed: expected a list of axes >= 1 "
                             "(dim 0 is the batch, dynamic already), or one {axis: name} mapping per tensor input")
        if not isinstance(self.dynamic_dims, Mapping):  # a lone mapping is refused by the export, which knows the inputs
            self.dynamic_dims = list(self.dynamic_dims)
        _choice(owner, "exporter", self.exporter, EXPORTERS)
        _choice(owner, "target", self.target, EXPORT_TARGETS)
        if self.weight_format is not None:
            _choice(owner, "weight_format", self.weight_format, WEIGHT_FORMATS)
        if self.opset is not None and (isinstance(self.opset, bool) or not isinstance(self.opset, int)
                                       or not 13 <= self.opset <= 23):
            raise ValueError(f"{owner}.opset={self.opset!r} is not allowed: expected None (the exporter's own) or an "
                             "int in [13, 23]")
        _positive(owner, "tolerance", self.tolerance, allow_none=True, strict=False)
        _positive(owner, "rtol", self.rtol, strict=False)
        for name in ("input_names", "output_names", "providers"):
            v = getattr(self, name)
            if v is not None:
                if isinstance(v, str) or not all(isinstance(s, str) for s in v):
                    raise ValueError(f"{owner}.{name}={v!r} is not allowed: expected a list of strings or None")
                setattr(self, name, list(v))
        if not isinstance(self.path, str) or not self.path.endswith(".onnx"):
            if isinstance(self.path, str) and self.path.endswith(CHECKPOINT_SUFFIXES):
                raise ValueError(f"{owner}.path={self.path!r} looks like a checkpoint/weights file; refusing to "
                                 "overwrite it: give a path ending in .onnx")
            raise ValueError(f"{owner}.path={self.path!r} is not allowed: expected a file name ending in .onnx")

    @property
    def dynamo(self) -> bool:
        """Whether the current torch.onnx exporter writes the file (``exporter == "dynamo"``)."""
        return self.exporter == "dynamo"

    def resolved_weight_format(self) -> str:
        """``weight_format``, or the target's default (int8 initializers for onnxruntime and OpenVINO, Q/DQ for
        TensorRT)."""
        return self.weight_format or ("qdq" if self.target == "tensorrt" else "int8")


def _axis_names(d) -> bool:
    """``{axis: name}`` with axes >= 0 and string names (one mapping per tensor input of ``dynamic_dims``)."""
    try:
        return all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 and isinstance(v, str)
                   for k, v in dict(d).items())
    except (TypeError, ValueError):
        return False


def _coerce(value, cls, where: str):
    """Accept a dataclass instance, a mapping of its fields (Hydra/CLI give mappings), or for a quantization
    recipe its preset name (``"int8_per_tensor"``, as in Hydra's ``quant=int8_per_tensor``)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and issubclass(cls, QuantConfig):
        if value not in RECIPES:
            raise ValueError(f"{where}={value!r} is not a recipe: choose one of {list(RECIPES)}, or pass a "
                             "QuantConfig")
        return RECIPES[value]()
    if isinstance(value, dict) or hasattr(value, "items"):
        data = dict(value.items())
        allowed = {f.name for f in fields(cls)}
        unknown = set(data) - allowed
        if unknown:
            raise ValueError(f"{where} has unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        return cls(**data)
    raise ValueError(f"{where} must be a {cls.__name__} or a mapping of its fields, got {type(value).__name__}")


def coerce(value, cls, where: str):
    """Public form of :func:`_coerce`: ``None`` gives the defaults."""
    return cls() if value is None else _coerce(value, cls, where)


@dataclass
class JobConfig:
    """The ``lq-train`` job: train FP32, calibrate (PTQ), fine-tune (QAT), export, evaluate in onnxruntime.

    Attributes:
        quant, calib, qat, export: the callback suite's configs (the job's recipe is ``int8_onnxruntime``: it
            ends in onnxruntime on this CPU, on that runtime's own grids; 7-bit weights run the fast kernels on
            every x86 CPU). On the digits CNN (Zen 5): the same 98.33% as ``int8_reduce_range``, 1.99x the FP32
            file where that recipe gives 1.57x (the export's speed check, batch 64).
        trainer: keyword arguments of ``lightning.Trainer`` (``max_epochs`` is set per phase).
        model: ``_target_`` and arguments of a LightningModule.
        data: ``_target_`` and arguments of a LightningDataModule.
        seed: seeds everything (data split, init, shuffling).
        fp32_epochs: epochs of floating point training before quantization (0: use the model as built).
        qat_epochs: epochs of quantization-aware fine-tuning (0: PTQ only).
        output_dir: where checkpoints, the ONNX files and the results table go.
    """

    # the int8_onnxruntime recipe's values on the base class: Hydra types the node by its default, and any
    # recipe (a QuantConfig subclass) must be able to replace it
    quant: QuantConfig = field(default_factory=lambda: QuantConfig(
        **{f.name: getattr(Int8OnnxruntimeConfig(), f.name) for f in fields(QuantConfig)}))
    calib: CalibConfig = field(default_factory=CalibConfig)
    qat: QATConfig = field(default_factory=QATConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    trainer: Dict[str, Any] = field(default_factory=dict)
    model: Dict[str, Any] = field(default_factory=lambda: {"_target_": "lq.zoo.SmallCNN"})
    data: Dict[str, Any] = field(default_factory=lambda: {"_target_": "lq.zoo.DigitsDataModule"})
    seed: int = 0
    fp32_epochs: int = 8
    qat_epochs: int = 3
    output_dir: str = "outputs"

    def __post_init__(self):
        owner = type(self).__name__
        self.quant = _coerce(self.quant, QuantConfig, f"{owner}.quant")
        self.calib = _coerce(self.calib, CalibConfig, f"{owner}.calib")
        self.qat = _coerce(self.qat, QATConfig, f"{owner}.qat")
        self.export = _coerce(self.export, ExportConfig, f"{owner}.export")
        for name in ("fp32_epochs", "qat_epochs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{owner}.{name}={v!r} is not allowed: expected an int >= 0")
        for name in ("model", "data"):
            if "_target_" not in getattr(self, name):
                raise ValueError(f"{owner}.{name} needs a _target_ (the class to build), got {getattr(self, name)!r}")


def register_configs() -> None:
    """Put the dataclasses in Hydra's ConfigStore; ``conf/`` presets extend them by name."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    for name, cls in RECIPES.items():
        cs.store(group="schema/quant", name=name, node=cls)
    cs.store(group="schema", name="calib", node=CalibConfig)
    cs.store(group="schema", name="qat", node=QATConfig)
    cs.store(group="schema", name="export", node=ExportConfig)


def _attribute_docs(cls) -> Dict[str, str]:
    """``{field: text}`` from the ``Attributes:`` section of a dataclass docstring."""
    import inspect
    import re

    doc = inspect.getdoc(cls) or ""
    if "Attributes:" not in doc:
        return {}
    out: Dict[str, str] = {}
    current = None
    for line in doc.split("Attributes:", 1)[1].splitlines():
        m = re.match(r"^    ([\w, ]+): (.*)$", line)
        if m:
            names = [n.strip() for n in m.group(1).split(",")]
            current = names
            for n in names:
                out[n] = m.group(2).strip()
        elif current and line.startswith("        "):
            for n in current:
                out[n] += " " + line.strip()
    return out


def reference_markdown() -> str:
    """The config reference of docs/reference.md, generated from the dataclasses (fields, defaults, docs)."""
    sections = [
        ("quant (`QuantConfig`)", QuantConfig, "Recipes: " + ", ".join(f"`{k}` ({v.__name__})" for k, v in RECIPES.items()) + "."),
        ("quant.input / quant.weight (`QuantizerConfig`)", QuantizerConfig, ""),
        ("calib (`CalibConfig`)", CalibConfig, ""),
        ("qat (`QATConfig`)", QATConfig, ""),
        ("export (`ExportConfig`)", ExportConfig, ""),
        ("lq-train job (`JobConfig`)", JobConfig, ""),
    ]
    parts = []
    for title, cls, note in sections:
        docs = _attribute_docs(cls)
        inst = cls()
        lines = [f"**{title}**" + (f" — {note}" if note else ""), "", "| field | default | meaning |", "|---|---|---|"]
        for f in fields(cls):
            default = getattr(inst, f.name)
            if f.name in ("quant", "calib", "qat", "export", "input", "weight"):
                default = "see below" if cls is JobConfig else ("per-tensor int8" if f.name == "input" else "per-channel int8")
            text = docs.get(f.name, "").replace("|", "\\|")
            shown = '""' if default == "" else default
            lines.append(f"| `{f.name}` | `{shown}` | {text} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
