"""Max pooling moved in front of a PReLU / LeakyReLU whose slopes are all >= 0, or a BatchNorm whose scales are.

``MaxPool(act(x)) == act(MaxPool(x))`` for any ``act`` that is non-decreasing and applied channel by channel:
the largest input of a window gives the largest output. PReLU and LeakyReLU are non-decreasing exactly when
their slopes are >= 0, and stay so in float (``a * x`` rounded to nearest never reverses an order for
``a >= 0``), so the swap is exact; with a negative slope it is not, and the pool stays where it is. An inference
BatchNorm is ``a * x + b`` per channel with ``a = gamma / sqrt(var + eps)``: the same holds when every ``a >= 0``
(adding ``b`` and rounding keep the order too). Per-tensor
QuantizeLinear/DequantizeLinear between the two (an input quantizer of the pool or of the next layer), and the
integer ``Max`` that keeps a narrow-range quantizer off -128, are non-decreasing too and move with the activation.

Why: the activation then runs on the pooled tensor, a quarter of the values behind a 2x2 pool, and the pool
reads the float output of the conv before it (onnxruntime's blocked float pool) instead of int8 values in
NCHW layout. In the P-Net of ``bench.ordinary`` the PReLU before its pool was the largest op of both the FP32
and the INT8 file (1.2 of 2.8 ms at batch 32). A conv -> ReLU -> BatchNorm -> MaxPool block (CREPE's) has the
conv's quantized output before the BatchNorm: the pool then runs on those integers in onnxruntime's NHWC uint8
kernel, where behind the BatchNorm it ran its NCHW uint8 pool on the requantized BatchNorm output (bench.library's
CREPE-style net, batch 32: 3.38 -> 1.22 ms, the first pool 1.69 -> 0.03 ms). Only where the op is the pool's
only reader.
"""

from __future__ import annotations

import numpy as np

from lq.export._ir import Graph, attr
from lq.export.passes._placement import same_q

_ACTIVATIONS = ("PRelu", "LeakyRelu", "BatchNormalization")


def pool_before_activations(g: Graph) -> int:
    """Move every eligible MaxPool above its activation chain; returns how many moved."""
    moved = 0
    for pool in [n for n in g.nodes if n.op_type == "MaxPool"]:
        if len(pool.output) > 1 and pool.output[1]:
            continue  # its indices are read
        chain = _monotone_chain(g, pool)
        if not chain or _makes_double_pair(g, pool, chain):
            continue
        top = chain[-1]  # the activation furthest up; the pool now reads its input
        pooled = g.fresh(f"{pool.output[0]}_before_{top.op_type.lower()}")
        pool.input[0], top.input[0] = top.input[0], pooled
        pool.output[0], out = pooled, pool.output[0]
        chain[0].output[0] = out  # the op that wrote the pool's input (read by the pool alone) writes its output
        g.nodes.remove(pool)
        g.nodes.insert(g.nodes.index(top), pool)
        moved += 1
    return moved


def _makes_double_pair(g: Graph, pool, chain: list) -> bool:
    """True when the move would leave the chain's last DequantizeLinear right before a QuantizeLinear on another
    grid (the pool's quantizer, then the next layer's: asymmetric ranges, or calibrations other than max, differ
    after a pool). onnxruntime merges such a Q -> DQ -> Q -> DQ into one pair (DoubleQDQPairsRemover), which
    rounds once where PyTorch rounds twice; with the pool between them both round, so the pool stays."""
    if chain[0].op_type != "DequantizeLinear":
        return False
    dq = chain[0]
    for q in g.consumers().get(pool.output[0], []):
        if q.op_type == "QuantizeLinear" and not same_q(g, dq, q):
            return True
    return False


def _monotone_chain(g: Graph, pool) -> list:
    """The ops from the pool's input upwards (nearest first) that the pool may move above, ending with a
    PReLU/LeakyReLU; empty when there is none. Each op is elementwise, non-decreasing per channel and read
    by the next one only."""
    prod, cons = g.producers(), g.consumers()
    chain, cur = [], pool.input[0]
    while True:
        n = prod.get(cur)
        if n is None or len(cons.get(cur, [])) != 1 or cur in g.graph_outputs or not _non_decreasing(g, n):
            break
        chain.append(n)
        cur = n.input[0]
    while chain and chain[-1].op_type not in _ACTIVATIONS:
        chain.pop()  # a quantizer above the top activation stays with the op that writes it
    return chain


def _non_decreasing(g: Graph, n) -> bool:
    if n.op_type == "LeakyRelu":
        return attr(n, "alpha", 0.01) >= 0
    if n.op_type == "PRelu":
        slope = g.const(n.input[1])
        if slope is None or not np.all(slope >= 0):
            return False
        # per channel at most: (C, 1, 1) against NCHW, so the pooled tensor broadcasts against it the same way
        return slope.size == 1 or (slope.ndim >= 3 and all(d == 1 for d in slope.shape[-2:]))
    if n.op_type == "BatchNormalization":  # inference form only: x * a + b per channel, a = scale / sqrt(var + eps)
        scale, var = g.const(n.input[1]), g.const(n.input[4]) if len(n.input) > 4 else None
        if scale is None or var is None or attr(n, "training_mode", 0) or len(n.output) > 1:
            return False
        return bool(np.all(scale / np.sqrt(var + attr(n, "epsilon", 1e-5)) >= 0))
    if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
        scale = g.const(n.input[1])
        return scale is not None and scale.size == 1 and float(scale.reshape(())) > 0
    if n.op_type in ("Max", "Min") and len(n.input) == 2:  # a narrow-range clamp of the integers: max(q, -127)
        bound = g.const(n.input[1])
        return bound is not None and bound.size == 1
    return False
