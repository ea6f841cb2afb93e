"""Block-quantized Linear weights calibrated better than round-to-nearest: a per-block scale search and AWQ.

Round-to-nearest with the block's own max (``block_method="max"``) wastes levels on one outlier per block and
treats every input channel alike. Two searches, both on what the model holds (amax buffers, weights and the input
quantizer's ``pre_quant_scale``), so the exported file computes exactly what the fake-quant model does:

* ``"mse"``: per block, the amax ``shrink * max|w|`` (``shrink`` on a grid from ``MIN_SHRINK`` to 1) with the
  smallest squared error of the block's fake-quantized weights. ``shrink = 1`` is round-to-nearest, so the weight
  error is never larger.
* ``"awq"`` (activation-aware, after Lin et al. 2023): input channels that see large activations matter more. Per
  Linear, ``s = mag^alpha`` (``mag``: the mean ``|x|`` of each input channel over the calibration data), the
  weight becomes ``W * s`` (its columns scaled up before quantization) and the input ``x * (1 / s)``
  (``TensorQuantizer.pre_quant_scale``: one per-channel Mul before the MatMul in the file); ``alpha`` on a grid in
  [0, 1] is chosen per layer on the layer's output error over the calibration rows, with the MSE block search on
  the scaled weight. Linears that read one tensor (Q/K/V) share one ``s``, chosen on their outputs together.
  Round-to-nearest (``alpha = 0``, max) is one of the candidates, so the output error on those rows is never
  larger. Then :mod:`lq.calib._awq_fold` moves ``1 / s`` into the op before where that is exact (a LayerNorm only
  those Linears read; V's output rows for attention's output projection): no Mul there in the file.

Only weight-only block quantizers (blocks along a Linear's input features, input quantizer disabled) take the
activation scaling: with an enabled input quantizer the scaled activations would quantize differently.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterable

import torch
from torch import nn

from lq._float64 import ops_for
from lq.config import BLOCK_METHODS
#: the smallest fraction of a block's max the MSE search tries, and how many fractions up to 1
MIN_SHRINK, SHRINK_STEPS = 0.5, 21
#: AWQ's exponents alpha (0 = no scaling)
ALPHAS = tuple(i / 10 for i in range(11))
#: calibration rows (tokens) per layer that AWQ's output error is measured on (spread over the batches)
MAX_ROWS, ROWS_PER_BATCH = 512, 128


@dataclasses.dataclass
class BlockChoice:
    """What the search chose for one layer, and the errors it compared (mean squared, on its own data)."""

    layer: str
    shrink: float  # mean chosen fraction of the block max (1 = round-to-nearest)
    alpha: float = 0.0  # AWQ exponent (0: no activation scaling)
    rtn_error: float = 0.0  # weight error (mse) or output error (awq; of its group) of round-to-nearest
    error: float = 0.0  # the same error after the search
    group: list[str] = dataclasses.field(default_factory=list)  # awq: the Linears reading its input (one scale)
    folded: str = ""  # awq: the op that took 1 / s ("": a Mul before the Linear)


def block_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose 2-D weight has a calibrated, static block quantizer with blocks along the input features."""
    out = []
    for name, m in model.named_modules():
        tq = getattr(m, "_weight_quantizer", None)
        w = getattr(m, "weight", None)
        if tq is None or not isinstance(w, torch.Tensor) or w.dim() != 2 or not tq.is_enabled:
            continue
        blocks = tq.block_sizes
        if not blocks or tq.dynamic or tq.amax is None or tq.is_fp8:
            continue
        axes = [a for a in blocks if isinstance(a, int)]
        if len(axes) == 1 and axes[0] % 2 == 1 and blocks.get("scale_bits") is None:
            out.append((name, m))
    return out


def _block_size(m: nn.Module) -> int:
    return int(next(v for a, v in m._weight_quantizer.block_sizes.items() if isinstance(a, int)))


def _fake_quant(wb: torch.Tensor, amax: torch.Tensor, tq) -> torch.Tensor:
    """``wb`` (N, K / B, B) fake-quantized with block amax (N, K / B) as the model's quantizer does (its kernel)."""
    return ops_for(wb).fake_quant(wb, amax.unsqueeze(-1).contiguous(), tq.num_bits, tq.unsigned, tq.narrow_range)


