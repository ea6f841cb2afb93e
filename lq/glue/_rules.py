"""THE table of glue ops lq quantizes inside a module's own ``forward``, and how.

A glue op is tensor arithmetic written as a function or operator (``x + y``, ``torch.cat``, ``q @ k``)
rather than a module. Runtimes keep such an op in INT8 only when its inputs are quantized:

* ``add`` -> one quantizer per operand (``QLinearAdd`` and TensorRT's fused add take a scale per input),
  which also gives the convs/linears that feed it the output quantizer onnxruntime needs to run them as
  ``QLinearConv``/``QGemm``. An operand that a quantized conv/linear of the same forward also reads (the
  ``x`` of ``f(x) + x``) is quantized by that layer's own input quantizer (``TIED_LAYERS``): one scale for
  the tensor, so the producer of ``x`` ends in one fused QuantizeLinear, not in two that differ (which
  would make the export copy the producer, one per scale).
* ``cat`` -> one quantizer per input, tied like an add's (``QLinearConcat`` takes a scale per input and
  re-scales; onnxruntime's own ``quantize_static`` files do the same). A U-Net's skip tensor is also
  max-pooled into the next encoder conv: tied to that conv's input quantizer, it has one grid, and the conv
  that writes it fuses. A tensor that several concats (or joins) of one forward read takes the first one's
  quantizer (a DenseNet's ``torch.cat`` of a growing list). (:class:`lq.nn.QuantCat` keeps one shared quantizer,
  for TensorRT.)
* ``matmul`` -> one quantizer per operand (``QLinearMatMul`` / ``MatMulInteger`` with two activation
  inputs, e.g. attention scores ``q @ k.transpose(-2, -1)`` and ``attn @ v``).
* ``pool`` (``F.adaptive_avg_pool2d``, ``F.avg_pool2d``, 1-d and 3-d too) -> one quantizer on the input, as
  the module forms have (:class:`lq.nn.QuantAdaptiveAvgPool2d` ...): onnxruntime then runs
  ``QLinearGlobalAveragePool``/``QLinearAveragePool`` and the residual add before the pool a ``QLinearAdd``
  (``F.relu(x + y)`` -> ``F.adaptive_avg_pool2d`` ends most ResNets).
* ``mul`` (``x * y`` of two activations: a squeeze-excite gate ``x * torch.sigmoid(s)``, a SiLU written as
  ``x * torch.sigmoid(x)``) -> one quantizer per operand, tied like an add's: ``QLinearMul``, and the
  sigmoid between two quantizers a ``QLinearSigmoid``. Only where the recipe quantizes activations
  (:attr:`lq.config.QuantConfig.activations`; :data:`OPTIONAL_KINDS`).
* ``attention`` (``F.scaled_dot_product_attention``) -> written out as its two matmuls with quantizers on
  q, k, the probabilities and v (:mod:`lq.glue._attention`).
* ``act`` (``F.silu``, ``F.hardswish``) -> one quantizer on the input, what :class:`lq.nn.QuantSiLU` /
  :class:`lq.nn.QuantHardswish` give the module forms: the layer before runs as an integer kernel and the
  activation as one float kernel between DQ and Q. Only where the recipe quantizes activations (as ``mul``).
* ``output`` -> a quantizer on the result of a function call, where the module form of the op gets an output
  quantizer (:mod:`lq.glue._outputs`): ``F.relu`` between a conv and a BatchNorm (``relu_norm``).

Only ops whose operands are all activations (computed from the module's inputs) count: ``x + self.pos``
(a parameter) or ``x + 1`` stay as they are. The same table serves both runtimes: the quantizers go into
the PyTorch model, so calibration, QAT and the export see the same thing.
"""

from __future__ import annotations

import dataclasses
import operator

import torch


@dataclasses.dataclass(frozen=True)
class GlueRule:
    kind: str  # add | cat | matmul | attention | pool
    shared: bool  # one quantizer for every operand (True) or one per operand (False)


ADD = GlueRule("add", shared=False)
CAT = GlueRule("cat", shared=False)
MATMUL = GlueRule("matmul", shared=False)
MUL = GlueRule("mul", shared=False)
#: ``F.scaled_dot_product_attention``: written out (lq.glue._attention) with a quantizer on q, k, the
#: probabilities and v, so both of its matmuls run as integer matmuls
ATTENTION = GlueRule("attention", shared=False)
#: average pooling written as a function: its input quantized
POOL = GlueRule("pool", shared=True)
#: a smooth activation written as a function: its input quantized (as the module forms are swapped)
ACT = GlueRule("act", shared=True)
#: the result of a function call quantized (the functional form of a module's output quantizer)
OUTPUT = GlueRule("output", shared=True)

#: the attribute of a quantized layer (conv, linear, pool) that quantizes its input
INPUT_QUANTIZER = "_input_quantizer"
#: the child of a rewritten module that holds its glue quantizers
CHILD = "lq_glue"

