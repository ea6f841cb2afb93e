"""``export_onnx``: a fake-quantized PyTorch model -> ONNX with QuantizeLinear/DequantizeLinear, verified."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import os
import tempfile
import time
import warnings
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import torch

from lq.export import (_finish, _float_convs, _float_twin, _fold_bn, _fold_constants, _int16, _kernel_report,
                       _loop_ops, _loops, _lower, _placement, _pool_first, _symbolic, _timing, _verify)
from lq.export._kernel_report import LayerKernel
from lq.export._fold_bn import FoldRecord
from lq.export._ir import ExportError, Graph, QuantNodeInfo, all_nodes, layer_name

log = logging.getLogger(__name__)

EXPORTERS = ("dynamo", "legacy")
TARGETS = ("onnxruntime", "tensorrt")
WEIGHT_FORMATS = ("int8", "qdq")
MIN_OPSET, MAX_OPSET = 13, 23
_PROTECTED_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")


class VerificationError(ExportError):
    """onnxruntime's output differs from PyTorch's fake-quant output by more than the tolerance."""


@dataclasses.dataclass
class ExportResult:
    """What :func:`export_onnx` produced.

    Attributes:
        path: the ONNX file.
        opset: its default-domain opset.
        exporter: "dynamo" or "legacy".
        max_abs_diff: max |onnxruntime - PyTorch fake-quant| on the sample (None when not verified).
        tolerance: the allowed difference (``atol + rtol * max|PyTorch output|``).
        providers: onnxruntime execution providers used for verification.
        file_size: bytes of the ONNX file.
        quantized: every quantized tensor (layer, weight/activation, dtype, axis, scale).
        folded_bn: BatchNorm layers folded (and those that could not be, with the reason).
        ort_ops: op types of the graph onnxruntime runs after its optimizations (fusion check).
        qdq_nodes: number of QuantizeLinear / DequantizeLinear nodes in the saved graph.
        warnings: anything worth knowing (fusions that could not happen, clipped weights ...).
        uint8_weights: layers whose int8 weights were stored as uint8 with zero point 128 (the same values) because
            onnxruntime's u8 x s8 kernels could saturate int16 on them on CPUs without VNNI (see ``_int16``).
        export_seconds: wall time of the export (PyTorch -> ONNX -> rewrites), without verification.
        layer_kernels: for every quantized conv/gemm/matmul (and quantized join or pool), the kernel onnxruntime
            runs and, when it is float, why (target onnxruntime with ``check_fusion``).
        speedup: FP32 time / INT8 time in onnxruntime on the sample (1 thread, median of interleaved runs
            against the same graph without its quantizers); None when not measured. Below 1 a warning names
            the layers that run in float.
    """

    path: str
    opset: int
    exporter: str
    max_abs_diff: float | None
    tolerance: float | None
    providers: list[str]
    file_size: int
    quantized: list[QuantNodeInfo]
    folded_bn: list[FoldRecord]
    ort_ops: Counter
    qdq_nodes: dict[str, int]
    input_names: list[str]
    output_names: list[str]
    warnings: list[str] = dataclasses.field(default_factory=list)
    export_seconds: float = 0.0
    uint8_weights: list[str] = dataclasses.field(default_factory=list)
    layer_kernels: list[LayerKernel] = dataclasses.field(default_factory=list)
    speedup: float | None = None

    def kernel_of(self, layer: str) -> str | None:
        """What onnxruntime runs for ``layer`` (e.g. ``QLinearConv``, or ``Conv (float: <why>)``), None if unknown."""
        texts = [k.text() for k in self.layer_kernels if k.layer == layer]
        return ", ".join(dict.fromkeys(texts)) if texts else None

    @property
    def quantized_layers(self) -> list[str]:
        return sorted({q.layer for q in self.quantized})

    @property
    def int8_kernels(self) -> dict[str, int]:
        """onnxruntime integer kernels in the optimized graph (QLinearConv, QLinearMatMul, QLinearAdd, QGemm ...)."""
        return {k: v for k, v in self.ort_ops.items() if k in _verify.INT8_KERNELS}

    def summary(self) -> str:
        lines = [f"ONNX export: {self.path} ({self.file_size / 1024:.1f} KiB, opset {self.opset}, {self.exporter})"]
        if self.max_abs_diff is not None:
            lines.append(f"  onnxruntime vs PyTorch fake-quant: max abs diff {self.max_abs_diff:.3g} "
                         f"(tolerance {self.tolerance:.3g}, providers {', '.join(self.providers)})")
        lines.append(f"  Q/DQ nodes: {self.qdq_nodes}; quantized tensors: {len(self.quantized)}")
        folded = [f.bn for f in self.folded_bn if f.skipped is None]
        if folded:
            lines.append(f"  BatchNorm folded: {', '.join(folded)}")
        if self.int8_kernels:
            lines.append("  onnxruntime INT8 kernels: " + ", ".join(f"{k} x{v}" for k, v in self.int8_kernels.items()))
        if self.layer_kernels:
            n_int = sum(k.integer for k in self.layer_kernels)
            lines.append(f"  layers on integer kernels: {n_int} of {len(self.layer_kernels)}")
        if self.speedup is not None:
            lines.append(f"  onnxruntime speed on the sample (1 thread): {self.speedup:.2f}x the FP32 graph")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)

    __str__ = summary


# =========================================================================== checks on the PyTorch side
def find_uncalibrated_quantizers(model: torch.nn.Module) -> list[str]:
    """Names of enabled quantizers that would need an amax and have none."""
    bad = []
    for name, m in model.named_modules():
        if not _is_quantizer(m):
            continue
        if not _quantizer_enabled(m):
            continue
        if _is_dynamic(m):
            continue
        if getattr(m, "amax", None) is None and getattr(m, "_min_range", None) is None:
            bad.append(name or "<model>")
    return bad


def _is_quantizer(m) -> bool:
    return type(m).__name__ in ("TensorQuantizer", "ScaledTensorQuantizer") or (
        hasattr(m, "_if_quant") and hasattr(m, "num_bits") and hasattr(m, "amax"))


def _quantizer_enabled(m) -> bool:
    for attr in ("is_enabled", "enabled"):
        v = getattr(m, attr, None)
        if isinstance(v, bool):
            if not v:
                return False
            break
    if getattr(m, "_disabled", False):
        return False
    if getattr(m, "_if_quant", True) is False:
        return False
    return True


def _is_dynamic(m) -> bool:
    desc = getattr(m, "_quant_desc", None) or getattr(m, "quant_desc", None)
    for obj in (m, desc):
        if obj is None:
            continue
        d = getattr(obj, "dynamic", None)
        if isinstance(d, bool) and d:
            return True
        if getattr(obj, "_dynamic", False) is True:
            return True
    bs = getattr(m, "block_sizes", None)
    if isinstance(bs, dict) and bs.get("type") == "dynamic":
        return True
    return False


@contextlib.contextmanager
def _export_mode(model: torch.nn.Module):
    """Quantizers call lq's ops during the export (``use_fb_fake_quant`` off): lq lowers them itself, exactly
    (torch's fake_quantize_* cannot express narrow range and do not trace with torch.export)."""
    classes = {cls for _, m in model.named_modules() if _is_quantizer(m) for cls in type(m).__mro__
               if "use_fb_fake_quant" in vars(cls)}
    saved = [(cls, cls.use_fb_fake_quant) for cls in classes]
    for cls, _ in saved:
        cls.use_fb_fake_quant = False
    try:
        yield
    finally:
        for cls, v in saved:
            cls.use_fb_fake_quant = v


# =========================================================================== helpers
def _as_tuple(sample) -> tuple:
    if isinstance(sample, torch.Tensor):
        return (sample,)
    if isinstance(sample, (tuple, list)):
        return tuple(sample)
    raise TypeError(f"sample_input must be a torch.Tensor or a tuple of tensors, got {type(sample).__name__}")


def _flatten_out(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        res = []
        for o in out:
            res.extend(_flatten_out(o))
        return res
    if isinstance(out, dict):
        res = []
        for o in out.values():
            res.extend(_flatten_out(o))
        return res
    raise TypeError(f"model output of type {type(out).__name__} is not supported (tensors, tuples, dicts)")


def _grown(args: tuple, dims: list[dict[int, str]]) -> tuple:
    """The sample at twice its size along its dynamic axes other than the batch (each concatenated with itself):
    a second shape that a model with dynamic H and W, or a dynamic sequence length, must run on, with the same
    value distribution. ``dims``: :func:`_dynamic_dims` of each tensor input (axes of one name grow together)."""
    out, k = [], 0
    for a in args:
        if isinstance(a, torch.Tensor):
            for d, name in sorted(dims[k].items()):
                if name != "batch":
                    a = torch.cat([a, a], dim=d)
            k += 1
        out.append(a)
    return tuple(out)


def _extra_dims(dynamic_dims, tensors: list) -> list[dict[int, str]]:
    """``dynamic_dims`` as ``{axis: name}`` per tensor input: a sequence of axes applies to every input that has
    them (named ``dim<axis>``), a sequence of one mapping per input is taken as given."""
    spec = list(dynamic_dims.values()) if isinstance(dynamic_dims, Mapping) else list(dynamic_dims)
    if spec and all(isinstance(d, Mapping) for d in spec):
        if isinstance(dynamic_dims, Mapping) or len(spec) != len(tensors):
            raise ValueError(f"dynamic_dims: give one {{axis: name}} mapping per tensor input, in order ({len(tensors)} "
                             f"input(s)), got {dynamic_dims!r}")
        for m, a in zip(spec, tensors):
            if any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < a.dim() or not isinstance(v, str)
                   for d, v in m.items()):
                raise ValueError(f"dynamic_dims: {m!r} is not allowed for an input of shape {tuple(a.shape)}: "
                                 "{axis: name} with 0 <= axis < its rank and a str name")
        return [dict(m) for m in spec]
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in spec):
        raise ValueError(f"dynamic_dims={dynamic_dims!r} is not allowed: axes >= 1 (dim 0 is dynamic_batch), or one "
                         "{axis: name} mapping per input")
    return [{d: f"dim{d}" for d in spec if d < a.dim()} for a in tensors]


