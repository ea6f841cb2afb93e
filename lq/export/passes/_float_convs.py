"""Convs that onnxruntime runs in float get their dequantized weights as float initializers.

Two kinds. onnxruntime fuses ``DQ(x), DQ(w) -> Conv -> Q`` into ``QLinearConv`` whenever it can, but for a
depthwise conv or a stem with 1-3 input channels its integer kernel is slower than its float one
(:data:`lq.rules.onnxruntime.ORT_INT8_CONV_MIN_CHANNELS_PER_GROUP`): float by choice. And a conv that no
quantizer reads (a PReLU or a mean reads it) runs in float whatever its weights are; with ``DQ(w)`` as
its weight, onnxruntime cannot re-lay the weights for its blocked NCHWc float conv and dequantizes them on
every run (the P-Net of ``bench.ordinary``, 3x3 convs: 2.52 -> 2.07 ms at batch 32; not for a 1x1 conv,
which runs as one GEMM either way: the U-Net's 1x1 head went 5.85 -> 6.10 ms, the reorders into and out of
NCHWc around it costing more than they saved). Replacing the weight's
DequantizeLinear by a float initializer holding exactly what it computes (``(q - zero_point) * scale`` in
float32) leaves the numbers unchanged. The input quantizer stays (it is part of the model), the bias stays
float (no int32 rounding is needed).

Only where a float op reads the conv's output (lq.glue gives by-choice convs no output quantizer), or where
its input is not quantized (a stem under the onnxruntime recipe). Where a dequantized input's conv output
reaches a QuantizeLinear through nothing but ReLU/Clip, onnxruntime's ``WeightBiasQuantization`` would
re-quantize float weights per tensor to fuse the conv anyway (changing the numbers), so those convs keep their
integer weights and run as QLinearConv; a conv writing a model output keeps them too.
"""

from __future__ import annotations

import numpy as np

from lq.export.passes._weight_layout import dequantize
from lq.export._ir import Graph, attr
from lq.rules.onnxruntime import ort_prefers_float_conv

#: marks the float weights of a conv left float by choice in the exported file (the kernel report names the reason)
FLOAT_BY_CHOICE = "float_by_choice"
#: marks the float (dequantized) weights of a conv that onnxruntime runs in float anyway, because no quantizer
#: reads its output (a PReLU or a mean reads it): float initializers let it use its blocked (NCHWc) float conv
FLOAT_WEIGHTS = "dequantized_float"
FLOAT_MARKERS = (FLOAT_BY_CHOICE, FLOAT_WEIGHTS)


def float_weights_for_float_convs(g: Graph) -> list[str]:
    """Give float weights to every Conv that runs in float: fewer than 4 input channels per group, or a kernel
    larger than 1x1, with no QuantizeLinear after it; returns the Conv names."""
    prod, cons = g.producers(), g.consumers()
    done, dropped = [], set()
    for n in g.nodes:
        if n.op_type != "Conv" or len(n.input) < 2:
            continue
        dq = prod.get(n.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or attr(dq, "block_size", 0):
            continue
        q, scale = g.const(dq.input[0]), g.const(dq.input[1])
        zp = g.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        if q is None or scale is None or q.ndim < 3 or q.dtype not in (np.int8, np.uint8):
            continue
        if _path_to_quantize(n, g, cons) and _reads_dequantized(n, prod):
            continue
        marker = FLOAT_BY_CHOICE if ort_prefers_float_conv(q.shape[1], q.shape[2:]) else FLOAT_WEIGHTS
        if marker == FLOAT_WEIGHTS and all(k == 1 for k in q.shape[2:]):
            continue  # a 1x1 conv is one GEMM either way; the NCHWc layout would only add reorders around it
        w = dequantize(q, scale, zp, attr(dq, "axis", 1))  # what the DequantizeLinear computes
        n.input[1] = g.add_const(f"{n.input[1]}_{marker}", w)
        if not [u for u in cons.get(dq.output[0], []) if u is not n]:
            dropped.add(id(dq))
        done.append(n.name)
    g.nodes = [n for n in g.nodes if id(n) not in dropped]
    return done


def _reads_dequantized(n, prod: dict) -> bool:
    """``n``'s input is a DequantizeLinear's output: onnxruntime may fuse it with a QuantizeLinear after it. A stem
    whose input quantizer the recipe turned off (:func:`lq.glue._outputs.float_stem`) reads the float model input:
    with float weights it runs onnxruntime's float conv, its ReLU fused, and the Q after it alone."""
    p = prod.get(n.input[0])
    return p is not None and p.op_type == "DequantizeLinear"


def _path_to_quantize(n, g: Graph, cons: dict, outputs: bool = True) -> bool:
    """``n``'s output reaches a QuantizeLinear through single-reader ReLU/Clip links only (what onnxruntime's
    WeightBiasQuantization and its QDQ conv fusion look for), or (``outputs``) is a model output."""
    cur = n
    while True:
        if cur.output[0] in g.graph_outputs:
            return outputs
        users = cons.get(cur.output[0], [])
        if len(users) != 1:
            return False
        if users[0].op_type == "QuantizeLinear":
            return True
        if users[0].op_type not in ("Relu", "Clip"):
            return False
        cur = users[0]
