"""How ``torch.ops.lq.*`` ops enter an ONNX graph.

Both exporters translate every lq op into a placeholder node of the private
domain ``lq.export`` that carries the op's arguments as attributes
(``FakeQuant(x, amax){num_bits, unsigned, narrow_range, x_rank}`` and so on).
:mod:`lq.export.passes._lower` then lowers the placeholders to standard
QuantizeLinear/DequantizeLinear with constant scales, once the whole graph
(and so which inputs are constant weights, what follows each quantizer, the
layer names) is known. No placeholder is left in a saved model.

* current exporter (``dynamo=True``): :func:`translation_table` gives the
  onnxscript functions for ``custom_translation_table``; the ``lq.export``
  schemas are registered with onnx once (:func:`register_schemas`).
* legacy TorchScript exporter: :func:`register_legacy_symbolics` registers
  ``torch.onnx`` symbolic functions for the same ops.
"""

from __future__ import annotations

import threading

import torch

DOMAIN = "lq.export"
VERSION = 1

# op name -> (inputs, int attributes) of its placeholder node
PLACEHOLDERS = {
    "FakeQuant": (("x", "amax"), ("num_bits", "unsigned", "narrow_range", "x_rank")),
    "Quant": (("x", "amax"), ("num_bits", "unsigned", "narrow_range", "x_rank")),
    "ScaledE4M3": (("x", "amax"), ("x_rank",)),
    "DynamicBlockQuant": (("x",), ("axis", "block_size", "num_bits", "unsigned", "narrow_range", "x_rank")),
    "FakeAffineQuant": (("x", "min_range", "max_range"), ("num_bits", "x_rank")),
}

_lock = threading.RLock()
_schemas_done = False
_legacy_done = False
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]


def register_placeholder(name: str, inputs, outputs, attrs, *, optional=(), doc: str) -> None:
    """Register one ``lq.export`` placeholder schema with onnx: float tensors in (``optional`` ones last) and
    out, int attributes. Nothing when it exists already (e.g. from an import under another module name)."""
    import onnx
    from onnx.defs import OpSchema

    with _lock:
        try:
            onnx.defs.get_schema(name, VERSION, DOMAIN)
            return
        except Exception:
            pass
        opt = OpSchema.FormalParameterOption.Optional
        onnx.defs.register_schema(OpSchema(
            name, DOMAIN, VERSION, doc,
            inputs=[OpSchema.FormalParameter(i, "T") for i in inputs]
            + [OpSchema.FormalParameter(i, "T", param_option=opt) for i in optional],
            outputs=[OpSchema.FormalParameter(o, "T") for o in outputs],
            type_constraints=[("T", _FLOATS, "float tensors")],
            attributes=[OpSchema.Attribute(a, OpSchema.AttrType.INT, required=False) for a in attrs],
        ))


def register_schemas() -> None:
    """Register the ``lq.export`` placeholder schemas with onnx (once per process)."""
    global _schemas_done
    with _lock:
        if _schemas_done:
            return
        for name, (inputs, attrs) in PLACEHOLDERS.items():
            register_placeholder(name, inputs, ["y", "scale"] if name == "Quant" else ["y"], attrs,
                                 doc=f"lq placeholder for torch.ops.lq ({name}); lowered to Q/DQ by lq.export")
        _schemas_done = True


def _rank(x) -> int:
    shape = getattr(x, "shape", None)
    try:
        return len(shape) if shape is not None else -1
    except TypeError:
        return -1


def translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``."""
    register_schemas()
    import onnxscript

    lqop = onnxscript.values.Opset(DOMAIN, VERSION)

    def fake_quant(x, amax, num_bits: int, unsigned: bool, narrow_range: bool):
        return lqop.FakeQuant(x, amax, num_bits=int(num_bits), unsigned=int(bool(unsigned)),
                              narrow_range=int(bool(narrow_range)), x_rank=_rank(x))

    def quant(x, amax, num_bits: int, unsigned: bool, narrow_range: bool):
        return lqop.Quant(x, amax, num_bits=int(num_bits), unsigned=int(bool(unsigned)),
                          narrow_range=int(bool(narrow_range)), x_rank=_rank(x), _num_outputs=2)

    def scaled_e4m3(x, amax):
        return lqop.ScaledE4M3(x, amax, x_rank=_rank(x))

    def dynamic_block(x, axis: int, block_size: int, num_bits: int, unsigned: bool, narrow_range: bool):
        return lqop.DynamicBlockQuant(x, axis=int(axis), block_size=int(block_size), num_bits=int(num_bits),
                                      unsigned=int(bool(unsigned)), narrow_range=int(bool(narrow_range)),
                                      x_rank=_rank(x))

    def fake_affine(x, min_range, max_range, num_bits: int):
        return lqop.FakeAffineQuant(x, min_range, max_range, num_bits=int(num_bits), x_rank=_rank(x))

    from onnxscript import opset18 as op

    def amax(x, dim=(), keepdim: bool = False):
        # torch.onnx's aten::amax needs an explicit dim; a dynamic per-tensor amax reduces over everything
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            return op.ReduceMax(x, keepdims=int(bool(keepdim)))
        axes = op.Constant(value_ints=[int(d) for d in (dim if isinstance(dim, (list, tuple)) else [dim])])
        return op.ReduceMax(x, axes, keepdims=int(bool(keepdim)))

    from lq.export.trace import _loop_ops  # the recurrent placeholders (QuantLSTM as one loop)

    ops = torch.ops.lq
    return {
        torch.ops.aten.amax.default: amax,
        ops.fake_quant.default: fake_quant,
        ops.quant.default: quant,
        ops.scaled_e4m3.default: scaled_e4m3,
        ops.fake_dynamic_block_quant.default: dynamic_block,
        ops.fake_affine_quant.default: fake_affine,
        **_loop_ops.translations(),
    }


def register_legacy_symbolics() -> None:
    """Register symbolic functions of the lq ops for the TorchScript exporter (once per process)."""
    global _legacy_done
    with _lock:
        if _legacy_done:
            return
        from torch.onnx import symbolic_helper as sh

        def _xr(x) -> int:
            try:
                d = x.type().dim()
            except Exception:
                d = None
            return -1 if d is None else int(d)

        @sh.parse_args("v", "v", "i", "b", "b")
        def fake_quant(g, x, amax, num_bits, unsigned, narrow_range):
            return g.op(f"{DOMAIN}::FakeQuant", x, amax, num_bits_i=num_bits, unsigned_i=int(unsigned),
                        narrow_range_i=int(narrow_range), x_rank_i=_xr(x)).setType(x.type())

        @sh.parse_args("v", "v", "i", "b", "b")
        def quant(g, x, amax, num_bits, unsigned, narrow_range):
            return g.op(f"{DOMAIN}::Quant", x, amax, num_bits_i=num_bits, unsigned_i=int(unsigned),
                        narrow_range_i=int(narrow_range), x_rank_i=_xr(x), outputs=2)

        @sh.parse_args("v", "v")
        def scaled_e4m3(g, x, amax):
            return g.op(f"{DOMAIN}::ScaledE4M3", x, amax, x_rank_i=_xr(x)).setType(x.type())

        @sh.parse_args("v", "i", "i", "i", "b", "b")
        def dynamic_block(g, x, axis, block_size, num_bits, unsigned, narrow_range):
            return g.op(f"{DOMAIN}::DynamicBlockQuant", x, axis_i=axis, block_size_i=block_size,
                        num_bits_i=num_bits, unsigned_i=int(unsigned), narrow_range_i=int(narrow_range),
                        x_rank_i=_xr(x)).setType(x.type())

        @sh.parse_args("v", "v", "v", "i")
        def fake_affine(g, x, lo, hi, num_bits):
            return g.op(f"{DOMAIN}::FakeAffineQuant", x, lo, hi, num_bits_i=num_bits,
                        x_rank_i=_xr(x)).setType(x.type())

        for name, fn in (("fake_quant", fake_quant), ("quant", quant), ("scaled_e4m3", scaled_e4m3),
                         ("fake_dynamic_block_quant", dynamic_block), ("fake_affine_quant", fake_affine)):
            torch.onnx.register_custom_op_symbolic(f"lq::{name}", fn, 9)
        _legacy_done = True