def _choose_opset(opset, model_has_fp8: bool) -> int:
    if opset is None:
        return 19 if model_has_fp8 else 17
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset={opset!r} is not allowed: expected an int in [{MIN_OPSET}, {MAX_OPSET}] "
                         "(>= 13 for per-channel axis, >= 19 for FP8, >= 21 for blocked Q/DQ)")
    return opset


def _model_has_fp8(model) -> bool:
    for _, m in model.named_modules():
        if _is_quantizer(m) and getattr(m, "num_bits", None) == (4, 3) and _quantizer_enabled(m):
            return True
    return False


def _dynamic_dims(a, dynamic_batch: bool, dynamic_spatial: bool, extra: Mapping[int, str] | None = None
                  ) -> dict[int, str]:
    """``{axis: name}`` of the dynamic axes of one input: dim 0 (batch), dims 2.. of an image-like input, and
    its ``extra`` axes (from ``dynamic_dims``)."""
    dims: dict[int, str] = {}
    if not isinstance(a, torch.Tensor) or a.dim() == 0:
        return dims
    if dynamic_batch:
        dims[0] = "batch"
    if dynamic_spatial and a.dim() >= 3:
        for d in range(2, a.dim()):
            dims[d] = ("height", "width")[d - 2] if a.dim() == 4 else f"dim{d}"
    dims.update(extra or {})
    return dims


