"""Find the glue ops of one traced ``forward`` whose operands are all activations."""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from lq.glue._rules import (CHILD, FLOAT_ONLY_REDUCERS_FUNCTIONS, FLOAT_ONLY_REDUCERS_METHODS, FUNCTIONS, JOIN_KINDS,
                            METHODS, OPTIONAL_KINDS, POOL, TIED_LAYERS, GlueRule)

#: attributes and methods of a tensor that give Python values (shapes, dtypes), not tensors
_META_ATTRS = {"shape", "dtype", "device", "ndim", "layout", "is_cuda", "requires_grad", "is_quantized"}
_META_METHODS = {"size", "dim", "numel", "nelement", "element_size", "stride", "item", "tolist", "get_device",
                 "is_contiguous", "is_floating_point", "__len__"}


@dataclasses.dataclass
class Site:
    """One glue op: the node, its rule, its activation operands and the name of its quantizer(s)."""

    node: fx.Node
    rule: GlueRule
    operands: list[fx.Node]
    name: str
    #: operand index -> module path (relative to the traced module) of the input quantizer of a layer that
    #: reads the same tensor; that quantizer quantizes the operand here too (joins and concats)
    tied: dict[int, str] = dataclasses.field(default_factory=dict)
    #: only the tied operands are quantized (:mod:`lq.glue._join_ties`): one whose tie is dropped stays float
    tied_only: bool = False
    #: an ``F.silu`` that also quantizes its gate (``<name>_gate``): :func:`lq.nn.modules.quant_activation.gated_silu`
    gated: bool = False
    #: operand index -> the quantizer of an earlier site of this forward that reads the same tensor
    #: (:func:`_share_repeated_operands`), which quantizes the operand here too
    aliases: dict[int, str] = dataclasses.field(default_factory=dict)

    def tied_part(self) -> "Site | None":
        """The site reduced to its tied operands (``tied_only``), or None when none is tied."""
        if not self.tied:
            return None
        ops = list(dict.fromkeys(self.operands))
        kept = [(ops[i], path) for i, path in sorted(self.tied.items())]
        return Site(self.node, self.rule, [op for op, _ in kept], self.name,
                    {i: path for i, (_, path) in enumerate(kept)}, tied_only=True)

    def operand_names(self) -> list[str | None]:
        """The site's own quantizer of each distinct operand (None where it is tied to a layer's)."""
        ops = list(dict.fromkeys(self.operands))
        if self.rule.shared:
            return [self.name] * len(ops)
        return [None if i in self.tied else self.aliases.get(i, f"{self.name}_{chr(ord('a') + i)}")
                for i in range(len(ops))]

    def quantizer_names(self) -> list[str]:
        """The quantizers the site owns: one if shared, else one per operand (``matmul_0_a``, ``matmul_0_b``)
        that is not tied to a layer's input quantizer."""
        if self.rule.kind == "attention":
            return [f"{self.name}_{part}" for part in ("q", "k", "probs", "v")]
        if self.rule.kind == "output":
            return [self.name]
        own = list(dict.fromkeys(n for n in self.operand_names() if n is not None))
        return own + [f"{self.name}_gate"] if self.gated else own


def activations(graph: fx.Graph) -> set[fx.Node]:
    """Nodes holding tensors computed from the forward's inputs (not parameters, constants or shapes)."""
    act: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            act.add(n)
            continue
        if n.op not in ("call_module", "call_function", "call_method"):
            continue
        if not any(i in act for i in n.all_input_nodes):
            continue
        if n.op == "call_function" and n.target is getattr and len(n.args) > 1 and n.args[1] in _META_ATTRS:
            continue
        if n.op == "call_method" and n.target in _META_METHODS:
            continue
        if n.op == "call_function" and getattr(n.target, "__module__", None) == "builtins" and n.target is not getattr:
            continue  # len(), int(), ... on activations give Python values
        act.add(n)
    return act


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(n: fx.Node) -> dict:
    """The arguments of a ``scaled_dot_product_attention`` node by name."""
    args = dict(zip(_SDPA_ARGS, n.args))
    args.update(n.kwargs)
    return args


