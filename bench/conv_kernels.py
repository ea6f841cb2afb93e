"""Which convs onnxruntime runs faster as QLinearConv than as its float conv, by input channels per group and
products per output.

    python -m bench.conv_kernels [--fast] [--out DIR]

The measurement behind ``lq.rules.onnxruntime.ORT_INT8_CONV_MIN_CHANNELS_PER_GROUP``,
``ORT_INT8_CONV_MIN_REDUCTION`` and ``ORT_INT8_HEAD_MIN_OUT_CHANNELS``: for depthwise convs (3x3 and 7x7), dense convs with 1 to 32 input channels, and
the stems people's models have (an RGB 7x7 at stride 2, 1-D audio stems of 32 to 512 taps on one channel), heads
with few output channels (a conv writing a model output runs as QLinearConv only with a Q/DQ pair after it), one
quantized conv (lq's ``int8_reduce_range`` recipe, exported by ``lq.export.export_onnx`` with a quantizer after it,
so onnxruntime fuses it into QLinearConv) against the same conv in FP32 (``torch.onnx``), batch 32, one
thread. The conv's own kernel time comes from onnxruntime's profiler (median over runs), so the Q/DQ and
layout ops around it do not count. The table names the CPU's ISA.

Where lq pads a conv's input channels for onnxruntime's symmetric conv kernel
(``lq.rules.onnxruntime.ort_padded_input_channels``), the same file without that padding is timed too: the
measurement behind ``ORT_SYM_CONV_CHANNEL_ALIGN``. Cases the rule does not pad (a 7x7 RGB stem, 1-D stems) are
timed padded as well, to show why not (lq pads 2-D convs only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bench import _report

torch.set_flush_denormal(True)

#: (label, in channels, out channels, kernel, groups, spatial size[, stride, spatial dims]); 1-D cases run Conv1d
#: on a signal of that length
CASES = [
    ("depthwise 3x3, 32 ch, 32x32", 32, 32, 3, 32, 32),
    ("depthwise 3x3, 64 ch, 16x16", 64, 64, 3, 64, 16),
    ("depthwise 7x7, 64 ch, 16x16", 64, 64, 7, 64, 16),
    ("dense 3x3, 1 -> 32, 32x32", 1, 32, 3, 1, 32),
    ("dense 3x3, 2 -> 32, 32x32", 2, 32, 3, 1, 32),
    ("dense 3x3, 3 -> 32, 32x32", 3, 32, 3, 1, 32),
    ("dense 3x3, 3 -> 16, 32x32", 3, 16, 3, 1, 32),
    ("dense 3x3, 4 -> 32, 32x32", 4, 32, 3, 1, 32),
    ("dense 3x3, 6 -> 32, 32x32", 6, 32, 3, 1, 32),
    ("dense 3x3, 8 -> 32, 32x32", 8, 32, 3, 1, 32),
    ("dense 3x3, 10 -> 16, 24x24 (P-Net's second conv)", 10, 16, 3, 1, 24),
    ("dense 3x3, 30 -> 32, 32x32", 30, 32, 3, 1, 32),
    ("dense 1x1, 16 -> 32, 32x32", 16, 32, 1, 1, 32),
    ("dense 1x1, 32 -> 32, 32x32", 32, 32, 1, 1, 32),
    ("dense 5x5, 3 -> 32, 32x32", 3, 32, 5, 1, 32),
    ("dense 7x7 stride 2, 3 -> 32, 64x64 (ResNet's RGB stem)", 3, 32, 7, 1, 64, 2),
    ("dense 7x7, 2 -> 32, 32x32", 2, 32, 7, 1, 32),
    ("1-D 9 taps, 1 -> 16, 784 samples", 1, 16, 9, 1, 784, 1, 1),
    ("1-D 32 taps, 1 -> 64, 784 samples", 1, 64, 32, 1, 784, 1, 1),
    ("1-D 128 taps stride 4, 1 -> 64, 784 samples", 1, 64, 128, 1, 784, 4, 1),
    ("1-D 512 taps stride 4, 1 -> 128, 784 samples (CREPE's stem)", 1, 128, 512, 1, 784, 4, 1),
    # convs that write a model output (``ort_prefers_float_head``): score-map and class heads
    ("1x1, 8 -> 1, 40x40 (a score-map head, model output)", 8, 1, 1, 1, 40),
    ("1x1, 8 -> 2, 40x40 (model output)", 8, 2, 1, 1, 40),
    ("3x3, 16 -> 10, 16x16 (model output)", 16, 10, 3, 1, 16),
]
#: the label of a case whose conv writes a model output
HEAD = "model output"
FAST = [0, 3, 5, 7]


def _model(cin, cout, k, groups, stride=1, dims=2):
    """The conv, then a ReLU and a 1x1 conv, so that a quantizer reads its output (onnxruntime fuses it)."""
    conv = nn.Conv1d if dims == 1 else nn.Conv2d
    return nn.Sequential(conv(cin, cout, k, stride, padding=k // 2, groups=groups), nn.ReLU(),
                         conv(cout, 8, 1)).eval()


def _conv_ms(path: str, x: np.ndarray, runs: int, prefix: str) -> tuple[float, str]:
    """Median kernel time of the file's first conv node in onnxruntime's profile, and its op type."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.enable_profiling = True
    opts.profile_file_prefix = prefix
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    for _ in range(runs):
        sess.run(None, {name: x})
    events = json.loads(Path(sess.end_profiling()).read_text())
    per_run: dict[str, list] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and \
                e["args"]["op_name"] in ("Conv", "FusedConv", "QLinearConv"):
            per_run.setdefault(e["name"], []).append((e["ts"], e["dur"], e["args"]["op_name"]))
    first = min(per_run.values(), key=lambda v: v[0][0])  # the first conv of the graph
    return float(np.median([d for _, d, _ in first[2:]])) / 1000.0, first[0][2]


