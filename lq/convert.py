"""Convert an existing model to quantized modules, without monkey-patching (the recommended API).

::

    from lq.convert import quantize_model
    summary = quantize_model(model, exclude=["head"],
                             overrides={"stem.*": {"weight": {"num_bits": 8, "axis": None}}})
    print(summary)            # a table: layer, type, bits, axis, amax
    logger.log_table(summary.rows())

Conversion is by exact module type (``type_map``), filtered by module-name
globs (``include`` / ``exclude``, :func:`fnmatch.fnmatchcase`; a pattern that
matches a module also matches everything inside it, so ``exclude=["head"]``
leaves the whole head float). Converted modules hold the SAME Parameter and
buffer objects, stay on their device, keep their dtype and train/eval mode.

Guarantees: every argument and every layer is validated and every new module
is built BEFORE the model is touched, so any error leaves the model exactly as
it was; modules that are already quantized are left alone (converting twice is
a no-op).
"""

from __future__ import annotations

import fnmatch
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from torch import nn

from lq import nn as quant_nn
from lq.glue import _float_region
from lq.glue._outputs import float_stem
from lq.rules.onnxruntime import ort_gates_silu
from lq.nn.modules._utils import DescriptorTypeError, QuantMixin, as_quant_descriptor
from lq.nn.modules.quant_activation import gate_descriptor
from lq.nn.modules.tensor_quantizer import iter_quantizers  # (name, TensorQuantizer) for every quantizer

__all__ = [
    "quantize_model",
    "dequantize_model",
    "iter_quantizers",
    "summarize",
    "QuantizationSummary",
    "LayerSummary",
    "DEFAULT_TYPE_MAP",
    "ConversionError",
    "UnsupportedModuleTypeError",
    "OverrideError",
    "DescriptorTypeError",
]

#: ``{float class: quantized class}`` for every float module type lq can quantize (read-only view)
DEFAULT_TYPE_MAP: Mapping[type, type] = types.MappingProxyType(dict(quant_nn.QUANT_MODULE_CLASSES))

_OVERRIDE_KEYS = ("input", "weight")


class ConversionError(ValueError):
    """Quantizing a model failed; the model was not modified."""


class UnsupportedModuleTypeError(ConversionError, TypeError):
    """``type_map`` names a type lq cannot quantize, or maps it to something that is not a quantized class."""


class OverrideError(ConversionError):
    """An ``overrides`` entry is malformed or its glob matches no quantized layer."""


# ====================================================================== helpers
def _as_patterns(value, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    try:
        out = tuple(value)
    except TypeError:
        raise TypeError(f"{what} must be a glob string or a list of them, got {value!r}") from None
    for p in out:
        if not isinstance(p, str):
            raise TypeError(f"{what} must contain glob strings, got {p!r}")
    return out


def _matches(name: str, patterns: Iterable[str]) -> bool:
    """True when ``name`` or one of its ancestors ("a", "a.b" for "a.b.c") matches a pattern."""
    parts = name.split(".") if name else [""]
    candidates = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(c, p) for p in patterns for c in candidates)


def _normalize_type_map(type_map) -> dict[type, type]:
    if type_map is None:
        return dict(DEFAULT_TYPE_MAP)
    if isinstance(type_map, Mapping):
        items = list(type_map.items())
    elif isinstance(type_map, (list, tuple, set, frozenset)):
        items = [(t, None) for t in type_map]
    else:
        raise UnsupportedModuleTypeError(
            f"type_map must be a dict {{float class: quantized class}} or a list of float classes, got {type_map!r}"
        )
    out = {}
    for float_cls, quant_cls in items:
        if not (isinstance(float_cls, type) and issubclass(float_cls, nn.Module)):
            raise UnsupportedModuleTypeError(f"type_map key {float_cls!r} is not an nn.Module class")
        if quant_cls is None:
            quant_cls = DEFAULT_TYPE_MAP.get(float_cls)
            if quant_cls is None:
                known = ", ".join(sorted(t.__name__ for t in DEFAULT_TYPE_MAP))
                raise UnsupportedModuleTypeError(
                    f"lq has no quantized version of {float_cls.__module__}.{float_cls.__name__}; "
                    f"quantizable types: {known} (or map it to a quantized class of your own)"
                )
        if not (isinstance(quant_cls, type) and callable(getattr(quant_cls, "from_float", None))):
            raise UnsupportedModuleTypeError(
                f"type_map[{float_cls.__name__}] = {quant_cls!r} is not a quantized module class "
                "(a class with a from_float(module, quant_desc_input, quant_desc_weight) classmethod)"
            )
        expected = getattr(quant_cls, "_float_module", None)
        if expected is not None and not issubclass(float_cls, expected):
            raise UnsupportedModuleTypeError(
                f"type_map[{float_cls.__name__}] = {quant_cls.__name__}, which converts "
                f"{expected.__name__} modules, not {float_cls.__name__}"
            )
        out[float_cls] = quant_cls
    return out


