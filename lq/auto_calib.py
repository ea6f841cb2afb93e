"""``method="auto"``: choose each layer group's calibration method by how close the model stays to float.

No single method suits every activation: LayerNorm outputs carry a few huge channels that must not be
clipped, GELU outputs have long thin tails that should be, a post-ReLU conv input is spiky (TensorRT's
entropy clips it to nothing). ``auto`` collects histograms like the histogram methods, starts every input
quantizer at ``max`` and then, group by group, keeps whichever of max / percentile / mse / entropy brings
the quantized model's outputs closest to the float model's (mean cosine) on the first calibration batches
(:func:`lq.sensitivity.calibration_method_search`). Groups are layer roles: module names with their
numeric indices wildcarded, so ``encoder.layer.0.attention.self.query`` ... ``layer.5`` choose together
(measured on all-MiniLM-L6-v2: mean cosine 0.991 where the best single method gives 0.980).

Under torch.distributed the metric is averaged over the ranks before every comparison, so every rank takes
the same decisions (their histograms are already reduced).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

#: what ``auto`` tries, in order (the first is where every group starts)
CANDIDATES = ("max", "percentile", "mse", "entropy")
#: the percentile candidate: the 99.99th clips LayerNorm outlier channels; 99.999 measured best on MiniLM
PERCENTILE = 99.999
#: calibration batches the metric runs on
SELECTION_BATCHES = 2


def role(layer: str) -> str:
    """``encoder.layer.3.attention.self.query`` -> ``encoder.layer.*.attention.self.query``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", layer)


def groups(model: nn.Module, names: Iterable[str]) -> dict[str, list[str]]:
    """``{role: [exact globs of its layers]}`` for the quantized layers owning the quantizers ``names``."""
    from lq.sensitivity import _glob_escape, quantized_layers

    layers = quantized_layers(model)
    wanted = {n.rsplit(".", 1)[0] for n in names}
    out: dict[str, list[str]] = {}
    for layer in layers:
        if layer in wanted or any(w.startswith(layer + ".") for w in wanted):
            out.setdefault(role(layer), []).append(_glob_escape(layer))
    return out


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _ddp_mean(metric: Callable[[nn.Module], float | None], process_group=None):
    """The metric averaged over the ranks that have selection batches (a rank without any joins every
    reduction with an empty contribution, so no rank waits for it)."""
    if not _distributed():
        return metric
    from lq.calib.calibrator import _comm_device

    def averaged(model):
        v = metric(model)
        t = torch.tensor([0.0 if v is None else float(v), 0.0 if v is None else 1.0], dtype=torch.float64,
                         device=_comm_device(None, process_group))
        torch.distributed.all_reduce(t, group=process_group)
        return float(t[0] / t[1]) if t[1] > 0 else 0.0

    averaged.higher_is_better = getattr(metric, "higher_is_better", True)
    return averaged


def choose(model: nn.Module, quantizers: list, methods: Mapping[str, str], batches: list,
           forward: Callable[[nn.Module, Any], Any], process_group=None) -> dict[str, str]:
    """Set amax of the ``auto`` quantizers (already loaded at ``max``) by the search; ``{role: method}``."""
    from lq.sensitivity import calibration_method_search, fidelity_metric

    auto = [n for n, _ in quantizers if methods.get(n) == "auto"]
    grp = groups(model, auto)
    if not grp or (not batches and not _distributed()):
        return {}
    try:
        if batches:
            metric = fidelity_metric(model, batches[:SELECTION_BATCHES], forward=forward, kind="cosine")
        else:  # this rank's shard was empty: it still takes part in every reduction
            def metric(m):
                return None
    except Exception as e:  # noqa: BLE001 - any output we cannot compare: fall back, say so
        warnings.warn(f"calibration method 'auto' fell back to 'max': the model's output on a calibration batch "
                      f"is not a tensor to compare ({e}); choose a method, or give calibration a forward that "
                      "returns one", RuntimeWarning, stacklevel=3)
        return {}
    result = calibration_method_search(model, _ddp_mean(metric, process_group), groups=grp,
                                       methods=CANDIDATES, percentile=PERCENTILE)
    return result.methods
