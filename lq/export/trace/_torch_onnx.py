"""Running ``torch.onnx.export``: sample inputs and outputs, dynamic axes, the opset, and both exporters.

The current exporter (``dynamo=True``, with lq's translation table) and the legacy TorchScript one
(``dynamo=False``, with lq's symbolics) give the same lq placeholders; everything after them is
:mod:`lq.export._export`'s pipeline.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any, Mapping

import onnx
import torch

from lq.export.trace import _symbolic
from lq.export._ir import all_nodes

MIN_OPSET, MAX_OPSET = 13, 23
#: the opset each exporter writes itself (torch.onnx's current exporter has no translations below 18): the
#: default, so that a user who asked for no opset gets no version conversion and no warning about one
NATIVE_OPSET = {"dynamo": 18, "legacy": 17}


def as_tuple(sample) -> tuple:
    if isinstance(sample, torch.Tensor):
        return (sample,)
    if isinstance(sample, (tuple, list)):
        return tuple(sample)
    raise TypeError(f"sample_input must be a torch.Tensor or a tuple of tensors, got {type(sample).__name__}")


def flatten_out(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        res = []
        for o in out:
            res.extend(flatten_out(o))
        return res
    if isinstance(out, dict):
        res = []
        for o in out.values():
            res.extend(flatten_out(o))
        return res
    raise TypeError(f"model output of type {type(out).__name__} is not supported (tensors, tuples, dicts)")


def grown(args: tuple, dims: list[dict[int, str]]) -> tuple:
    """The sample at twice its size along its dynamic axes other than the batch (each concatenated with itself):
    a second shape that a model with dynamic H and W, or a dynamic sequence length, must run on, with the same
    value distribution. ``dims``: :func:`dynamic_dims` of each tensor input (axes of one name grow together)."""
    out, k = [], 0
    for a in args:
        if isinstance(a, torch.Tensor):
            for d, name in sorted(dims[k].items()):
                if name != "batch":
                    a = torch.cat([a, a], dim=d)
            k += 1
        out.append(a)
    return tuple(out)


def extra_dims(dynamic_dims, tensors: list) -> list[dict[int, str]]:
    """``dynamic_dims`` as ``{axis: name}`` per tensor input: a sequence of axes applies to every input that has
    them (named ``dim<axis>``), a sequence of one mapping per input is taken as given."""
    spec = list(dynamic_dims.values()) if isinstance(dynamic_dims, Mapping) else list(dynamic_dims)
    if spec and all(isinstance(d, Mapping) for d in spec):
        if isinstance(dynamic_dims, Mapping) or len(spec) != len(tensors):
            raise ValueError(f"dynamic_dims: give one {{axis: name}} mapping per tensor input, in order "
                             f"({len(tensors)} input(s)), got {dynamic_dims!r}")
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


def choose_opset(opset, min_opset: int, exporter: str) -> int:
    """``opset`` as given, or (None) the exporter's own opset raised to what the model's quantizers need
    (:func:`lq.export.prepare._model_checks.model_min_opset`)."""
    if opset is None:
        return max(NATIVE_OPSET[exporter], min_opset)
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset={opset!r} is not allowed: expected an int in [{MIN_OPSET}, {MAX_OPSET}] "
                         "(>= 13 for per-channel axis, >= 19 for FP8, >= 21 for blocked Q/DQ)")
    return opset


def dynamic_dims(a, dynamic_batch: bool, dynamic_spatial: bool, extra: Mapping[int, str] | None = None
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


def export_dynamo(model, args, opset, input_names, output_names, dims) -> onnx.ModelProto:
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
    return prog.model_proto


def export_legacy(model, args, opset, input_names, output_names, dims) -> onnx.ModelProto:
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


def set_opset(model: onnx.ModelProto, opset: int, notes: list[str]) -> tuple[onnx.ModelProto, int]:
    """Convert to ``opset`` when the exporter produced another one (the current exporter emits >= 18)."""
    cur = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), opset)
    if cur == opset:
        return model, opset
    from onnx import version_converter

    try:
        converted = version_converter.convert_version(model, opset)
        if opset < 18:
            _drop_default_noop_with_empty_axes(converted.graph)
        onnx.checker.check_model(converted)
        return converted, opset
    except Exception as e:
        notes.append(f"the exported graph has opset {cur}: conversion to the requested opset {opset} failed "
                     f"({type(e).__name__}); the current torch.onnx exporter emits opset >= 18, use "
                     f"dynamo=False for an older opset")
        return model, cur


def _drop_default_noop_with_empty_axes(graph: onnx.GraphProto) -> None:
    """onnx's version converter takes a Reduce* op (other than ReduceSum) from opset 18 down with its
    ``noop_with_empty_axes`` attribute, which those ops only have from 18 on, and the checker then rejects the
    file (a plain ``x.mean((2, 3))`` does it). At its default 0 the attribute says nothing: drop it."""
    for n in all_nodes(graph):
        if n.op_type.startswith("Reduce") and n.op_type != "ReduceSum":
            keep = [a for a in n.attribute if not (a.name == "noop_with_empty_axes" and a.i == 0)]
            if len(keep) != len(n.attribute):
                del n.attribute[:]
                n.attribute.extend(keep)