def _normalize_overrides(overrides) -> list[tuple[str, dict]]:
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise OverrideError(f"overrides must be a dict {{glob: {{'input': ..., 'weight': ...}}}}, got {overrides!r}")
    out = []
    for pattern, spec in overrides.items():
        if not isinstance(pattern, str) or not pattern:
            raise OverrideError(f"overrides key {pattern!r} is not a module-name glob (a non-empty str)")
        if not isinstance(spec, Mapping):
            raise OverrideError(
                f"overrides[{pattern!r}] must be a dict with keys {_OVERRIDE_KEYS}, got {type(spec).__name__}"
            )
        bad = [k for k in spec if k not in _OVERRIDE_KEYS]
        if bad:
            raise OverrideError(f"overrides[{pattern!r}] has unknown key(s) {bad}; allowed: {_OVERRIDE_KEYS}")
        descs = {}
        for k, v in spec.items():
            descs[k] = as_quant_descriptor(v, f"overrides[{pattern!r}][{k!r}]")
        out.append((pattern, descs))
    return out


def _model_device(model: nn.Module):
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


# ====================================================================== summary
def _fmt_bits(q) -> str:
    if q is None:
        return "-"
    if not q.is_enabled or not q._if_quant:
        return "off"
    if q.is_fp8:
        return "fp8"
    return f"{'u' if q.unsigned else ''}int{q.num_bits}"


def _fmt_axis(q) -> str:
    if q is None:
        return "-"
    if q.block_sizes is not None:
        return "blocks " + ",".join(f"{k}:{v}" for k, v in q.block_sizes.items() if not isinstance(k, str))
    return "tensor" if q.axis is None else f"axis {q.axis}"


def _amax_stats(qs) -> tuple[float | None, float | None]:
    vals = [q.amax.detach().float() for q in qs if q is not None and q.amax is not None]
    if not vals:
        return None, None
    return min(float(v.min()) for v in vals), max(float(v.max()) for v in vals)


@dataclass
class LayerSummary:
    """One quantized (or deliberately skipped) layer."""

    name: str
    type: str
    status: str  # "quantized" | "already quantized" | "excluded"
    input_bits: Any = None
    input_axis: Any = None
    input_amax: float | None = None
    input_amax_min: float | None = None
    weight_bits: Any = None
    weight_axis: Any = None
    weight_amax: float | None = None
    weight_amax_min: float | None = None
    num_quantizers: int = 0
    input_dynamic: bool = False
    weight_dynamic: bool = False
    _input_text: str = field(default="-", repr=False)
    _weight_text: str = field(default="-", repr=False)

    @classmethod
    def of_glue(cls, name: str, label: str, quantizers: list, status: str) -> "LayerSummary":
        """A glue op (``x + y``, ``torch.cat``, ``a @ b``) of a module's forward and its operand quantizers."""
        q = quantizers[0]
        lo, hi = _amax_stats(quantizers)
        return cls(name=name, type=label, status=status, input_bits=q.num_bits, input_axis=q.axis,
                   input_amax=hi, input_amax_min=lo, num_quantizers=len(quantizers),
                   input_dynamic=bool(q.dynamic), _input_text=f"{_fmt_bits(q)} {_fmt_axis(q)}")

    @classmethod
    def of(cls, name: str, module: nn.Module, status: str) -> "LayerSummary":
        if not isinstance(module, QuantMixin):
            return cls(name=name, type=type(module).__name__, status=status)
        inputs, weights = [], []
        for qname, q in module.iter_quantizers():
            (weights if "weight" in qname else inputs).append(q)
        # out_proj of attention and similar quantized children count as this layer's
        for _, child in module.named_children():
            if isinstance(child, QuantMixin):
                for qname, q in child.iter_quantizers():
                    (weights if "weight" in qname else inputs).append(q)
        qi = inputs[0] if inputs else None
        qw = weights[0] if weights else None
        imin, imax = _amax_stats(inputs)
        wmin, wmax = _amax_stats(weights)
        return cls(
            name=name,
            type=type(module).__name__,
            status=status,
            input_bits=None if qi is None else qi.num_bits,
            input_axis=None if qi is None else qi.axis,
            input_amax=imax,
            input_amax_min=imin,
            weight_bits=None if qw is None else qw.num_bits,
            weight_axis=None if qw is None else qw.axis,
            weight_amax=wmax,
            weight_amax_min=wmin,
            num_quantizers=len(inputs) + len(weights),
            input_dynamic=bool(qi is not None and qi.dynamic),
            weight_dynamic=bool(qw is not None and qw.dynamic),
            _input_text=f"{_fmt_bits(qi)} {_fmt_axis(qi)}" if qi is not None else "-",
            _weight_text=f"{_fmt_bits(qw)} {_fmt_axis(qw)}" if qw is not None else "-",
        )

    def row(self) -> dict:
        d = asdict(self)
        d.pop("_input_text")
        d.pop("_weight_text")
        for k in ("input_bits", "weight_bits", "input_axis", "weight_axis"):
            if isinstance(d[k], tuple):
                d[k] = list(d[k])
        return d


