"""Human-facing reports of a quantized model: the per-layer table, logger output, calibration figures."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from torch import nn

from lq.nn.modules.tensor_quantizer import iter_quantizers

COLUMNS = ("quantizer", "bits", "axis", "amax", "method", "state")
#: added once an export has run: what onnxruntime runs for the quantizer's layer
KERNEL_COLUMN = "onnxruntime kernel"
#: why a layer the export's measured fallback sent back to float is float (lq.export.timing._fallback)
FALLBACK_REASON = ("sent back to float after timing: the file with its quantizers ran at {fb.before.ratio:.2f}x FP32, "
                   "the file kept runs at {fb.after.ratio:.2f}x (at batch {fb.after.batch})")


def columns(rows: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The table's columns: the kernel column only when some row has it (after an export)."""
    return COLUMNS + ((KERNEL_COLUMN,) if any(KERNEL_COLUMN in r for r in rows) else ())


def layer_of_quantizer(name: str) -> str:
    """``"block.conv1._input_quantizer"`` -> ``"block.conv1"`` (the module that owns the quantizer)."""
    head, _, leaf = name.rpartition(".")
    return head if leaf.endswith("quantizer") else name


def with_kernels(rows: list[dict], result) -> list[dict]:
    """The quantizer rows with the kernel onnxruntime runs for each one's layer (from an ``ExportResult``)."""
    if not getattr(result, "layer_kernels", None):
        return rows
    out = []
    for r in rows:
        layer = layer_of_quantizer(r["quantizer"])
        kernel = result.kernel_of(layer)
        if kernel is None:  # e.g. an attention block's inner quantizers: report the block's own kernels
            kernel = next((result.kernel_of(k.layer) for k in result.layer_kernels
                           if k.layer.startswith(layer + ".")), None)
        out.append({**r, KERNEL_COLUMN: kernel or "-"})
    return out


def kernel_rows(result) -> list[tuple[str, str, str, str]]:
    """``(layer, op, kernel, why float)`` per layer and kernel, in the file's order.

    A layer the export computes once per reader's grid (two quantizers of different scales read its output,
    so each copy fuses: :func:`lq.export.passes._placement`) has one row, its kernel counted (``QLinearConv x2``),
    where the table listed the layer twice."""
    counts: dict[tuple, int] = {}
    for k in result.layer_kernels:
        key = (k.layer, k.op, k.kernel, k.reason or "")
        counts[key] = counts.get(key, 0) + 1
    rows = [(layer, op, kernel if n == 1 else f"{kernel} x{n}", why) for (layer, op, kernel, why), n in counts.items()]
    return rows + [(layer, "-", "float", FALLBACK_REASON.format(fb=result.fallback_kept))
                   for layer in getattr(result, "float_fallback", [])]


def kernel_table(result, title: str | None = None):
    """A rich table: layer, exported op, the kernel its runtime runs (onnxruntime's, or OpenVINO's compiled layer for
    ``target="openvino"``), why float (:func:`kernel_rows`)."""
    from rich.table import Table

    from lq.export.verify._verify import runtime_name

    runtime = runtime_name(getattr(result, "providers", None))
    table = Table(title=title or f"what {runtime} runs for each quantized layer")
    for c in ("layer", "op", f"{runtime} kernel", "why float"):
        table.add_column(c)
    for row in kernel_rows(result):
        table.add_row(*row)
    check = getattr(result, "speed_check", None)
    if check is not None:
        table.caption = f"speed: {check.ratio:.2f}x {check.reference} ({check.details()})"
    return table


def _amax_text(q) -> str:
    a = q.amax.detach() if q.amax is not None else None
    if q.dynamic:
        return "dynamic"
    if a is None:
        return "uncalibrated"
    if a.numel() == 1:
        return f"{float(a):.4g}"
    return f"{float(a.min()):.4g}..{float(a.max()):.4g} ({a.numel()})"


def _method_text(q, method: str) -> str:
    """``auto`` with what it ended with for this quantizer (``auto: percentile``; :mod:`lq.auto_calib`)."""
    chosen = getattr(q, "auto_method", None)
    return f"auto: {chosen}" if method == "auto" and chosen else method


def quantizer_rows(model: nn.Module, methods: Optional[Mapping[str, str]] = None) -> list[dict]:
    """One row per TensorQuantizer: name, bits, axis, amax, calibration method, state."""
    rows = []
    for name, q in iter_quantizers(model):
        bits = "fp8_e4m3" if q.is_fp8 else f"{'u' if q.unsigned else ''}int{q.num_bits}"
        if q.block_sizes:
            blocks = {k: v for k, v in q.block_sizes.items() if not isinstance(k, str)}
            bits += f" blocks {blocks}"
        state = "disabled" if not q.is_enabled else ("learned" if q.learn_amax else "quant")
        methods_text = _method_text(q, (methods or {}).get(name, type(q.calibrator).__name__
                                                           if q.calibrator is not None else "-"))
        rows.append({
            "quantizer": name,
            "bits": bits,
            "axis": "tensor" if q.axis is None else str(q.axis),
            "amax": _amax_text(q),
            "method": methods_text,
            "state": state,
            # what method "auto" chose and gained against max (not a column: the table's caption)
            "auto_note": getattr(q, "auto_note", None) if str(methods_text).startswith("auto") else None,
            # numeric largest amax (not a printed column): what loggers get as a metric
            "amax_max": None if q.amax is None or q.dynamic else float(q.amax.detach().max()),
        })
    return rows


