"""The export's measured fallback on small models at the batches where INT8 files are slower than FP32.

    python -m bench.fallback [--fast] [--out DIR]

Two models a user trains on scikit-learn's real 8x8 digits (1,797 images; the last 397 held out): an MLP
(64-128-128-10) and the zoo's ``SmallCNN`` (16 channels). Each is quantized and calibrated with lq's defaults and
exported by ``lq.export.export_onnx`` with its speed check at batch 1, 8 and 32 (``--fast``: batch 1, the MLP,
fewer epochs). Where the check finds the file slower than the plain FP32 export, the export's fallback
(``lq/export/timing/_fallback.py``) exports, verifies and times copies with layers back in float. The table
gives the check's ratio before and after, the layers sent to float, the tries and their seconds, and the
held-out accuracy of the FP32 model, of the PyTorch fake-quant model and of the saved file in onnxruntime. Every
ratio is the export's own measurement: onnxruntime, 1 thread, both files timed in the same interleaved rounds.
The table names the CPU's ISA.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench import _report

torch.set_flush_denormal(True)

#: the held-out digits (the rest trains and calibrates)
HELD_OUT = 397


def _data():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    return x, torch.tensor(d.target)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def _cnn() -> nn.Module:
    from lq.zoo.cnn import SmallCNN

    return SmallCNN(in_channels=1, channels=16)


#: (label, builder, input shape of one image)
MODELS = [("digits MLP 64-128-128-10", _mlp, (64,)), ("zoo SmallCNN, 16 channels, 8x8 digits", _cnn, (1, 8, 8))]


def _train(model: nn.Module, x, y, epochs: int) -> nn.Module:
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    for _ in range(epochs):
        for i in range(0, len(x), 64):
            loss = nn.functional.cross_entropy(model(x[i:i + 64]), y[i:i + 64])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def _torch_acc(model, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _file_acc(path: str, name: str, x, y) -> float:
    import onnxruntime as ort

    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return float((s.run(None, {name: x.numpy()})[0].argmax(1) == y.numpy()).mean())


def measure(label: str, build, shape, batch: int, epochs: int, d: str) -> dict:
    import lq
    from lq.calibration import calibrate_model
    from lq.export import export_onnx

    torch.manual_seed(0)  # the same model at every batch
    x, y = _data()
    x = x.view(-1, *shape)
    xtr, ytr, xte, yte = x[:-HELD_OUT], y[:-HELD_OUT], x[-HELD_OUT:], y[-HELD_OUT:]
    model = _train(build(), xtr, ytr, epochs)
    q = copy.deepcopy(model)
    lq.quantize_model(q)
    calibrate_model(q, list(xtr.split(64)))
    path = str(Path(d) / f"{batch}.onnx")
    t0 = time.perf_counter()
    res = export_onnx(q, xtr[:batch], path, speed_batch=batch)
    seconds = time.perf_counter() - t0
    fb = res.fallback
    return {"model": label, "batch": batch, "before": (fb.before if fb else res.speed_check).ratio,
            "after": res.speed_check.ratio, "noisy": res.speed_check.noisy, "ran": fb is not None,
            "layers": list(res.float_fallback), "tries": len(fb.tries) if fb else 0,
            "stopped": fb.stopped if fb else "", "export_s": seconds,
            "acc": {"FP32": _torch_acc(model, xte, yte), "fake-quant": _torch_acc(q, xte, yte),
                    "file": _file_acc(path, res.input_names[0], xte, yte)}}


def _float_cell(r: dict) -> str:
    """What the fallback sent to float, or why it did not run."""
    if r["ran"]:
        return ", ".join(r["layers"]) or "none (no copy was faster)"
    return "- (not slower)" if r["before"] >= 1.0 else "- (a noisy check: not run)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="the MLP at batch 1, 3 epochs (CI smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default docs/results, or outputs/bench_fast with --fast)")
    args = ap.parse_args(argv)
    out, cmd, t0 = _report.start_run(args)
    models = MODELS[:1] if args.fast else MODELS
    batches = (1,) if args.fast else (1, 8, 32)
    epochs = 3 if args.fast else 30
    rows = []
    for label, build, shape in models:
        for b in batches:
            with tempfile.TemporaryDirectory() as d:
                rows.append(measure(label, build, shape, b, epochs, d))
            r = rows[-1]
            _report.log(f"  {label} batch {b}: {r['before']:.2f}x -> {r['after']:.2f}x, float: {r['layers']}, "
                        f"{r['tries']} tries, {r['export_s']:.1f} s")

    def pct(v):
        return f"{100 * v:.2f}%"

    table = _report.table(
        ["model", "batch", "file with every quantizer", "file saved", "layers sent to float", "tries",
         "export s", "FP32 acc", "fake-quant acc", "file acc"],
        [(r["model"], r["batch"], f"{r['before']:.2f}x", f"{r['after']:.2f}x" + (" (noisy)" if r["noisy"] else ""),
          _float_cell(r), r["tries"], f"{r['export_s']:.1f}",
          pct(r["acc"]["FP32"]), pct(r["acc"]["fake-quant"]), pct(r["acc"]["file"])) for r in rows], "lrrrlrrrrr")
    _report.finish_run(out, "fallback", {"rows": rows}, "The export's measured fallback",
                       f"Produced by `bench/fallback.py` (CPU: {_report.cpu_isa()}). Ratios: the export's own speed check, the INT8 "
                       "file against the plain FP32 export, onnxruntime, 1 thread. \"file with every quantizer\": "
                       "before the fallback; \"file saved\": what `export_onnx` wrote. Accuracy on the 397 held-out "
                       "digits.", table, cmd, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
