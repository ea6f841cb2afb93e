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
  (``TensorQuantizer.pre_quant_scale``: one per-channel Mul before the MatMul in the file). ``alpha`` (a grid in
  [0, 1]) and the block amax are chosen together per layer on the layer's output error over all calibration
  tokens, ``trace(dW H dW^T)`` with ``H = E[x x^T]`` the input's second moments and ``dW`` the error of the
  effective weight ``Q(W * s) / s``. For every ``alpha`` two amax candidates: the block max, and per block the
  fraction of the max (the MSE grid) with the smallest error of that block's outputs (``H``'s diagonal block:
  the clipping that costs the outputs least, not the weights). Linears that read one tensor (Q/K/V) share one
  ``s``, chosen on their outputs together. Round-to-nearest (``alpha = 0``, max) is one of the candidates, so
  the output error on the calibration data is never larger. Then :mod:`lq.calib._awq_fold` moves ``1 / s`` into
  the op before where that is exact (a LayerNorm only those Linears read; V's output rows for attention's
  output projection): no Mul there in the file.

* ``"gptq"``: AWQ where ``1 / s`` folds into the op before (no Mul in the file: the file runs what round-to-nearest
  runs, at its speed), then GPTQ's rounding (after Frantar et al. 2022) on the chosen grids: the columns of the
  scaled weight are rounded one at a time, each rounding error spread over the columns not yet rounded through
  the inverse of ``H`` (the scaled input's second moments), so the output error ``trace(dW H dW^T)`` on the
  calibration rows drops below what rounding each weight to its nearest level gives. The rounded weight is on
  the grid, so the quantizer gives it back unchanged and the file holds the same codes. Kept per layer group only
  where it lowers that output error.

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
ALPHAS = tuple(i / 20 for i in range(21))
#: GPTQ: the damping added to ``H``'s diagonal (a fraction of its mean), and how many columns are rounded before
#: their errors are applied to the rest in one product
GPTQ_DAMP, GPTQ_COLUMNS = 0.01, 128
#: GPTQ only where the calibration rows number at least this many times the layer's input features: its rounding
#: follows ``H``, and an ``H`` from few rows is a poor estimate (MiniLM, 4 documents of 32 tokens = 128 rows for
#: 384-1536 features: cosine to FP32 0.964, under round-to-nearest's 0.965; 300 documents of 128 tokens: 0.981)
GPTQ_MIN_ROWS_PER_FEATURE = 4


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
    unscaled_error: float = 0.0  # awq: the best output error without activation scaling (alpha = 0)
    gptq: bool = False  # gptq: its weights rounded by GPTQ (False: too few calibration rows, or no better)


def block_layers(model: nn.Module, calibrated: bool = True) -> list[tuple[str, nn.Module]]:
    """The modules whose 2-D weight has a static block quantizer with blocks along the input features, calibrated
    (``calibrated=False``: or still to be: whether a calibration will have block layers to search)."""
    out = []
    for name, m in model.named_modules():
        tq = getattr(m, "_weight_quantizer", None)
        w = getattr(m, "weight", None)
        if tq is None or not isinstance(w, torch.Tensor) or w.dim() != 2 or not tq.is_enabled:
            continue
        blocks = tq.block_sizes
        if not blocks or tq.dynamic or (calibrated and tq.amax is None) or tq.is_fp8:
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
    """Per-channel mean |x| and the second moments ``sum x x^T`` of a Linear's input over every calibration token,
    from a forward pre-hook."""

    def __init__(self, k: int):
        self.abs_sum = torch.zeros(k, dtype=torch.float64)
        self.xtx = torch.zeros(k, k, dtype=torch.float64)
        self.count = 0

    def __call__(self, module, args):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1]).cpu()
        self.abs_sum += x.abs().sum(0, dtype=torch.float64)
        self.xtx += (x.T @ x).double()  # float32 per batch, float64 across batches
        self.count += x.shape[0]

    def second_moments(self) -> torch.Tensor:
        """``H = E[x x^T]`` (float32): the output error of a weight error ``dW`` is ``trace(dW H dW^T)``."""
        return (self.xtx / max(self.count, 1)).float()


