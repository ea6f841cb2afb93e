"""The sample's side of the export: inputs as a tuple, outputs flattened, dynamic axes by name, the sample grown
along them for verification, and the opset the model needs. Decided before tracing (stage 1)."""

from __future__ import annotations

from typing import Mapping

import torch

MIN_OPSET, MAX_OPSET = 13, 23
#: the opset each exporter writes itself (torch.onnx's current exporter has no translations below 18): the
#: default, so that a user who asked for no opset gets no version conversion and no warning about one
NATIVE_OPSET = {"dynamo": 18, "legacy": 17}


def as_tuple(sample) -> tuple:
    if isinstance(sample, torch.Tensor):
        return (sample,)
    if isinstance(sample, (tuple, list)):
        return tuple(sample)
    raise TypeError(f"sample_input must be a torch.Tensor or a tuple of tensors, got {type(sample).__name__}")


def flatten_out(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        res = []
        for o in out:
            res.extend(flatten_out(o))
        return res
    if isinstance(out, dict):
        res = []
        for o in out.values():
            res.extend(flatten_out(o))
        return res
    raise TypeError(f"model output of type {type(out).__name__} is not supported (tensors, tuples, dicts)")


def grown(args: tuple, dims: list[dict[int, str]]) -> tuple:
    """The sample at twice its size along its dynamic axes other than the batch (each concatenated with itself):
    a second shape that a model with dynamic H and W, or a dynamic sequence length, must run on, with the same
    value distribution. ``dims``: :func:`dynamic_dims` of each tensor input (axes of one name grow together)."""
    out, k = [], 0
    for a in args:
        if isinstance(a, torch.Tensor):
            for d, name in sorted(dims[k].items()):
                if name != "batch":
                    a = torch.cat([a, a], dim=d)
            k += 1
        out.append(a)
    return tuple(out)


def perturbed(args: tuple, seed: int, dims: list[dict[int, str]] | None = None) -> tuple:
    """New rows from the sample, to judge a classifier's top-1 class on more rows than the sample has
    (:mod:`lq.export.verify._judge`): each row of a float input with a batch axis (axis 0 named "batch" in ``dims``)
    mixed with another row of the sample (weights 0.2-0.8), then moved by rounding-level noise (uniform within half
    a step of an 8-bit grid over the tensor's range). Mixed rows are new points of the input domain, so a file that
    disagrees with PyTorch near one sample row is not counted again on copies of it. Integer inputs (token ids,
    masks) are kept."""
    g = torch.Generator().manual_seed(seed)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    batched = [bool(d.get(0) == "batch") for d in dims] if dims is not None else [False] * len(tensors)
    n = next((t.shape[0] for t, b in zip(tensors, batched) if b and t.dim()), 0)
    perm = torch.randperm(n, generator=g) if n > 1 else None
    out, i = [], 0
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_floating_point() and a.numel():
                if perm is not None and batched[i] and a.shape[0] == n:
                    lam = (0.2 + 0.6 * torch.rand(n, generator=g, dtype=a.dtype)).reshape(-1, *([1] * (a.dim() - 1)))
                    a = lam * a + (1 - lam) * a[perm]
                step = float(a.abs().max()) / 127
                a = a + (torch.rand(a.shape, generator=g, dtype=a.dtype) - 0.5) * step
            i += 1
        out.append(a)
    return tuple(out)


def extra_dims(dynamic_dims, tensors: list) -> list[dict[int, str]]:
    """``dynamic_dims`` as ``{axis: name}`` per tensor input: a sequence of axes applies to every input that has
    them (named ``dim<axis>``), a sequence of one mapping per input is taken as given."""
    spec = list(dynamic_dims.values()) if isinstance(dynamic_dims, Mapping) else list(dynamic_dims)
    if spec and all(isinstance(d, Mapping) for d in spec):
        if isinstance(dynamic_dims, Mapping) or len(spec) != len(tensors):
            raise ValueError(f"dynamic_dims: give one {{axis: name}} mapping per tensor input, in order "
                             f"({len(tensors)} input(s)), got {dynamic_dims!r}")
        for m, a in zip(spec, tensors):
            if any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < a.dim() or not isinstance(v, str)
                   for d, v in m.items()):
                raise ValueError(f"dynamic_dims: {m!r} is not allowed for an input of shape {tuple(a.shape)}: "
                                 "{axis: name} with 0 <= axis < its rank and a str name")
        return [dict(m) for m in spec]
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in spec):
        raise ValueError(f"dynamic_dims={dynamic_dims!r} is not allowed: axes >= 1 (dim 0 is dynamic_batch), or one "
                         "{axis: name} mapping per input")
    return [{d: f"dim{d}" for d in spec if d < a.dim()} for a in tensors]


def choose_opset(opset, min_opset: int, exporter: str) -> int:
    """``opset`` as given, or (None) the exporter's own opset raised to what the model's quantizers need
    (:func:`lq.export.prepare._model_checks.model_min_opset`)."""
    if opset is None:
        return max(NATIVE_OPSET[exporter], min_opset)
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset={opset!r} is not allowed: expected an int in [{MIN_OPSET}, {MAX_OPSET}] "
                         "(>= 13 for per-channel axis, >= 19 for FP8, >= 21 for blocked Q/DQ)")
    return opset


def dynamic_dims(a, dynamic_batch: bool, dynamic_spatial: bool, extra: Mapping[int, str] | None = None
                 ) -> dict[int, str]:
    """``{axis: name}`` of the dynamic axes of one input: dim 0 (batch), dims 2.. of an image-like input, and
    its ``extra`` axes (from ``dynamic_dims``)."""
    dims: dict[int, str] = {}
    if not isinstance(a, torch.Tensor) or a.dim() == 0:
        return dims
    if dynamic_batch:
        dims[0] = "batch"
    if dynamic_spatial and a.dim() >= 3:
        for d in range(2, a.dim()):
            dims[d] = ("height", "width")[d - 2] if a.dim() == 4 else f"dim{d}"
    dims.update(extra or {})
    return dims
