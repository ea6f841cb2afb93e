"""Bias correction on and off: what it changes on library-style CNNs, and what it costs.

    python -m bench.bias_correction [--fast] [--out DIR] [--models I ...]

The models of :mod:`bench.library` (and an EfficientNetV2-S-style one), trained briefly on the 5,000 real MNIST
digits (``--epochs``, default 1 epoch on 2,000 images: weak models, where quantization costs the most), then
quantized three ways: lq's default recipe (``int8_onnxruntime``), ``int8_per_tensor`` (one weight scale per
tensor) and 4-bit per-channel weights with 8-bit inputs; each calibrated by ``calibrate_model``'s defaults on 16
batches of 32, with ``bias_correction`` off and on. Reported per row: FP32 accuracy on 1,000 held-out digits, the
fake-quant model's accuracy without and with the correction, the squared error of its logits against FP32's over
their variance (held-out digits), calibration seconds without and with, and what the correction kept (layers
corrected, layers whose correction did not help on the judging batches, or "none kept" where the model's output
was further from float with them).

``--fast``: the O-Net shape only, 512 training images, 256 test images (a smoke run of the code: a model that
little trained says nothing about the correction).
"""

from __future__ import annotations

import copy
import time

import torch

from bench import _report
from bench import library as L

torch.set_flush_denormal(True)

#: the bench.library models and the EfficientNetV2-style one: (label, spec)
MODELS = [*L.MODELS[:2], L.Spec("EfficientNetV2-S-style, scaled down (fused-MBConv, MBConv + SE, SiLU)",
                                 L.EfficientNetV2Small, "32", 1), *L.MODELS[2:4]]


def _setups():
    from lq.callbacks.swap import QuantSwap
    from lq.config import RECIPES
    from lq.convert import quantize_model
    from lq.tensor_quant import QuantDescriptor

    return [("int8_onnxruntime (default)", lambda q: QuantSwap(RECIPES["int8_onnxruntime"]()).swap(q)),
            ("int8_per_tensor", lambda q: QuantSwap(RECIPES["int8_per_tensor"]()).swap(q)),
            ("W4A8 (4-bit per-channel weights)",
             lambda q: quantize_model(q, quant_desc_input=QuantDescriptor(num_bits=8),
                                      quant_desc_weight=QuantDescriptor(num_bits=4, axis=(0,))))]


def logits_error(q: torch.nn.Module, fp: torch.nn.Module, x: torch.Tensor) -> float:
    """Squared error of ``q``'s outputs against ``fp``'s over the variance of ``fp``'s, on ``x``."""
    with torch.no_grad():
        a = torch.cat([fp(c) for c in x.split(250)])
        b = torch.cat([q(c) for c in x.split(250)])
    return float(((a - b) ** 2).mean() / a.var())


def run_model(spec: L.Spec, epochs: int, n_train: int, fast: bool) -> list[dict]:
    from lq.calibration import calibrate_model

    torch.manual_seed(0)
    xtr, ytr, xte, yte = L.dataset(spec.data, fast)
    model = L.train(spec, spec.build(False), xtr[:n_train], ytr[:n_train], epochs)
    fp = L.torch_quality(spec, model, xte, yte)
    batches = list(xtr[:512].split(32))
    rows = []
    for label, swap in _setups():
        row = {"model": spec.label, "quant": label, "fp32": fp}
        for on in (False, True):
            q = copy.deepcopy(model)
            swap(q)
            q.eval()
            t = time.perf_counter()
            res = calibrate_model(q, batches, progress=False, bias_correction=on)
            key = "on" if on else "off"
            row[f"calib_s_{key}"] = time.perf_counter() - t
            row[f"acc_{key}"] = L.torch_quality(spec, q, xte, yte)
            row[f"error_{key}"] = logits_error(q, model, xte)
            if on:
                r = res.bias_correction
                row["kept"] = {"corrected": len(r.corrected), "not_helping": len(r.not_helping),
                               "fell_back": r.fell_back, "skipped": len(r.skipped)}
        rows.append(row)
        _report.log(f"  {label}: {100 * row['acc_off']:.1f}% -> {100 * row['acc_on']:.1f}%, error "
                    f"{row['error_off']:.5f} -> {row['error_on']:.5f}")
    return rows


def _kept(k: dict) -> str:
    if k["fell_back"]:
        return f"none kept ({k['not_helping']} of the rest not helping)"
    return f"{k['corrected']} corrected, {k['not_helping']} not helping"


def main(argv=None) -> int:
    ap = _report.models_parser(__doc__, "the O-Net shape only, 512 training / 256 test images", len(MODELS), threads=1)
    ap.add_argument("--epochs", type=int, default=1, help="FP32 training epochs (default 1: weak models)")
    ap.add_argument("--train", type=int, default=2000, help="training images (default 2000)")
    args = ap.parse_args(argv)
    out, cmd, t0 = _report.start_run(args)
    which = args.models if args.models is not None else ([3] if args.fast else range(len(MODELS)))
    rows = []
    for i in which:
        _report.log(f"{MODELS[i].label} ...")
        rows += run_model(MODELS[i], args.epochs, min(args.train, 512) if args.fast else args.train, args.fast)
    table = _report.table(
        ["model", "quantization", "FP32", "off", "on", "logits error off", "on", "calibration s off", "on",
         "what the correction kept"],
        [(r["model"].split(" (")[0], r["quant"], f"{100 * r['fp32']:.1f}%", f"{100 * r['acc_off']:.1f}%",
          f"{100 * r['acc_on']:.1f}%", f"{r['error_off']:.5f}", f"{r['error_on']:.5f}", f"{r['calib_s_off']:.1f}",
          f"{r['calib_s_on']:.1f}", _kept(r["kept"])) for r in rows], "llrrrrrrrl")
    intro = (f"Produced by `bench/bias_correction.py` (CPU: {_report.cpu_isa()}). Accuracy of the fake-quant model "
             "on held-out digits with `calibrate_model(bias_correction=False / True)`; logits error = squared error "
             "against FP32's logits over their variance. See the module docstring for the setup.")
    _report.finish_run(out, "bias_correction", {"rows": rows, "fast": args.fast}, "Bias correction", intro, table,
                       cmd, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