#: layers whose input quantizer an add operand shares when the layer reads the same tensor (they quantize their
#: input per tensor with ``_input_quantizer``)
TIED_LAYERS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear,
               # a squeeze-excite block pools the tensor it then scales: pool and product share one grid
               torch.nn.AdaptiveAvgPool1d, torch.nn.AdaptiveAvgPool2d, torch.nn.AdaptiveAvgPool3d)
#: ops between an operand and that layer that map a grid onto itself (max pooling, nearest upsampling,
#: reshapes): quantizing before or after them gives the same numbers, so the tie may look through them
MAX_POOLS = (torch.nn.MaxPool1d, torch.nn.MaxPool2d, torch.nn.MaxPool3d)
MAX_POOL_FUNCTIONS = {torch.nn.functional.max_pool1d, torch.nn.functional.max_pool2d, torch.nn.functional.max_pool3d}
#: (dropout in evaluation is the identity; zero padding adds the grid's zero, which every lq grid holds exactly)
TIE_THROUGH_MODULES = MAX_POOLS + (torch.nn.Flatten, torch.nn.Identity, torch.nn.Dropout, torch.nn.Dropout1d,
                                   torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.ZeroPad1d, torch.nn.ZeroPad2d,
                                   torch.nn.ZeroPad3d)
TIE_THROUGH_FUNCTIONS = MAX_POOL_FUNCTIONS | {torch.flatten, torch.nn.functional.dropout}
TIE_THROUGH_METHODS = {"flatten", "view", "reshape", "contiguous"}


def upsamples_nearest(node, parent) -> bool:
    """A nearest upsampling (``F.interpolate``/``F.upsample`` with ``mode="nearest"``, ``F.upsample_nearest``,
    ``nn.Upsample(mode="nearest")``): it repeats existing values, so it keeps their grid (other modes average)."""
    if node.op == "call_function" and node.target in (torch.nn.functional.interpolate, torch.nn.functional.upsample):
        return node.kwargs.get("mode", node.args[3] if len(node.args) > 3 else "nearest") == "nearest"
    if node.op == "call_function":
        return node.target is torch.nn.functional.upsample_nearest
    if node.op == "call_module":
        m = parent.get_submodule(node.target)
        return isinstance(m, torch.nn.Upsample) and m.mode == "nearest"
    return False


def pads_with_zeros(node) -> bool:
    """``F.pad(x, pad)`` in constant mode with the value 0, as the ZeroPad modules pad: grid-preserving."""
    if node.op != "call_function" or node.target is not torch.nn.functional.pad:
        return False
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", None)
    return mode == "constant" and (value is None or value == 0)


def ties_through(node, parent) -> bool:
    """``node`` maps the grid of its first argument onto itself (a max pool, a reshape, dropout, zero padding ...):
    a quantizer before it and one after it may be one."""
    if node.op == "call_module":
        m = parent.get_submodule(node.target)
        return isinstance(m, TIE_THROUGH_MODULES) or (isinstance(m, _CONSTANT_PADS) and m.value == 0)
    if node.op == "call_function":
        return node.target in TIE_THROUGH_FUNCTIONS or pads_with_zeros(node)
    return node.op == "call_method" and node.target in TIE_THROUGH_METHODS


_CONSTANT_PADS = (torch.nn.ConstantPad1d, torch.nn.ConstantPad2d, torch.nn.ConstantPad3d)

