"""Which kernel onnxruntime runs for every quantized layer, and why a layer stays float.

The answer comes from onnxruntime's own optimized graph (the fused nodes keep the name of the node they
replace; a loop keeps its name, and its body is read the same way, so the step of an exported LSTM is
reported like any layer), not from a prediction: a quantized conv that onnxruntime could not fuse shows up as the float
``Conv``/``FusedConv`` it really runs. The reason for a float layer is read from the exported graph: what is
missing around it for onnxruntime's QDQ fusion (an unquantized input, or an output that a float op reads).
"""

from __future__ import annotations

import dataclasses
import re

import onnx

from lq.export._ir import COMPUTE, Graph, as_model
from lq.export.passes._mean_first import MEAN_FIRST
from lq.export.passes._float_convs import FLOAT_BY_CHOICE, FLOAT_MARKERS
from lq.rules.onnxruntime import (ORT_INT8_CONV_MIN_CHANNELS_PER_GROUP, ORT_INT8_CONV_MIN_REDUCTION,
                                  ORT_INT8_HEAD_MIN_OUT_CHANNELS, ort_prefers_float_head)
from lq.export.verify._verify import INT8_KERNELS, RUNTIME_QUANTIZED_LSTM

#: the reason of a conv the export left float on purpose (:mod:`lq.export.passes._float_convs`)
BY_CHOICE = (f"float by choice: fewer than {ORT_INT8_CONV_MIN_CHANNELS_PER_GROUP} input channels per group "
             f"and fewer than {ORT_INT8_CONV_MIN_REDUCTION} products per output (depthwise or a 1-3 channel stem "
             "with a small kernel), where onnxruntime's float conv is faster than its integer one")
#: the reason of a 1x1 conv the export moved behind the spatial mean that read it (:mod:`lq.export.passes._mean_first`)
ON_THE_MEAN = ("float by choice: a 1x1 conv whose output was averaged now runs on the average of its input "
               "(one pixel per image instead of the whole map: less work than any kernel, the same numbers)")
#: the reason of a conv writing a model output with few output channels (lq.rules.onnxruntime.ort_prefers_float_head)
HEAD_BY_CHOICE = (f"float by choice: a model output with fewer than {ORT_INT8_HEAD_MIN_OUT_CHANNELS} output channels, "
                  "where onnxruntime's float conv is faster than QLinearConv (which would also need a Q/DQ pair "
                  "on the output)")
#: the reason of a layer whose input quantizer is off: lq turns it off in the float region after a float stem
#: (lq/glue/_float_region.py: a squeeze-excite branch's 1x1 convs there), or the user did
INPUT_OFF = ("float by choice: its input quantizer is off (lq does that in the float region after a float stem, "
             "where onnxruntime's float kernels are faster: lq/glue/_float_region.py)")
#: reasons of convs the export left float on purpose, because that is faster
CHOSEN = (BY_CHOICE, ON_THE_MEAN, HEAD_BY_CHOICE, INPUT_OFF)

#: exported ops a layer's kernel is reported for: the compute ops (lq.export._ir.COMPUTE) and the quantized joins/pools
_JOINS = ("Add", "Mul", "Concat", "AveragePool", "GlobalAveragePool")
#: the op a block-quantized Linear is written as for onnxruntime (its 4/8-bit weight kernel)
BLOCK_KERNEL = "MatMulNBits"
#: activations lq.glue gives no output quantizer in front of (see FLOAT_READER_MODULES in lq.glue._rules)
_SLOPED = ("PRelu", "LeakyRelu")


@dataclasses.dataclass(frozen=True)
class LayerKernel:
    """One exported op of a quantized layer and what onnxruntime runs for it."""

    layer: str
    op: str  # the op in the exported file
    kernel: str  # the op onnxruntime runs (QLinearConv, QGemm, MatMulIntegerToFloat ... or a float op)
    reason: str | None = None  # why it is float (None when it is an integer kernel)
    #: whether the runtime runs it on integers, where the kernel's name does not say (OpenVINO: the precision of
    #: its compiled layer); None: an onnxruntime op, integer when it is one of INT8_KERNELS
    runs_integer: bool | None = None

    @property
    def integer(self) -> bool:
        return self.kernel in INT8_KERNELS if self.runs_integer is None else self.runs_integer

    @property
    def by_choice(self) -> bool:
        """Float because the export chose the faster float kernel (not for want of a quantizer)."""
        return self.reason in CHOSEN

    def text(self) -> str:
        return self.kernel if self.integer else f"{self.kernel} (float: {self.reason})"