def _fmt_amax(lo, hi, dynamic: bool = False) -> str:
    if dynamic:
        return "dynamic"
    if hi is None:
        return "uncalibrated"
    if lo is None or f"{lo:.3g}" == f"{hi:.3g}":
        return f"{hi:.4g}"
    return f"{lo:.3g}..{hi:.3g}"


class QuantizationSummary:
    """Which layers were quantized, with bits, axis and amax.

    ``print(summary)`` shows a table (rich's, when rich is installed);
    ``rich.print(summary)`` renders it in color; :meth:`rows` gives a list of
    plain dicts for loggers (``logger.log_table(key, data=...)``, CSV, ...).
    """

    def __init__(self, layers: list[LayerSummary], notes: list[str] | None = None):
        self.layers = list(layers)
        self.notes = list(notes or [])

    @property
    def quantized(self) -> list[str]:
        """Names of the layers converted by this call."""
        return [layer.name for layer in self.layers if layer.status == "quantized"]

    @property
    def skipped(self) -> list[str]:
        """Names of quantizable layers left float (excluded by name)."""
        return [layer.name for layer in self.layers if layer.status == "excluded"]

    def rows(self) -> list[dict]:
        return [layer.row() for layer in self.layers]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerSummary]:
        return iter(self.layers)

    def __getitem__(self, name: str) -> LayerSummary:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    _HEADERS = ("layer", "type", "status", "input", "input amax", "weight", "weight amax")

    def _table_rows(self) -> list[tuple[str, ...]]:
        return [
            (
                layer.name,
                layer.type,
                layer.status,
                layer._input_text,
                _fmt_amax(layer.input_amax_min, layer.input_amax, layer.input_dynamic)
                if layer._input_text != "-" else "-",
                layer._weight_text,
                _fmt_amax(layer.weight_amax_min, layer.weight_amax, layer.weight_dynamic)
                if layer._weight_text != "-" else "-",
            )
            for layer in self.layers
        ]

    def _title(self) -> str:
        n = sum(1 for layer in self.layers if layer.status != "excluded")
        return f"lq quantization summary: {n} quantized layer(s), {len(self.skipped)} excluded"

    def __rich__(self):
        from rich.table import Table

        table = Table(title=self._title())
        for h in self._HEADERS:
            table.add_column(h, no_wrap=h in ("layer",))
        for row in self._table_rows():
            table.add_row(*row)
        if self.notes:
            table.caption = "; ".join(self.notes)
        return table

    def _plain(self) -> str:
        rows = [self._HEADERS] + self._table_rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._HEADERS))]
        lines = [self._title()]
        for k, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        try:
            import io

            from rich.console import Console
        except ImportError:  # pragma: no cover - rich is a dependency
            return self._plain()
        buf = io.StringIO()
        Console(file=buf, width=160, color_system=None, force_terminal=False).print(self.__rich__())
        return buf.getvalue().rstrip("\n")

    def __repr__(self) -> str:
        return f"QuantizationSummary({len(self.layers)} layers, quantized={self.quantized})"


def summarize(model: nn.Module) -> QuantizationSummary:
    """The summary of every quantized layer of ``model`` as it is now (e.g. after calibration)."""
    layers: list[LayerSummary] = []
    seen: set[int] = set()
    inside: list[str] = []  # quantized layers already listed: their quantized children belong to them
    for name, m in model.named_modules():
        if not isinstance(m, QuantMixin) or id(m) in seen:
            continue
        if any(name.startswith(p + ".") for p in inside):
            continue
        seen.add(id(m))
        inside.append(name)
        layers.append(LayerSummary.of(name, m, "quantized"))
    return QuantizationSummary(layers)


