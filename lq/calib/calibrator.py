"""Base class of every calibrator (the API of ``pytorch_quantization.calib.calibrator``).

A calibrator watches tensors (:meth:`_Calibrator.collect`) and proposes an
amax (:meth:`_Calibrator.compute_amax`). All calibrators share ONE signature::

    collect(x)                          # add a batch
    reset()                             # forget everything
    compute_amax(method=None, **kwargs) # None when no data was seen

``method`` and the method keyword arguments (``stride``, ``start_bin``,
``percentile``) are accepted by every calibrator, so one call works for all of
them; calibrators without methods (max, EMA, min/max) ignore them.

State is declared torchmetrics-style with :meth:`_Calibrator.add_state`,
naming how each state merges across calibrators and processes ("max", "min",
"sum", or a custom merge implemented by the subclass). :meth:`merge` folds in
another calibrator of the same kind; :meth:`sync` does the same across the
processes of a ``torch.distributed`` process group (a no-op when
``torch.distributed`` is not initialized) so every rank ends with identical
statistics; :meth:`state_dict` / :meth:`load_state_dict` persist them.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from lq import _checks

__all__ = ["_Calibrator", "METHODS", "METHOD_KWARGS"]

#: Every method name any calibrator understands ("max" and None mean: the calibrator's own rule).
METHODS = (None, "max", "entropy", "mse", "percentile", "sample_mean")
#: Keyword arguments of :meth:`_Calibrator.compute_amax` (histogram methods); others are a TypeError.
METHOD_KWARGS = ("stride", "start_bin", "percentile")

_REDUCE_FX = ("max", "min", "sum", "cat", "custom")
#: states a calibrator's state_dict from before they existed lacks (the signed range, the per-sample extremes)
_ADDED_LATER = ("_range_", "_sample_")


def _norm_calib_axis(axis):
    """The descriptor's axis rule (None, an int or a tuple of distinct ints): one definition, in tensor_quant."""
    from lq.tensor_quant import _norm_axis

    return _norm_axis(axis)


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class _Calibrator:
    """Abstract base of calibrators.

    Args:
        num_bits: bits of the quantization the amax is for (an int, or ``(4, 3)`` for FP8).
        axis: None (per tensor) or the axis / axes that keep their own amax.
        unsigned: whether the quantization is unsigned.
    """

    def __init__(self, num_bits=8, axis=None, unsigned=False):
        if isinstance(num_bits, (list, tuple)):
            if tuple(num_bits) != (4, 3):
                raise ValueError(f"num_bits={tuple(num_bits)!r} is not supported: use an int or (4, 3) for FP8 E4M3")
            num_bits = (4, 3)
        else:
            _checks.check_num_bits(num_bits, bool(unsigned))
        if not isinstance(unsigned, bool):
            raise TypeError(f"unsigned must be a bool, got {unsigned!r}")
        self._num_bits = num_bits
        self._axis = _norm_calib_axis(axis)
        self._unsigned = unsigned
        self._state_specs: dict[str, tuple[Any, str]] = {}
        self._warned_nonfinite = False
        self._nonfinite_total = 0

    # ------------------------------------------------------------------ state declaration
    def add_state(self, name: str, default: Any, dist_reduce_fx: str) -> None:
        """Declare a piece of state and how it merges ("max", "min", "sum", "cat" or "custom")."""
        if dist_reduce_fx not in _REDUCE_FX:
            raise ValueError(f"dist_reduce_fx={dist_reduce_fx!r} is not allowed: one of {_REDUCE_FX}")
        self._state_specs[name] = (copy.deepcopy(default), dist_reduce_fx)
        setattr(self, name, copy.deepcopy(default))

    def _config(self) -> dict:
        """Constructor settings that must match for merge / load_state_dict."""
        return {"num_bits": self._num_bits, "axis": self._axis, "unsigned": self._unsigned}

    # ------------------------------------------------------------------ the API
    def collect(self, x: torch.Tensor) -> None:
        """Add the statistics of tensor ``x``."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget all collected statistics."""
        for name, (default, _) in self._state_specs.items():
            setattr(self, name, copy.deepcopy(default))
        self._warned_nonfinite = False
        self._nonfinite_total = 0

    def compute_amax(self, method=None, **kwargs):
        """The amax to quantize with (float32 tensor), or None when no data was collected."""
        raise NotImplementedError

    @property
    def has_data(self) -> bool:
        """True once a tensor was collected."""
        raise NotImplementedError

    @property
    def num_bits(self):
        return self._num_bits

    @property
    def axis(self):
        return self._axis

    @property
    def unsigned(self) -> bool:
        return self._unsigned

    @property
    def nonfinite_count(self) -> int:
        """How many NaN/Inf values were skipped so far (in this process)."""
        return self._nonfinite_total

    # ------------------------------------------------------------------ the signed range (asymmetric quantizers)
    def _track_range(self) -> None:
        """Also keep the signed min and max of per-tensor data (subclasses call this in ``__init__``): an
        asymmetric quantizer clips that range with the method's amax (:meth:`compute_range`)."""
        self.add_state("_range_min", None, "min")
        self.add_state("_range_max", None, "max")

    def _note_range(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        lo, hi = lo.detach().float().reshape(()), hi.detach().float().reshape(())
        if self._range_min is None:
            self._range_min, self._range_max = lo, hi
        else:
            dev = self._range_min.device
            self._range_min = torch.minimum(self._range_min, lo.to(dev))
            self._range_max = torch.maximum(self._range_max, hi.to(dev))

    def compute_range(self):
        """``(min_range, max_range)`` of the finite data seen, widened to hold 0 (float32 scalars); None when
        this calibrator keeps no signed range (per channel, blocks) or saw no data."""
        lo, hi = getattr(self, "_range_min", None), getattr(self, "_range_max", None)
        if lo is None:
            return None
        return torch.minimum(lo, torch.zeros_like(lo)).clone(), torch.maximum(hi, torch.zeros_like(hi)).clone()

    # ------------------------------------------------------------------ helpers for subclasses
    @staticmethod
    def _check_method(method, kwargs, allowed=METHODS) -> None:
        if method not in allowed:
            raise ValueError(f"calibration method {method!r} is not supported: allowed {allowed}")
        unknown = set(kwargs) - set(METHOD_KWARGS)
        if unknown:
            raise TypeError(f"unknown compute_amax argument(s) {sorted(unknown)}; allowed {list(METHOD_KWARGS)}")

    def _input(self, x) -> torch.Tensor:
        """``x`` detached; integer and bool tensors as float32 (the reference toolkit calibrates them too)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.collect expects a torch.Tensor, got {type(x).__name__}")
        if x.is_complex():
            raise TypeError(f"{type(self).__name__}.collect expects a real tensor (float, integer or bool), "
                            f"got {x.dtype}")
        x = x.detach()
        return x if x.is_floating_point() else x.float()

    def _reduce_dims(self, x: torch.Tensor) -> tuple[tuple[int, ...], list[int]]:
        """(dims reduced, keepdim shape of the amax) for the calibrator's axis on ``x``."""
        if self._axis is None:
            return tuple(range(x.dim())), []
        axes = self._axis if isinstance(self._axis, tuple) else (self._axis,)
        keep = sorted({_checks.normalize_axis(a, x.dim()) for a in axes})
        dims = tuple(d for d in range(x.dim()) if d not in keep)
        shape = [x.shape[d] if d in keep else 1 for d in range(x.dim())]
        return dims, shape

    def _note_nonfinite(self, count: int) -> None:
        if count <= 0:
            return
        self._nonfinite_total += count
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"{type(self).__name__}: skipped {count} non-finite value(s) (NaN/Inf) in a calibration batch; "
                "they never enter amax (further occurrences are counted in .nonfinite_count, not warned)",
                RuntimeWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ merge / sync
    def _check_same_kind(self, other) -> None:
        if type(other) is not type(self):
            raise TypeError(f"cannot merge a {type(other).__name__} into a {type(self).__name__}")
        if other._config() != self._config():
            raise ValueError(
                f"cannot merge {type(self).__name__}s with different settings: {self._config()} vs {other._config()}"
            )

    def merge(self, other: "_Calibrator") -> "_Calibrator":
        """Fold the statistics of ``other`` (same class and settings) into this one; returns self."""
        self._check_same_kind(other)
        for name, (_, fx) in self._state_specs.items():
            setattr(self, name, _merge_values(getattr(self, name), getattr(other, name), fx, name))
        self._merge_custom(other)
        self._nonfinite_total += other._nonfinite_total
        return self

    def _merge_custom(self, other) -> None:
        """Merge the states declared "custom" (subclasses)."""

    def sync(self, process_group=None) -> "_Calibrator":
        """Reduce the statistics over ``process_group`` so every rank ends with the same state.

        No-op when ``torch.distributed`` is not initialized. Ranks that saw no
        data take part (they contribute nothing). Returns self.
        """
        if not _dist_ready():
            return self
        for name, (_, fx) in self._state_specs.items():
            if fx in ("max", "min", "sum"):
                setattr(self, name, _sync_tensor(getattr(self, name), fx, process_group))
            elif fx == "cat":
                setattr(self, name, _sync_cat(getattr(self, name), process_group))
        self._sync_custom(process_group)
        return self

    def _sync_custom(self, process_group) -> None:
        """Sync the states declared "custom" (subclasses)."""

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """Settings and collected statistics (tensors detached, on their device)."""
        state = {"class": type(self).__name__, "config": self._config(), "nonfinite_total": self._nonfinite_total}
        for name in self._state_specs:
            state[name] = _detach(getattr(self, name))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (settings must match)."""
        if state.get("class") != type(self).__name__:
            raise ValueError(f"state_dict is of a {state.get('class')}, not of a {type(self).__name__}")
        if state.get("config") != self._config():
            raise ValueError(
                f"{type(self).__name__} state_dict has settings {state.get('config')}, this calibrator {self._config()}"
            )
        missing = [n for n in self._state_specs if n not in state and not n.startswith(_ADDED_LATER)]
        if missing:
            raise KeyError(f"{type(self).__name__} state_dict lacks {missing}")
        for name in self._state_specs:  # a state_dict from before a state was added has none: None
            setattr(self, name, _detach(state.get(name)))
        self._nonfinite_total = int(state.get("nonfinite_total", 0))

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({cfg})"


# ---------------------------------------------------------------------- helpers
def finite_minmax(x: torch.Tensor, dims: tuple[int, ...], shape: list[int]):
    """``(min, max, nonfinite_count)`` of ``x`` over ``dims`` (float32, reshaped to ``shape``), NaN/Inf skipped.

    One reduction pass for finite data; only a batch holding NaN/Inf takes a second, masked pass. A channel
    with no finite value gets ``(0, 0)``.
    """
    if len(dims) == x.dim():
        lo, hi = torch.aminmax(x)
    else:
        lo, hi = x.amin(dim=dims), x.amax(dim=dims)
    lo, hi = lo.float(), hi.float()
    count = 0
    if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
        finite = torch.isfinite(x)
        count = int((~finite).sum())
        big = torch.finfo(x.dtype).max
        lo = torch.where(finite, x, torch.full((), big, dtype=x.dtype, device=x.device)).amin(dim=dims).float()
        hi = torch.where(finite, x, torch.full((), -big, dtype=x.dtype, device=x.device)).amax(dim=dims).float()
        none = lo > hi
        lo = torch.where(none, torch.zeros_like(lo), lo)
        hi = torch.where(none, torch.zeros_like(hi), hi)
    return lo.reshape(shape), hi.reshape(shape), count


def _detach(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, list):
        return [_detach(e) for e in v]
    return copy.deepcopy(v)


def _merge_values(a, b, fx: str, name: str):
    if fx == "custom":
        return a
    if fx == "cat":
        return list(a or []) + list(b or [])
    if a is None:
        return _detach(b)
    if b is None:
        return a
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape:
            raise ValueError(f"cannot merge state {name!r}: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
        b = b.to(a.device)
        if fx == "max":
            return torch.maximum(a, b)
        if fx == "min":
            return torch.minimum(a, b)
        return a + b
    if fx == "max":
        return max(a, b)
    if fx == "min":
        return min(a, b)
    return a + b


def _gather_objects(obj, process_group):
    world = torch.distributed.get_world_size(process_group)
    out = [None] * world
    torch.distributed.all_gather_object(out, obj, group=process_group)
    return out


def _comm_device(t: torch.Tensor | None, process_group) -> torch.device:
    backend = torch.distributed.get_backend(process_group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def summed_over_ranks(values: list[int], process_group=None) -> list[int]:
    """Integer counts summed over the processes of ``process_group`` (themselves without torch.distributed): what
    every rank needs to take the same decision from counts each rank made on its own batches."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_comm_device(None, process_group))
    torch.distributed.all_reduce(t, group=process_group)
    return [int(v) for v in t.tolist()]


def _sync_tensor(value, fx: str, process_group):
    """all_reduce a tensor-or-None state; ranks holding None contribute the identity of ``fx``."""
    dist = torch.distributed
    meta = None if value is None else (tuple(value.shape), str(value.dtype)) if isinstance(value, torch.Tensor) else (
        "py", type(value).__name__)
    metas = [m for m in _gather_objects(meta, process_group) if m is not None]
    if not metas:
        return value
    if len(set(metas)) != 1:
        raise ValueError(f"cannot sync calibrator state across ranks: shapes differ between ranks {metas}")
    m = metas[0]
    if m[0] == "py":
        t = torch.tensor([float(value) if value is not None else _identity(fx)], dtype=torch.float64)
        t = t.to(_comm_device(None, process_group))
        dist.all_reduce(t, op=_OPS[fx](), group=process_group)
        r = t.item()
        return int(r) if m[1] == "int" else r
    shape, dtype = m
    orig_device = value.device if value is not None else torch.device("cpu")
    dev = _comm_device(value, process_group)
    if value is None:
        t = torch.full(shape, _identity(fx), dtype=getattr(torch, dtype.split(".")[-1]), device=dev)
    else:
        t = value.detach().to(dev).clone()
    dist.all_reduce(t, op=_OPS[fx](), group=process_group)
    return t.to(orig_device)


def _sync_cat(value, process_group):
    gathered = _gather_objects([_detach(v).cpu() if isinstance(v, torch.Tensor) else v for v in (value or [])],
                               process_group)
    return [v for part in gathered for v in part]


def _identity(fx: str) -> float:
    return {"max": float("-inf"), "min": float("inf"), "sum": 0.0}[fx]


_OPS = {
    "max": lambda: torch.distributed.ReduceOp.MAX,
    "min": lambda: torch.distributed.ReduceOp.MIN,
    "sum": lambda: torch.distributed.ReduceOp.SUM,
}