def rich_table(rows: Iterable[Mapping[str, Any]], title: str = "lq quantization summary"):
    from rich.table import Table

    rows = list(rows)
    cols = columns(rows)
    table = Table(title=title)
    for c in cols:
        table.add_column(c, justify="right" if c in ("amax",) else "left")
    for r in rows:
        table.add_row(*(str(r.get(c, "-")) for c in cols))
    notes = auto_notes(rows)
    if notes:
        table.caption = "; ".join(notes)
    return table


def auto_notes(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """What calibration method ``auto`` chose and gained against ``max`` (once per calibration), from the rows."""
    out: list[str] = []
    for r in rows:
        n = r.get("auto_note")
        if n and n not in out:
            out.append(n)
    return out


def markdown_table(rows: Iterable[Mapping[str, Any]]) -> str:
    rows = list(rows)
    cols = columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |" for r in rows]
    notes = auto_notes(rows)
    return "\n".join(lines + (["", *notes] if notes else []))


def print_table(rows, title: str = "lq quantization summary") -> None:
    print_rich(rich_table(rows, title))


def print_rich(renderable) -> None:
    """Print a rich table whole: on a terminal at its width, into a file or pipe never cut at 80 columns
    (where layer names would end in "...")."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        natural = console.measure(renderable, options=console.options.update(max_width=10_000)).maximum
        console = Console(width=max(console.width, natural))
    console.print(renderable)


def log_table(loggers, rows: list[dict], step: int = 0, key: str = "lq/summary") -> None:
    """Send the table to every logger in the form it takes (table, text), and amax as metrics."""
    metrics = {f"lq/amax/{r['quantizer']}": r["amax_max"] for r in rows if r.get("amax_max") is not None}
    for logger in loggers or []:
        exp = getattr(logger, "experiment", None)
        if hasattr(logger, "log_table"):
            logger.log_table(key=key, columns=list(COLUMNS), data=[[r[c] for c in COLUMNS] for r in rows])
        elif exp is not None and hasattr(exp, "add_text"):
            exp.add_text(key, markdown_table(rows), global_step=step)
        if metrics:
            logger.log_metrics(metrics, step=step)


def histogram_figures(model: nn.Module, max_figures: int = 4, percentile: float = 99.99) -> list[tuple[str, Any]]:
    """Figures of collected calibration histograms with the amax each method would choose."""
    from lq import calib

    out = []
    for name, q in iter_quantizers(model):
        cal = q.calibrator
        if not isinstance(cal, calib.HistogramCalibrator) or not cal.has_data or q.axis is not None:
            continue
        out.append((name, histogram_figure(name, cal, percentile)))
        if len(out) >= max_figures:
            break
    return out


def histogram_figure(name: str, cal, percentile: float = 99.99):
    """One histogram of |x| (log counts) with vertical lines at each method's amax."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    counts = cal._calib_hist.float().cpu().numpy()  # the reference toolkit's attribute names
    edges = cal._calib_bin_edges.float().cpu().numpy()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(edges[:-1], counts, width=edges[1] - edges[0], align="edge", color="#7a9cc6", linewidth=0)
    ax.set_yscale("log")
    picks = {"max": float(cal.compute_amax("max"))}  # the exact absmax (the last edge is the grid's top)
    for method in ("entropy", "mse", "percentile"):
        kwargs = {"percentile": percentile} if method == "percentile" else {}
        picks[method] = float(cal.compute_amax(method, **kwargs))
    colors = {"max": "black", "entropy": "tab:red", "mse": "tab:green", "percentile": "tab:orange"}
    for method, amax in picks.items():
        ax.axvline(amax, color=colors[method], linestyle="--", label=f"{method}: {amax:.3g}")
    ax.set_xlim(0, max(picks.values()) * 1.05)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("|x|")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def log_figures(loggers, figures: list[tuple[str, Any]], step: int = 0) -> int:
    """Send figures to loggers that take images; returns how many were logged."""
    n = 0
    for logger in loggers or []:
        exp = getattr(logger, "experiment", None)
        for name, fig in figures:
            key = f"lq/calib_hist/{name}"
            if exp is not None and hasattr(exp, "add_figure"):
                exp.add_figure(key, fig, global_step=step, close=False)
                n += 1
            elif hasattr(logger, "log_image"):
                logger.log_image(key=key, images=[fig])
                n += 1
    return n
