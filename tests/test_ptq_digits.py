"""End-to-end post-training quantization on real data: scikit-learn's handwritten digits.

A small CNN (2 conv + BN/ReLU, linear head) is trained for a few seconds with a
plain PyTorch loop, converted with :func:`lq.convert.quantize_model`, and
calibrated with max, entropy, percentile (99.99) and mse through
``TensorQuantizer.enable_calib`` / ``load_calib_amax``. The best INT8 accuracy
must be within 1 point of FP32.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lq.nn as quant_nn
from lq.convert import iter_quantizers, quantize_model, summarize

torch.set_flush_denormal(True)

sklearn = pytest.importorskip("sklearn")


def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8) in [0, 1]
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.3, stratify=y, random_state=0)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr)), (torch.from_numpy(xte), torch.from_numpy(yte))


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.flatten(1))


def train(model, x, y, epochs=5, batch=64, lr=1e-2):
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * ((len(x) + batch - 1) // batch))
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            idx = perm[i : i + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


@torch.no_grad()
def accuracy(model, x, y) -> float:
    return 100.0 * float((model(x).argmax(1) == y).float().mean())


@torch.no_grad()
def collect(model, batches, calibrator: str):
    """Feed ``batches`` to every quantizer's calibrator with quantization off."""
    for name, q in iter_quantizers(model):
        if not name.endswith("_weight_quantizer"):
            q.calibrator = calibrator  # weights keep their max calibrator
        q.disable_quant()
        q.enable_calib()
    for xb in batches:
        model(xb)
    for _, q in iter_quantizers(model):
        q.disable_calib()
        q.enable_quant()


def load_amax(model, method):
    for name, q in iter_quantizers(model):
        if name.endswith("_weight_quantizer") or method == "max":
            q.load_calib_amax()
        elif method == "percentile":
            q.load_calib_amax("percentile", percentile=99.99)
        else:
            q.load_calib_amax(method)


@pytest.fixture
def one_thread():
    """Small ops are fastest on one thread; with a busy 2-core CPU, two OpenMP threads are ~100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_ptq_digits_int8_within_one_point_of_fp32(one_thread):
    torch.manual_seed(0)
    (xtr, ytr), (xte, yte) = digits()
    model = train(DigitsCNN(), xtr, ytr)
    fp32 = accuracy(model, xte, yte)
    assert fp32 > 95.0, f"FP32 training failed: {fp32:.2f}%"
    conv1_weight = model.conv1.weight

    summary = quantize_model(model)
    assert summary.quantized == ["conv1", "conv2", "fc"]
    assert model.conv1.weight is conv1_weight and isinstance(model.conv1, quant_nn.QuantConv2d)

    calib = list(xtr[:512].split(128))
    results = {}
    collect(model, calib, "max")
    load_amax(model, "max")
    results["max"] = accuracy(model, xte, yte)
    collect(model, calib, "histogram")  # one histogram pass serves all three methods
    for method in ("entropy", "percentile", "mse"):
        load_amax(model, method)
        results[method] = accuracy(model, xte, yte)

    # every quantizer ended with a static amax, but the input of the 1-channel stem, which runs in float on the
    # model's input under the default recipe (it stays off through pytorch-quantization's calibration loop)
    off = [n for n, q in iter_quantizers(model) if not q.is_enabled]
    assert off == ["conv1._input_quantizer"], off
    assert all(q.amax is not None for _, q in iter_quantizers(model) if q.is_enabled)
    print(f"\nFP32 accuracy: {fp32:.2f}%")
    for method, acc in results.items():
        print(f"INT8 {method:>10}: {acc:.2f}% ({acc - fp32:+.2f})")
    print(summarize(model))
    best = max(results.values())
    assert best >= fp32 - 1.0, f"best INT8 {best:.2f}% vs FP32 {fp32:.2f}%: {results}"
    # quantization really happened: the INT8 logits differ from FP32 ones
    for _, q in iter_quantizers(model):
        q.disable()
    with torch.no_grad():
        ref = model(xte[:64])
    for _, q in iter_quantizers(model):
        q.enable()
    with torch.no_grad():
        assert not torch.equal(model(xte[:64]), ref)
