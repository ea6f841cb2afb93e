"""QAT through ``QuantCallback()``'s defaults on the library-style CNNs: how close the exported file comes to FP32.

    python -m bench.qat [--fast] [--out DIR] [--models I ...] [--epochs N]

Each model of :mod:`bench.library` (and the EfficientNetV2-S-style one of :mod:`bench.bias_correction`) is trained
in FP32 as bench.library trains it (AdamW, one-cycle LR peaking at the model's LR, on 3,500 of the 4,000 training
digits; 500 held out as validation data), then wrapped in a LightningModule whose ``configure_optimizers`` is the
optimizer it was trained with (AdamW at that peak LR, no schedule: what a user's module returns) and fine-tuned by
``Trainer(max_epochs=2, callbacks=[lq.QuantCallback()])``: the default recipe, ``auto`` calibration, the default
QAT schedule (``lr_policy=auto``: 1% of the module's LR, cosine-annealed, since the model is calibrated first) and
the export at the end of fit with the PTQ-vs-QAT choice on the validation digits (``export.export_best``).

Reported per model, on the 1,000 test digits (IoU for the dense net): FP32 (PyTorch), post-training (lq's default
PTQ on the batches the callback calibrates on, fake-quant in PyTorch), the QAT model (PyTorch), the exported file in onnxruntime, which of PTQ and QAT the
callback exported and its validation scores; and, beside it, the same fine-tuning at the module's own LR
(``lr_policy=none``, the default before issue 40): what a fine-tuning LR buys.

``--fast``: the O-Net shape, 512 training / 256 test images, one QAT epoch, no speed check, no ``none`` run.
"""

from __future__ import annotations

import copy
import itertools
import os
import tempfile
import time
import warnings

import lightning as L
import torch

from bench import _report
from bench import bias_correction as BC
from bench import library as B

torch.set_flush_denormal(True)

#: training digits held out as the callback's validation data (the PTQ-vs-QAT choice)
VAL = 500

#: bench.library's models with the EfficientNetV2-S-style one (trained 1 epoch: weak, where quantization costs most)
MODELS = [*BC.MODELS, B.MODELS[4]]


class Wrapped(L.LightningModule):
    """The user's LightningModule around a trained model: its loss, and the optimizer it was trained with."""

    def __init__(self, model: torch.nn.Module, spec: B.Spec):
        super().__init__()
        self.model, self.spec = model, spec

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        return B.loss_fn(self.spec, self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", B.loss_fn(self.spec, self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.spec.lr, weight_decay=1e-4)


def _loader(x, y, shuffle: bool = False):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=shuffle,
                                       generator=torch.Generator().manual_seed(0) if shuffle else None)


def qat(spec: B.Spec, model: torch.nn.Module, data, policy: str, epochs: int, fast: bool, d: str) -> dict:
    """``QuantCallback()`` with ``qat.lr_policy=policy`` on a copy of ``model``; the exported file's quality."""
    import lq
    from lq.config import ExportConfig, QATConfig

    xtr, ytr, xval, yval, xte, yte = data
    path = os.path.join(d, f"qat_{policy}.onnx")
    outputs = ["region", "link"] if spec.seg else ["output"]
    cb = lq.QuantCallback(qat=QATConfig(lr_policy=policy), verbose=False,
                          export=ExportConfig(path=path, speed_check=not fast,
                                              output_names=outputs if len(outputs) > 1 else None))
    m = Wrapped(copy.deepcopy(model), spec)
    t = time.perf_counter()
    trainer = L.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=d, accelerator="cpu", callbacks=[cb],
                        num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(m, _loader(xtr, ytr, shuffle=True), _loader(xval, yval))
    return {"policy": cb.schedule.policy, "seconds": time.perf_counter() - t, "chosen": cb.best.chosen,
            "val_scores": cb.best.scores, "qat_torch": B.torch_quality(spec, m.model.eval(), xte, yte),
            "file": B.ort_quality(spec, path, xte, yte)}