def _export_dynamo(model, args, opset, input_names, output_names, dims) -> onnx.ModelProto:
    table = _symbolic.translation_table()
    kw: dict[str, Any] = {}
    if any(dims):
        shared: dict[str, Any] = {}
        kw["dynamic_shapes"] = tuple(
            {ax: shared.setdefault(nm, torch.export.Dim(nm, min=1 if nm == "batch" else 2)) for ax, nm in d.items()}
            or None
            for d in dims)
    with warnings.catch_warnings(), _quiet_torch_onnx():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(model, args, dynamo=True, opset_version=max(opset, 18),
                                 custom_translation_table=table, input_names=input_names,
                                 output_names=output_names, optimize=True, verbose=False, **kw)
    m = prog.model_proto
    return m


def _export_legacy(model, args, opset, input_names, output_names, dims) -> onnx.ModelProto:
    _symbolic.register_legacy_symbolics()
    kw: dict[str, Any] = {}
    if any(dims):
        axes = {n: d for n, d in zip(input_names, dims) if d}
        if any(0 in d for d in dims):
            axes.update({n: {0: "batch"} for n in output_names})
        kw["dynamic_axes"] = axes
    buf = io.BytesIO()
    with warnings.catch_warnings(), _quiet_torch_onnx():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, buf, dynamo=False, opset_version=min(opset, 20), input_names=input_names,
                          output_names=output_names, do_constant_folding=True,
                          custom_opsets={_symbolic.DOMAIN: _symbolic.VERSION}, **kw)
    return onnx.load_from_string(buf.getvalue())


