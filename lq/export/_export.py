"""``export_onnx``: a fake-quantized PyTorch model -> ONNX with QuantizeLinear/DequantizeLinear, verified."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
import time
from collections import Counter
from typing import Mapping, Sequence

import numpy as np
import onnx
import torch
from torch.nn.utils.rnn import PackedSequence

from lq.export.finish import _finish
from lq.export.passes import (_channel_affine, _dynamic_lstm, _float_convs, _fold_bn, _fold_constants, _gelu_order, _int16,
                              _linear_gemm, _loops, _lower, _matmul_nbits, _mean_first, _placement, _pool_first, _upsample)
from lq.export.prepare import _loop_ops, _model_checks
from lq.export.report import _kernel_report
from lq.export.timing import _float_twin, _fp32_reference, _timing
from lq.export.trace import _symbolic, _torch_onnx
from lq.export.verify import _rounding_noise, _verify
from lq.export.passes._fold_bn import FoldRecord
from lq.export._ir import ExportError, Graph, QuantNodeInfo, all_nodes, layer_name
from lq.export.report._kernel_report import LayerKernel
from lq.export.prepare._model_checks import find_uncalibrated_quantizers
from lq.export.report._result import ExportResult, VerificationError

log = logging.getLogger(__name__)

EXPORTERS = ("dynamo", "legacy")
TARGETS = ("onnxruntime", "tensorrt")
WEIGHT_FORMATS = ("int8", "qdq")
_PROTECTED_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")


# =========================================================================== helpers
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
    speed_batch: int | None = None,
    speed_check: bool = True,
) -> ExportResult:
    """Export a fake-quantized model to ONNX with QuantizeLinear/DequantizeLinear, check and verify it.

    The model is never modified: the export works on a deep copy in eval mode
    (so training, checkpointing and testing can go on afterwards).

    Args:
        model: a ``torch.nn.Module`` (a LightningModule is fine) whose quantizers are calibrated.
        sample_input: a tensor (or tuple of tensors) to trace with and to verify on.
        path: the ``.onnx`` file to write (written only once the export succeeded).

    Keyword Args:
        opset: default-domain opset, 13..23. None: the one the exporter writes (18 for the current exporter,
            17 for the legacy one), raised to what the quantizers need: per-channel >= 13, FP8
            (float8e4m3fn) >= 19, blocked Q/DQ >= 21. Another opset is converted to, with a warning if that fails.
        dynamo: True for the current ``torch.onnx`` exporter, False for the legacy TorchScript one.
        fold_bn: fold BatchNorm into the preceding Conv/Gemm (exactly: per-channel weight scales
            absorb ``|gamma / sqrt(var + eps)|``).
        check: run ``onnx.checker.check_model``.
        verify: run the model in onnxruntime on ``sample_input`` and compare with the PyTorch
            fake-quant output; raise :class:`VerificationError` when they disagree. Judged in output
            quantization steps (see :mod:`lq.export.verify._verify`): an output fails when more than 1% of its
            elements are over 6 steps off (rounding ties cascade through a deep network: a few steps are
            normal), or, for (batch, classes) logits, when the top-1 class differs beyond a rounding tie on more
            than 1% of the rows. The numbers are in ``ExportResult.output_checks``.
        rtol, atol: when given, the verdict is ``max|ort - torch| <= atol + rtol * max|torch|`` instead (the
            step numbers are still measured and reported); ``tolerance`` is an alias of ``atol``.
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
        speed_batch: the batch size the speed check times the INT8 file at, against the plain FP32 export of the
            same model (``torch.onnx.export`` of the float model); None: the sample's batch. Another batch
            repeats the sample along the batch axis, which must be dynamic. The check runs when the file is
            verified for onnxruntime with ``check_fusion`` (:attr:`ExportResult.speed_check`).
        speed_check: False skips that check (no FP32 export, no timing; ``speed_check`` and ``speedup`` are
            None), for a caller that times the file itself.

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
    opset = _torch_onnx.choose_opset(opset, _model_checks.model_min_opset(model), "dynamo" if dynamo else "legacy")

    bad = find_uncalibrated_quantizers(model)
    if bad:
        raise ExportError(
            f"{len(bad)} enabled quantizer(s) have no amax (not calibrated): {', '.join(bad)}. "
            "Calibrate them first (or load a calibrated state_dict, set a fixed amax in the QuantDescriptor, "
            "or disable them) before exporting.")

    if isinstance(sample_input, PackedSequence) or any(isinstance(a, PackedSequence) for a in
                                                       _torch_onnx.as_tuple(sample_input)):
        raise ExportError("a PackedSequence sample cannot be exported (its batch sizes are data; ONNX has no packed "
                          "sequences): export with the padded tensor, (B, T, F) for batch_first=True, else (T, B, F)")
    args = tuple(a.detach().cpu().float() if isinstance(a, torch.Tensor) and a.is_floating_point() else
                 (a.detach().cpu() if isinstance(a, torch.Tensor) else a) for a in _torch_onnx.as_tuple(sample_input))
    device_type = next((p.device.type for p in model.parameters()), "cpu")

    # --- deep copy: the training model is never touched
    work = copy.deepcopy(model)
    work = work.cpu().float().eval()
    for p in work.parameters():
        p.requires_grad_(False)
    with torch.no_grad(), _model_checks.export_mode(work):
        ref_out = [o.detach().float().numpy() for o in _torch_onnx.flatten_out(work(*args))]
    cases = [(args, ref_out)]  # (inputs, PyTorch outputs) that verification compares onnxruntime with
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    dims = [_torch_onnx.dynamic_dims(a, dynamic_batch, dynamic_spatial, extra)
            for a, extra in zip(tensors, _torch_onnx.extra_dims(dynamic_dims, tensors), strict=True)]
    _check_speed_batch(speed_batch, tensors, dims)
    if any(name != "batch" for dd in dims for name in dd.values()):
        grown = _torch_onnx.grown(args, dims)
        what = "dynamic_spatial=True" if dynamic_spatial else f"dynamic_dims={dynamic_dims}"
        try:
            with torch.no_grad(), _model_checks.export_mode(work):
                cases.append((grown, [o.detach().float().numpy() for o in _torch_onnx.flatten_out(work(*grown))]))
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
    dynamic = _loop_ops.runtime_dynamic_layers(work)
    if dynamic and (target != "onnxruntime" or not dynamo):
        raise ExportError(f"QuantLSTM {', '.join(dynamic)} quantize(s) activations as onnxruntime's "
                          "DynamicQuantizeLSTM (runtime_dynamic), an onnxruntime op written by the current exporter "
                          "only: export with target='onnxruntime' and dynamo=True, or call set_runtime_dynamic(False) "
                          "and calibrate")
    try:
        # a QuantLSTM traces as one placeholder per layer and direction (not one step per time step): the
        # current exporter only (the legacy one has no translation for it and keeps the unrolled steps)
        loops = _loop_ops.loop_mode(work) if dynamo else contextlib.nullcontext(_loop_ops.legacy_notes(work))
        with torch.no_grad(), _model_checks.export_mode(work), loops as loop_notes:
            notes.extend(loop_notes)
            unrolled = list(loop_notes)  # QuantLSTMs written one step per time step: fixed sequence length
            if dynamo:
                proto = _torch_onnx.export_dynamo(work, args, opset, input_names, output_names, dims)
            else:
                proto = _torch_onnx.export_legacy(work, args, opset, input_names, output_names, dims)
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"torch.onnx export ({exporter}) failed: {type(e).__name__}: {_short(e)}") from e

    timed = verify and check_fusion and target == "onnxruntime" and speed_check
    twin = _float_twin.float_twin(proto) if timed else None  # recurrent layers as ONNX LSTM, as in an FP32 export
    proto = _loops.lower_recurrent(proto)  # recurrent placeholders -> Scan (bodies still hold lq placeholders)

    # --- graph rewrites
    infos: list[QuantNodeInfo] = []
    folds: list[FoldRecord] = []
    u8_weights: list[str] = []
    dynamic_lstms: list[str] = []
    lower_opts = _lower.LowerOptions(opset=opset, weight_format=weight_format,
                                     activation_dtype="uint8" if target == "onnxruntime" else "int8",
                                     narrow_clamp=target == "onnxruntime")

    def rewrite(g: Graph) -> None:
        """The Q/DQ passes, in order; every loop body goes through the same ones (:func:`_loops.rewrite_bodies`)."""
        _fold_constants.fold_constants(g)
        _lower.lower_placeholders(g, lower_opts, infos)
        _lower.fold_weight_quantize(g)
        if target == "onnxruntime":  # block-quantized Linear weights -> onnxruntime's MatMulNBits kernel
            notes.extend(_matmul_nbits.write_matmul_nbits(g))
            _placement.dedupe_scalings(g)
        for layer, unsigned in _dynamic_lstm.write_dynamic_lstms(g):
            dynamic_lstms.append(layer)
            if unsigned:
                u8_weights.append(layer)
        if fold_bn:
            folds.extend(_fold_bn.fold_batchnorm(g))
        _finish.split_weight_dq(g)
        _finish.transpose_weight_dq(g)
        if target == "onnxruntime":
            _pool_first.pool_before_activations(g)
            _placement.dedupe_quantizers(g)
            _placement.split_shared_producers(g)
            _placement.hoist_quantizers(g)
            _placement.clips_on_integers(g)
            _float_convs.float_weights_for_float_convs(g)
            _linear_gemm.linears_as_gemm(g)
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
    shapes = _finish.value_shapes(proto)
    g = Graph(proto)
    changed = _placement.global_pools(g, {k: len(v) for k, v in shapes.items()})
    if target == "onnxruntime":
        changed += _mean_first.mean_before_pointwise_convs(g)
        changed += _channel_affine.affines_as_batchnorm(g, shapes)
        changed += _upsample.nearest_upsamples_as_expand(g, shapes)
        changed += _gelu_order.reorder_gelus(g)
    if changed:
        proto = g.finalize()
    layer_of = {n.name: layer_name(n) for n in all_nodes(proto.graph)}
    unfused = _kernel_report.unfused_layers(proto, layer_of) if target == "onnxruntime" else []
    risks = _int16.int16_risks(proto)  # before the metadata goes: it names the layers
    u8_weights = list(dict.fromkeys(u8_weights))  # a layer once, not once per weight (an LSTM has several)
    if u8_weights:
        shown = ", ".join(u8_weights[:6]) + (f" and {len(u8_weights) - 6} more" if len(u8_weights) > 6 else "")
        notes.append(f"{len(u8_weights)} layer(s) with 8-bit weights ({shown}) run on onnxruntime's uint8 x uint8 "
                     "kernels (their int8 x uint8 pair sums could saturate int16 on CPUs without VNNI; the stored values "
                     "are the same): the int8_reduce_range recipe (7-bit weights, used in calibration and QAT too) "
                     "keeps the faster uint8 x int8 kernels on every CPU")
    if dynamic_lstms:
        layers = ", ".join(dict.fromkeys(dynamic_lstms))
        notes.append(f"{len(dynamic_lstms)} LSTM layer-direction(s) ({layers}) run as "
                     "onnxruntime's fused DynamicQuantizeLSTM, which quantizes h at every step from h itself. On one "
                     "intra-op thread it computes what PyTorch does up to float rounding (now and then a rounding tie "
                     "of h falls the other way, and the steps after carry it; verified so); with more threads each "
                     "quantizes its share of the batch with its own scale, which moves results by a few steps of h "
                     "(bench.ordinary's LSTM: logits up to 0.06 apart at 2 threads, 0.013 at one; same predictions)")
    if not keep_metadata:
        _finish.strip_metadata(proto)
    _finish.remove_placeholder_opset(proto)
    proto, opset = _torch_onnx.set_opset(proto, opset, notes)
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
    checks: list[_verify.OutputCheck] = []
    verdict = None
    if verify:
        max_diff, ref_max = 0.0, 0.0
        steps = _verify.output_steps(proto)
        by_output: dict[int, _verify.OutputCheck] = {}
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
                sess = _verify.make_session(data, providers, graph_optimization_level=_verify.verify_level(target),
                                            intra_op_num_threads=1 if dynamic_lstms else None)
                ort_out = _verify.run(sess, feeds)
            except Exception as e:
                _save_unverified(proto, path)
                shape = [tuple(a.shape) for a in inputs if isinstance(a, torch.Tensor)]
                fixed = unrolled if inputs is not args else []  # a grown input failed: say what fixes its size
                raise ExportError(f"onnxruntime could not run the exported model on input shape(s) {shape}: "
                                  f"{_short(e)} (saved as {_unverified(path)} for inspection)"
                                  + (f". The sequence length is fixed in the file: {'; '.join(fixed)}" if fixed
                                     else "")) from e
            bad_ort = _verify.nonfinite_report(ort_out, output_names)
            if bad_ort:
                _save_unverified(proto, path)
                raise VerificationError(f"onnxruntime's output holds NaN/Inf where PyTorch's is finite ({bad_ort}). "
                                        f"The file was saved as {_unverified(path)}; {path} was not written.")
            max_diff = max(max_diff, _verify.max_abs_diff(ort_out, refs))
            ref_max = max([ref_max] + [float(np.abs(r).max()) for r in refs if r.size])
            for i, (out, o, r) in enumerate(zip(proto.graph.output, ort_out, refs)):
                by_output[i] = _verify.compare_output(out.name, o, r, steps[i], by_output.get(i))
        checks = list(by_output.values())
        if atol is None and not rtol:  # judged in output steps (see _verify: FAR_STEPS, FAR_FRACTION, TOP1_FRACTION)
            if _verify.needs_noise(checks):  # beyond the fixed count: is that this model's own rounding noise?
                _measure_rounding_noise(work, cases, checks)
            failed = _verify.step_verdict(checks)
        else:  # the user's bound on max|diff| wins; the step numbers are still reported
            tol = (atol or 0.0) + rtol * ref_max
            failed = "" if max_diff <= tol else (
                f"max abs diff {max_diff:.4g} is more than the tolerance {tol:.4g} "
                f"(atol={atol}, rtol={rtol}, max|output|={ref_max:.4g})")
        verdict = "; ".join(c.text() for c in checks)
        if failed:
            _save_unverified(proto, path)
            raise VerificationError(
                f"onnxruntime's output is not the PyTorch fake-quant output: {failed}.\nMeasured: {verdict}. The "
                f"model was saved as {_unverified(path)}; {path} was not written")
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
        n_chosen = len({k.layer for k in kernels if k.by_choice})  # float by choice: faster, and said so per layer
        if kernels:  # what onnxruntime really runs, not the prediction from the file (it fuses a Gemm/MatMul
            # whose float output an Add or GELU reads: QGemm, MatMulIntegerToFloat)
            unfused = list(dict.fromkeys(f"{k.layer}: {k.reason}" for k in kernels if k.op in _kernel_report.COMPUTE
                                         and not k.integer and not k.by_choice))
        if unfused:
            notes.append(f"onnxruntime runs {len(unfused)} quantized conv/gemm/matmul in float: {'; '.join(unfused)}")
        elif n_float > n_chosen:
            notes.append(f"onnxruntime runs {n_float - n_chosen} conv/gemm/matmul in float (not quantized, or not "
                         "fused by onnxruntime): see its optimized graph")
    speed = None
    if twin is not None:
        loops = sum(n.op_type == "Scan" for n in proto.graph.node)
        feeds = _timing.batch_feeds(tensors, dims, speed_batch)

        def plain():  # the user's float model through torch.onnx.export, as they would export it
            return _fp32_reference.plain_export(work, args, dynamo, opset, input_names, output_names, dims)

        speed = _speed_note(data, plain, twin, feeds, speed_batch or _timing.batch_size(tensors, dims), providers,
                            kernels, loops, notes)
    return ExportResult(
        path=path, opset=opset, exporter=exporter, max_abs_diff=max_diff, tolerance=tol, providers=providers,
        output_checks=checks, verdict=verdict,
        file_size=os.path.getsize(path), quantized=infos, folded_bn=folds, ort_ops=ort_ops,
        qdq_nodes=_count_qdq(proto), input_names=input_names, output_names=output_names, warnings=notes,
        export_seconds=export_seconds, uint8_weights=u8_weights, layer_kernels=kernels,
        speedup=None if speed is None else speed.ratio, speed_check=speed)


