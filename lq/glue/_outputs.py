"""Output quantizers for quantized layers that a float op reads (a conv before GroupNorm, a linear before GELU).

Found at the level of the parent module: in its traced forward (``self.norm(self.conv(x))``) or, for an
``nn.Sequential``, between consecutive children. The quantizer lives on the layer itself as
``<layer>._output_quantizer`` (so state_dict, calibration and the summary find it like any other) and a
forward hook applies it: the layer's class and forward stay as they are, ``nn.Sequential`` indexing is
untouched, and :func:`remove` takes both away again.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx
from torch import nn

from lq.rules.onnxruntime import ort_prefers_float_conv
from lq.glue._rules import (ACT_FUNCTIONS, FLOAT_READER_FUNCTIONS, FLOAT_READER_METHODS, FLOAT_READER_MODULES,
                            FOLDED_NORMS, MAX_POOL_FUNCTIONS, MAX_POOLS, OUTPUT_LAYERS, RELU_FUNCTIONS, RELU_METHODS,
                            RELU_MODULES, SLOPED_FUNCTIONS, SLOPED_MODULES)

ATTR = "_output_quantizer"
_HOOK_ID = "_lq_output_hook"


def quantize_output(module: nn.Module, args, output):
    """The forward hook: the layer's output through its output quantizer (looked up at call time, so a deep
    copy of the model quantizes with its own copy)."""
    return module._modules[ATTR](output)


@dataclasses.dataclass
class OutputSite:
    """One layer whose output a float op reads; or (``node`` set, ``layer`` None) a function call of a forward
    whose result gets a quantizer where the module form would have one (``F.relu`` before a BatchNorm): the glue
    site :data:`lq.glue._rules.OUTPUT` of that forward."""

    name: str  # the layer's module path
    layer: nn.Module | None
    reader: str  # what reads it, for the summary
    node: fx.Node | None = None

    @property
    def path(self) -> str:
        return f"{self.name}.{ATTR}" if self.name else ATTR


def _never(m: nn.Module) -> bool:
    return False


def _float_reader(m: nn.Module, quantized=_never, sloped: bool = False) -> bool:
    """A float reader module that stays float (a quantized SiLU/HardSwish quantizes its own input); ``sloped``:
    PReLU and LeakyReLU too (:data:`lq.glue._rules.SLOPED`)."""
    kinds = FLOAT_READER_MODULES + (SLOPED_MODULES if sloped else ())
    return isinstance(m, kinds) and not quantized(m)


def _reader(node: fx.Node, parent: nn.Module, quantized=_never, sloped: bool = False,
            act: bool = False) -> str | None:
    """What ``node`` is, when it reads its input in float (None otherwise); ``act``: SiLU/HardSwish functions quantize
    their own input (an ``act`` glue site), as the swapped modules do."""
    if node.op == "call_module":
        m = parent.get_submodule(node.target)
        return type(m).__name__ if _float_reader(m, quantized, sloped) else None
    if node.op == "call_function" and (node.target in FLOAT_READER_FUNCTIONS
                                       or (sloped and node.target in SLOPED_FUNCTIONS)):
        if act and node.target in ACT_FUNCTIONS:
            return None
        return getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method" and node.target in FLOAT_READER_METHODS:
        return node.target
    return None


def _folded_norm(node: fx.Node, parent: nn.Module) -> fx.Node | None:
    """The BatchNorm call that alone reads ``node`` (the conv's output), else None."""
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_module":
        if isinstance(parent.get_submodule(users[0].target), FOLDED_NORMS):
            return users[0]
    return None


def is_relu(node: fx.Node, parent: nn.Module) -> bool:
    """A ReLU (ReLU6) as a module, a function or a tensor method."""
    if node.op == "call_module":
        return isinstance(parent.get_submodule(node.target), RELU_MODULES)
    return (node.op == "call_function" and node.target in RELU_FUNCTIONS) or \
        (node.op == "call_method" and node.target in RELU_METHODS)


def _relu_then_norm(node: fx.Node, parent: nn.Module) -> fx.Node | None:
    """The ReLU (module, function or method) that alone reads ``node`` (the conv's output) and is itself read by a
    BatchNorm alone (conv -> ReLU -> BatchNorm, the norm after the activation), else None."""
    users = list(node.users)
    if len(users) != 1 or not is_relu(users[0], parent):
        return None
    return users[0] if _folded_norm(users[0], parent) is not None else None


def sites_in_graph(parent: nn.Module, prefix: str, graph: fx.Graph, wants, quantized=_never,
                   relu_norm: bool = False, sloped: bool = False, act: bool = False) -> list[OutputSite]:
    """Children of ``parent`` called in ``graph`` whose output (or their BatchNorm's) a float reader takes;
    ``relu_norm``: also a conv -> ReLU -> BatchNorm's ReLU (:data:`lq.glue._rules.RELU_NORM`; a ReLU function or
    method gives a site with ``node`` set); ``sloped``: PReLU and LeakyReLU read as float
    (:data:`lq.glue._rules.SLOPED`); ``act``: SiLU/HardSwish functions quantize their own input."""
    out = []
    for n in graph.nodes:
        if n.op != "call_module":
            continue
        layer = parent.get_submodule(n.target)
        if not wants(layer):
            continue
        relu = _relu_then_norm(n, parent) if relu_norm else None
        if relu is not None:
            norm = type(parent.get_submodule(next(iter(relu.users)).target)).__name__
            if relu.op != "call_module":
                out.append(OutputSite(prefix, None, norm, node=relu))
                continue
            owner = parent.get_submodule(relu.target)
            if not has_output_quantizer(owner):
                out.append(OutputSite(f"{prefix}.{relu.target}" if prefix else relu.target, owner, norm))
            continue
        norm = _folded_norm(n, parent)
        at, owner = (norm, parent.get_submodule(norm.target)) if norm is not None else (n, layer)
        readers = [r for r in (_reader(u, parent, quantized, sloped, act) for u in at.users) if r]
        if readers and not has_output_quantizer(owner):
            out.append(OutputSite(f"{prefix}.{at.target}" if prefix else at.target, owner, readers[0]))
    return out


def sites_in_sequential(seq: nn.Sequential, prefix: str, wants, quantized=_never,
                        relu_norm: bool = False, sloped: bool = False) -> list[OutputSite]:
    """Children ``(layer, reader)`` or ``(layer, BatchNorm, reader)`` in a row of an ``nn.Sequential``
    (torchvision's ``Conv2dNormActivation`` is one): the quantizer on the last before the reader; ``relu_norm``:
    also ``(layer, ReLU, BatchNorm)``, the quantizer on the ReLU."""
    items = list(seq._modules.items())
    out = []
    for i, (name, layer) in enumerate(items):
        if not wants(layer):
            continue
        if (relu_norm and i + 2 < len(items) and isinstance(items[i + 1][1], RELU_MODULES)
                and isinstance(items[i + 2][1], FOLDED_NORMS)):
            at_name, owner = items[i + 1]
            if not has_output_quantizer(owner):
                out.append(OutputSite(f"{prefix}.{at_name}" if prefix else at_name, owner,
                                      type(items[i + 2][1]).__name__))
            continue
        j = i + 1 if i + 1 < len(items) and isinstance(items[i + 1][1], FOLDED_NORMS) else i
        at_name, owner = items[j]
        if j + 1 < len(items) and _float_reader(items[j + 1][1], quantized, sloped) \
                and not has_output_quantizer(owner):
            out.append(OutputSite(f"{prefix}.{at_name}" if prefix else at_name, owner, type(items[j + 1][1]).__name__))
    return out


def wants_output_quantizer(layer: nn.Module, will_be_quantized) -> bool:
    """A quantized conv whose integer kernel onnxruntime would run; not a depthwise conv or a 1-3 channel stem
    with a small kernel, which it runs faster in float (:func:`lq.rules.onnxruntime.ort_prefers_float_conv`): an output quantizer would
    only add a Q/DQ pair there."""
    return (isinstance(layer, OUTPUT_LAYERS) and will_be_quantized(layer)
            and not ort_prefers_float_conv(layer.in_channels // layer.groups, layer.kernel_size)
            and not has_output_quantizer(layer))


def float_stem(layer: nn.Module) -> bool:
    """A dense conv with 1-3 input channels and a small kernel (an image net's stem), which onnxruntime runs
    faster in float (:func:`lq.rules.onnxruntime.ort_prefers_float_conv`). Unlike a depthwise conv, it reads the
    model's float input, so running it in float costs no layout change: EfficientNet-style net of
    ``bench.library``, batch 8 (AVX-512 VNNI), its 1 -> 16 3x3 stem 0.145 ms as QLinearConv, 0.032 ms in float;
    its depthwise convs in float (their SiLUs too) took the whole file from 1.75 to 6.4 ms (NHWC <-> NCHW)."""
    return (isinstance(layer, OUTPUT_LAYERS) and layer.groups == 1
            and ort_prefers_float_conv(layer.in_channels, layer.kernel_size))


def pooled_stems(model: nn.Module, graphs: dict) -> set[int]:
    """Ids of the :func:`float_stem` convs whose output a max pool reads (through their BatchNorm and ReLU): such
    a stem stays integer with its input quantized. In float its output leaves the conv in NCHW, and onnxruntime
    pools the quantized tensor with its slow NCHW uint8 MaxPool instead of NhwcMaxPool on a QLinearConv's output:
    bench.ordinary's U-Net (1 -> 16 channels, 28x28, then a max pool), batch 32, Zen 5 VNNI: 2.53 ms with the stem
    as QLinearConv, 3.40 ms with it float (its MaxPool alone 1.0 ms)."""
    from lq.glue import _plain_sequential

    def stem_block(m: nn.Module) -> nn.Module | None:  # the stem that ``m`` is, or that alone computes its output
        items = list(m._modules.values()) if _plain_sequential(m) else [m]
        if items and float_stem(items[0]) and all(isinstance(i, FOLDED_NORMS + RELU_MODULES) for i in items[1:]):
            return items[0]
        return None

    out = set()
    for _, m in model.named_modules():
        if _plain_sequential(m):
            items = list(m._modules.values())
            for i, layer in enumerate(items):
                j = i + 1
                while j < len(items) and isinstance(items[j], FOLDED_NORMS + RELU_MODULES):
                    j += 1
                if float_stem(layer) and j < len(items) and isinstance(items[j], MAX_POOLS):
                    out.add(id(layer))
        graph = graphs.get(id(m))
        if graph is None or _plain_sequential(m):
            continue
        for n in graph.nodes:
            stem = stem_block(m.get_submodule(n.target)) if n.op == "call_module" else None
            if stem is not None and _pooled(n, m):
                out.add(id(stem))
    return out


def _pooled(node: fx.Node, parent: nn.Module) -> bool:
    """A max pool reads ``node``, directly or through the BatchNorms and ReLUs (modules or functions) that alone
    read it."""
    for u in node.users:
        if (u.op == "call_function" and u.target in MAX_POOL_FUNCTIONS) or \
                (u.op == "call_module" and isinstance(parent.get_submodule(u.target), MAX_POOLS)):
            return True
    if len(node.users) == 1:
        (u,) = node.users
        if is_relu(u, parent) or (u.op == "call_module" and isinstance(parent.get_submodule(u.target), FOLDED_NORMS)):
            return _pooled(u, parent)
    return False


def has_output_quantizer(layer: nn.Module) -> bool:
    return ATTR in layer._modules


def commit(site: OutputSite, layer: nn.Module, quantizer: nn.Module) -> None:
    """Attach ``quantizer`` to ``layer`` (the converted layer, which may be a new object) with the hook."""
    layer._modules[ATTR] = quantizer
    handle = layer.register_forward_hook(quantize_output)
    layer.__dict__[_HOOK_ID] = handle.id


def remove(layer: nn.Module) -> None:
    """Take an output quantizer and its hook off ``layer``."""
    hook = layer.__dict__.pop(_HOOK_ID, None)
    if hook is not None:
        layer._forward_hooks.pop(hook, None)
    layer._modules.pop(ATTR, None)