def float_reason(n: onnx.NodeProto, g: Graph, prod: dict, cons: dict, layer_of: dict | None = None,
                 input_off: frozenset = frozenset()) -> str | None:
    """Why onnxruntime cannot fuse ``n`` into an integer kernel, read from the exported graph (None: it can).

    Readers are named by the PyTorch module they come from (``layer_of``) where known, else by op type;
    ``input_off``: the layers whose input quantizer the model has turned off."""
    if n.op_type == "Conv" and len(n.input) > 1 and FLOAT_BY_CHOICE in n.input[1]:
        return BY_CHOICE
    if n.op_type == "Conv" and prod.get(n.input[0]) is not None and MEAN_FIRST in prod[n.input[0]].name:
        return ON_THE_MEAN
    data_inputs = n.input[:2] if n.op_type in COMPUTE else [i for i in n.input if i and not g.is_const(i)]
    data_inputs = [i for i in data_inputs if not _float_weights(i)]  # dequantized by the export: quantized
    if any(prod.get(i) is None or prod[i].op_type != "DequantizeLinear" for i in data_inputs):
        return INPUT_OFF if (layer_of or {}).get(n.name) in input_off else "input or weight is not quantized"
    users = cons.get(n.output[0], [])
    if n.op_type in ("Gemm", "MatMul") and not users and n.output[0] in g.graph_outputs:
        return None  # onnxruntime's QGemm / MatMulIntegerToFloat give a float output directly
    if n.output[0] in g.graph_outputs:
        out_channels = _out_channels(n, g, prod)
        if out_channels is not None and ort_prefers_float_head(out_channels):
            return HEAD_BY_CHOICE
        return "its output is a model output (no quantizer reads it)"
    if not users or any(u.op_type != "QuantizeLinear" for u in users):
        floats = [u for u in users if u.op_type != "QuantizeLinear"]
        me = (layer_of or {}).get(n.name)
        named = {}
        for u in floats:
            layer = (layer_of or {}).get(u.name)
            named.setdefault(layer if layer not in (None, me) else "", set()).add(u.op_type)
        readers = sorted(f"{layer} ({', '.join(sorted(ops))})" if layer else ", ".join(sorted(ops))
                         for layer, ops in named.items())
        # a max pool the export moved above an activation (_pool_first): name the activation behind it too
        behind = [f"{(layer_of or {}).get(v.name) or v.op_type} ({v.op_type})" for u in floats if u.op_type == "MaxPool"
                  for v in cons.get(u.output[0], []) if v.op_type != "QuantizeLinear"]
        what = "a conv/gemm" if n.op_type in COMPUTE else n.op_type
        if any(u.op_type == "Add" for u in floats):
            hint = "quantize the add's inputs, e.g. lq.nn.QuantAdd for a residual add"
        elif floats and all(u.op_type in _SLOPED for u in floats):
            hint = ("on pytorch-quantization's symmetric grids lq gives a conv before PReLU/LeakyReLU no output "
                    "quantizer on purpose: the slope times a grid value often lands exactly between two steps of the "
                    "next quantizer, and onnxruntime and PyTorch round such ties differently; the int8_onnxruntime "
                    "recipe (the default) gives it one (lq.glue._rules.SLOPED)")
        else:
            hint = f"onnxruntime runs {what} as an integer kernel only when a QuantizeLinear reads its output"
        then = f", then by {', '.join(sorted(set(behind)))}," if behind else ""
        return f"its output is read by {', '.join(readers)}{then} without a quantizer ({hint})"
    return None


def _out_channels(n: onnx.NodeProto, g: Graph, prod: dict) -> int | None:
    """The output channels of a Conv ``n`` from its weight (a constant, or a DequantizeLinear of one)."""
    if n.op_type != "Conv" or len(n.input) < 2:
        return None
    w = g.const(n.input[1])
    p = prod.get(n.input[1])
    if w is None and p is not None and p.op_type == "DequantizeLinear":
        w = g.const(p.input[0])
    return None if w is None or w.ndim < 3 else int(w.shape[0])


def _float_weights(name: str) -> bool:
    """A weight the export stored as its dequantized float values (:mod:`lq.export.passes._float_convs`)."""
    return any(m in name for m in FLOAT_MARKERS)


def unfused_layers(model: onnx.ModelProto, layer_of: dict[str, str], input_off: frozenset = frozenset()) -> list[str]:
    """Conv/Gemm/MatMul nodes (loop bodies included) onnxruntime cannot turn into an INT8 kernel, with the reason."""
    out = []
    for g in _graphs(model):
        prod, cons = g.producers(), g.consumers()
        for n in g.nodes:
            if n.op_type in COMPUTE:
                why = float_reason(n, g, prod, cons, layer_of, input_off)
                if why and why not in CHOSEN:
                    out.append(f"{layer_of.get(n.name) or n.name}: {why}")
    return out


