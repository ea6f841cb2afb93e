"""Shared pieces of the evidence harness (bench.accuracy, bench.speed): machine facts, tables, timing."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def cpu_isa() -> str:
    """The x86 integer-SIMD level onnxruntime's kernels pick from: what every speed table must name."""
    from lq._ext import cpu_flags

    flags = cpu_flags()
    if not flags:
        return "unknown"
    if "amx_int8" in flags:
        return "AMX + AVX-512 VNNI"
    if "avx512_vnni" in flags:
        return "AVX-512 VNNI"
    if "avx512bw" in flags:
        return "AVX-512 (no VNNI)" + (" + AVX-VNNI" if "avx_vnni" in flags else "")
    if "avx_vnni" in flags:
        return "AVX2 + AVX-VNNI"
    if "avx2" in flags:
        return "AVX2 (no AVX-512, no VNNI)"
    return "pre-AVX2"


def has_vnni(isa: str) -> bool:
    """Whether the CPU named by :func:`cpu_isa` accumulates u8 x s8 products in int32 (VNNI or AMX)."""
    return "VNNI" in isa.replace("no VNNI", "") or "AMX" in isa


def machine() -> dict:
    """What the numbers were measured on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:  # the family and model too: a virtual machine's bare "AMD EPYC" may be Zen 4 (family 25) or Zen 5 (26),
        # whose float and integer kernels compare differently (two bench.ordinary runs, same code: 3.01x vs 2.86x)
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()[:30]
                      if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "model name" in fields:
            cpu = fields["model name"]
            if "cpu family" in fields and "model" in fields:
                cpu += f" (family {fields['cpu family']}, model {fields['model']})"
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "isa": cpu_isa(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "os": f"{platform.system()} {platform.release()}",
    }
    try:
        info["load_average"] = " ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        pass
    for mod in ("onnxruntime", "onnx", "openvino", "nncf", "transformers", "lightning", "sklearn"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional
            pass
    try:
        import lq

        info["lq_extension"] = "C++ kernels" if lq.extension_loaded() else "reference (pure PyTorch)"
    except Exception:  # noqa: BLE001
        pass
    return info


def command() -> str:
    return "python -m " + " ".join(shlex.quote(a) for a in [_module_name()] + sys.argv[1:])


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None and spec.name else Path(sys.argv[0]).stem


def machine_markdown(info: dict, cmd: str, seconds: float) -> str:
    lines = [f"Command: `{cmd}` ({seconds:.0f} s)", "", "| machine | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    return "\n".join(lines)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one char per column, ``l`` or ``r``."""
    align = align or "l" + "r" * (len(headers) - 1)
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    out = ["| " + " | ".join(headers) + " |", sep]
    out += ["| " + " | ".join("-" if c is None else str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")


def _jsonable(v):
    try:
        import numpy as np

        if isinstance(v, np.generic):
            return v.item()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(v, Path):
        return str(v)
    return str(v)


# =========================================================================== timing
def percentile(vals: Sequence[float], q: float) -> float:
    s = sorted(vals)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def spread(vals: Sequence[float]) -> dict:
    """median and inter-quartile range of repeated measurements."""
    return {"median": statistics.median(vals), "p25": percentile(vals, 25), "p75": percentile(vals, 75),
            "n": len(vals)}


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, inner: int = 1, warmup: int = 2) -> dict:
    """Seconds per call of each function, timed round-robin so machine load hits all alike.

    Returns ``{name: [seconds per call for each repeat]}``.
    """
    for f in fns.values():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                f()
            times[k].append((time.perf_counter() - t) / inner)
    return times


def ratios(num: Sequence[float], den: Sequence[float]) -> dict:
    """Per-repeat ratios num[i] / den[i] (paired: measured in the same round) summarized by :func:`spread`."""
    return spread([a / b for a, b in zip(num, den, strict=True)])


def fmt_ratio(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f}x [{s['p25']:.{digits}f}-{s['p75']:.{digits}f}]"


def fmt_ms(s: dict) -> str:
    m = s["median"] * 1e3
    d = 3 if m < 1 else (2 if m < 10 else 1)
    return f"{m:.{d}f} [{s['p25'] * 1e3:.{d}f}-{s['p75'] * 1e3:.{d}f}]"


_NOISY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "lq", "torch.onnx", "onnxscript",
                  "torch._dynamo", "torch._inductor")


def models_parser(doc: str, fast_help: str, models: int, threads: int) -> "argparse.ArgumentParser":
    """The options every per-model bench takes (``--fast``, ``--out``, ``--models``, ``--threads``); the bench adds
    its own."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help=fast_help)
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default docs/results, or outputs/bench_fast with --fast)")
    ap.add_argument("--models", nargs="*", type=int, default=None, choices=range(models),
                    help="indices of the models (default all; --fast: the O-Net shape)")
    ap.add_argument("--threads", type=int, default=threads, help=f"torch threads (default {threads})")
    return ap


def start_run(args) -> tuple[Path, str, float]:
    """Common start of a bench entry point: output folder, torch threads, quiet logs, command, clock.

    ``args`` needs ``out``, ``fast`` and ``threads``; returns ``(out folder, command line, start time)``.
    """
    import logging
    import warnings

    import torch

    out = args.out or (Path("outputs/bench_fast") if args.fast else Path("docs/results"))
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    return out, command(), time.perf_counter()


def finish_run(out: Path, name: str, data: dict, title: str, intro: str, table_md: str, cmd: str,
               seconds: float) -> Path:
    """Common end of a one-table bench: ``<name>.json`` (``data`` with the machine, command and seconds) and
    ``<name>.md`` (title, intro, the table, the run's machine and command); returns the markdown's path."""
    info = machine()
    write_json(out / f"{name}.json", {**data, "machine": info, "command": cmd, "seconds": seconds})
    md = out / f"{name}.md"
    md.write_text("\n".join([f"# {title}", "", intro, "", table_md, "", "## Run", "",
                             machine_markdown(info, cmd, seconds)]) + "\n")
    print(f"\nwrote {md} ({seconds:.0f} s)")
    return md


def print_targets(targets: Sequence[tuple[str, str, bool]], md: Path | None, seconds: float) -> None:
    """The end of a bench with targets: one PASS/MISS line per target, then where the markdown went (``md`` None:
    :func:`finish_run` said it already)."""
    for what, measured, ok in targets:
        print(f"{'PASS' if ok else 'MISS'}  {what}: {measured}")
    if md is not None:
        print(f"\nwrote {md} ({seconds:.0f} s)")


def log(msg: str) -> None:
    print(msg, flush=True)
