"""Shared machinery of the quantized modules: descriptors, quantizer creation, float <-> quant.

``QuantMixin`` (input and weight) and ``QuantInputMixin`` (input only) carry
the class-level default descriptors and :meth:`init_quantizer`, with the
names of NVIDIA's pytorch-quantization toolkit (``_input_quantizer``,
``_weight_quantizer``, ``set_default_quant_desc_input`` ...). On top of that
every quantized module can be built from an existing float module with
:meth:`from_float` (the same Parameter objects, buffers, hooks, device and
train/eval mode) and turned back with :meth:`to_float`.
"""

from __future__ import annotations

import copy
import inspect
from typing import Iterator

import torch
from torch import nn

from lq import tensor_quant
from lq.nn.modules import _bias_shift
from lq.tensor_quant import QuantDescriptor

__all__ = [
    "QuantMixin",
    "QuantInputMixin",
    "input_quant_class",
    "DescriptorTypeError",
    "as_quant_descriptor",
    "pop_quant_desc_in_kwargs",
    "quant_class",
]


#: the layers whose output a bias shift corrects (:mod:`lq.nn.modules._bias_shift`)
_BIASED = (nn.Linear, nn.modules.conv._ConvNd)


class DescriptorTypeError(TypeError, ValueError):
    """A quantization descriptor was neither a ``QuantDescriptor`` nor a dict of its arguments.

    Subclasses both ``TypeError`` and ``ValueError`` (the reference toolkit raises
    ``ValueError`` here), so either ``except`` clause catches it.
    """


def as_quant_descriptor(value, what: str = "quant_desc") -> QuantDescriptor:
    """``value`` as a ``QuantDescriptor``: a descriptor is returned as is, a dict is ``QuantDescriptor(**value)``."""
    if isinstance(value, QuantDescriptor):
        return value
    if isinstance(value, dict):
        try:
            return QuantDescriptor(**value)
        except (TypeError, ValueError) as e:
            raise DescriptorTypeError(f"{what}: invalid QuantDescriptor arguments {value!r}: {e}") from e
    raise DescriptorTypeError(
        f"{what} must be a QuantDescriptor or a dict of QuantDescriptor arguments, got {type(value).__name__}"
    )


def require_fake_quant(desc: QuantDescriptor, owner: str, what: str) -> QuantDescriptor:
    """``desc`` itself, after checking it fake-quantizes: a module's float op cannot take the
    integers a ``fake_quant=False`` quantizer returns (use a ``TensorQuantizer`` alone for those)."""
    if not desc.fake_quant:
        raise ValueError(
            f"Only fake quantization is supported in quantized modules: {owner} got {what} with "
            f"fake_quant=False (leave fake_quant=True)"
        )
    return desc


def unused_keys_error(owner: str, keys, allowed: str) -> TypeError:
    """The error for constructor keywords nobody takes (the words "Unused keys" are what
    callers of the reference toolkit match on)."""
    return TypeError(f"Unused keys: {sorted(keys)}; {owner} takes {allowed}")


def _desc_args(cls) -> str:
    """The descriptor keywords ``cls`` takes, in words."""
    return "quant_desc_input and quant_desc_weight" if cls._has_weight else "quant_desc_input only (it has no weight)"


def _tensor_quantizer_cls():
    # imported lazily: tensor_quantizer imports nothing from here, but keeping the import
    # late lets this file load on its own (and keeps import order free).
    from lq.nn.modules.tensor_quantizer import TensorQuantizer

    return TensorQuantizer


def _module_device(module: nn.Module):
    for t in module.parameters(recurse=False):
        return t.device
    for t in module.buffers(recurse=False):
        return t.device
    for t in module.parameters():
        return t.device
    return None


def _shallow_state(module: nn.Module) -> dict:
    """A copy of ``module.__dict__`` whose containers (parameter, buffer, module and hook
    dicts, flat weight lists ...) are new containers holding the SAME objects."""
    out = {}
    for k, v in module.__dict__.items():
        if isinstance(v, (dict, list, set)):
            v = copy.copy(v)
        out[k] = v
    return out


def _disable_mha_fastpath_hook(module, args):  # noqa: ARG001 - a forward pre-hook that does nothing
    """Present only to make ``nn.TransformerEncoderLayer`` take its Python path.

    The fused inference path of ``TransformerEncoderLayer`` reads the attention
    weights directly and would skip the quantizers; it is not taken when any
    submodule has a forward hook.
    """
    return None