# ====================================================================== conversion
def _quantize_with_recipe(model, recipe, target, *, type_map, include, exclude, overrides, glue,
                          unsigned_after_relu, recurrent, activations, sample,
                          shared_inputs=None) -> "QuantizationSummary":
    """quantize_model without descriptors: the recipe (or the target's), changed by the arguments given."""
    from dataclasses import replace

    from lq import recipe as _recipe
    from lq.config import QuantConfig, coerce

    if recipe is not None and target is not None:
        raise ValueError("quantize_model: give recipe= or target= (which picks a recipe), not both")
    cfg = coerce(recipe, QuantConfig, "quantize_model: recipe") if recipe is not None else \
        _recipe.default_recipe(target or "onnxruntime")
    changes = {k: v for k, v in (("glue", glue), ("unsigned_after_relu", unsigned_after_relu),
                                 ("recurrent", recurrent), ("activations", activations),
                                 ("shared_inputs", shared_inputs)) if v is not None}
    include = list(_as_patterns(include, "include"))
    if include != ["*"]:  # the user's selection replaces the recipe's; excludes add up
        changes["include"] = include
    changes["exclude"] = list(cfg.exclude) + list(_as_patterns(exclude, "exclude"))
    cfg = replace(cfg, **changes)
    return _recipe.apply_recipe(model, cfg, type_map=None if type_map is None else _normalize_type_map(type_map),
                                overrides=dict(_normalize_overrides(overrides)), sample=sample)


@dataclass
class _Target:
    module: nn.Module
    name: str
    quant_cls: type
    locations: list = field(default_factory=list)  # [(parent, attribute)]
    new: nn.Module | None = None
    row: int = -1  # index of this layer in the summary


