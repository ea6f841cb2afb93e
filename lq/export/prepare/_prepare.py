"""Stage 1: check the model and the sample, and make the copy that every later stage works on.

The user's model is never touched: the export runs on a deep copy in eval mode, on the CPU, in float32. Here too
the PyTorch outputs that verification compares onnxruntime with are computed (on the sample, and on a sample
grown along every dynamic axis not named "batch"), and the graph's input/output names and dynamic axes decided.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from lq.config import ExportConfig
from lq.calib import _stamp
from lq.export._files import short
from lq.export._ir import ExportError
from lq.export.prepare import _model_checks
from lq.export.prepare import _inputs
from lq.nn.modules import _bias_shift


@dataclasses.dataclass
class Prepared:
    """The model copy and what the later stages need to know about the sample."""

    work: torch.nn.Module  # eval-mode CPU float32 deep copy, parameters frozen
    args: tuple  # the sample as the copy takes it
    cases: list  # (inputs, PyTorch outputs as numpy) that verification compares onnxruntime with
    tensors: list  # the sample's tensor inputs (graph inputs)
    dims: list  # per tensor input, {axis: name} of its dynamic axes
    input_names: list
    output_names: list
    opset: int
    device_type: str  # where the user's model lives ("cuda": verification uses onnxruntime's CUDA provider)
    #: calibrated and not trained since (lq.calib._stamp): with its quantizers off it is the user's own model
    calibrated_as_is: bool = False
    #: ``{layer path: its bias before bias correction's shift was folded in}`` (:func:`_bias_shift.fold_into_bias`)
    folded_biases: dict = dataclasses.field(default_factory=dict)


def prepare(model, sample_input, cfg: ExportConfig) -> Prepared:
    """Refuse what cannot be exported (in one or two lines: what was wrong, what is allowed), copy the model,
    run it on the sample."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    opset = _inputs.choose_opset(cfg.opset, _model_checks.model_min_opset(model), cfg.exporter)
    bad = _model_checks.find_uncalibrated_quantizers(model)
    if bad:
        raise ExportError(
            f"{len(bad)} enabled quantizer(s) have no amax (not calibrated): {', '.join(bad)}. "
            "Calibrate them first (or load a calibrated state_dict, set a fixed amax in the QuantDescriptor, "
            "or disable them) before exporting.")
    if isinstance(sample_input, PackedSequence) or any(isinstance(a, PackedSequence) for a in
                                                       _inputs.as_tuple(sample_input)):
        raise ExportError("a PackedSequence sample cannot be exported (its batch sizes are data; ONNX has no packed "
                          "sequences): export with the padded tensor, (B, T, F) for batch_first=True, else (T, B, F)")
    args = tuple(a.detach().cpu().float() if isinstance(a, torch.Tensor) and a.is_floating_point() else
                 (a.detach().cpu() if isinstance(a, torch.Tensor) else a) for a in _inputs.as_tuple(sample_input))
    device_type = next((p.device.type for p in model.parameters()), "cpu")

    work = copy.deepcopy(model).cpu().float().eval()
    folded = _bias_shift.fold_into_bias(work)  # bias correction's shifts into the biases: the graph keeps its bias
    # initializers
    for p in work.parameters():
        p.requires_grad_(False)
    ref_out = outputs(work, args)
    cases = [(args, ref_out)]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    dims = [_inputs.dynamic_dims(a, cfg.dynamic_batch, cfg.dynamic_spatial, extra)
            for a, extra in zip(tensors, _inputs.extra_dims(cfg.dynamic_dims, tensors), strict=True)]
    _check_speed_batch(cfg.speed_batch, tensors, dims)
    if any(name != "batch" for dd in dims for name in dd.values()):
        grown = _inputs.grown(args, dims)
        what = "dynamic_spatial=True" if cfg.dynamic_spatial else f"dynamic_dims={cfg.dynamic_dims}"
        try:
            cases.append((grown, outputs(work, grown)))
        except Exception as e:
            raise ExportError(
                f"{what}, but the model does not run on an input twice the sample's size along those axes "
                f"({type(e).__name__}: {short(e, 300)}): it fixes its spatial size (e.g. flatten -> Linear) or its "
                f"length; export with {'dynamic_spatial=False' if cfg.dynamic_spatial else 'dynamic_dims=()'}"
            ) from e
    n_in = len(tensors)
    input_names = list(cfg.input_names) if cfg.input_names else (
        ["input"] if n_in == 1 else [f"input_{i}" for i in range(n_in)])
    output_names = list(cfg.output_names) if cfg.output_names else (
        ["output"] if len(ref_out) == 1 else [f"output_{i}" for i in range(len(ref_out))])

    return Prepared(work=work, args=args, cases=cases, tensors=tensors, dims=dims, input_names=input_names,
                    output_names=output_names, opset=opset, device_type=device_type,
                    calibrated_as_is=_stamp.untouched(model), folded_biases=folded)


def outputs(work: torch.nn.Module, inputs: tuple) -> list[np.ndarray]:
    """The model's outputs on ``inputs`` as the export sees them (export mode, no grad), flattened, as numpy."""
    with torch.no_grad(), _model_checks.export_mode(work):
        return [o.detach().float().numpy() for o in _inputs.flatten_out(work(*inputs))]


def batch_size(tensors: Sequence, dims: Sequence[dict]) -> int | None:
    """The sample's batch: the size of the first axis named "batch" (``dims`` as ``_inputs.dynamic_dims``),
    else dim 0 of the first input; None without a tensor input."""
    for a, d in zip(tensors, dims):
        for ax, name in d.items():
            if name == "batch":
                return int(a.shape[ax])
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() else None


def _check_speed_batch(speed_batch, tensors, dims) -> None:
    """A speed batch other than the sample's needs a dynamic batch axis to run on."""
    if speed_batch is None:
        return
    if speed_batch != batch_size(tensors, dims) and not any("batch" in d.values() for d in dims):
        raise ValueError(f"speed_batch={speed_batch} differs from the sample's batch, but the file has no dynamic "
                         "batch axis to run it on: export with dynamic_batch=True (or name the batch axis in "
                         "dynamic_dims), or leave speed_batch=None")
