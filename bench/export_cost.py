"""What quantizing costs as a model grows: stacks of N identical blocks, export seconds per node, calibration
seconds per layer.

    python -m bench.export_cost [--fast] [--out DIR] [--sizes 8 16 32 64 128 256]

Two families, each N identical blocks on a small input so the graph, not the arithmetic, sets the time: a conv net
(conv -> BatchNorm -> ReLU -> conv -> BatchNorm, a residual add, ReLU: a ResNet basic block at 16 channels, 8x8)
and a transformer (pre-norm attention and MLP, 32 wide, 8 tokens). Each model goes through lq's default path
(``quantize_model(model, sample=...)``, ``calibrate_model`` with ``max`` and with the default ``auto``,
``export_onnx`` with verification; the speed check is off here, it times the file rather than building it),
and the export's own stage seconds (``ExportResult.stage_seconds``) are divided by the saved file's node count.
Linear cost means seconds per node that stay flat as N grows: the last column is each row's seconds per node over
the smallest stack's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import onnx
import torch
from torch import nn


class ConvBlock(nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c))
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.body(x) + x)


class ConvStack(nn.Module):
    def __init__(self, n: int, c: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(*[ConvBlock(c) for _ in range(n)])
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class TransformerStack(nn.Module):
    def __init__(self, n: int, d: int = 32):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1))


FAMILIES = {"conv": (ConvStack, (3, 8, 8)), "transformer": (TransformerStack, (8, 16))}


def measure(family: str, n: int, d: str) -> dict:
    import lq
    from lq.calibration import calibrate_model
    from lq.export import export_onnx

    build, shape = FAMILIES[family]
    torch.manual_seed(0)
    model = build(n).eval()
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, *shape, generator=g) for _ in range(8)]
    t = time.perf_counter()
    lq.quantize_model(model, sample=batches[0])
    quantize_s = time.perf_counter() - t
    layers = sum(1 for m in model.modules() if hasattr(m, "_weight_quantizer"))
    t = time.perf_counter()
    calibrate_model(model, batches, method="max", progress=False)
    max_s = time.perf_counter() - t
    t = time.perf_counter()
    calibrate_model(model, batches, progress=False)
    auto_s = time.perf_counter() - t
    path = f"{d}/{family}{n}.onnx"
    t = time.perf_counter()
    res = export_onnx(model, batches[0][:4], path, speed_check=False, progress=False)
    export_s = time.perf_counter() - t
    nodes = len(onnx.load(path, load_external_data=False).graph.node)
    return {"family": family, "n": n, "layers": layers, "nodes": nodes, "quantize_s": quantize_s,
            "calib_max_s": max_s, "calib_auto_s": auto_s, "export_s": export_s, "stages": res.stage_seconds}


def write_markdown(rows: list[dict], out: Path, cmd: str, seconds: float) -> Path:
    from bench import _report

    base = {}
    lines = []
    for r in rows:
        per_node = r["export_s"] / r["nodes"]
        base.setdefault(r["family"], per_node)
        st = r["stages"]
        lines.append([r["family"], r["n"], r["layers"], r["nodes"], f"{r['calib_max_s'] / r['layers'] * 1e3:.1f}",
                      f"{r['calib_auto_s'] / r['layers'] * 1e3:.1f} ({r['calib_auto_s'] / r['calib_max_s']:.1f}x)",
                      f"{st.get('trace', 0):.2f}", f"{st.get('rewrite', 0):.2f}", f"{st.get('verify', 0):.2f}",
                      f"{st.get('report', 0):.2f}", f"{r['export_s']:.2f}", f"{per_node * 1e3:.2f}",
                      f"{per_node / base[r['family']]:.2f}x"])
    headers = ["family", "N blocks", "layers", "nodes in file", "calib max ms/layer", "calib auto ms/layer (vs max)",
               "trace s", "rewrite s", "verify s", "report s", "export s", "export ms/node", "vs smallest"]
    intro = (f"Produced by `bench/export_cost.py` (CPU: {_report.cpu_isa()}), 1 thread. " + __doc__.split("\n\n")[2]
             .replace("\n", " "))
    return _report.finish_run(out, "export_cost", {"rows": rows}, "What quantizing costs as the model grows", intro,
                              _report.table(headers, lines), cmd, seconds)


def main(argv=None) -> int:
    from bench import _report

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fast", action="store_true", help="a smoke run: N = 2, 4, 8")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", nargs="*", type=int, default=None, help="the N to run (default 8 16 32 64 128 256)")
    ap.add_argument("--family", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    args = ap.parse_args(argv)
    out, cmd, t0 = _report.start_run(args)
    sizes = args.sizes or ([2, 4, 8] if args.fast else [8, 16, 32, 64, 128, 256])
    with tempfile.TemporaryDirectory() as d:  # the first export of a process also loads the exporter: not timed
        measure("conv", 1, d)
    rows = []
    for family in args.family:
        for n in sizes:
            with tempfile.TemporaryDirectory() as d:
                rows.append(measure(family, n, d))
            r = rows[-1]
            _report.log(f"{family} N={n}: {r['nodes']} nodes, export {r['export_s']:.1f} s "
                        f"({r['export_s'] / r['nodes'] * 1e3:.2f} ms/node), calib max {r['calib_max_s']:.1f} s, "
                        f"auto {r['calib_auto_s']:.1f} s")
    write_markdown(rows, out, cmd, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