def run_model(spec: B.Spec, epochs: int, fast: bool) -> dict:
    torch.manual_seed(0)
    xtr, ytr, xte, yte = B.dataset(spec.data, fast)
    nval = 128 if fast else VAL
    xtr, ytr, xval, yval = xtr[:-nval], ytr[:-nval], xtr[-nval:], ytr[-nval:]
    model = B.train(spec, spec.build(fast), xtr, ytr, spec.epochs)
    row = {"model": spec.label, "metric": spec.metric, "fp32": B.torch_quality(spec, model, xte, yte),
           "train_images": len(xtr), "val_images": len(xval), "test_images": len(xte), "fp32_epochs": spec.epochs}
    # the batches the callback calibrates on: the first 16 of the seeded, shuffled training loader's first pass
    calib = [b[0] for b in itertools.islice(_loader(xtr, ytr, shuffle=True), 16)]
    ptq = B.swap_and_calibrate(copy.deepcopy(model), calib, "int8_onnxruntime")
    row["ptq_torch"] = B.torch_quality(spec, ptq, xte, yte)
    data = (xtr, ytr, xval, yval, xte, yte)
    with tempfile.TemporaryDirectory() as d:
        row["auto"] = qat(spec, model, data, "auto", epochs, fast, d)
        if not fast:
            row["none"] = qat(spec, model, data, "none", epochs, fast, d)
    return row


def _q(r: dict, v) -> str:
    return B._q(r, v)


def _chosen(q: dict) -> str:
    s = q.get("val_scores")
    if not s:
        return q["chosen"] or "qat"
    return f"{q['chosen']} (val PTQ {100 * s['ptq']:.1f}%, QAT {100 * s['qat']:.1f}%)"


def main(argv=None) -> int:
    ap = _report.models_parser(__doc__, "the O-Net shape, 512 / 256 images, 1 QAT epoch", len(MODELS), threads=2)
    ap.add_argument("--epochs", type=int, default=2, help="QAT epochs (default 2)")
    args = ap.parse_args(argv)
    out, cmd, t0 = _report.start_run(args)
    which = args.models if args.models is not None else ([3] if args.fast else range(len(MODELS)))
    epochs = 1 if args.fast else args.epochs
    rows = []
    for i in which:
        spec = MODELS[i]
        _report.log(f"{spec.label} ...")
        r = run_model(spec, epochs, args.fast)
        rows.append(r)
        _report.log(f"  FP32 {_q(r, r['fp32'])}, PTQ {_q(r, r['ptq_torch'])}, QAT file {_q(r, r['auto']['file'])} "
                    f"({_chosen(r['auto'])})" + (f"; at the module's LR {_q(r, r['none']['file'])}" if "none" in r
                                                 else ""))
    cpu = _report.cpu_isa()
    head = ["model", "FP32", "PTQ (PyTorch)", "QAT default: file (onnxruntime)", "QAT model (PyTorch)",
            "exported", "within 0.5 point of FP32", "QAT at the module's LR: file", "QAT s (default)"]
    body = []
    for r in rows:
        a, n = r["auto"], r.get("none")
        body.append([r["model"].split(" (")[0], _q(r, r["fp32"]), _q(r, r["ptq_torch"]), _q(r, a["file"]),
                     _q(r, a["qat_torch"]), _chosen(a), "yes" if a["file"] >= r["fp32"] - 0.005 else "**no**",
                     _q(r, n["file"]) if n else "-", f"{a['seconds']:.0f}"])
    intro = (f"Produced by `bench/qat.py` (CPU: {cpu}). `Trainer(max_epochs={epochs}, "
             "callbacks=[lq.QuantCallback()])` on each FP32-trained model, the module's optimizer being the one it "
             "was trained with (AdamW at its peak LR); quality on held-out digits (IoU for the U-Net). See the "
             "module docstring for the setup.")
    _report.finish_run(out, "qat", {"rows": rows, "fast": args.fast, "epochs": epochs}, "QAT with the callback's defaults",
                       intro, _report.table(head, body, "lrrrrlcrr"), cmd, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