def _measure_rounding_noise(work, cases, checks) -> None:
    """Add to ``checks`` how far PyTorch's own output moves under rounding-level noise (see
    :mod:`lq.export.verify._rounding_noise`) on the verification inputs."""
    def run(inputs):
        return lambda m: [o.detach().float().numpy() for o in _torch_onnx.flatten_out(m(*inputs))]

    for seed, (inputs, refs) in enumerate(cases):
        with _model_checks.export_mode(work):
            noisy = _rounding_noise.noisy_outputs(work, run(inputs), seed)
        if noisy is None:
            return
        for c, n, r in zip(checks, noisy, refs):
            if c.step > 0:
                _verify.add_noise(c, n, r)


def _check_speed_batch(speed_batch, tensors, dims) -> None:
    """``speed_batch`` is None or an int >= 1, and a batch other than the sample's has a dynamic batch axis."""
    if speed_batch is None:
        return
    if isinstance(speed_batch, bool) or not isinstance(speed_batch, int) or speed_batch < 1:
        raise ValueError(f"speed_batch={speed_batch!r} is not allowed: expected an int >= 1 (or None: the sample's "
                         "batch)")
    if speed_batch != _timing.batch_size(tensors, dims) and not any("batch" in d.values() for d in dims):
        raise ValueError(f"speed_batch={speed_batch} differs from the sample's batch, but the file has no dynamic "
                         "batch axis to run it on: export with dynamic_batch=True (or name the batch axis in "
                         "dynamic_dims), or leave speed_batch=None")