def quantize_model(
    model: nn.Module,
    *,
    type_map=None,
    include=("*",),
    exclude=(),
    overrides=None,
    quant_desc_input=None,
    quant_desc_weight=None,
    glue: bool | None = None,
    unsigned_after_relu: bool | None = None,
    recurrent: str | None = None,
    activations: bool | None = None,
    recipe=None,
    target: str | None = None,
    sample=None,
    shared_inputs: bool | None = None,
) -> QuantizationSummary:
    """Replace the float modules of ``model`` by quantized ones, in place.

    With no descriptor (``quant_desc_input``/``quant_desc_weight``) the layers get a recipe: ``recipe`` (a name in
    :data:`lq.config.RECIPES` or a :class:`lq.config.QuantConfig`), else the one for ``target``
    (:data:`lq.recipe.TARGET_RECIPES`: ``int8_onnxruntime`` for onnxruntime, the default; ``int8_per_channel``,
    pytorch-quantization's numbers, for tensorrt; ``int8_openvino`` for openvino). The other arguments then change the recipe's choice. With a
    descriptor, the layers get exactly what is given (and each class's default for the other role), as
    pytorch-quantization's ``quant_modules`` does.

    Args:
        model: the model (modified in place; the root module itself is never replaced).
        recipe: see above; not together with a descriptor.
        target: ``onnxruntime``, ``tensorrt`` or ``openvino``: picks the recipe when neither a recipe nor a
            descriptor is given.
        type_map: ``{float class: quantized class}`` (a value of None means lq's class for
            that type), or a list of float classes; default :data:`DEFAULT_TYPE_MAP`
            (every type lq can quantize). Matching is by exact type.
        include: module-name globs to convert (default all).
        exclude: module-name globs to leave float (wins over ``include``).
        overrides: ``{glob: {"input": QuantDescriptor | dict, "weight": ...}}`` per-layer
            descriptors; when several globs match a layer, later entries win.
        quant_desc_input / quant_desc_weight: descriptors for every converted layer
            (QuantDescriptor or dict); None keeps each class's default (per-tensor
            inputs, per-channel weights).
        glue: also quantize the glue ops written in the modules' own forwards (``x + y``,
            ``torch.cat``, ``a @ b`` between activations; see :mod:`lq.glue`), so a residual add
            runs as an integer add and the layers feeding it fuse. Their quantizers are named
            ``<module>.lq_glue.add_0_a`` ... (globs in ``overrides``/``exclude`` reach them). A module
            torch.fx cannot trace keeps its glue float; the summary's notes name it.
        unsigned_after_relu: 8-bit per-tensor input quantizers (layers' and glue's) that only ever see
            a ReLU's output (pooled, reshaped ...) quantize on the unsigned grid ``[0, 255]``: twice the
            steps, and onnxruntime drops the ReLU (:mod:`lq.glue._nonneg`). onnxruntime only: TensorRT
            takes int8 Q/DQ. Part of :class:`lq.config.Int8ReduceRangeConfig`.
        recurrent: how the new ``QuantLSTM`` layers quantize their activations. ``"scan"``: with their input
            quantizers (calibrated; pytorch-quantization's numbers), exported as an ONNX ``Scan`` loop for any
            runtime. ``"dynamic"``: as onnxruntime's fused ``DynamicQuantizeLSTM`` does, from each tensor
            itself (:meth:`lq.nn.QuantLSTM.set_runtime_dynamic`; onnxruntime only, no ``proj_size``): one
            kernel per layer, faster than the loop where the layer is small.

        activations: also quantize ``x * y`` of two activations in the modules' forwards (a squeeze-excite
            gate, a SiLU written out) like an add, so onnxruntime runs QLinearMul/QLinearSigmoid; part of
            :class:`lq.config.Int8OnnxruntimeConfig` (``QuantConfig.activations``, which also swaps
            ``nn.SiLU``/``nn.Hardswish`` through ``type_map`` for their input-quantized versions; one that reads
            a 1-3 channel stem onnxruntime runs in float stays float).
        shared_inputs: quantized layers that read the same tensor use one input quantizer
            (:class:`lq.config.QuantConfig`; implied by ``glue`` with ``activations``).

    Returns:
        a :class:`QuantizationSummary` of the converted, already quantized and excluded layers.

    Raises:
        UnsupportedModuleTypeError: ``type_map`` names a type without a quantized class.
        OverrideError: a malformed ``overrides`` entry, or a glob that matches no quantized layer.
        DescriptorTypeError: a descriptor that is not a QuantDescriptor or a dict of its arguments.
        ConversionError: a layer could not be converted (the message names it).
        In every case the model is left untouched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if quant_desc_input is None and quant_desc_weight is None:
        return _quantize_with_recipe(model, recipe, target, type_map=type_map, include=include, exclude=exclude,
                                     overrides=overrides, glue=glue, unsigned_after_relu=unsigned_after_relu,
                                     recurrent=recurrent, activations=activations, sample=sample,
                                     shared_inputs=shared_inputs)
    if recipe is not None or target is not None:
        raise ValueError("quantize_model: give a recipe (recipe= or target=) or descriptors (quant_desc_input/"
                         "quant_desc_weight), not both: a recipe sets both descriptors")
    glue = True if glue is None else glue
    unsigned_after_relu = bool(unsigned_after_relu)
    recurrent = "scan" if recurrent is None else recurrent
    activations = bool(activations)
    shared_inputs = bool(shared_inputs)
    from lq.config import RECURRENT_MODES

    if recurrent not in RECURRENT_MODES:
        raise ValueError(f"quantize_model: recurrent={recurrent!r} is not allowed: "
                         f"choose one of {list(RECURRENT_MODES)}")
    tmap = _normalize_type_map(type_map)
    include = _as_patterns(include, "include")
    exclude = _as_patterns(exclude, "exclude")
    rules = _normalize_overrides(overrides)
    qi_all = None if quant_desc_input is None else as_quant_descriptor(quant_desc_input, "quant_desc_input")
    qw_all = None if quant_desc_weight is None else as_quant_descriptor(quant_desc_weight, "quant_desc_weight")

    root_selected = _matches("", include) and not _matches("", exclude)
    if not isinstance(model, QuantMixin) and type(model) in tmap and root_selected:
        raise ConversionError(
            f"the model itself is a {type(model).__name__}, which quantize_model cannot replace in place; "
            f"use {tmap[type(model)].__name__}.from_float(model) instead"
        )

    # ---- phase 1: find targets (nothing is modified)
    targets: dict[int, _Target] = {}
    decisions: dict[int, tuple[bool, str]] = {}
    layers: list[LayerSummary] = []
    already: dict[int, str] = {}
    visited_parents: set[int] = set()

    def visit(parent: nn.Module, prefix: str):
        if id(parent) in visited_parents:
            return
        visited_parents.add(id(parent))
        for attr, child in parent._modules.items():
            if child is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if isinstance(child, QuantMixin):
                if id(child) not in already:
                    already[id(child)] = name
                    layers.append(LayerSummary.of(name, child, "already quantized"))
                continue
            quant_cls = tmap.get(type(child))
            if quant_cls is not None:
                selected = _matches(name, include) and not _matches(name, exclude)
                prev = decisions.get(id(child))
                if prev is not None and prev[0] != selected:
                    raise ConversionError(
                        f"the same {type(child).__name__} module is used as {prev[1]!r} and {name!r}, which "
                        "include/exclude treat differently; a shared module is either quantized or not"
                    )
                if prev is None:
                    decisions[id(child)] = (selected, name)
                if selected:
                    t = targets.setdefault(id(child), _Target(child, name, quant_cls))
                    if not any(p is parent and a == attr for p, a in t.locations):
                        t.locations.append((parent, attr))
                    if prev is None:
                        layers.append(None)  # placeholder, filled after conversion (keeps model order)
                        t.row = len(layers) - 1
                    continue
                if prev is None:
                    layers.append(LayerSummary.of(name, child, "excluded"))
            visit(child, name)

    visit(model, "")

    # ---- glue ops in the modules' own forwards (traced, nothing modified)
    glue_plans, glue_outputs, glue_notes = [], [], []
    pool_pairs: list = []
    tensor_groups: list = []  # layers reading one tensor through pools and concats (lq.glue._tensor_ties)
    region = None  # what stays float at the model's input (lq.glue._float_region), onnxruntime recipe only
    region_names: list[str] = []  # the quantizers it leaves out (input quantizers of its modules, output ones)
    argument_pairs: list = []
    one_tensor = None  # the forwards joined (lq.glue._whole), where each tensor's readers get one quantizer
    unsigned: set[str] = set()
    call_shapes: dict = {}  # id(module) -> its output's shape on the sample (what size-dependent rules read)
    if glue or unsigned_after_relu or shared_inputs:
        from lq import glue as _glue
        from lq.glue import _argument_ties, _pool_grid, _join_ties, _tensor_ties

        graphs: dict = {}
        will_be_quantized = lambda m: isinstance(m, QuantMixin) or id(m) in targets  # noqa: E731
        captured, capture_notes = _captured(model, sample)
        if captured is not None and activations:
            call_shapes = captured.output_shapes(model)
        if captured is not None:
            idle = [t.name for t in targets.values() if not captured.ran(t.module)]
            if idle:
                capture_notes.append(f"{', '.join(idle[:6])}{' ...' if len(idle) > 6 else ''} never ran on the sample "
                                     "(a layer whose weight a function outside it uses, or an unused branch): quantized, "
                                     "and calibration turns off the quantizers of layers that see no data")
        glue_plans, glue_outputs, glue_already, glue_notes = _glue.plan(
            model, selected=lambda n: _matches(n, include) and not _matches(n, exclude),
            skip=will_be_quantized, will_be_quantized=will_be_quantized, graphs=graphs,
            optional=(_glue.ACTIVATIONS if activations else frozenset()) | (
                {"mul"} if shared_inputs and not glue else frozenset()), captured=captured)
        glue_notes = capture_notes + glue_notes
        if not glue:  # but, for OpenVINO, a join reads a layer's input on its grid (lq.glue._join_ties)
            glue_plans = _join_ties.tied_joins(glue_plans) if shared_inputs else []
            for t in _join_ties.unread_pools(targets.values(), glue_plans) if shared_inputs else []:
                del targets[id(t.module)]
                layers[t.row] = None  # not a layer the recipe quantizes: no row
        if activations:  # the float stem and what reads it in float (lq.glue._float_region)
            region = _float_region.float_region(model, graphs, glue_plans if glue else [], will_be_quantized,
                                                _glue._outputs.pooled_stems(model, graphs))
            for t in [t for t in targets.values() if id(t.module) in region.modules]:
                del targets[id(t.module)]
                layers[t.row] = LayerSummary.of(t.name, t.module, f"float: {_float_region.REASON}")
                region_names.append(f"{t.name}._input_quantizer")
            region_names += [o.path for o in glue_outputs if region.writes_float(o.layer)]
            glue_outputs = [o for o in glue_outputs if not region.writes_float(o.layer)]
        if (glue and activations) or shared_inputs:  # one tensor on one grid: a max pool's output and its reader,
            # (the captured forwards, or without a capture the fx-traced ones: one walk either way)
            one_tensor = _glue.whole_graph(model, captured if captured is not None else graphs)
            pool_pairs = _pool_grid.pool_readers(one_tensor, will_be_quantized)
            if shared_inputs and captured is not None:  # and, for OpenVINO, through max pools and concats
                tensor_groups = _tensor_ties.tensor_groups(one_tensor, will_be_quantized)
            # and every quantizer reading one tensor, in whichever forward (lq.glue._one_tensor)
        if not glue:
            glue_outputs, glue_already, glue_notes = [], [], []
        # a child's join operand and the caller's layer reading the same tensor: one grid (lq.glue._argument_ties)
        argument_pairs = _argument_ties.argument_readers(model, graphs, glue_plans, will_be_quantized)
        if unsigned_after_relu:
            unsigned = _glue.unsigned_inputs(model, graphs, glue_plans, will_be_quantized)
    glue_plans = [p for p in glue_plans if not any(_matches(q, exclude) for q in p.quantizer_paths())]
    glue_outputs = [o for o in glue_outputs if not _matches(o.path, exclude)]
    if glue:
        for name, m in model.named_modules():
            if isinstance(m, QuantMixin) and _glue._outputs.has_output_quantizer(m):
                path = f"{name}.{_glue._outputs.ATTR}"
                layers.append(LayerSummary.of_glue(path, "output", [m._modules[_glue._outputs.ATTR]],
                                                   "already quantized"))
                already[id(m._modules[_glue._outputs.ATTR])] = path
        for name in glue_already:
            m = model.get_submodule(name)
            for qname, qd in m._modules[_glue.CHILD].items():
                full = f"{name}.{_glue.CHILD}.{qname}" if name else f"{_glue.CHILD}.{qname}"
                layers.append(LayerSummary.of_glue(full, "glue", [qd], "already quantized"))
                already[id(qd)] = full

    # ---- overrides: validate that every glob hits a quantized layer
    quant_names = ([t.name for t in targets.values()] + list(already.values())
                   + [q for p in glue_plans for q in p.quantizer_paths()] + [o.path for o in glue_outputs])
    for pattern, _ in rules:
        if not any(_matches(n, [pattern]) for n in quant_names):
            sample = ", ".join(quant_names[:8]) + (" ..." if len(quant_names) > 8 else "")
            raise OverrideError(
                f"overrides glob {pattern!r} matches no quantized layer (quantized layers: {sample or 'none'})"
            )

    # ---- phase 2: build every new module (the model is still untouched)
    device = _model_device(model)
    for t in targets.values():
        qi, qw = qi_all, qw_all
        for pattern, descs in rules:
            if _matches(t.name, [pattern]):
                qi = descs.get("input", qi)
                qw = descs.get("weight", qw)
        if not getattr(t.quant_cls, "_has_weight", True):
            qw = None
        if f"{t.name}._input_quantizer" in unsigned:
            qi = _unsigned_desc(qi if qi is not None else t.quant_cls.default_quant_desc_input)
        try:
            t.new = t.quant_cls.from_float(t.module, qi, qw)
            if recurrent == "dynamic" and isinstance(t.new, quant_nn.QuantLSTM):
                if t.new.proj_size > 0:  # the fused op has no projection: this layer keeps the calibrated loop
                    glue_notes.append(f"{t.name}: proj_size={t.new.proj_size}, which onnxruntime's fused "
                                      "DynamicQuantizeLSTM cannot express: quantized with its input quantizers "
                                      "(recurrent='scan') instead")
                else:
                    t.new.set_runtime_dynamic(True)
        except DescriptorTypeError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the layer's name
            raise ConversionError(f"cannot quantize {t.name!r} ({type(t.module).__name__}): {e}") from e
        if activations and isinstance(t.new, QuantMixin) and (
                id(t.module) in region.convs if region is not None else float_stem(t.module)):
            t.new._input_quantizer.disable()  # runs in float on the model's input: lq.glue._float_region
        if (isinstance(t.new, quant_nn.QuantSiLU) and t.new._input_quantizer.is_enabled
                and ort_gates_silu(call_shapes.get(id(t.module)))):  # a large map: the gate on the integers too
            t.new.quantize_gate()
        has_state = any(True for _ in t.module.parameters()) or any(True for _ in t.module.buffers())
        if not has_state and device is not None and isinstance(t.new, QuantMixin):
            for _, q in t.new.iter_quantizers():
                q.to(device)

    def converted(m: nn.Module) -> nn.Module:
        """The quantized module that replaces ``m`` (``m`` itself when it is not swapped)."""
        return targets[id(m)].new if id(m) in targets else m

    def glue_desc(path: str):
        d = qi_all
        for pattern, descs in rules:
            if _matches(path, [pattern]):
                d = descs.get("input", d)
        d = d if d is not None else quant_nn.QuantAdd.default_quant_desc_input
        if path.endswith("_gate"):  # an F.silu site's gate (lq.glue._sites.Site.gated): on [0, 1]
            return gate_descriptor(d)
        return _unsigned_desc(d) if path in unsigned else d

    for p in glue_plans:
        try:
            p.build(glue_desc, converted)
        except DescriptorTypeError:
            raise
        except Exception as e:  # noqa: BLE001 - a module whose rewrite fails keeps its glue float
            glue_notes.append(f"{p.name or 'the model'} ({type(p.module).__name__}): its +, torch.cat and matmul "
                              f"stay float (rewriting its forward failed: {type(e).__name__}: {e})")
            p.cls = p.table = None
            continue
        if region is not None:  # a squeeze-excite product in the float region: float (lq.glue._float_region)
            for site in p.sites:
                if (id(p.module), site.name) in region.sites:
                    for q in site.quantizer_names():
                        p.quantizers[q].disable()
        if device is not None:
            p.quantizers.to(device)
    glue_plans = [p for p in glue_plans if p.built]
    tensor_readers: list = []  # every read of one tensor, in whichever forward (lq.glue._one_tensor)
    if one_tensor is not None:
        from lq.glue import _one_tensor

        tensor_readers = _one_tensor.reader_groups(one_tensor, glue_plans, will_be_quantized)
    output_quantizers = []
    for o in glue_outputs:
        q = _glue.GlueQuantizer(glue_desc(o.path))
        output_quantizers.append(q.to(device) if device is not None else q)

    # ---- phase 3: commit (plain dict assignments; cannot fail half way)
    notes = list(glue_notes)
    for t in targets.values():
        for parent, attr in t.locations:
            parent._modules[attr] = t.new
        layers[t.row] = LayerSummary.of(t.name, t.new, "quantized")
    if region_names:  # checkpoints of an lq that quantized them still load
        model.register_load_state_dict_pre_hook(_float_region.OldQuantizerKeys(region_names))
    if tensor_groups:  # before the pools take their readers' quantizers
        _tensor_ties.share(tensor_groups, converted)
    if pool_pairs:
        _pool_grid.share(pool_pairs, converted)
    if argument_pairs:
        _argument_ties.share(argument_pairs, converted)
    if tensor_readers:
        _one_tensor.share(tensor_readers, converted)
    for o, q in zip(glue_outputs, output_quantizers, strict=True):
        layer = converted(o.layer)
        _glue._outputs.commit(o, layer, q)
        layers.append(LayerSummary.of_glue(o.path, f"output -> {o.reader}", [q], "quantized"))
    for p in glue_plans:
        p.commit()
        for s in p.sites:
            qs = p.site_quantizers(s)
            status = "quantized" if any(q.is_enabled for q in qs) else f"float: {_float_region.REASON}"
            layers.append(LayerSummary.of_glue(p.path(s.name), p.label(s), qs, status))
    if any(isinstance(t.new, quant_nn.QuantMultiheadAttention) for t in targets.values()):
        for name, m in model.named_modules():
            if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False):
                m.use_nested_tensor = False
                notes.append(f"{name or 'model'}: nested-tensor fast path turned off (it would bypass the quantizers)")
    return QuantizationSummary([row for row in layers if row is not None], notes)


def _call_args(sample) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a model call on ``sample``: a tensor, a tuple/list of positional inputs, or a dict of
    keyword inputs (what :func:`lq.export_onnx` takes)."""
    if isinstance(sample, dict):
        return (), dict(sample)
    if isinstance(sample, (list, tuple)):
        return tuple(sample), {}
    return (sample,), {}


