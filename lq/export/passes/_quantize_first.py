"""For OpenVINO: a per-tensor Q/DQ pair after an op that keeps the grid moves in front of it, so the quantizer sits
on the producer's output and the op runs on the integers.

OpenVINO fuses a FakeQuantize into the conv (or PReLU) that writes its input only when nothing else reads that
output; a FakeQuantize that reads a float Reshape, MaxPool or Concat ran as a layer of its own, with the op before
it in float. NNCF's files quantize at the producer. The moves, each exact for a grid of one scale and zero point:

* ``Reshape``/``Flatten``/``Transpose``/``Squeeze``/``Unsqueeze``/nearest ``Resize`` -> Q -> DQ becomes
  Q -> DQ -> op: the op only moves (or repeats) elements, and a per-tensor quantizer rounds each on its own.
  A model's first Linear reading ``x.flatten(1)``: the O-Net of ``bench.openvino`` went from 0.564 to 0.547 ms at
  batch 8 (NNCF's file: 0.548 ms), the same output bit for bit.
* ``Concat`` -> Q -> DQ becomes a Q/DQ pair on every input, the Concat reading the dequantized values: the
  concatenation of values on one grid is on that grid. (OpenVINO splits such a FakeQuantize itself; in the file
  the split lets a member's pair meet the other pairs of the same tensor.)
* ``MaxPool`` -> Q -> DQ becomes Q -> DQ -> MaxPool where every other reader of the pool's input quantizes it on
  the same grid (a U-Net's skip tensor, pooled into the next stage and concatenated for the decoder, its readers
  tied by :mod:`lq.glue._tensor_ties`): a rounding that keeps order commutes with ``max``. The pairs of the
  tensor are then one (:func:`lq.export.passes._placement.dedupe_quantizers`), which OpenVINO fuses into the
  conv that writes it. Elsewhere the pool stays first: a FakeQuantize of its own runs faster after the pool,
  on a quarter of the values.

A move is made only where the Q's output is read by one DequantizeLinear and the op's output by that Q alone.
"""

from __future__ import annotations

import numpy as np

from lq.export._ir import Graph
from lq.export.passes._placement import same_q
from lq.rules import commutes

#: ops whose (first) input a per-tensor pair moves in front of unconditionally: data movement, nearest upsampling
_MOVES = ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Resize")


def quantizers_first(g: Graph) -> int:
    """Move every eligible Q/DQ pair in front of the op it reads (sweeps until none moves); returns how many."""
    moved = 0
    for _ in range(64):  # a chain of k such ops needs k sweeps
        done = _sweep(g)
        moved += done
        if not done:
            return moved
    return moved


def _sweep(g: Graph) -> int:
    prod, cons = g.producers(), g.consumers()
    touched: set[str] = set()
    moved = 0
    for q in [n for n in g.nodes if n.op_type == "QuantizeLinear"]:
        op = prod.get(q.input[0])
        dq = _pair(g, q, cons)
        if op is None or dq is None or len(cons.get(op.output[0], [])) != 1 or op.output[0] in g.graph_outputs:
            continue
        if {op.output[0], *op.input} & touched:
            continue
        if op.op_type == "Concat":
            _split(g, q, dq, op)
        elif op.op_type == "MaxPool" and len(op.output) == 1 and _quantized_elsewhere(g, q, op, cons):
            _move(q, dq, op, g)
        elif op.op_type in _MOVES and commutes(op.op_type, op):
            _move(q, dq, op, g)
        else:
            continue
        touched |= {op.output[0], *op.input}
        moved += 1
    # the node order is restored by Graph.finalize (a topological sort)
    return moved


def _pair(g: Graph, q, cons):
    """The DequantizeLinear that alone reads ``q``, where ``q`` quantizes per tensor; else None."""
    scale = g.const(q.input[1])
    readers = cons.get(q.output[0], [])
    if scale is None or np.asarray(scale).size != 1 or len(readers) != 1 or q.output[0] in g.graph_outputs:
        return None
    return readers[0] if readers[0].op_type == "DequantizeLinear" else None


def _quantized_elsewhere(g: Graph, q, op, cons) -> bool:
    """Every reader of ``op``'s input but ``op`` is a QuantizeLinear on ``q``'s grid (and there is one at least)."""
    others = [c for c in cons.get(op.input[0], []) if c is not op]
    return bool(others) and all(c.op_type == "QuantizeLinear" and same_q(g, q, c) for c in others)


def _move(q, dq, op, g: Graph) -> None:
    """``x -> op -> Q -> DQ -> readers`` becomes ``x -> Q -> DQ -> op -> readers``."""
    out = dq.output[0]  # what the readers read: the op writes it now
    q.input[0] = op.input[0]
    dq.output[0] = g.fresh(f"{out}_before_{op.op_type.lower()}")
    op.input[0] = dq.output[0]
    op.output[0] = out


def _split(g: Graph, q, dq, cat) -> None:
    """``Concat(a, b) -> Q -> DQ -> readers`` becomes ``Concat(DQ(Q(a)), DQ(Q(b))) -> readers``."""
    for i, x in enumerate(cat.input):
        qi = g.make_node("QuantizeLinear", [x, *q.input[1:]], hint=f"{q.name}_{i}", like=q)
        dqi = g.make_node("DequantizeLinear", [qi.output[0], *dq.input[1:]], hint=f"{dq.name}_{i}", like=dq)
        for a in q.attribute:
            qi.attribute.add().CopyFrom(a)
        for a in dq.attribute:
            dqi.attribute.add().CopyFrom(a)
        g.nodes += [qi, dqi]
        cat.input[i] = dqi.output[0]
    cat.output[0] = dq.output[0]
    g.nodes = [n for n in g.nodes if n is not q and n is not dq]
