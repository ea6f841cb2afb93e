"""Post-training quantization only: no QAT. Calibrate through ``trainer.validate``, export, run in onnxruntime.

    python examples/post_training.py [--fast]
"""

import argparse
import os

import lightning as L
import numpy as np
import onnxruntime as ort
import torch

import lq
from lq.config import CalibConfig
from lq.zoo import DigitsDataModule, SmallCNN


def main(fast: bool = False, out: str = "outputs/post_training") -> dict:
    torch.set_flush_denormal(True)
    L.seed_everything(0)
    dm = DigitsDataModule(batch_size=64)
    model = SmallCNN(max_epochs_hint=6)
    L.Trainer(max_epochs=1 if fast else 6, logger=False, enable_checkpointing=False, default_root_dir=out,
              limit_train_batches=3 if fast else None).fit(model, datamodule=dm)

    # The callback swaps the layers at setup; the first validate() calibrates (percentile, 8 batches),
    # the second one measures the INT8 model.
    cb = lq.QuantCallback(calib=CalibConfig(method="percentile", num_batches=8), verbose=False)
    trainer = L.Trainer(logger=False, callbacks=[cb], default_root_dir=out)
    fp32 = trainer.validate(model, datamodule=dm, verbose=False)[0]["val_acc"]
    int8 = trainer.validate(model, datamodule=dm, verbose=False)[0]["val_acc"]

    # Export without a fit: the same exporter the callback uses at on_fit_end.
    x, y = dm.arrays("test")
    os.makedirs(out, exist_ok=True)
    result = lq.export_onnx(model, x[:8], os.path.join(out, "ptq_int8.onnx"))
    sess = ort.InferenceSession(result.path, providers=["CPUExecutionProvider"])
    pred = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0].argmax(1)
    onnx_acc = float((pred == y.numpy()).mean())
    print(f"val accuracy FP32 {fp32:.4f} | INT8 PTQ {int8:.4f}; test accuracy in onnxruntime {onnx_acc:.4f}")
    return {"fp32": fp32, "int8": int8, "onnx": onnx_acc, "agree": float(np.mean(pred == model.eval()(x).argmax(1).numpy()))}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fast", action="store_true")
    p.add_argument("--out", default="outputs/post_training")
    a = p.parse_args()
    main(a.fast, a.out)