#: call_function targets
FUNCTIONS = {
    operator.add: ADD, torch.add: ADD,
    torch.cat: CAT, torch.concat: CAT, torch.concatenate: CAT,
    operator.matmul: MATMUL, torch.matmul: MATMUL, torch.bmm: MATMUL,
    operator.mul: MUL, torch.mul: MUL,
    torch.nn.functional.scaled_dot_product_attention: ATTENTION,
    torch.nn.functional.adaptive_avg_pool1d: POOL, torch.nn.functional.adaptive_avg_pool2d: POOL,
    torch.nn.functional.adaptive_avg_pool3d: POOL, torch.nn.functional.avg_pool1d: POOL,
    torch.nn.functional.avg_pool2d: POOL, torch.nn.functional.avg_pool3d: POOL,
    torch.nn.functional.silu: ACT, torch.nn.functional.hardswish: ACT,
}
#: call_method targets (``x.add(y)``, ``a.matmul(b)``)
METHODS = {"add": ADD, "matmul": MATMUL, "bmm": MATMUL, "mul": MUL}
#: kinds quantized only where the recipe asks (``find_sites(..., optional=...)``)
OPTIONAL_KINDS = frozenset({"mul", "act", "relu_norm", "sloped"})
#: what ``QuantConfig.activations`` turns on
ACTIVATIONS = frozenset({"mul", "act", "relu_norm", "sloped"})
#: ``relu_norm`` (optional, with ``QuantConfig.activations``): a conv -> ReLU -> BatchNorm (CREPE's layers, nets that
#: normalize after the activation) gets its output quantizer on the ReLU, which the BatchNorm reads in float: the
#: conv then runs as QLinearConv with the ReLU fused (a zero point of 0 on an asymmetric grid), as onnxruntime's own
#: files do; the BatchNorm cannot fold into the conv across the ReLU and runs in float between DQ and the next Q
RELU_NORM = "relu_norm"
#: ``sloped`` (optional, with ``QuantConfig.activations``): a conv read by PReLU / LeakyReLU gets an output quantizer,
#: so it runs as QLinearConv and the activation in float between DQ and Q, as in onnxruntime's own files; the
#: export then moves a max pool behind the activation onto the conv's integers (NhwcMaxPool). O-Net-style net,
#: batch 32, AVX-512 VNNI: 2.42 ms against 3.56 ms with those convs float (FP32 6.4 ms).
#: The slope times a value on the conv's grid can land half-way between two steps of the next quantizer, and
#: runtimes break such ties differently: on the symmetric grids of pytorch-quantization's descriptors, which
#: under max calibration often share one amax (0.1 x 5 steps = 0.5), 8-20% of a P-Net's outputs ended one step
#: from PyTorch's, so that path keeps those convs float; on the asymmetric grids the two ranges differ and the
#: same O-Net file had 0.31% of its outputs one step off (none beyond two), which the export's verification
#: measures and reports.
SLOPED = "sloped"
SLOPED_MODULES = (torch.nn.PReLU, torch.nn.LeakyReLU)
SLOPED_FUNCTIONS = {torch.nn.functional.prelu, torch.nn.functional.leaky_relu}
#: activations after which a BatchNorm reader gets the output quantizer (non-negative: the runtime drops them)
RELU_MODULES = (torch.nn.ReLU, torch.nn.ReLU6)
#: the same as functions and tensor methods
RELU_FUNCTIONS = {torch.nn.functional.relu, torch.relu, torch.nn.functional.relu6}
RELU_METHODS = {"relu", "relu_"}
#: kinds whose result stays float when only float ops read it, and whose operands tie to a layer's quantizer
JOIN_KINDS = frozenset({"add", "mul"})


# --------------------------------------------------------------------------- output quantizers
#: layers whose output gets a quantizer when a float op reads it (see FLOAT_READER_*): onnxruntime runs
#: ``DQ -> Conv/Gemm/MatMul`` as an integer kernel only when a QuantizeLinear reads the output, and TensorRT
#: then keeps the layer's output in INT8 as well. The cost is one Q/DQ pair on a tensor the layer already
#: writes, far less than a float conv/gemm.
#: Convs only: onnxruntime runs ``DQ -> MatMul/Gemm`` with a float output as ``MatMulIntegerToFloat``/``QGemm``
#: already, so a Linear before GELU/LayerNorm keeps its integer kernel without one (an output quantizer there
#: only added a Q/DQ pair and its rounding: 0.06 of 0.61 ms on the bench transformer).
OUTPUT_LAYERS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
#: a BatchNorm right after such a layer folds into it in the file, so the output quantizer goes on the BatchNorm's
#: output (``conv -> bn -> Q``, which the export makes ``conv' -> Q``): quantizing the conv's output before a
#: float BatchNorm would be a different model from the file
FOLDED_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)

#: readers that take a float input and have no quantizer of their own: normalizations and smooth activations
#: (ReLU/ReLU6 are not here: the export moves a quantizer across them exactly, so a quantized reader after
#: them suffices). LeakyReLU and PReLU are read as such only where the recipe asks (:data:`SLOPED`).
#: Modules by type, functions by identity, tensor methods by name.
FLOAT_READER_MODULES = (
    torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.SiLU, torch.nn.GELU, torch.nn.Sigmoid, torch.nn.Tanh,
    torch.nn.Hardswish, torch.nn.Hardsigmoid, torch.nn.Mish, torch.nn.ELU, torch.nn.Softmax,
)
FLOAT_READER_FUNCTIONS = {
    torch.nn.functional.silu, torch.nn.functional.gelu, torch.sigmoid, torch.nn.functional.sigmoid, torch.tanh,
    torch.nn.functional.tanh, torch.nn.functional.hardswish, torch.nn.functional.hardsigmoid,
    torch.nn.functional.mish, torch.nn.functional.elu, torch.softmax, torch.nn.functional.softmax,
    torch.nn.functional.group_norm, torch.nn.functional.layer_norm,
}
#: float readers that quantize their own input where the recipe quantizes activations (an ``act`` site)
ACT_FUNCTIONS = {f for f, r in FUNCTIONS.items() if r is ACT}
FLOAT_READER_METHODS = {"sigmoid", "tanh", "softmax"}

#: an ``add`` whose result only these read (or float readers above, or other such adds) stays float: no
#: integer kernel can take it, so operand quantizers would only add Q/DQ pairs and rounding. This is the
#: residual stream of a pre-norm transformer (``h = h + attn(norm(h))``, read by the next LayerNorm and the
#: next add, finally by ``h.mean(1)``). An add whose result leaves the forward (a ResNet block's
#: ``relu(f(x) + x)``) or reaches a quantized layer, a pool or a cat is quantized.
FLOAT_ONLY_REDUCERS_FUNCTIONS = {torch.mean}
FLOAT_ONLY_REDUCERS_METHODS = {"mean"}