def _captured(model: nn.Module, sample):
    """``(capture or None, notes)``: the model run once on ``sample`` (or its ``example_input_array``, Lightning's
    attribute) and recorded, in eval and in train mode (a module whose forward runs other ops in training keeps
    its glue float: the quantizers are placed by counting its calls). Without a sample, or when the run fails,
    placement traces each module with torch.fx, and a note says so."""
    from lq.capture import capture

    if sample is None:
        sample = getattr(model, "example_input_array", None)
    if sample is None:
        return None, ["no sample to capture the model with: glue placed per module by torch.fx tracing "
                      "(quantize_model(model, sample=batch_of_inputs) places it on the whole model's graph)"]
    args, kwargs = _call_args(sample)
    try:
        captured = capture(model, args, kwargs)
    except Exception as e:  # noqa: BLE001 - the fx path still quantizes the layers
        return None, [f"running the model on the sample failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}): "
                      "glue placed per module by torch.fx tracing"]
    try:
        trained = capture(model, args, kwargs, training=True)
    except Exception:  # noqa: BLE001 - e.g. BatchNorm on one row: nothing to compare with
        trained = None
    if trained is not None:
        for mid, graph in captured.graphs.items():
            other = trained.graphs.get(mid)
            if other is not None and mid not in captured.varying and _keys(graph) != _keys(other):
                captured.varying[mid] = "its forward runs other ops in training than in evaluation"
    return captured, list(captured.notes)