class QuantMixin:
    """Mixin for modules that quantize an input and a weight.

    Class attributes ``default_quant_desc_input`` / ``default_quant_desc_weight``
    are used when a constructor gets no descriptor; change them per class with
    :meth:`set_default_quant_desc_input` / :meth:`set_default_quant_desc_weight`.
    """

    default_quant_desc_input = tensor_quant.QUANT_DESC_8BIT_PER_TENSOR
    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_PER_TENSOR

    #: the torch.nn class this quantized class replaces (set by every subclass)
    _float_module: type | None = None
    #: names of the quantizer submodules (TensorQuantizer or ModuleList of them) this class adds
    _quantizer_names: tuple[str, ...] = ("_input_quantizer", "_weight_quantizer")
    _has_weight = True
    #: with its quantizers passing their inputs on, the forward traces to the graph its float module's does (a
    #: conv, a linear, a pool): the FP32 twin of an export is then the user's plain FP32 export
    #: (:func:`lq.export.timing._float_twin.plain_twin`). False where the float module runs other code (an LSTM's
    #: fused op, ``nn.MultiheadAttention``'s fast path).
    traces_as_float = True

    @classmethod
    def set_default_quant_desc_input(cls, value):
        """Set the class default input descriptor (a ``QuantDescriptor``; a copy is kept)."""
        if not isinstance(value, QuantDescriptor):
            raise DescriptorTypeError(f"{value!r} is not an instance of QuantDescriptor")
        cls.default_quant_desc_input = copy.deepcopy(value)

    @classmethod
    def set_default_quant_desc_weight(cls, value):
        """Set the class default weight descriptor (a ``QuantDescriptor``; a copy is kept)."""
        if not isinstance(value, QuantDescriptor):
            raise DescriptorTypeError(f"{value!r} is not an instance of QuantDescriptor")
        cls.default_quant_desc_weight = copy.deepcopy(value)

    # ------------------------------------------------------------------ descriptors
    @classmethod
    def _resolve_descs(cls, quant_desc_input=None, quant_desc_weight=None):
        qi = cls.default_quant_desc_input if quant_desc_input is None else quant_desc_input
        qi = as_quant_descriptor(qi, f"{cls.__name__} quant_desc_input")
        require_fake_quant(qi, cls.__name__, "quant_desc_input")
        if not cls._has_weight:
            if quant_desc_weight is not None:
                raise unused_keys_error(cls.__name__, ["quant_desc_weight"], _desc_args(cls))
            return qi, None
        qw = cls.default_quant_desc_weight if quant_desc_weight is None else quant_desc_weight
        qw = as_quant_descriptor(qw, f"{cls.__name__} quant_desc_weight")
        require_fake_quant(qw, cls.__name__, "quant_desc_weight")
        return qi, qw

    def init_quantizer(self, quant_desc_input, quant_desc_weight, num_layers=None):
        """Create ``_input_quantizer`` and ``_weight_quantizer`` (or, with ``num_layers``,
        the ModuleLists ``_input_quantizers`` / ``_weight_quantizers``)."""
        TensorQuantizer = _tensor_quantizer_cls()
        owner = type(self).__name__
        quant_desc_input = require_fake_quant(as_quant_descriptor(quant_desc_input, "quant_desc_input"), owner,
                                              "quant_desc_input")
        quant_desc_weight = require_fake_quant(as_quant_descriptor(quant_desc_weight, "quant_desc_weight"), owner,
                                               "quant_desc_weight")
        if num_layers is None:
            self._input_quantizer = TensorQuantizer(quant_desc_input)
            self._weight_quantizer = TensorQuantizer(quant_desc_weight)
        else:
            self._input_quantizers = nn.ModuleList(TensorQuantizer(quant_desc_input) for _ in range(num_layers))
            self._weight_quantizers = nn.ModuleList(TensorQuantizer(quant_desc_weight) for _ in range(num_layers))

    def _setup_quantizers(self, quant_desc_input, quant_desc_weight):
        """Build every quantizer of this class from resolved descriptors (overridden by
        modules with more quantizers than one input and one weight)."""
        self.init_quantizer(quant_desc_input, quant_desc_weight)

    @property
    def input_quantizer(self):
        return self._input_quantizer

    @property
    def weight_quantizer(self):
        return self._weight_quantizer

    # ------------------------------------------------------------------ introspection
    def iter_quantizers(self) -> Iterator[tuple[str, nn.Module]]:
        """``(name, TensorQuantizer)`` for this module's own quantizers (``_input_quantizers.0`` ...)."""
        TensorQuantizer = _tensor_quantizer_cls()
        for name in self._quantizer_names:
            q = self._modules.get(name)
            if isinstance(q, TensorQuantizer):
                yield name, q
            elif isinstance(q, nn.ModuleList):
                for i, qq in enumerate(q):
                    yield f"{name}.{i}", qq

    def weight_quantizer_pairs(self) -> Iterator[tuple[nn.Module, torch.Tensor]]:
        """``(quantizer, weight tensor)`` for every weight this module quantizes (what a
        weight calibrator needs; a quantizer shared by several weights appears once per weight)."""
        if self._has_weight and "_weight_quantizer" in self._modules:
            yield self._weight_quantizer, self.weight

    # ------------------------------------------------------------------ float <-> quant
    @classmethod
    def from_float(cls, module: nn.Module, quant_desc_input=None, quant_desc_weight=None):
        """A quantized module built from the float ``module``, sharing its state.

        The new module holds the SAME Parameter and buffer objects (``new.weight is
        module.weight``), hooks and attributes, sits on the same device, keeps the
        dtype and the train/eval mode; ``module`` itself is not modified. Descriptors
        default to the class defaults.

        Raises:
            TypeError: ``module`` is not an instance of the float class, is already
                quantized, or is a subclass that overrides ``forward``.
        """
        float_cls = cls._float_module
        if isinstance(module, QuantMixin):
            raise TypeError(f"{type(module).__name__} is already a quantized module")
        if float_cls is None or not isinstance(module, float_cls):
            raise TypeError(
                f"{cls.__name__}.from_float expects a {getattr(float_cls, '__name__', float_cls)}, "
                f"got {type(module).__name__}"
            )
        if getattr(type(module), "forward", None) is not getattr(float_cls, "forward", None):
            raise TypeError(
                f"{type(module).__name__} overrides forward(); converting it to {cls.__name__} would "
                f"change what it computes. Map it explicitly to a quantized class of its own."
            )
        qi, qw = cls._resolve_descs(quant_desc_input, quant_desc_weight)
        new = cls.__new__(cls)
        new.__dict__.update(_shallow_state(module))
        new._init_quant(qi, qw)
        return new

    def _init_quant(self, quant_desc_input=None, quant_desc_weight=None):
        """Constructor tail: resolve descriptors, create the quantizers on the module's device."""
        qi, qw = type(self)._resolve_descs(quant_desc_input, quant_desc_weight)
        self._from_float_children(qi, qw)
        self._setup_quantizers(qi, qw)
        self._place_quantizers(_module_device(self))
        if isinstance(self, _BIASED):
            _bias_shift.install(self)

    def _from_float_children(self, quant_desc_input, quant_desc_weight):
        """Hook for modules whose children must be converted too (attention's out_proj)."""

    def _place_quantizers(self, device):
        for _, q in self.iter_quantizers():
            if device is not None:
                q.to(device)
            q.train(self.training)

    def to_float(self) -> nn.Module:
        """The float ``torch.nn`` module, sharing this module's parameters and buffers
        (quantizers and their amax are dropped)."""
        float_cls = self._float_module
        state = _bias_shift.without(_shallow_state(self))
        for name in self._quantizer_names:
            state["_modules"].pop(name, None)
        for key in self._extra_attrs():
            state.pop(key, None)
        new = float_cls.__new__(float_cls)
        new.__dict__.update(state)
        self._to_float_children(new)
        return new

    def _extra_attrs(self) -> tuple[str, ...]:
        return ()

    def _to_float_children(self, new: nn.Module):
        """Hook: turn quantized children of the float copy ``new`` back to float."""