@contextlib.contextmanager
def _quiet_torch_onnx():
    names = ["torch.onnx", "torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes", "onnxscript",
             "onnx_ir"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _set_opset(model: onnx.ModelProto, opset: int, notes: list[str]) -> tuple[onnx.ModelProto, int]:
    """Convert to ``opset`` when the exporter produced another one (the current exporter emits >= 18)."""
    cur = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), opset)
    if cur == opset:
        return model, opset
    from onnx import version_converter

    try:
        converted = version_converter.convert_version(model, opset)
        onnx.checker.check_model(converted)
        return converted, opset
    except Exception as e:
        notes.append(f"the exported graph has opset {cur}: conversion to the requested opset {opset} failed "
                     f"({type(e).__name__}); the current torch.onnx exporter emits opset >= 18, use "
                     f"dynamo=False for an older opset")
        return model, cur


def _count_qdq(model: onnx.ModelProto) -> dict[str, int]:
    c = Counter(n.op_type for n in all_nodes(model.graph))
    return {"QuantizeLinear": c.get("QuantizeLinear", 0), "DequantizeLinear": c.get("DequantizeLinear", 0)}


def _atomic_save(model: onnx.ModelProto, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".lq-export-", suffix=".onnx", dir=d)
    os.close(fd)
    try:
        onnx.save_model(model, tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the file is for serving, as readable as any other
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# =========================================================================== the API
def export_onnx(
    model: torch.nn.Module,
    sample_input,
    path: str | os.PathLike,
    *,
    opset: int | None = None,
    dynamo: bool = True,
    fold_bn: bool = True,
    check: bool = True,
    verify: bool = True,
    rtol: float = 0.0,
    atol: float | None = None,
    tolerance: float | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_batch: bool = True,
    dynamic_spatial: bool = False,
    dynamic_dims: Sequence[int] | Sequence[Mapping[int, str]] = (),
    target: str = "onnxruntime",
    weight_format: str | None = None,
    providers: Sequence[str] | None = None,
    check_fusion: bool = True,
    keep_metadata: bool = False,
) -> ExportResult:
    """Export a fake-quantized model to ONNX with QuantizeLinear/DequantizeLinear, check and verify it.

    The model is never modified: the export works on a deep copy in eval mode
    (so training, checkpointing and testing can go on afterwards).

    Args:
        model: a ``torch.nn.Module`` (a LightningModule is fine) whose quantizers are calibrated.
        sample_input: a tensor (or tuple of tensors) to trace with and to verify on.
        path: the ``.onnx`` file to write (written only once the export succeeded).

    Keyword Args:
        opset: default-domain opset, 13..23 (None: 17, or 19 when the model has FP8 quantizers).
            Per-channel needs >= 13, FP8 (float8e4m3fn) >= 19, blocked Q/DQ >= 21.
        dynamo: True for the current ``torch.onnx`` exporter, False for the legacy TorchScript one.
        fold_bn: fold BatchNorm into the preceding Conv/Gemm (exactly: per-channel weight scales
            absorb ``|gamma / sqrt(var + eps)|``).
        check: run ``onnx.checker.check_model``.
        verify: run the model in onnxruntime on ``sample_input`` and compare with the PyTorch
            fake-quant output; raise :class:`VerificationError` beyond the tolerance.
        rtol, atol: allowed ``max|ort - torch| <= atol + rtol * max|torch|``; ``tolerance`` is an
            alias of ``atol``. Default when neither is given: 5% of ``max|torch output|``, and never less
            than two quantization steps at the output (one flipped rounding there is normal between
            runtimes; a barely trained model has outputs of only a few steps).
        input_names, output_names: graph input/output names (default ``input``, ``output``).
        dynamic_batch: make dim 0 of inputs and outputs dynamic.
        dynamic_spatial: also make the spatial dims (H, W, ...: every dim after the channels of an input of
            rank >= 3) dynamic, for fully convolutional models run on several sizes (image pyramids). A model
            that fixes its spatial size (flatten -> Linear) cannot, and the error says so.
        dynamic_dims: more dynamic axes: a sequence of axes for every input that has them, e.g. ``(1,)`` for the
            time axis of batch-first sequences ``(B, T, F)``, ``(3,)`` for the width of a text-line image; or one
            ``{axis: name}`` per tensor input where inputs differ (axes of one name have one size), e.g.
            ``[{0: "batch", 1: "time"}, {1: "batch"}, {1: "batch"}]`` for ``x, h0, c0`` with
            ``dynamic_batch=False``. A ``QuantLSTM`` is exported as one ONNX ``Scan`` per layer and direction,
            which runs for any sequence length. Verification also runs the sample doubled along every dynamic
            axis not named "batch".
        target: "onnxruntime" (Q/DQ placed for onnxruntime's QLinear* fusions; uint8 after ReLU) or
            "tensorrt" (int8 with zero point 0 everywhere, as TensorRT requires).
        weight_format: "int8" (quantized weights stored as int8 initializers + DequantizeLinear;
            default for onnxruntime) or "qdq" (float weights + QuantizeLinear + DequantizeLinear;
            default for TensorRT).
        providers: onnxruntime execution providers for verification (default CPU, or CUDA when the
            model is on a GPU and onnxruntime has it).
        check_fusion: also build onnxruntime's optimized graph and report the fused INT8 kernels.
        keep_metadata: keep the exporter's per-node metadata (PyTorch stack traces, module names).

    Returns:
        :class:`ExportResult`.

    Raises:
        ExportError: uncalibrated quantizers (named), configurations ONNX cannot express (named, with what is
            allowed), checker failures. :class:`VerificationError` when the difference exceeds the tolerance
            (the model is then saved next to ``path`` as ``*.unverified.onnx`` and ``path`` is left alone).
    """
    t0 = time.perf_counter()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    path = os.fspath(path)
    if not path.endswith(".onnx"):
        if path.endswith(_PROTECTED_SUFFIXES):
            raise ValueError(f"path={path!r} looks like a checkpoint/weights file; refusing to overwrite it: "
                             "give a path ending in .onnx")
        raise ValueError(f"path={path!r} must end in .onnx")
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not allowed: one of {TARGETS}")
    if weight_format is None:
        weight_format = "int8" if target == "onnxruntime" else "qdq"
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r} is not allowed: one of {WEIGHT_FORMATS}")
    if tolerance is not None and atol is not None:
        raise ValueError("give either tolerance or atol (they are the same), not both")
    if tolerance is not None:
        atol = tolerance
    for nm, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
            raise ValueError(f"{nm}={v!r} is not allowed: expected a float >= 0")
    opset = _choose_opset(opset, _model_has_fp8(model))

    bad = find_uncalibrated_quantizers(model)
    if bad:
        raise ExportError(
            f"{len(bad)} enabled quantizer(s) have no amax (not calibrated): {', '.join(bad)}. "
            "Calibrate them first (or load a calibrated state_dict, set a fixed amax in the QuantDescriptor, "
            "or disable them) before exporting.")

    args = tuple(a.detach().cpu().float() if isinstance(a, torch.Tensor) and a.is_floating_point() else
                 (a.detach().cpu() if isinstance(a, torch.Tensor) else a) for a in _as_tuple(sample_input))
    device_type = next((p.device.type for p in model.parameters()), "cpu")

    # --- deep copy: the training model is never touched
    work = copy.deepcopy(model)
    work = work.cpu().float().eval()
    for p in work.parameters():
        p.requires_grad_(False)
    with torch.no_grad(), _export_mode(work):
        ref_out = [o.detach().float().numpy() for o in _flatten_out(work(*args))]
    cases = [(args, ref_out)]  # (inputs, PyTorch outputs) that verification compares onnxruntime with
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    dims = [_dynamic_dims(a, dynamic_batch, dynamic_spatial, extra)
            for a, extra in zip(tensors, _extra_dims(dynamic_dims, tensors), strict=True)]
    if any(name != "batch" for dd in dims for name in dd.values()):
        grown = _grown(args, dims)
        what = "dynamic_spatial=True" if dynamic_spatial else f"dynamic_dims={dynamic_dims}"
        try:
            with torch.no_grad(), _export_mode(work):
                cases.append((grown, [o.detach().float().numpy() for o in _flatten_out(work(*grown))]))
        except Exception as e:
            raise ExportError(
                f"{what}, but the model does not run on an input twice the sample's size along those axes "
                f"({type(e).__name__}: {_short(e, 300)}): it fixes its spatial size (e.g. flatten -> Linear) or its "
                f"length; export with {'dynamic_spatial=False' if dynamic_spatial else 'dynamic_dims=()'}") from e
    n_in = len(tensors)
    input_names = list(input_names) if input_names else (
        ["input"] if n_in == 1 else [f"input_{i}" for i in range(n_in)])
    output_names = list(output_names) if output_names else (
        ["output"] if len(ref_out) == 1 else [f"output_{i}" for i in range(len(ref_out))])

    exporter = "dynamo" if dynamo else "legacy"
    notes: list[str] = []
    try:
        # a QuantLSTM traces as one placeholder per layer and direction (not one step per time step): the
        # current exporter only (the legacy one has no translation for it and keeps the unrolled steps)
        loops = _loop_ops.loop_mode(work) if dynamo else contextlib.nullcontext([])
        with torch.no_grad(), _export_mode(work), loops as loop_notes:
            notes.extend(loop_notes)
            if dynamo:
                proto = _export_dynamo(work, args, opset, input_names, output_names, dims)
            else:
                proto = _export_legacy(work, args, opset, input_names, output_names, dims)
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"torch.onnx export ({exporter}) failed: {type(e).__name__}: {_short(e)}") from e

    proto = _loops.lower_recurrent(proto)  # recurrent placeholders -> Scan (bodies still hold lq placeholders)
    timed = verify and check_fusion and target == "onnxruntime"
    twin = _float_twin.float_twin(proto) if timed else None

    # --- graph rewrites
    infos: list[QuantNodeInfo] = []
    folds: list[FoldRecord] = []
    u8_weights: list[str] = []
    lower_opts = _lower.LowerOptions(opset=opset, weight_format=weight_format,
                                     activation_dtype="uint8" if target == "onnxruntime" else "int8",
                                     narrow_clamp=target == "onnxruntime")

    def rewrite(g: Graph) -> None:
        """The Q/DQ passes, in order; every loop body goes through the same ones (:func:`_loops.rewrite_bodies`)."""
        _fold_constants.fold_constants(g)
        _lower.lower_placeholders(g, lower_opts, infos)
        _lower.fold_weight_quantize(g)
        if fold_bn:
            folds.extend(_fold_bn.fold_batchnorm(g))
        _finish.split_weight_dq(g)
        _finish.transpose_weight_dq(g)
        if target == "onnxruntime":
            _pool_first.pool_before_activations(g)
            _placement.dedupe_quantizers(g)
            _placement.split_shared_producers(g)
            _placement.hoist_quantizers(g, relu_to_unsigned=True)
            _float_convs.float_weights_for_float_convs(g)
            _placement.quantize_bias(g)
        _placement.dedupe_quantizers(g)
        if target == "onnxruntime":
            u8_weights.extend(_int16.encode_int16_safe(g))
        if weight_format == "qdq":
            _finish.weights_to_qdq(g)
        _loops.rewrite_bodies(g, rewrite)

    g = Graph(proto)
    rewrite(g)
    for f in folds:
        if f.skipped:
            notes.append(f"BatchNorm '{f.bn}' not folded into '{f.layer}': {f.skipped}")
        if f.clipped:
            notes.append(f"folding '{f.bn}' flipped the sign of {f.clipped} weight(s) at -128, clipped to 127")
    proto = g.finalize()
    ranks = _finish.value_ranks(proto)
    g = Graph(proto)
    if _placement.global_pools(g, ranks):
        proto = g.finalize()
    layer_of = {n.name: layer_name(n) for n in all_nodes(proto.graph)}
    unfused = _kernel_report.unfused_layers(proto, layer_of) if target == "onnxruntime" else []
    risks = _int16.int16_risks(proto)  # before the metadata goes: it names the layers
    if u8_weights:
        notes.append(f"{len(u8_weights)} layer(s) with 8-bit weights run on onnxruntime's uint8 x uint8 kernels "
                     "(their int8 x uint8 pair sums could saturate int16 on CPUs without VNNI; the stored values "
                     "are the same): the int8_reduce_range recipe (7-bit weights, used in calibration and QAT too) "
                     "keeps the faster uint8 x int8 kernels on every CPU")
    if not keep_metadata:
        _finish.strip_metadata(proto)
    _finish.remove_placeholder_opset(proto)
    proto, opset = _set_opset(proto, opset, notes)
    if any(n.domain == _symbolic.DOMAIN for n in proto.graph.node):  # pragma: no cover - defensive
        raise ExportError("internal error: an lq placeholder was left in the graph")
    if target == "onnxruntime" and risks:  # pragma: no cover - encode_int16_safe leaves none
        raise ExportError("internal error: integer kernels that can saturate int16 remain: "
                          + "; ".join(map(str, risks)))
    if target == "tensorrt":
        if risks:
            notes.append(f"{len(risks)} integer kernel(s) would saturate in onnxruntime's CPU kernels without VNNI "
                         "(TensorRT accumulates in int32, so the file is right for TensorRT; for onnxruntime "
                         "export with target='onnxruntime'): " + "; ".join(map(str, risks)))
        u8 = sorted({q.layer for q in infos if q.dtype == "uint8" and q.kind == "activation"})
        if u8:
            notes.append(f"TensorRT supports only int8 Q/DQ; unsigned (uint8) quantizers: {', '.join(u8)}")
    proto.producer_name = "lq.export"
    if check:
        try:
            onnx.checker.check_model(proto, full_check=True)
        except Exception as e:
            raise ExportError(f"onnx.checker rejected the exported model: {_short(e)}") from e
    export_seconds = time.perf_counter() - t0

    # --- verification (from the serialized model, as it will be deployed)
    providers = list(providers) if providers else _verify.default_providers(device_type)
    data = proto.SerializeToString()
    max_diff = tol = None
    ort_ops: Counter = Counter()
    if verify:
        max_diff, ref_max = 0.0, 0.0
        for inputs, refs in cases:
            feeds = [a.numpy() for a in inputs if isinstance(a, torch.Tensor)]
            bad_in = _verify.nonfinite_report(feeds, input_names)
            bad_ref = _verify.nonfinite_report(refs, output_names)
            if bad_in or bad_ref:
                _save_unverified(proto, path)
                raise VerificationError(
                    "cannot verify the export: "
                    + (f"the sample input holds NaN/Inf ({bad_in})" if bad_in else
                       f"the PyTorch model's own output holds NaN/Inf on the sample ({bad_ref}): the trained "
                       "weights or an amax are not finite")
                    + f". The file was saved as {_unverified(path)}; {path} was not written.")
            try:
                sess = _verify.make_session(data, providers, graph_optimization_level=_verify.verify_level(target))
                ort_out = _verify.run(sess, feeds)
            except Exception as e:
                _save_unverified(proto, path)
                shape = [tuple(a.shape) for a in inputs if isinstance(a, torch.Tensor)]
                raise ExportError(f"onnxruntime could not run the exported model on input shape(s) {shape}: "
                                  f"{_short(e)} (saved as {_unverified(path)} for inspection)") from e
            bad_ort = _verify.nonfinite_report(ort_out, output_names)
            if bad_ort:
                _save_unverified(proto, path)
                raise VerificationError(f"onnxruntime's output holds NaN/Inf where PyTorch's is finite ({bad_ort}). "
                                        f"The file was saved as {_unverified(path)}; {path} was not written.")
            max_diff = max(max_diff, _verify.max_abs_diff(ort_out, refs))
            ref_max = max([ref_max] + [float(np.abs(r).max()) for r in refs if r.size])
        step = _verify.output_step(proto)
        if atol is None and not rtol:
            # 5% of the largest output, and never less than two quantization steps flipped at the output
            tol = max(0.05 * ref_max, 2.0 * step) + 1e-6
        else:
            tol = (atol or 0.0) + rtol * ref_max
        if not max_diff <= tol:
            _save_unverified(proto, path)
            raise VerificationError(
                f"onnxruntime output differs from the PyTorch fake-quant output by max abs diff {max_diff:.4g}, "
                f"more than the tolerance {tol:.4g} (atol={atol}, rtol={rtol}, max|output|={ref_max:.4g}, "
                f"output quantization step {step:.3g}). The model was saved as {_unverified(path)}; {path} was "
                "not written")
    _atomic_save(proto, path)
    kernels: list[LayerKernel] = []
    if check_fusion:
        try:
            optimized = _verify.optimized_model(path, providers)
            ort_ops = Counter(n.op_type for n in all_nodes(optimized.graph))  # loop bodies too
            if target == "onnxruntime":
                kernels = _kernel_report.layer_kernels(proto, optimized, layer_of)
        except Exception as e:  # pragma: no cover - diagnostics only
            notes.append(f"could not inspect onnxruntime's optimized graph: {_short(e)}")
    if check_fusion and target == "onnxruntime" and ort_ops:
        n_float = sum(ort_ops.get(k, 0) for k in ("Conv", "FusedConv", "Gemm", "MatMul", "FusedGemm", "FusedMatMul"))
        if n_float:
            why = "; ".join(unfused) if unfused else "see onnxruntime's optimized graph"
            notes.append(f"onnxruntime runs {n_float} conv/gemm/matmul in float: {why}")
    speed = None
    if twin is not None:
        speed = _speed_note(data, twin, cases[0][0], providers, kernels, notes)
    return ExportResult(
        path=path, opset=opset, exporter=exporter, max_abs_diff=max_diff, tolerance=tol, providers=providers,
        file_size=os.path.getsize(path), quantized=infos, folded_bn=folds, ort_ops=ort_ops,
        qdq_nodes=_count_qdq(proto), input_names=input_names, output_names=output_names, warnings=notes,
        export_seconds=export_seconds, uint8_weights=u8_weights, layer_kernels=kernels, speedup=speed)