def _keys(graph) -> list:
    return [n.meta.get("lq_call", (n.op, n.target))[0] for n in graph.nodes if n.op != "placeholder"]


def _unsigned_desc(d):
    """``d`` on the unsigned grid, where that is an 8-bit integer per-tensor quantizer (else ``d``)."""
    if d is None or d.is_fp8 or d.unsigned or d.asymmetric or d.num_bits != 8 or d.axis is not None or d.block_sizes:
        return d
    return type(d)(**{**d.dict(), "unsigned": True})


def dequantize_model(model: nn.Module) -> nn.Module:
    """Turn every quantized module of ``model`` back into its float ``torch.nn`` module, in place
    (the same Parameter objects; quantizers and amax are dropped). Returns the model, or the float
    module when ``model`` itself is a quantized module."""
    if isinstance(model, QuantMixin):
        model = model.to_float()
    from lq import glue as _glue

    for m in list(model.modules()):
        _glue.remove(m)
        _glue._outputs.remove(m)
    replaced: dict[int, nn.Module] = {}
    stack = [model]
    seen = set()
    while stack:
        parent = stack.pop()
        if id(parent) in seen:
            continue
        seen.add(id(parent))
        for attr, child in list(parent._modules.items()):
            if child is None:
                continue
            if isinstance(child, QuantMixin) and getattr(child, "_float_module", None) is not None:
                if id(child) not in replaced:
                    replaced[id(child)] = child.to_float()
                parent._modules[attr] = replaced[id(child)]
                continue
            stack.append(child)
    return model
