"""Running ``torch.onnx.export``: sample inputs and outputs, dynamic axes, the opset, and both exporters.

The current exporter (``dynamo=True``, with lq's translation table) and the legacy TorchScript one
(``dynamo=False``, with lq's symbolics) give the same lq placeholders; everything after them is
:mod:`lq.export._export`'s pipeline.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import threading
import warnings
from typing import Any

import onnx
import torch

from lq.export.trace import _optimize, _symbolic
from lq.export._ir import all_nodes

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
        core = _core_export()
        if core is not None:
            export, shapes_for = core
            shapes, rename = shapes_for(kw.get("dynamic_shapes"))
            prog = export(model, args, registry=_registry(max(opset, 18), table), dynamic_shapes=shapes,
                          input_names=input_names, output_names=output_names, optimize=False, verbose=False,
                          opset_version=max(opset, 18))
            if rename and shapes is not None:  # the axes named as the user named them, as torch.onnx.export does
                prog._rename_dynamic_axes(kw["dynamic_shapes"])
        else:
            prog = torch.onnx.export(model, args, dynamo=True, opset_version=max(opset, 18),
                                     custom_translation_table=table, input_names=input_names,
                                     output_names=output_names, optimize=False, verbose=False, **kw)
        _optimize.optimize(prog)  # the exporter's clean-up without its rewrite that grows with the graph's square
    return prog.model_proto


_REGISTRIES: dict = {}
_REGISTRY_LOCK = threading.Lock()
_NEEDS = {"registry", "dynamic_shapes", "input_names", "output_names", "optimize", "opset_version", "verbose"}


@functools.cache
def _core_export():
    """torch.onnx's exporter below ``torch.onnx.export(dynamo=True)`` (and how that call names dynamic axes),
    which takes a registry of translations: ``torch.onnx.export`` builds that registry from onnxscript's torchlib
    on every call (0.34 s of a small model's 1.15 s export on a Xeon), so lq builds it once per opset (:func:`_registry`). None where this torch has no such
    function with those arguments: then ``torch.onnx.export`` itself is called, as before."""
    try:
        import inspect

        from torch.onnx._internal.exporter import _core, _dynamic_shapes, _onnx_program
    except ImportError:
        return None
    fn = getattr(_core, "export", None)
    shapes = getattr(_dynamic_shapes, "convert_str_to_export_dim", None)
    try:
        ok = (fn is not None and shapes is not None and _NEEDS <= set(inspect.signature(fn).parameters)
              and hasattr(_onnx_program.ONNXProgram, "_rename_dynamic_axes"))
    except (TypeError, ValueError):
        ok = False
    return (fn, shapes) if ok else None


def _registry(opset: int, table: dict):
    """onnxscript's translations for ``opset`` with lq's placeholders registered (what ``torch.onnx.export``
    builds per call from ``custom_translation_table``), built once per opset and process."""
    with _REGISTRY_LOCK:
        reg = _REGISTRIES.get(opset)
        if reg is None:
            from torch.onnx._internal.exporter import _constants, _registration

            reg = _registration.ONNXRegistry.from_torchlib(opset_version=max(opset, _constants.TORCHLIB_OPSET))
            for op, fn in table.items():
                reg.register_op(op, fn, is_complex=False)
            _REGISTRIES[opset] = reg
        return reg


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