def _speed_note(int8_model: bytes, twin, inputs, providers, kernels: list[LayerKernel], notes: list[str]):
    """Time the INT8 file against its FP32 twin; below 1x, add a warning naming the float layers."""
    feeds = [a.numpy() for a in inputs if isinstance(a, torch.Tensor)]
    try:
        ratio, int8_ms, fp32_ms = _timing.speedup(int8_model, twin.SerializeToString(), feeds, providers)
    except Exception as e:  # diagnostics only: a failure to time never fails the export
        notes.append(f"could not time the INT8 file against FP32: {_short(e, 300)}")
        return None
    if ratio < 1.0:
        floats = [f"{k.layer} ({k.kernel}: {k.reason})" for k in kernels if not k.integer]
        notes.append(
            f"the INT8 file runs at {ratio:.2f}x the speed of FP32 in onnxruntime on the sample (1 thread, "
            f"{int8_ms:.3g} ms vs {fp32_ms:.3g} ms): "
            + (f"{len(floats)} quantized layer(s) run in float between Q/DQ: " + "; ".join(floats) if floats else
               "every quantized layer runs an integer kernel; the Q/DQ conversions cost more than they save "
               "at this size"))
    return ratio


def _unverified(path: str) -> str:
    return path[: -len(".onnx")] + ".unverified.onnx"


def _save_unverified(proto, path):
    try:
        _atomic_save(proto, _unverified(path))
    except Exception:  # pragma: no cover
        pass


def _short(e: BaseException, n: int = 1500) -> str:
    s = str(e).strip()
    return s if len(s) <= n else s[:n] + " ..."
