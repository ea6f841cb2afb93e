"""A spatial mean moved in front of the 1x1 conv whose output it averages.

A 1x1 conv with stride 1 and no padding is the same linear map ``y = W x + b`` at every pixel, so the mean over
all pixels of its output is the map applied to the mean of its input: ``mean(W x + b) == W mean(x) + b``. The
heads of fully convolutional classifiers end that way (``self.head(features).mean((2, 3))``: the U-Net and the
P-Net of ``bench.ordinary``); written in that order the conv runs over the whole feature map, and as no
quantizer reads its output, onnxruntime runs it as a float conv there (the kernel report said "read by mean
without a quantizer"). After the move it runs on one pixel per image: ``H x W`` times less work than any kernel,
integer or float, on the full map, with the same numbers up to float summation order (the conv reads the
quantized input, as before; only the order of the sums changes).

``ReduceMean`` over exactly the spatial axes (either ``keepdims``) and ``GlobalAveragePool`` are moved; the conv
must be read by the mean alone and not be a model output. The moved pool is named with :data:`MEAN_FIRST` so that
the kernel report can say why the conv is float (:mod:`lq.export.report._kernel_report`).
"""

from __future__ import annotations

from lq.export._ir import Graph, attr
from lq.export.passes._placement import spatial_mean

#: the name of a pool this pass moved in front of a 1x1 conv (the kernel report looks for it)
MEAN_FIRST = "mean_first"


def mean_before_pointwise_convs(g: Graph) -> int:
    """Move every eligible spatial mean above the 1x1 conv it reads; returns how many moved."""
    prod, cons = g.producers(), g.consumers()
    moved = 0
    for mean in [n for n in g.nodes if n.op_type in ("ReduceMean", "GlobalAveragePool")]:
        conv = prod.get(mean.input[0])
        if conv is None or conv.op_type != "Conv" or conv.output[0] in g.graph_outputs \
                or len(cons.get(conv.output[0], [])) != 1:
            continue
        rank = _conv_rank(g, conv, prod)
        if rank is None or not _pointwise(conv, rank) or not spatial_mean(g, mean, rank):
            continue
        pooled = g.fresh(f"{conv.input[0]}_{MEAN_FIRST}")
        pool = g.make_node("GlobalAveragePool", [conv.input[0]], [pooled], hint=MEAN_FIRST, like=mean)
        conv.input[0] = pooled
        out = mean.output[0]
        if mean.op_type == "ReduceMean" and not attr(mean, "keepdims", 1):  # [N, C, 1, ..] -> [N, C]
            conv.output[0] = g.fresh(f"{conv.output[0]}_{MEAN_FIRST}")
            g.nodes[g.nodes.index(mean)] = g.make_node("Flatten", [conv.output[0]], [out], like=mean, axis=1)
        else:
            conv.output[0] = out
            g.nodes.remove(mean)
        g.nodes.insert(g.nodes.index(conv), pool)
        moved += 1
    return moved


def _conv_rank(g: Graph, conv, prod: dict) -> int | None:
    """The rank of the conv's tensors: 2 + the number of its kernel's spatial dims."""
    ks = attr(conv, "kernel_shape")
    if ks is not None:
        return 2 + len(ks)
    w = conv.input[1]
    while not g.is_const(w):  # the weight behind its DequantizeLinear (and QuantizeLinear, for qdq weights)
        p = prod.get(w)
        if p is None or p.op_type not in ("DequantizeLinear", "QuantizeLinear"):
            return None
        w = p.input[0]
    return g.const(w).ndim


def _pointwise(conv, rank: int) -> bool:
    """A 1x1 kernel, stride 1, no padding: the same linear map at every pixel, each output pixel from its own."""
    spatial = rank - 2
    ks = attr(conv, "kernel_shape")
    return ((ks is None or list(ks) == [1] * spatial)
            and list(attr(conv, "strides", [1] * spatial)) == [1] * spatial
            and not any(attr(conv, "pads", [0] * 2 * spatial))
            and attr(conv, "auto_pad", b"NOTSET") in (b"NOTSET", b"VALID"))