class QuantInputMixin(QuantMixin):
    """Mixin for modules that quantize their input only (pooling, normalization, add/cat)."""

    _quantizer_names = ("_input_quantizer",)
    _has_weight = False
    default_quant_desc_weight = None

    @classmethod
    def set_default_quant_desc_weight(cls, value):
        raise TypeError(f"{cls.__name__} has no weight to quantize")

    def init_quantizer(self, quant_desc_input, quant_desc_weight=None, num_layers=None):
        """Create ``_input_quantizer``."""
        if quant_desc_weight is not None:
            raise unused_keys_error(type(self).__name__, ["quant_desc_weight"], _desc_args(type(self)))
        TensorQuantizer = _tensor_quantizer_cls()
        desc = as_quant_descriptor(quant_desc_input, "quant_desc_input")
        self._input_quantizer = TensorQuantizer(require_fake_quant(desc, type(self).__name__, "quant_desc_input"))

    @property
    def weight_quantizer(self):
        raise AttributeError(f"{type(self).__name__} has no weight quantizer")


def pop_quant_desc_in_kwargs(quant_cls, input_only=False, **kwargs):
    """Pop ``quant_desc_input`` / ``quant_desc_weight`` from ``kwargs`` (class defaults when
    absent); raise on any other leftover key. Returns the descriptor(s) like the reference
    toolkit: ``quant_desc_input`` alone when ``input_only``, else the pair."""
    qi = kwargs.pop("quant_desc_input", None)
    qw = kwargs.pop("quant_desc_weight", None)
    if kwargs:
        allowed = "quant_desc_input" if input_only else "quant_desc_input and quant_desc_weight"
        raise unused_keys_error(getattr(quant_cls, "__name__", str(quant_cls)), kwargs, allowed)
    qi = as_quant_descriptor(quant_cls.default_quant_desc_input if qi is None else qi, "quant_desc_input")
    if input_only:
        return qi
    qw = as_quant_descriptor(quant_cls.default_quant_desc_weight if qw is None else qw, "quant_desc_weight")
    return qi, qw