def _operands(n: fx.Node, rule: GlueRule) -> list | None:
    if rule.kind == "attention":
        a = sdpa_arguments(n)
        if a.get("enable_gqa") or isinstance(a.get("dropout_p", 0.0), fx.Node) \
                or isinstance(a.get("is_causal", False), fx.Node) or isinstance(a.get("scale"), fx.Node):
            return None  # only Python-valued flags are written out
        return [a.get("query"), a.get("key"), a.get("value")]
    if rule.kind in ("pool", "act"):
        return [n.args[0] if n.args else n.kwargs.get("input")]
    if rule.kind == "cat":
        seq = n.args[0] if n.args else n.kwargs.get("tensors")
        return list(seq) if isinstance(seq, (list, tuple)) else None
    if n.op == "call_method":
        return [n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("other")]
    if len(n.args) >= 2:
        return [n.args[0], n.args[1]]
    return [n.args[0] if n.args else n.kwargs.get("input"), n.kwargs.get("other")]


def _float_only(node: fx.Node, parent, float_adds: set) -> bool:
    """Only float ops read ``node``: float readers (GroupNorm, LayerNorm, GELU ...), ``mean`` or adds that stay
    float themselves."""
    from lq.glue._outputs import _reader

    def float_reader(u: fx.Node) -> bool:
        if u in float_adds:
            return True
        if u.op == "call_function" and u.target in FLOAT_ONLY_REDUCERS_FUNCTIONS and not spatial_mean(u):
            return True
        if u.op == "call_method" and u.target in FLOAT_ONLY_REDUCERS_METHODS and not spatial_mean(u):
            return True
        return parent is not None and _reader(u, parent) is not None

    return bool(node.users) and all(float_reader(u) for u in node.users)


def find_sites(graph: fx.Graph, tie=None, parent=None, optional: frozenset = frozenset(), float_only=None) -> list[Site]:
    """Every glue op of ``graph`` whose operands are all activation tensors, in graph order, except adds whose
    result only float ops read (:data:`lq.glue._rules.FLOAT_ONLY_REDUCERS_METHODS`).

    ``tie(node)``: the path of the input quantizer of a layer that also reads ``node``, or None; an ``add``
    operand with one is quantized by it (:data:`lq.glue._rules.TIED_LAYERS`). ``parent``: the traced module
    (to tell what its children are). ``float_only``: a :class:`lq.glue._float_only.FloatOnly` of the captured model,
    which follows a result out of this forward (else a result that leaves it counts as read by an integer op)."""
    act = activations(graph)
    counts: dict[str, int] = {}
    sites = []
    for n in graph.nodes:
        rule = None
        if n.op == "call_function":
            rule = FUNCTIONS.get(n.target)
        elif n.op == "call_method":
            rule = METHODS.get(n.target)
        if rule is None and spatial_mean(n) and _read_by_layer(n, parent):
            rule = POOL
        if rule is None or (rule.kind in OPTIONAL_KINDS and rule.kind not in optional):
            continue
        if rule.kind == "add" and (n.kwargs.get("alpha", 1) != 1 or (n.op == "call_function" and len(n.args) > 2)):
            continue  # add with a scale: not a plain residual join
        ops = _operands(n, rule)
        if not ops or len(ops) < (1 if rule.shared else 2) or not all(isinstance(o, fx.Node) and o in act for o in ops):
            continue
        k = counts.get(rule.kind, 0)
        counts[rule.kind] = k + 1
        site = Site(n, rule, ops, f"{rule.kind}_{k}")
        if rule.kind in JOIN_KINDS | {"cat"} and tie is not None:
            for i, op in enumerate(dict.fromkeys(ops)):
                path = tie(op)
                if path is not None:
                    site.tied[i] = path
        sites.append(site)
    float_adds: set = set()
    for site in reversed(sites):  # readers come later in the graph: decide them first
        if site.rule.kind in JOIN_KINDS and (float_only.value(parent, site.node) if float_only is not None
                                             else _float_only(site.node, parent, float_adds)):
            float_adds.add(site.node)
    sites = [s for s in sites if s.node not in float_adds]
    counts.clear()
    for s in sites:  # names in graph order among the quantized sites
        k = counts.get(s.rule.kind, 0)
        counts[s.rule.kind] = k + 1
        s.name = f"{s.rule.kind}_{k}"
    _tie_to_pools(sites)
    _share_repeated_operands(sites)
    return sites


