"""Per-runtime Q/DQ rules: one table per runtime (:mod:`lq.rules.onnxruntime`, :mod:`lq.rules.tensorrt`,
:mod:`lq.rules.openvino`), one
entry per operator family, read by the placement on both sides (``lq.glue`` in the PyTorch model, the rewrite
passes of ``lq.export`` in the graph). Below both: neither the modules nor the exporter own it.

An entry (:class:`OpRule`) says, for a family of ONNX ops:

* ``commutes``: ``fq(op(fq(x))) == fq(op(x))`` *exactly* for any per-tensor quantizer ``fq`` whose grid
  contains 0, so a quantizer that reads the op's output may be copied (hoisted) to its input, the one after the
  op staying. A fact about the op, not the runtime: :data:`COMMUTING_OPS` holds it once. True for ops that map
  grid values to grid values and keep order (ReLU, MaxPool, pure data movement, nearest Resize), and for Clip to
  any constant bounds: a rounding that keeps order distributes over ``min`` and ``max``
  (``fq(min(a, c)) == min(fq(a), fq(c))``). PReLU, LeakyReLU, GELU, SiLU, Hardswish, Sigmoid and averaging are
  not: moving a quantizer across them changes the result.
* ``produces``: the op computes a new value that a quantizer right after it turns into the output of a fused
  integer kernel (``DQ -> op -> Q``). A quantizer hoisted through commuting ops stops here.
* ``kernels``: the integer kernels the runtime runs for ``DQ -> op -> Q`` (onnxruntime: op types of its
  optimized graph, checked by tests/test_rules.py); empty when the op runs on the integers as it is (data
  movement, ReLU fused into its producer) or in float between Q/DQ pairs.

Adding an operator is adding an entry to a runtime's table and its example to tests/test_rules.py.
"""

from __future__ import annotations

import dataclasses

#: ops across which a per-tensor quantizer moves exactly (see the module docstring); Resize only with
#: ``mode="nearest"`` (it picks existing values; linear/cubic interpolation does not commute)
COMMUTING_OPS = frozenset({"Relu", "Clip", "MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze",
                           "Identity", "Resize"})


@dataclasses.dataclass(frozen=True)
class OpRule:
    family: str
    ops: tuple[str, ...]
    produces: bool = False
    kernels: tuple[str, ...] = ()
    note: str = ""

    @property
    def commutes(self) -> bool:
        return all(op in COMMUTING_OPS for op in self.ops)


_UNLISTED = OpRule("unlisted", ())


def table(runtime: str = "onnxruntime") -> tuple[OpRule, ...]:
    """The runtime's entries, one per operator family."""
    from lq.rules import onnxruntime, openvino, tensorrt

    tables = {"onnxruntime": onnxruntime.RULES, "tensorrt": tensorrt.RULES, "openvino": openvino.RULES}
    if runtime not in tables:
        raise ValueError(f"runtime={runtime!r} is not allowed: one of {sorted(tables)}")
    return tables[runtime]


def rule(op_type: str, runtime: str = "onnxruntime") -> OpRule:
    """The entry of the family ``op_type`` belongs to (an unlisted op neither commutes nor produces)."""
    return next((r for r in table(runtime) if op_type in r.ops), _UNLISTED)


def commutes(op_type: str, node=None) -> bool:
    """Whether a quantizer may move across the op; ``node`` (the ONNX node) for ops whose attributes decide it
    (Resize: only ``mode="nearest"``)."""
    if op_type == "Resize" and op_type in COMMUTING_OPS:
        if node is None:
            return False
        mode = next((a.s for a in node.attribute if a.name == "mode"), b"nearest")
        return mode in (b"nearest", "nearest")
    return op_type in COMMUTING_OPS


def produces(op_type: str, runtime: str = "onnxruntime") -> bool:
    return rule(op_type, runtime).produces