def _graphs(model: onnx.ModelProto):
    """:class:`Graph` views of ``model``'s graph and of every loop body in it."""
    stack = [model.graph]
    while stack:
        graph = stack.pop(0)
        g = Graph(model) if graph is model.graph else Graph(as_model(graph, model))
        yield g
        stack.extend(a.g for n in graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)


def _quantized(n: onnx.NodeProto, prod: dict) -> bool:
    """A quantizer feeds ``n``, or its weights are a quantized layer's, dequantized by the export (a stem that reads
    the float model input has no other trace of its quantization)."""
    return (any(prod.get(i) is not None and prod[i].op_type == "DequantizeLinear" for i in n.input)
            or (n.op_type == "Conv" and len(n.input) > 1 and _float_weights(n.input[1])))


def _runs_as(n: onnx.NodeProto, opt_by_name: dict, opt_cons: dict, prod: dict) -> str:
    """The optimized node standing for ``n``: same name, a name onnxruntime derived from it, or the node
    that reads the same weight initializer (following a DequantizeLinear that was kept)."""
    w = n.input[1] if len(n.input) > 1 else ""
    if _float_weights(w):  # onnxruntime may rename it and re-lay its weights (NCHWc): its float conv
        return n.op_type
    if n.name in opt_by_name:
        return opt_by_name[n.name].op_type
    # a name onnxruntime derived (node_conv2d -> node_conv2d_token_3), not another node's (node_conv2d_1)
    derived = [m for name, m in opt_by_name.items()
               if n.name and name.startswith(n.name) and not re.match(r"_\d", name[len(n.name):])]
    if derived:
        return derived[0].op_type
    p = prod.get(w)
    source = p.input[0] if p is not None and p.op_type == "DequantizeLinear" else w
    for reader in opt_cons.get(source, []):
        if reader.op_type == "DequantizeLinear":
            nxt = [r for r in opt_cons.get(reader.output[0], []) if r.op_type != "QuantizeLinear"]
            if nxt:
                return nxt[0].op_type
        else:
            return reader.op_type
    return "unknown"


def layer_kernels(model: onnx.ModelProto, optimized: onnx.ModelProto, layer_of: dict[str, str],
                  input_off: frozenset = frozenset()) -> list[LayerKernel]:
    """For every quantized compute op (and quantized join or pool) of ``model``, loop bodies included: what
    onnxruntime runs (``input_off``: the layers whose input quantizer the model has turned off)."""
    return _kernels(Graph(model), optimized.graph, model, layer_of, input_off)


def _kernels(g: Graph, optimized: onnx.GraphProto, model: onnx.ModelProto, layer_of: dict,
             input_off: frozenset) -> list[LayerKernel]:
    """:func:`layer_kernels` of one graph ``g`` against its optimized twin; a loop's body against the body of
    the optimized loop of the same name."""
    prod, cons = g.producers(), g.consumers()
    opt_by_name = {m.name: m for m in optimized.node if m.name}
    opt_cons: dict[str, list] = {}
    for m in optimized.node:
        for i in m.input:
            opt_cons.setdefault(i, []).append(m)
    out = []
    for n in g.nodes:
        opt_loop = opt_by_name.get(n.name)
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH and opt_loop is not None:
                twin = next((b.g for b in opt_loop.attribute if b.name == a.name and b.type == a.type), None)
                if twin is not None:
                    out.extend(_kernels(Graph(as_model(a.g, model)), twin, model, layer_of, input_off))
        if n.op_type == RUNTIME_QUANTIZED_LSTM:  # quantizes its own activations: no Q/DQ around it
            kernel = opt_by_name[n.name].op_type if n.name in opt_by_name else n.op_type
            out.append(LayerKernel(layer_of.get(n.name) or n.name, n.op_type, kernel,
                                   None if kernel in INT8_KERNELS else "onnxruntime did not run its fused kernel"))
            continue
        if n.op_type == BLOCK_KERNEL:  # block-quantized weights inside the op (lq.export.passes._matmul_nbits)
            kernel = opt_by_name[n.name].op_type if n.name in opt_by_name else n.op_type
            out.append(LayerKernel(layer_of.get(n.name) or n.name, n.op_type, kernel,
                                   None if kernel in INT8_KERNELS else "onnxruntime did not run its 4-bit kernel"))
            continue
        if n.op_type not in COMPUTE + _JOINS or not _quantized(n, prod) or MEAN_FIRST in n.name:
            continue  # (a mean the export moved in front of a 1x1 conv: the model's float mean, not a layer)
        kernel = _runs_as(n, opt_by_name, opt_cons, prod)
        reason = None
        if kernel not in INT8_KERNELS:
            reason = float_reason(n, g, prod, cons, layer_of, input_off) or \
                "onnxruntime did not fuse it (see its optimized graph)"
        out.append(LayerKernel(layer_of.get(n.name) or n.name, n.op_type, kernel, reason))
    return out
