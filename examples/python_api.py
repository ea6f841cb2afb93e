"""Quantize a LightningModule with one callback: calibrate, fine-tune (QAT), export INT8 ONNX.

    python examples/python_api.py          # full run (about a minute on 2 CPU cores)
    python examples/python_api.py --fast   # a few batches, for CI
"""

import argparse

import lightning as L
import torch

import lq
from lq.config import CalibConfig, ExportConfig, Int8PerChannelConfig, QATConfig
from lq.zoo import DigitsDataModule, SmallCNN


def main(fast: bool = False, out: str = "outputs/python_api") -> dict:
    torch.set_flush_denormal(True)
    L.seed_everything(0)
    limits = dict(limit_train_batches=3, limit_val_batches=2) if fast else {}
    dm = DigitsDataModule(batch_size=64)
    model = SmallCNN(max_epochs_hint=6)

    # 1. ordinary floating point training
    L.Trainer(max_epochs=1 if fast else 6, logger=False, enable_checkpointing=False, default_root_dir=out,
              **limits).fit(model, datamodule=dm)

    # 2. quantization: swap at setup, calibrate before the first step, QAT with the reference LR recipe,
    #    export model_int8.onnx at the end and check it in onnxruntime
    quant = lq.QuantCallback(
        quant=Int8PerChannelConfig(),
        calib=CalibConfig(method="percentile", percentile=99.99, num_batches=8),
        qat=QATConfig(lr_policy="cosine", freeze_bn_epoch=1),
        export=ExportConfig(path="model_int8.onnx"),
    )
    trainer = L.Trainer(max_epochs=1 if fast else 2, logger=False, callbacks=[quant], default_root_dir=out, **limits)
    trainer.fit(model, datamodule=dm)
    metrics = trainer.test(model, datamodule=dm)[0]
    print(f"INT8 QAT test accuracy: {metrics['test_acc']:.4f}; ONNX model: {quant.exporter.path}")
    return metrics


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fast", action="store_true", help="a few batches only (CI)")
    p.add_argument("--out", default="outputs/python_api")
    a = p.parse_args()
    main(a.fast, a.out)