def spatial_mean(n: fx.Node) -> bool:
    """``x.mean((2, 3), keepdim=True)`` / ``torch.mean(x, (-2, -1), keepdim=True)``: an average over two or more
    trailing axes keeping them, a global average pool of an (N, C, H, W ...) tensor (timm's squeeze-excite).
    A mean over one axis (a transformer's ``h.mean(1)``) is not: it stays a float reducer."""
    if not ((n.op == "call_method" and n.target in FLOAT_ONLY_REDUCERS_METHODS)
            or (n.op == "call_function" and n.target in FLOAT_ONLY_REDUCERS_FUNCTIONS)):
        return False
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    if not isinstance(dims, (tuple, list)) or len(dims) < 2 or not all(isinstance(d, int) for d in dims):
        return False
    if keepdim is not True and not _read_by_linear(n):
        return False  # without keepdim it ends a classifier head, which the export handles (mean first)
    return all(d >= 2 for d in dims) or all(d < 0 for d in dims)


def _read_by_linear(n: fx.Node) -> bool:
    """``x.mean((2, 3))`` whose every reader is a layer call: the global average pool of a classifier head written
    as a mean (torchvision's ``nn.AdaptiveAvgPool2d(1)`` + ``flatten``), quantized as the pool module is."""
    return bool(n.users) and all(u.op == "call_module" for u in n.users)


def _read_by_layer(n: fx.Node, parent) -> bool:
    """A quantized layer (conv, linear) reads the mean: a squeeze-excite's reduce conv. A mean that ends the
    model or a head stays a float reducer: the export moves it in front of a 1x1 head (less work than any
    kernel, lq.export.passes._mean_first)."""
    if parent is None:
        return False
    for u in n.users:
        if u.op == "call_module":
            try:
                if isinstance(parent.get_submodule(u.target), TIED_LAYERS):
                    return True
            except AttributeError:
                continue
    return False


def _tie_to_pools(sites: list[Site]) -> None:
    """An add/mul/cat operand that a pool site also reads is quantized by the pool's quantizer (a squeeze-excite
    block pools the tensor it then scales): one grid for the tensor, so its producer ends in one QuantizeLinear."""
    pools = {s.operands[0]: s for s in sites if s.rule.kind == "pool"}
    for s in sites:
        if s.rule.kind not in JOIN_KINDS | {"cat"}:
            continue
        for i, op in enumerate(dict.fromkeys(s.operands)):
            if i not in s.tied and op in pools:
                s.tied[i] = f"{CHILD}.{pools[op].name}"


def _share_repeated_operands(sites: list[Site]) -> None:
    """A tensor that several joins or concats of one forward read is quantized by the first one's quantizer (or
    what the first one is tied to): one grid for the tensor, so its producer ends in one QuantizeLinear. A DenseNet
    written with ``torch.cat`` of a growing list concatenates every feature again in each later layer: one
    quantizer per concat gave a feature as many grids, which coincide under max calibration and otherwise leave
    the conv that writes it in float (bench.styles' DenseNet style b: 4 of 14 convs)."""
    first: dict[fx.Node, tuple[Site, int]] = {}
    for s in sites:
        if s.rule.kind not in JOIN_KINDS | {"cat"} or s.rule.shared:
            continue
        for i, op in enumerate(dict.fromkeys(s.operands)):
            if op not in first:
                first[op] = (s, i)
            elif i not in s.tied:
                f, j = first[op]
                if j in f.tied:
                    s.tied[i] = f.tied[j]
                else:
                    s.aliases[i] = f.operand_names()[j]
