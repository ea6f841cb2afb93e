"""The float region at a model's input: the layers after a float stem that onnxruntime runs faster in float.

Under the onnxruntime recipe a 1-3 channel stem reads the float model input and runs in float
(:func:`lq.glue._outputs.float_stem`). In a mobile net the layers right after it are ones onnxruntime's float
kernels run faster too: the stem's activation, then the first block's depthwise conv (few channels on the
largest map, :func:`lq.rules.onnxruntime.ort_prefers_float_conv`), its activation, the squeeze-excite pooling and
product. Quantizing the tensors between them buys nothing there and costs a QuantizeLinear, a transpose into
onnxruntime's NHWC integer layout, its depthwise QLinearConv (slowest with few channels: 16 channels at 32x32,
batch 32, 0.33 ms against 0.10 ms in float) and a QLinearMul whose per-channel broadcast over 16 channels runs
0.29 ms against 0.05 ms for the float Mul (AVX-512 VNNI). So the float input extends as far as such layers
read it, and the file's integers begin at the input quantizer of the first layer that runs faster on integers:
a dense conv with 4 or more input channels per group, a linear layer, an add or a cat (which quantize their
operands). ``bench.library``'s EfficientNet-style net (AVX-512 VNNI): 0.94/1.07/1.13x FP32 at batch 1/8/32
before, 1.02/1.24/1.30x with the region (docs/results/library.md).

The walk follows values from the model input through the module tree as the forwards call it (the per-module
fx graphs the glue traced), like :mod:`lq.glue._nonneg`. A value is in the region when it is the model input, a
float stem's output (one a max pool does not read: :func:`lq.glue._outputs.pooled_stems`), or computed from
one by activations, normalizations (BatchNorm, GroupNorm, LayerNorm), pooling, reshapes, a squeeze-excite
product, or a conv that onnxruntime runs faster in float. A layer joins only if every call of it reads the region; anything lq cannot
follow (an untraceable forward, an unknown function) ends the region, which is today's placement.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from lq.glue._nonneg import (KEEP_FUNCTIONS, KEEP_METHODS, KEEP_MODULES, POOL_MODULES, RELU_FUNCTIONS,
                             RELU_METHODS)
from lq.glue._outputs import float_stem
from lq.glue._rules import (FLOAT_READER_FUNCTIONS, FLOAT_READER_METHODS, FLOAT_READER_MODULES, FOLDED_NORMS,
                            OUTPUT_LAYERS, RELU_MODULES, SLOPED_FUNCTIONS, SLOPED_MODULES)
from lq.nn.modules.quant_activation import ACTIVATION_MODULE_CLASSES
from lq.rules.onnxruntime import ort_prefers_float_conv

#: ops whose output is computed in float from their input alone (activations, normalizations, reshapes, max pooling;
#: the glue's table of float readers and the sign-keeping ops of :mod:`lq.glue._nonneg`): a float input stays float
_ELEMENTWISE_MODULES = (FLOAT_READER_MODULES + RELU_MODULES + SLOPED_MODULES + FOLDED_NORMS + KEEP_MODULES
                        + (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d))
_ELEMENTWISE_FUNCTIONS = FLOAT_READER_FUNCTIONS | SLOPED_FUNCTIONS | RELU_FUNCTIONS | KEEP_FUNCTIONS | {F.hardsigmoid}
_ELEMENTWISE_METHODS = FLOAT_READER_METHODS | RELU_METHODS | KEEP_METHODS
#: why such a layer is float, for the summary
REASON = "in the float region after the stem, where onnxruntime runs faster in float (lq.glue._float_region)"
#: glue kinds that run in float when an operand is in the region (a squeeze-excite product, an average pool);
#: an add, a cat or a matmul quantizes its operands: the region ends there
_FLOAT_GLUE_KINDS = frozenset({"mul", "pool", "act"})
_GLOBAL_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                 nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
#: pools: lq quantizes the input of the average and max pools (:data:`lq.glue._nonneg.POOL_MODULES`)
_POOLS = POOL_MODULES + _GLOBAL_POOLS
_GLOBAL_POOL_FUNCTIONS = {F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
                          F.adaptive_max_pool2d, F.adaptive_max_pool3d}

#: a value's place: outside the region (quantized where a layer reads it), a map in the region, a vector in the
#: region (a region map pooled to one value per channel: a squeeze-excite branch, whose 1x1 convs or linears have
#: nothing to gain from integer kernels and would only add Q/DQ and layout changes; they stay float too), or
#: unknown (inside a forward lq cannot follow: outside, except that a stem reading it is taken to read the
#: model's input, as it does in every net lq has seen)
OUT, MAP, VECTOR, UNKNOWN = 0, 1, 2, 3
_INSIDE = (MAP, VECTOR)


@dataclasses.dataclass
class Region:
    """What runs in float: layers (their input quantizer off, their weights still quantized), activation and
    pool modules (left unquantized), and glue sites ``(id(module), site name)`` (their quantizers off)."""

    convs: set[int] = dataclasses.field(default_factory=set)
    modules: set[int] = dataclasses.field(default_factory=set)
    sites: set[tuple[int, str]] = dataclasses.field(default_factory=set)
    #: float modules whose output is in the region (a BatchNorm after a region conv): no output quantizer there
    outputs: set[int] = dataclasses.field(default_factory=set)

    def writes_float(self, layer: nn.Module) -> bool:
        """Whether ``layer``'s output stays in the region (an output quantizer planned on it would only add Q/DQ)."""
        return id(layer) in self.convs or id(layer) in self.outputs


def _global(output_size) -> bool:
    """An adaptive pool's ``output_size`` of one element per channel."""
    sizes = output_size if isinstance(output_size, (tuple, list)) else (output_size,)
    return all(v == 1 for v in sizes)