def gptq_round(w: torch.Tensor, amax: torch.Tensor, h: torch.Tensor, tq, block: int) -> torch.Tensor:
    """``w`` (N, K) rounded onto its block grids (``amax`` (N, K / block)) column by column, each column's rounding
    error compensated on the columns after it so that ``trace(dW H dW^T)`` stays small (GPTQ); ``h`` (K, K): the
    input's second moments. Every value of the result is a level of its block's grid."""
    n, k = w.shape
    h = h.double().clone()
    h.diagonal().add_(GPTQ_DAMP * float(h.diagonal().mean()) + 1e-12)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    w = w.detach().float().clone()
    q = torch.empty_like(w)
    for i0 in range(0, k, GPTQ_COLUMNS):
        i1 = min(i0 + GPTQ_COLUMNS, k)
        part, errs = w[:, i0:i1].clone(), torch.empty(n, i1 - i0, dtype=w.dtype, device=w.device)
        for j in range(i1 - i0):
            col = part[:, j]
            qc = _fake_quant(col.reshape(n, 1, 1).contiguous(), amax[:, (i0 + j) // block].reshape(n, 1), tq).reshape(n)
            q[:, i0 + j] = qc
            e = (col - qc) / u[i0 + j, i0 + j]
            part[:, j:] -= e.unsqueeze(1) * u[i0 + j, i0 + j:i1].unsqueeze(0)
            errs[:, j] = e
        w[:, i1:] -= errs @ u[i0:i1, i1:]
    return q


def _enough_rows_for_gptq(st: "_Rows", features: int) -> bool:
    return st.count >= GPTQ_MIN_ROWS_PER_FEATURE * features


def search_awq(model: nn.Module, batches: Iterable, forward: Callable[[nn.Module, Any], Any],
               num_batches: int | None = None, fold: bool = True, keep_muls: bool = True,
               gptq: bool = False, warn_few_rows: bool = True) -> list[BlockChoice]:
    """AWQ: per weight-only block-quantized Linear, the activation scale ``s = mag^alpha`` and block amax with the
    smallest output error on the calibration rows (round-to-nearest among the candidates); sets the weight, the
    input quantizer's ``pre_quant_scale`` (``1 / s``) and the amax. Linears reading one tensor (Q/K/V) share one
    ``s``, searched on their outputs together. Then (``fold``) ``1 / s`` goes into the op before where exact
    (:mod:`lq.calib._awq_fold`). Other block layers get the MSE search. ``keep_muls=False``: Linears whose ``1 / s``
    folds nowhere (after a GELU, or a LayerNorm whose output is also the residual) are not scaled (``alpha = 0``,
    the output-aware clipping alone): the file runs no Mul before any MatMulNBits. ``gptq``: the chosen weights then
    rounded by :func:`gptq_round` where that lowers the group's output error (``warn_few_rows``: say which layers saw
    too few rows for it)."""
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
    scalable = None if keep_muls else _awq_fold.foldable(model, flow)
    for group in flow.groups:
        for name in group:
            if not stats[name].count:
                raise RuntimeError(f"AWQ: layer '{name}' saw no calibration data; run the batches through it, or "
                                   "use block_method='mse' (no data needed)")
        alphas = ALPHAS if scalable is None or group[0] in scalable else (0.0,)
        out += _awq_group(group, [mods[n] for n in group], stats[group[0]], alphas, gptq)
    few = [n for n in stats if gptq and warn_few_rows and not _enough_rows_for_gptq(stats[n], mods[n].weight.shape[1])]
    if few:
        import warnings

        warnings.warn(f"block_method='gptq': {len(few)} layer(s) saw fewer calibration rows (tokens) than "
                      f"{GPTQ_MIN_ROWS_PER_FEATURE}x their input features ({', '.join(few[:3])}"
                      f"{' ...' if len(few) > 3 else ''}), too few to steer GPTQ's rounding: those keep "
                      "round-to-nearest on the searched grid; calibrate on more batches", stacklevel=3)
    if fold:
        where = _awq_fold.fold(model, flow, first, forward)
        for c in out:
            c.folded = where.get(c.layer, "")
    return out


def _awq_group(names: list[str], ms: list[nn.Module], st: _Rows, alphas=ALPHAS, gptq: bool = False) -> list[BlockChoice]:
    """AWQ for Linears reading one input: one ``s`` for all (their weights side by side, as one Linear: blocks run
    along the input features, so each row quantizes alone); ``gptq``: then GPTQ's rounding on the chosen grids."""
    tq, block = ms[0]._weight_quantizer, _block_size(ms[0])
    rows = [m.weight.shape[0] for m in ms]
    w = torch.cat([m.weight.detach().float() for m in ms])
    n, k = w.shape
    kb = k // block
    h = st.second_moments().to(w.device)
    h_blocks = torch.stack([h[i * block:(i + 1) * block, i * block:(i + 1) * block] for i in range(kb)])
    mag = (st.abs_sum / st.count).float().to(w.device)
    mag = mag.clamp_min(float(mag.max()) * 1e-4 + 1e-12)

    def quantized(ws: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        return _fake_quant(ws.reshape(n, kb, block), amax, tq).reshape(n, k)

    def output_error(ws: torch.Tensor, s: torch.Tensor, amax: torch.Tensor) -> float:
        """Mean squared output error per output feature: ``x (Q(W s) / s)^T`` against ``x W^T``."""
        d = quantized(ws, amax) / s - w
        return float(((d @ h) * d).sum()) / n

    def output_clipped_amax(ws: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Per block, the fraction of its max (the MSE grid) whose error costs that block's outputs least."""
        wb = ws.reshape(n, kb, block)
        inv = (1.0 / s).reshape(kb, block)
        top = wb.abs().amax(-1)
        best_amax = best_err = None
        for shrink in torch.linspace(MIN_SHRINK, 1.0, SHRINK_STEPS).tolist():
            a = top * shrink
            d = (_fake_quant(wb, a, tq) - wb) * inv
            err = torch.einsum("nkb,kbc,nkc->nk", d, h_blocks, d)
            if best_err is None:
                best_amax, best_err = a, err
            else:
                better = err < best_err
                best_amax, best_err = torch.where(better, a, best_amax), torch.where(better, err, best_err)
        return best_amax

    one = torch.ones(k, device=w.device)
    rtn = output_error(w, one, w.reshape(n, kb, block).abs().amax(-1))
    best = (rtn, 0.0, one, w, w.reshape(n, kb, block).abs().amax(-1))
    unscaled = rtn
    for alpha in alphas:
        s = one if alpha == 0 else mag**alpha
        s = s / (s.max() * s.min()).sqrt()
        ws = w * s
        for amax in (ws.reshape(n, kb, block).abs().amax(-1), output_clipped_amax(ws, s)):
            err = output_error(ws, s, amax)
            if alpha == 0:
                unscaled = min(unscaled, err)
            if err < best[0]:
                best = (err, alpha, s, ws, amax)
    err, alpha, s, ws, amax = best
    rounded_by_gptq = False
    if gptq and _enough_rows_for_gptq(st, k):  # the scaled input x / s has second moments H / (s s^T)
        rounded = gptq_round(ws, amax, h / torch.outer(s, s), tq, block)
        d = rounded / s - w
        rounded_err = float(((d @ h) * d).sum()) / n
        if rounded_err < err:
            err, ws, rounded_by_gptq = rounded_err, rounded, True
    out = []
    for name, m, ws_m, amax_m in zip(names, ms, ws.split(rows), amax.split(rows)):
        with torch.no_grad():
            m.weight.copy_(ws_m.to(m.weight.dtype))
        if alpha > 0:
            m._input_quantizer.pre_quant_scale = (1.0 / s).float()
        _set_amax(m, amax_m)
        top = ws_m.reshape(ws_m.shape[0], kb, block).abs().amax(-1).clamp_min(1e-30)
        out.append(BlockChoice(name, float((amax_m / top).mean()), alpha, rtn, err, names, unscaled_error=unscaled,
                               gptq=rounded_by_gptq))
    return out


def search_block_scales(model: nn.Module, method: str, batches: Iterable | None = None,
                        forward: Callable[[nn.Module, Any], Any] | None = None,
                        num_batches: int | None = None, keep_muls: bool = True) -> list[BlockChoice]:
    """Calibrate ``model``'s block-quantized Linear weights with ``method`` (see the module docstring): ``max``
    leaves the calibrated block max, ``mse`` needs no data, ``awq`` runs ``batches`` through the model
    (``keep_muls``: see :func:`search_awq`)."""
    if method not in BLOCK_METHODS:
        raise ValueError(f"block_method={method!r} is not allowed: choose one of {list(BLOCK_METHODS)}")
    if method == "max":
        return []
    if method == "mse":
        return search_mse(model)
    if batches is None:
        raise ValueError(f"block_method={method!r} needs calibration batches (the activation magnitudes); use "
                         "'mse' without data")
    if forward is None:
        from lq.calib._forward import default_forward as forward
    if method in ("gptq", "auto"):  # auto: gptq's path, GPTQ where the rows support it, said per layer, not warned
        return search_awq(model, batches, forward, num_batches, keep_muls=False, gptq=True,
                          warn_few_rows=method == "gptq")
    return search_awq(model, batches, forward, num_batches, keep_muls=keep_muls)