def quant_signature(float_cls: type, with_weight: bool) -> inspect.Signature:
    """``float_cls.__init__``'s signature with keyword-only ``quant_desc_input`` (and
    ``quant_desc_weight``) added: what ``inspect.signature`` (and so LightningCLI /
    jsonargparse) shows for the quantized class."""
    sig = inspect.signature(float_cls.__init__)
    params = list(sig.parameters.values())
    var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    params = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    extra = [inspect.Parameter("quant_desc_input", inspect.Parameter.KEYWORD_ONLY, default=None)]
    if with_weight:
        extra.append(inspect.Parameter("quant_desc_weight", inspect.Parameter.KEYWORD_ONLY, default=None))
    return sig.replace(parameters=params + extra + var_kw)


def _keyword_params(float_cls: type):
    """Names ``float_cls(...)`` takes as keywords: from the first ``__init__`` along the MRO
    that lists them (``nn.LSTM`` forwards ``**kwargs`` to ``nn.RNNBase``); None when all
    of them take ``**kwargs``."""
    for klass in float_cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL} - {"self"}
    return None


def quant_class(cls):
    """Class decorator for ``class QuantX(nn.X, QuantMixin)``: records ``nn.X`` as the float
    class and, unless the class defines its own, gives it the constructor
    ``QuantX(*nn.X args, quant_desc_input=None, quant_desc_weight=None, **nn.X kwargs)``."""
    float_cls = cls.__bases__[0]
    cls._float_module = float_cls
    if "__init__" not in cls.__dict__:

        float_params = _keyword_params(float_cls)
        takes_any = float_params is None
        allowed = f"the arguments of torch.nn.{float_cls.__name__} plus {_desc_args(cls)}"

        def __init__(self, *args, quant_desc_input=None, quant_desc_weight=None, **kwargs):
            unknown = [] if takes_any else [k for k in kwargs if k not in float_params]
            if unknown:  # checked before anything is built, with the words the reference uses
                raise unused_keys_error(cls.__name__, unknown, allowed)
            float_cls.__init__(self, *args, **kwargs)
            self._init_quant(quant_desc_input, quant_desc_weight)

        __init__.__qualname__ = f"{cls.__name__}.__init__"
        __init__.__doc__ = (
            f"Same arguments as ``torch.nn.{float_cls.__name__}``, plus keyword-only ``quant_desc_input``"
            + (" and ``quant_desc_weight``" if cls._has_weight else "")
            + " (None: the class defaults)."
        )
        cls.__init__ = __init__
    cls.__init__.__signature__ = quant_signature(float_cls, cls._has_weight)
    return cls


def _input_quantized_forward(self, input):
    return self._float_module.forward(self, self._input_quantizer(input))


def input_quant_class(float_cls: type, module: str) -> type:
    """``Quant<float_cls>``: the float module's own ``forward`` applied to its quantized input.

    For modules whose only quantized tensor is the input (pooling, instance norm): a
    subclass of ``float_cls`` and :class:`QuantInputMixin`, registered with :func:`quant_class`.
    """
    name = "Quant" + float_cls.__name__
    cls = type(
        name,
        (float_cls, QuantInputMixin),
        {
            "__module__": module,
            "__qualname__": name,
            "__doc__": f"``nn.{float_cls.__name__}`` applied to its quantized input (per tensor by default).",
            "forward": _input_quantized_forward,
        },
    )
    return quant_class(cls)
