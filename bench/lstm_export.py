"""LSTM export benchmark: lq's loop export (one ONNX Scan per layer and direction) on ordinary models.

    python -m bench.lstm_export [--fast] [--unrolled]

Models (written the ordinary way, nn.LSTM, swapped to QuantLSTM by ``quantize_model``, max calibration):

* ``bench.ordinary.LSTMClassifier``: 8 steps of 8 features, 2-layer nn.LSTM (hidden 64), linear head;
* a text-line recognizer (CRNN): conv-bn-relu-pool x2 stem on a 32 x 256 image -> 64 time steps of 512
  features -> 2-layer bidirectional nn.LSTM (hidden 128) -> per-step linear head (37 classes);
* its recurrent part alone (BiLSTM): the same LSTM and head on (B, 64, 512) inputs.

For each, with lq's default recipe (8-bit weights, LSTMs as Scan loops), ``int8_reduce_range`` (7-bit weights,
LSTMs as onnxruntime's fused DynamicQuantizeLSTM: ``recurrent='dynamic'``) and that recipe with the Scan loops
(``recurrent='scan'``): export time,
node count (loop bodies included), max |onnxruntime - PyTorch fake-quant| on the sample and on a third
sequence length (the time axis is dynamic), the kernels onnxruntime runs for the LSTM's matmuls (from the
export report), and onnxruntime speed at batch 32, one thread, against the FP32 export
(``torch.onnx`` legacy exporter: the ONNX LSTM op) and onnxruntime's own ``quantize_static`` of it (QDQ,
per-channel), files timed in turns. ``--unrolled`` also times the export without the loop (the previous
path: torch.export follows the Python loop step by step) of the classifier and the BiLSTM (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import numpy as np
import onnx
import torch
from torch import nn

from bench import _report
from bench.onnx_export import ort_quantize_static, ort_times
from bench.ordinary import LQ_DEFAULT, LQ_REDUCE, LSTMClassifier, export_fp32, lq_ptq

FP32 = "FP32 export"
ORT_QS = "ORT quantize_static"
LQ_REDUCE_SCAN = "lq INT8 (int8_reduce_range, recurrent='scan')"

torch.set_flush_denormal(True)


class CRNN(nn.Module):
    """Conv stem over a text-line image, the width as time, 2-layer bidirectional LSTM, per-step classes."""

    def __init__(self, hidden: int = 128, classes: int = 37):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2))
        self.lstm = nn.LSTM(64 * 8, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x):  # (B, 1, 32, W) -> (B, W / 4, classes)
        f = self.stem(x)
        f = f.flatten(1, 2).transpose(1, 2)  # (B, W / 4, 64 * 8)
        return self.head(self.lstm(f)[0])


class BiLSTM(nn.Module):
    """The CRNN's recurrent part alone: 2-layer bidirectional LSTM over (B, T, 512) features, per-step classes."""

    def __init__(self, features: int = 512, hidden: int = 128, classes: int = 37):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def _inputs(label: str, n: int, seed: int, steps: int = 64) -> torch.Tensor:
    """``n`` inputs of model ``label``; ``steps``: the sequence length (CRNN: a quarter of the image width)."""
    g = torch.Generator().manual_seed(seed)
    if label == "classifier":
        from bench.ordinary import digits

        x = digits((1, 8, 8))[0]
        return x[torch.randperm(len(x), generator=g)[:n]]
    if label == "CRNN":
        return torch.rand(n, 1, 32, 4 * steps, generator=g)
    return torch.randn(n, steps, 512, generator=g)


def _nodes(path: str) -> int:
    from lq.export._ir import all_nodes

    return sum(1 for _ in all_nodes(onnx.load(path).graph))


@contextlib.contextmanager
def _unrolled():
    """lq's export with the loop switched off: the previous path, for comparison."""
    from lq.export.trace import _loop_ops

    saved = _loop_ops.loop_mode
    _loop_ops.loop_mode = lambda model: contextlib.nullcontext([])
    try:
        yield
    finally:
        _loop_ops.loop_mode = saved


