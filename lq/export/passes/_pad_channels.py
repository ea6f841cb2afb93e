"""Zero input channels for the small integer convs that onnxruntime would otherwise run on its slow path.

onnxruntime's x86 QLinearConv has a fast "symmetric" kernel for dense convs whose input channels are a multiple
of four (:func:`lq.rules.onnxruntime.ort_padded_input_channels` says which convs, and why). An RGB stem has
three. This pass pads the stem's quantized input with channels holding the input's zero point, and its int8
filter with zero weights for them: every output sums exactly the products it summed before (a zero weight adds
nothing, whatever the code it meets), so the file computes what it computed, and onnxruntime takes the fast
kernel. The pad runs on the uint8 tensor between QuantizeLinear and DequantizeLinear, so ``DQ -> Conv -> Q``
still fuses into QLinearConv.

Only convs onnxruntime fuses: the input a DequantizeLinear's output, the weights int8 with zero zero points
(onnxruntime's condition for the symmetric kernel) and the output read by a QuantizeLinear (directly or through
ReLU/Clip, what its fusion looks for). A conv running in float is left as it is.
"""

from __future__ import annotations

import numpy as np

from lq.export._ir import Graph, attr
from lq.export.passes._float_convs import _path_to_quantize
from lq.rules.onnxruntime import ort_padded_input_channels


def pad_conv_input_channels(g: Graph) -> list[str]:
    """Pad the input channels of the integer convs :func:`ort_padded_input_channels` names; returns their names."""
    prod, cons = g.producers(), g.consumers()
    done = []
    before: dict[int, list] = {}  # id(conv) -> the Pad and DequantizeLinear it now reads
    for n in g.nodes:
        if n.op_type != "Conv" or len(n.input) < 2:
            continue
        x_dq, w_dq = prod.get(n.input[0]), prod.get(n.input[1])
        if x_dq is None or w_dq is None or x_dq.op_type != "DequantizeLinear" or w_dq.op_type != "DequantizeLinear":
            continue
        w = g.const(w_dq.input[0])
        w_zp = g.const(w_dq.input[2]) if len(w_dq.input) > 2 and w_dq.input[2] else None
        if w is None or w.dtype != np.int8 or w.ndim != 4 or attr(w_dq, "axis", 1) != 0 or attr(w_dq, "block_size", 0):
            continue
        if w_zp is not None and np.any(w_zp):
            continue
        x_scale = g.const(x_dq.input[1])
        if x_scale is None or x_scale.size != 1 or len(cons.get(w_dq.output[0], [])) != 1:
            continue
        if not _path_to_quantize(n, g, cons, outputs=False):
            continue
        channels = ort_padded_input_channels(w.shape[1], w.shape[0], attr(n, "group", 1), w.shape[2:])
        if channels is None:
            continue
        x_zp = g.const(x_dq.input[2]) if len(x_dq.input) > 2 and x_dq.input[2] else np.array(0, np.uint8)
        if x_zp is None:
            continue
        extra = channels - w.shape[1]
        padded = np.concatenate([w, np.zeros((w.shape[0], extra) + w.shape[2:], np.int8)], axis=1)
        w_dq.input[0] = g.add_const(f"{w_dq.input[0]}_padded", padded)
        pads = g.add_const(f"channel_pads_for_{n.name}", np.array([0, 0, 0, 0, 0, extra, 0, 0], np.int64))
        zp = g.add_const(f"pad_value_for_{n.name}", x_zp.reshape(()))  # Pad's constant_value is a scalar
        pad = g.make_node("Pad", [x_dq.input[0], pads, zp], hint=f"channel_pad_for_{n.name}", mode="constant", like=n)
        dq = g.make_node("DequantizeLinear", [pad.output[0], *x_dq.input[1:]], hint=f"padded_dq_for_{n.name}", like=x_dq)
        n.input[0] = dq.output[0]
        before[id(n)] = [pad, dq]
        done.append(n.name)
    if before:
        g.nodes = [m for n in g.nodes for m in (*before.get(id(n), ()), n)]
    return done