@contextlib.contextmanager
def _padding(on: bool):
    """lq's export with its channel padding (the default) or without it, and for cases the rule does not pad, with
    it forced (the rule's function answering the next multiple of 4 for any dense conv): restored on exit."""
    from lq.export.passes import _pad_channels, _pipeline
    from lq.rules.onnxruntime import ORT_SYM_CONV_CHANNEL_ALIGN

    passes, rule = _pipeline.GRAPH_PASSES, _pad_channels.ort_padded_input_channels
    if not on:
        _pipeline.GRAPH_PASSES = tuple(p for p in passes if p.name != "pad_conv_input_channels")
    else:
        align = ORT_SYM_CONV_CHANNEL_ALIGN
        _pad_channels.ort_padded_input_channels = lambda cin, cout, groups, k: \
            None if groups != 1 or cin % align == 0 else -(-cin // align) * align
    try:
        yield
    finally:
        _pipeline.GRAPH_PASSES, _pad_channels.ort_padded_input_channels = passes, rule


def measure(case, d: str, runs: int) -> dict:
    from bench.ordinary import lq_ptq
    from lq.export import export_onnx
    from lq.rules.onnxruntime import ort_padded_input_channels

    label, cin, cout, k, groups, hw, *rest = case
    stride, dims = (rest[0] if rest else 1), (rest[1] if len(rest) > 1 else 2)
    torch.manual_seed(0)
    model = _model(cin, cout, k, groups, stride, dims)
    x = torch.randn(32, cin, *([hw] * dims))
    fp32, int8 = os.path.join(d, "fp32.onnx"), os.path.join(d, "int8.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x[:1],), fp32, dynamo=False, opset_version=17, input_names=["input"],
                          dynamic_axes={"input": {0: "batch"}})
    # the file with lq's placement as it is (no measured fallback): this bench measures the kernels themselves
    quantized = lq_ptq(model, [x], reduce_range=True)
    export_onnx(quantized, x[:4], int8, fallback_seconds=0)
    xn = x.numpy()
    f_ms, f_op = _conv_ms(fp32, xn, runs, os.path.join(d, "p_fp32"))
    i_ms, i_op = _conv_ms(int8, xn, runs, os.path.join(d, "p_int8"))
    row = {"case": label, "channels_per_group": cin // groups, "products": cin // groups * k ** dims,
           "out_channels": cout, "head": HEAD in label, "fp32_ms": f_ms, "int8_ms": i_ms,
           "int8_op": i_op, "fp32_op": f_op, "speedup": f_ms / i_ms,
           "padded_by_lq": ort_padded_input_channels(cin, cout, groups, (k,) * dims) is not None,
           "other_ms": None}
    if groups == 1 and cin % 4 and dims == 2 and HEAD not in label:  # the other side of the padding rule, same run
        other = os.path.join(d, "int8_other.onnx")
        with _padding(not row["padded_by_lq"]):
            export_onnx(quantized, x[:4], other, fallback_seconds=0)
        row["other_ms"] = _conv_ms(other, xn, runs, os.path.join(d, "p_other"))[0]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="4 cases, few runs (CI smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default docs/results, or outputs/bench_fast with --fast)")
    args = ap.parse_args(argv)
    out, cmd, t0 = _report.start_run(args)
    cases = [CASES[i] for i in FAST] if args.fast else CASES
    runs = 8 if args.fast else 40
    rows = []
    for case in cases:
        with tempfile.TemporaryDirectory() as d:
            rows.append(measure(case, d, runs))
        r = rows[-1]
        _report.log(f"  {r['case']}: FP32 {r['fp32_ms']:.3f} ms, {r['int8_op']} {r['int8_ms']:.3f} ms "
                    f"({r['speedup']:.2f}x)")
    def other(r) -> str:  # the INT8 conv on the other side of the padding rule
        if r["other_ms"] is None:
            return "-"
        return f"{r['other_ms']:.3f} ({'unpadded' if r['padded_by_lq'] else 'padded'})"

    table = _report.table(["conv (batch 32)", "input channels per group", "products per output", "FP32 conv ms",
                           "INT8 kernel", "INT8 ms (lq's file)", "INT8 speed-up", "channels padded by lq",
                           "INT8 ms, the other way"],
                          [(r["case"], r["channels_per_group"], r["products"], f"{r['fp32_ms']:.3f}", r["int8_op"],
                            f"{r['int8_ms']:.3f}", f"{r['speedup']:.2f}x", "yes" if r["padded_by_lq"] else "no",
                            other(r)) for r in rows], "lrrrlrrll")
    _report.finish_run(out, "conv_kernels", {"rows": rows}, "Conv kernels: INT8 or float",
                       f"Produced by `bench/conv_kernels.py` (CPU: {_report.cpu_isa()}). One conv's kernel time in "
                       "onnxruntime's profiler, 1 thread; INT8 = lq's int8_reduce_range export, which onnxruntime "
                       "fuses into QLinearConv.", table, cmd, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