def run(label: str, model: nn.Module, dims: tuple, d: str, fast: bool, unrolled: bool) -> dict:
    from lq.export import export_onnx
    from lq.export.verify._verify import make_session

    model.eval()
    calib = [_inputs(label, 32, s) for s in range(2 if fast else 8)]
    sample = _inputs(label, 4, 100)
    paths = {FP32: os.path.join(d, "fp32.onnx")}
    row: dict = {"model": label, "lq": {}}
    for name, rr, recurrent in ((LQ_DEFAULT, False, None), (LQ_REDUCE_SCAN, True, "scan"), (LQ_REDUCE, True, None)):
        q = lq_ptq(model, calib, rr, method="max", recurrent=recurrent)  # max: as documented above
        paths[name] = p = os.path.join(d, f"lq_{int(rr)}_{recurrent}.onnx")  # recurrent None: the recipe's
        t = time.perf_counter()
        res = export_onnx(q, sample, p, dynamic_dims=dims, speed_check=not fast)  # --fast: the bench times it below
        r = row["lq"][name] = {"export_s": time.perf_counter() - t, "nodes": _nodes(p), "max_diff": res.max_abs_diff,
                               "steps": res.verdict}
        lstm = [k for k in res.layer_kernels if k.layer == "lstm"]
        r["lstm_kernels"] = f"{sum(k.integer for k in lstm)} of {len(lstm)} integer: " + ", ".join(
            sorted({k.text() for k in lstm}))
        # a length the export's own verification (the sample and the sample doubled) did not see
        other = _inputs(label, 4, 101, steps=40) if dims else None
        if other is not None:
            with torch.no_grad():
                ref = q(other).numpy()
            out = make_session(p, intra_op_num_threads=1).run(None, {"input": other.numpy()})[0]
            r["other_length"] = (tuple(other.shape), float(np.abs(out - ref).max()))
        if unrolled and name == LQ_DEFAULT:
            with _unrolled():
                pu = os.path.join(d, "unrolled.onnx")
                t = time.perf_counter()
                ru = export_onnx(q, sample, pu, speed_check=not fast)
                row["unrolled"] = {"export_s": time.perf_counter() - t, "nodes": _nodes(pu),
                                   "max_diff": ru.max_abs_diff}
    export_fp32(model, paths[FP32], sample[:1], exporter="legacy")  # its LSTM op, as onnxruntime's tool takes it
    paths[ORT_QS] = os.path.join(d, "ort.onnx")
    ort_quantize_static(paths[FP32], paths[ORT_QS], calib)
    xb = np.ascontiguousarray(_inputs(label, 32, 7).numpy())
    repeats, min_time = (3, 0.05) if fast else (9, 0.3)
    times = ort_times(paths, xb, 1, repeats, min_time)
    row["ms"] = {k: _report.spread(v) for k, v in times.items()}
    row["vs_fp32"] = {k: _report.ratios(times[FP32], v) for k, v in times.items() if k != FP32}
    row["vs_ort"] = {k: _report.ratios(times[ORT_QS], times[k]) for k in (LQ_DEFAULT, LQ_REDUCE_SCAN, LQ_REDUCE)}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="few calibration batches and timing repeats")
    ap.add_argument("--unrolled", action="store_true",
                    help="also time the unrolled export (the previous path) of the classifier and the BiLSTM")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    isa = _report.cpu_isa()
    print(f"CPU: {isa}; onnxruntime at batch 32, 1 thread")
    models = [("classifier", LSTMClassifier(), ()), ("CRNN", CRNN(), (3,)), ("BiLSTM", BiLSTM(), (1,))]
    for label, model, dims in models:
        with tempfile.TemporaryDirectory() as d:
            r = run(label, model, dims, d, args.fast, args.unrolled and label != "CRNN")
        print(f"\n{label}:")
        for name, e in r["lq"].items():
            print(f"  {name}: export {e['export_s']:.1f} s, {e['nodes']} nodes (loop bodies included), max diff "
                  f"{e['max_diff']:.3g} ({e['steps']}); LSTM matmuls {e['lstm_kernels']}")
            if "other_length" in e:
                print(f"    input {e['other_length'][0]} (another sequence length): max diff {e['other_length'][1]:.3g}")
        if "unrolled" in r:
            u = r["unrolled"]
            print(f"  unrolled (the previous path): export {u['export_s']:.1f} s, {u['nodes']} nodes, max diff "
                  f"{u['max_diff']:.3g}")
        for k, v in r["ms"].items():
            extra = f"  {_report.fmt_ratio(r['vs_fp32'][k])} FP32" if k in r["vs_fp32"] else ""
            if k in r["vs_ort"]:
                extra += f", {_report.fmt_ratio(r['vs_ort'][k])} quantize_static"
            print(f"  {k:50s} {_report.fmt_ms(v)} ms{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