class FloatRegion:
    """Votes per layer and glue site: did every call of it read a value of the float region?"""

    def __init__(self, model: nn.Module, graphs: dict[int, fx.Graph], sites: dict[int, list],
                 will_be_quantized, pooled: set[int]):
        self.model = model
        self.graphs = graphs  # id(module) -> its traced forward
        self.sites = sites  # id(module) -> its glue sites
        self.will_be_quantized = will_be_quantized
        self.pooled = pooled  # float stems that stay integer
        self.votes: dict[object, bool] = {}
        self.kind: dict[object, str] = {}
        self._active: set[int] = set()

    def _vote(self, key, kind: str, inside: bool) -> None:
        self.votes[key] = self.votes.get(key, True) and inside
        self.kind[key] = kind

    def find(self) -> Region:
        self.module(self.model, MAP)
        region = Region()
        for key, inside in self.votes.items():
            if inside:
                getattr(region, self.kind[key]).add(key)
        return region

    # ------------------------------------------------------------------ modules
    def module(self, m: nn.Module, place: int) -> int:
        """The place of ``m``'s output, given its (first) input's."""
        from lq.glue import _plain_sequential

        if isinstance(m, OUTPUT_LAYERS + (nn.Linear,)) and self.will_be_quantized(m):
            if isinstance(m, OUTPUT_LAYERS) and float_stem(m) and place != VECTOR:
                # a stem on the float input starts the region; the same small conv reading integers runs in
                # float too (lq.glue._outputs.float_stem), but its output is no region: what reads it stays as it is
                self._vote(id(m), "convs", id(m) not in self.pooled)
                return MAP if place in (MAP, UNKNOWN) and id(m) not in self.pooled else OUT
            if not (place == VECTOR or place == MAP and isinstance(m, OUTPUT_LAYERS)
                    and ort_prefers_float_conv(m.in_channels // m.groups, m.kernel_size)):
                place = OUT
            self._vote(id(m), "convs", place in _INSIDE)
            return place
        if isinstance(m, _POOLS) or type(m) in ACTIVATION_MODULE_CLASSES:
            if self.will_be_quantized(m):
                self._vote(id(m), "modules", place in _INSIDE)
            if place in _INSIDE and isinstance(m, _GLOBAL_POOLS) and _global(m.output_size):
                return VECTOR
            return place
        if isinstance(m, _ELEMENTWISE_MODULES) and not self.will_be_quantized(m):
            self._vote(id(m), "outputs", place in _INSIDE)
            return place
        if _plain_sequential(m):  # its children in a row
            for child in m._modules.values():
                place = self.module(child, place)
            return place
        graph = self.graphs.get(id(m))
        if graph is None or id(m) in self._active:
            for child in m._modules.values():  # cannot follow its forward: only float stems inside start a region
                self.module(child, UNKNOWN)
            return OUT
        self._active.add(id(m))
        try:
            return self.graph(m, graph, place)
        finally:
            self._active.discard(id(m))

    # ------------------------------------------------------------------ one forward
    def graph(self, m: nn.Module, graph: fx.Graph, place: int) -> int:
        by_node = {s.node: s for s in self.sites.get(id(m), [])}
        env: dict[fx.Node, int] = {}
        first = True
        for n in graph.nodes:
            if n.op == "placeholder":
                env[n] = place if first else UNKNOWN if place == UNKNOWN else OUT
                first = False
                continue
            if n.op == "output":
                res = n.args[0]
                return env.get(res, OUT) if isinstance(res, fx.Node) else OUT
            a0 = n.args[0] if n.args else None
            arg = env.get(a0, OUT) if isinstance(a0, fx.Node) else OUT
            site = by_node.get(n)
            if site is not None and site.rule.kind == "output":  # an activation's result: float where it reads float
                self._vote((id(m), site.name), "sites", arg in _INSIDE)
                env[n] = arg
            elif site is not None:
                places = [env.get(op, OUT) for op in site.operands]
                floats = site.rule.kind in _FLOAT_GLUE_KINDS and any(p in _INSIDE for p in places)
                self._vote((id(m), site.name), "sites", floats)
                env[n] = OUT if not floats else VECTOR if all(p == VECTOR for p in places) or (
                    n.target in _GLOBAL_POOL_FUNCTIONS and _global(n.args[1] if len(n.args) > 1
                                                                   else n.kwargs.get("output_size"))) else MAP
            elif n.op == "call_module":
                env[n] = self.module(m.get_submodule(n.target), arg)
            elif n.op == "call_function" and n.target in _ELEMENTWISE_FUNCTIONS or \
                    n.op == "call_method" and n.target in _ELEMENTWISE_METHODS:
                env[n] = arg
            else:
                env[n] = OUT
        return OUT


class OldQuantizerKeys:
    """A load-state-dict pre-hook for the model: drops the entries of the quantizers the region leaves out
    (``paths``, relative to the model: input quantizers of its activations and pools, output quantizers), which a
    checkpoint of an earlier lq, that had them, holds. Their values are not needed: those layers run in float."""

    def __init__(self, paths: list[str]):
        self.paths = tuple(paths)

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
        starts = tuple(f"{prefix}{p}." for p in self.paths)
        for k in [k for k in state_dict if k.startswith(starts)]:
            del state_dict[k]


def float_region(model: nn.Module, graphs: dict, plans: list, will_be_quantized, pooled: set[int]) -> Region:
    """:class:`Region` of ``model``: ``graphs`` the traced forwards by module id, ``plans`` the glue plans
    (:class:`lq.glue.GluePlan`), ``pooled`` the float stems that stay integer. Run before the plans are built."""
    return FloatRegion(model, graphs, {id(p.module): p.sites for p in plans}, will_be_quantized, pooled).find()