def _speed_note(int8_model: bytes, plain, twin, feeds, batch, providers, kernels: list[LayerKernel], loops: int,
                notes: list[str]) -> _timing.SpeedCheck | None:
    """Time the INT8 file against ``plain()``, the plain FP32 export of the same model (the twin where that
    export fails, said so in a note), at ``feeds``' batch; below 1x, add a warning in those terms naming the
    float layers (and, when the file has ``loops`` Scan loops, what runs them fused)."""
    reference = _timing.PLAIN
    try:
        fp32 = plain().SerializeToString()
    except Exception as e:  # noqa: BLE001 - any failure of the user's own export: time against the twin instead
        reference = _timing.TWIN
        notes.append(f"the speed check could not export the float model with torch.onnx.export "
                     f"({type(e).__name__}: {_short(e, 300)}), so it times the INT8 file against {_timing.TWIN}, "
                     "which can differ from the FP32 file a user would export")
        fp32 = twin.SerializeToString()
    try:
        check = _timing.compare(int8_model, fp32, feeds, providers, batch=batch, reference=reference)
    except Exception as e:  # diagnostics only: a failure to time never fails the export
        notes.append(f"could not time the INT8 file against {reference}: {_short(e, 300)}")
        return None
    if check.slower:
        floats = [f"{k.layer} ({k.kernel}: {k.reason})" for k in kernels if not k.integer]
        notes.append(
            f"the INT8 file runs at {check.ratio:.2f}x the speed of {reference} in onnxruntime ({check.details()}): "
            + (f"{len(floats)} quantized layer(s) run in float between Q/DQ: " + "; ".join(floats) if floats else
               "every quantized layer runs an integer kernel; the Q/DQ conversions cost more than they save "
               "at this size")
            + (f"; its {loops} recurrent layer(s) run as loops of small ops per time step (the step quantizes "
               "h), the FP32 file's as onnxruntime's fused float LSTM kernel: recurrent='dynamic' (QuantConfig, "
               "or QuantLSTM.set_runtime_dynamic) runs them as onnxruntime's fused DynamicQuantizeLSTM"
               if loops else "")
            + (f". The measurement is noisy: {check.noise}" if check.noisy else ""))
    return check


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