def mse_block_amax(w: torch.Tensor, block: int, tq) -> tuple[torch.Tensor, torch.Tensor]:
    """(block amax (N, K / B) with the smallest squared weight error per block, that error); ``shrink = 1`` (the
    block max) is among the candidates."""
    n, k = w.shape
    wb = w.detach().float().reshape(n, k // block, block)
    top = wb.abs().amax(-1)
    best_amax, best_err = top, ((_fake_quant(wb, top, tq) - wb) ** 2).sum(-1)
    for shrink in torch.linspace(MIN_SHRINK, 1.0, SHRINK_STEPS)[:-1].tolist():
        a = top * shrink
        err = ((_fake_quant(wb, a, tq) - wb) ** 2).sum(-1)
        better = err < best_err
        best_amax, best_err = torch.where(better, a, best_amax), torch.where(better, err, best_err)
    return best_amax, best_err


def _set_amax(m: nn.Module, amax: torch.Tensor) -> None:
    tq = m._weight_quantizer
    tq.amax = amax.reshape(tq.amax.shape).to(tq.amax.device)


def search_mse(model: nn.Module, layers: list[tuple[str, nn.Module]] | None = None) -> list[BlockChoice]:
    """Per-block MSE scale search for every block-quantized Linear weight of ``model`` (or of ``layers``); sets
    their amax."""
    out = []
    for name, m in block_layers(model) if layers is None else layers:
        w, block = m.weight.detach(), _block_size(m)
        amax, err = mse_block_amax(w, block, m._weight_quantizer)
        top = w.float().reshape(w.shape[0], -1, block).abs().amax(-1)
        rtn = ((_fake_quant(w.float().reshape(w.shape[0], -1, block), top, m._weight_quantizer)
                - w.float().reshape(w.shape[0], -1, block)) ** 2).sum()
        _set_amax(m, amax)
        shrink = float((amax / top.clamp_min(1e-30)).mean())
        out.append(BlockChoice(name, shrink, 0.0, float(rtn) / w.numel(), float(err.sum()) / w.numel()))
    return out


class _Rows:
    """Per-channel mean |x| and up to ``MAX_ROWS`` rows of a Linear's input, from a forward pre-hook."""

    def __init__(self, k: int):
        self.abs_sum = torch.zeros(k, dtype=torch.float64)
        self.count = 0
        self.rows: list[torch.Tensor] = []
        self.kept = 0

    def __call__(self, module, args):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1]).cpu()
        self.abs_sum += x.abs().sum(0, dtype=torch.float64)
        self.count += x.shape[0]
        if self.kept < MAX_ROWS:  # rows spread over each batch, and over the first batches
            take = x[:: max(1, x.shape[0] // ROWS_PER_BATCH)][: min(ROWS_PER_BATCH, MAX_ROWS - self.kept)]
            self.rows.append(take.clone())
            self.kept += take.shape[0]


def search_awq(model: nn.Module, batches: Iterable, forward: Callable[[nn.Module, Any], Any],
               num_batches: int | None = None, fold: bool = True) -> list[BlockChoice]:
    """AWQ: per weight-only block-quantized Linear, the activation scale ``s = mag^alpha`` and block amax with the
    smallest output error on the calibration rows (round-to-nearest among the candidates); sets the weight, the
    input quantizer's ``pre_quant_scale`` (``1 / s``) and the amax. Linears reading one tensor (Q/K/V) share one
    ``s``, searched on their outputs together. Then (``fold``) ``1 / s`` goes into the op before where exact
    (:mod:`lq.calib._awq_fold`). Other block layers get the MSE search."""
    from lq.calib import _awq_fold

    layers = block_layers(model)
    awq, rest = [], []
    for name, m in layers:
        iq = getattr(m, "_input_quantizer", None)
        weight_only = iq is not None and not iq.is_enabled and iq.pre_quant_scale is None
        (awq if weight_only else rest).append((name, m))
    out = search_mse(model, rest)
    if not awq:
        return out
    it = iter(batches) if num_batches is None else itertools.islice(batches, num_batches)
    first = next(it, None)
    if first is None:
        raise RuntimeError("AWQ: no calibration batches")
    flow = _awq_fold.trace(model, [n for n, _ in awq], first, forward)
    hooks, stats = [], {}
    for name, m in awq:
        stats[name] = _Rows(m.weight.shape[1])
        hooks.append(m.register_forward_pre_hook(stats[name]))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in itertools.chain([first], it):
                forward(model, batch)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    mods = dict(awq)
    for group in flow.groups:
        for name in group:
            if not stats[name].count:
                raise RuntimeError(f"AWQ: layer '{name}' saw no calibration data; run the batches through it, or "
                                   "use block_method='mse' (no data needed)")
        out += _awq_group(group, [mods[n] for n in group], stats[group[0]])
    if fold:
        where = _awq_fold.fold(model, flow, first, forward)
        for c in out:
            c.folded = where.get(c.layer, "")
    return out


def _awq_group(names: list[str], ms: list[nn.Module], st: _Rows) -> list[BlockChoice]:
    """AWQ for Linears reading one input: one ``s`` for all (their weights side by side, as one Linear: blocks run
    along the input features, so each row quantizes alone)."""
    tq, block = ms[0]._weight_quantizer, _block_size(ms[0])
    rows = [m.weight.shape[0] for m in ms]
    w = torch.cat([m.weight.detach().float() for m in ms])
    n, k = w.shape
    x = torch.cat(st.rows).to(w.device)
    ref = x @ w.T
    mag = (st.abs_sum / st.count).float().to(w.device)
    mag = mag.clamp_min(float(mag.max()) * 1e-4 + 1e-12)

    def output_error(ws: torch.Tensor, inv: torch.Tensor | None, amax: torch.Tensor) -> float:
        wq = _fake_quant(ws.reshape(n, k // block, block), amax, tq).reshape(n, k)
        xs = x if inv is None else x * inv
        return float(((xs @ wq.T - ref) ** 2).mean())

    def block_max(ws: torch.Tensor) -> torch.Tensor:
        return ws.reshape(n, k // block, block).abs().amax(-1)

    rtn = output_error(w, None, block_max(w))
    best = (rtn, 0.0, None, w, block_max(w))
    for alpha in ALPHAS[1:]:  # alpha on round-to-nearest blocks (cheap), then the MSE blocks for the best one
        s = mag**alpha
        s = s / (s.max() * s.min()).sqrt()
        inv = (1.0 / s).float()
        ws = w * s
        err = output_error(ws, inv, block_max(ws))
        if err < best[0]:
            best = (err, alpha, inv, ws, block_max(ws))
    _, alpha, inv, ws, _ = best
    amax, _ = mse_block_amax(ws, block, tq)
    err = output_error(ws, inv, amax)
    if err < best[0]:
        best = (err, alpha, inv, ws, amax)
    err, alpha, inv, ws, amax = best
    out = []
    for name, m, ws_m, amax_m in zip(names, ms, ws.split(rows), amax.split(rows)):
        with torch.no_grad():
            m.weight.copy_(ws_m.to(m.weight.dtype))
        if inv is not None:
            m._input_quantizer.pre_quant_scale = inv
        _set_amax(m, amax_m)
        top = ws_m.reshape(ws_m.shape[0], k // block, block).abs().amax(-1).clamp_min(1e-30)
        out.append(BlockChoice(name, float((amax_m / top).mean()), alpha, rtn, err, names))
    return out


def search_block_scales(model: nn.Module, method: str, batches: Iterable | None = None,
                        forward: Callable[[nn.Module, Any], Any] | None = None,
                        num_batches: int | None = None) -> list[BlockChoice]:
    """Calibrate ``model``'s block-quantized Linear weights with ``method`` (see the module docstring): ``max``
    leaves the calibrated block max, ``mse`` needs no data, ``awq`` runs ``batches`` through the model."""
    if method not in BLOCK_METHODS:
        raise ValueError(f"block_method={method!r} is not allowed: choose one of {list(BLOCK_METHODS)}")
    if method == "max":
        return []
    if method == "mse":
        return search_mse(model)
    if batches is None:
        raise ValueError("block_method='awq' needs calibration batches (the activation magnitudes); use 'mse' "
                         "without data")
    if forward is None:
        from lq.calib._forward import default_forward as forward
    return search_awq(model, batches, forward, num_batches)
