"""The style zoo: each architecture of the benches written the ways people write it.

    python -m bench.styles [--fast] [--out DIR]

Eight architectures, each from its published description and sized for 32x32 images (a 1-D audio net for 1,024
samples, a face net for 24x24), each written in three or four styles that compute exactly the same function
(:func:`same_weights` copies one style's weights into another, and the tests check the outputs agree):

* ``a``: ``nn.Sequential`` blocks and modules for everything (``nn.ReLU``, ``nn.MaxPool2d``, ``nn.ZeroPad2d``);
* ``b``: one module whose helper methods call functions (``F.relu``, ``F.pad``, ``F.max_pool2d``, ``torch.cat``,
  ``torch.flatten``) on its layers;
* ``c``: forwards that torch.fx cannot trace: ``isinstance`` checks, lists of tensors, branches on shapes and on
  ``requires_grad``, a ``torch.utils.checkpoint`` branch (not taken in evaluation), in-place ``+=`` and ReLUs;
* ``d`` (where it fits): a module's weight passed to a functional op (``F.conv2d(x, self.conv.weight, ...)``,
  ``F.linear(x, self.qkv.weight, self.qkv.bias)`` as Swin's attention does).

lq places quantizers on one capture of the whole model (:mod:`lq.capture`), so every style of an architecture
must give the same integer kernels in onnxruntime's graph: the tests (``tests/test_styles.py``) check the counts
per architecture and style, and this bench times each style's file against the faster plain FP32 export and
onnxruntime's ``quantize_static`` (same calibration data, the same weights: trained once on real MNIST digits
and copied into every style).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def same_weights(src: nn.Module, dst: nn.Module) -> nn.Module:
    """Copy ``src``'s parameters and buffers into ``dst`` in registration order (the styles register their layers
    in the same order under different names)."""
    a, b = src.state_dict(), dst.state_dict()
    assert len(a) == len(b), (len(a), len(b))
    for (ka, va), (kb, vb) in zip(a.items(), b.items()):
        assert va.shape == vb.shape, (ka, kb, va.shape, vb.shape)
    dst.load_state_dict(dict(zip(b.keys(), a.values())))
    return dst


def _bn_act(c: int, act: type) -> list[nn.Module]:
    return [nn.BatchNorm2d(c), act()]


# ================================================================================ ResNet (He et al. 2016)
class ResBlockA(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \
            if stride != 1 or cin != cout else nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.body(x) + self.short(x))


class ResNetA(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.layers = nn.Sequential(ResBlockA(16, 16, 1), ResBlockA(16, 32, 2))
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(self.pool(self.layers(self.stem(x))))


class ResNetB(nn.Module):
    """Every layer a direct child; blocks applied by a helper method with functions."""

    def __init__(self):
        super().__init__()
        self.conv0, self.bn0 = nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16)
        self.c1a, self.b1a, self.c1b, self.b1b = (nn.Conv2d(16, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                                  nn.Conv2d(16, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16))
        self.c2a, self.b2a, self.c2b, self.b2b = (nn.Conv2d(16, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32),
                                                  nn.Conv2d(32, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32))
        self.c2s, self.b2s = nn.Conv2d(16, 32, 1, 2, bias=False), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def _block(self, x, ca, ba, cb, bb, short=None):
        y = bb(cb(F.relu(ba(ca(x)))))
        return F.relu(y + (x if short is None else short(x)))

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn0(self.conv0(x))), 2)
        x = self._block(x, self.c1a, self.b1a, self.c1b, self.b1b)
        x = self._block(x, self.c2a, self.b2a, self.c2b, self.b2b, lambda t: self.b2s(self.c2s(t)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResBlockC(nn.Module):
    """torchvision's BasicBlock as written there (in-place ReLU, ``out += identity``), plus input checks."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \
            if stride != 1 or cin != cout else None
        self.relu = nn.ReLU(inplace=True)
        self.memory_efficient = False

    def _body(self, x):
        return self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))

    def forward(self, x):
        x = x[0] if isinstance(x, (list, tuple)) else x
        identity = x if self.downsample is None else self.downsample(x)
        if self.memory_efficient and x.requires_grad:
            out = checkpoint(self._body, x, use_reentrant=False)
        else:
            out = self._body(x)
        out += identity
        return self.relu(out)


class ResNetC(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        self.blocks = nn.ModuleList([ResBlockC(16, 16, 1), ResBlockC(16, 32, 2)])
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        if x.dim() == 3:
            x = x.unsqueeze(0)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        feats = [x]
        for block in self.blocks:
            feats.append(block(feats[-1] if len(feats) % 2 else [feats[-1]]))
        x = feats[-1].mean((2, 3)) if x.shape[-1] > 1 else feats[-1].flatten(1)
        return self.fc(x)


class ResNetD(ResNetB):
    """Style ``b`` whose convs and linear are applied by functions on the layers' own weights."""

    def _conv(self, conv: nn.Conv2d, x):
        return F.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    def _block(self, x, ca, ba, cb, bb, short=None):
        y = bb(self._conv(cb, F.relu(ba(self._conv(ca, x)))))
        return F.relu(y + (x if short is None else short(x)))

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn0(self._conv(self.conv0, x))), 2)
        x = self._block(x, self.c1a, self.b1a, self.c1b, self.b1b)
        x = self._block(x, self.c2a, self.b2a, self.c2b, self.b2b, lambda t: self.b2s(self._conv(self.c2s, t)))
        return F.linear(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1), self.fc.weight, self.fc.bias)


# ============================================ MobileNetV3 inverted residual (Howard et al. 2019): SE, Hardswish
class SEA(nn.Module):
    def __init__(self, c: int, r: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.act, self.fc2, self.gate = nn.Conv2d(c, r, 1), nn.ReLU(), nn.Conv2d(r, c, 1), nn.Hardsigmoid()

    def forward(self, x):
        return x * self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))


class InvertedA(nn.Module):
    def __init__(self, cin: int, mid: int, cout: int, stride: int, act: type, se: bool):
        super().__init__()
        layers = [nn.Conv2d(cin, mid, 1, bias=False), *_bn_act(mid, act),
                  nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), *_bn_act(mid, act)]
        if se:
            layers.append(SEA(mid, max(8, mid // 4)))
        layers += [nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class MobileNetA(nn.Module):
    act = nn.Hardswish

    def __init__(self):
        super().__init__()
        a = self.act
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), *_bn_act(16, a)),
            InvertedA(16, 48, 16, 1, a, True), InvertedA(16, 64, 24, 2, a, True), InvertedA(24, 72, 24, 1, a, True),
            nn.Sequential(nn.Conv2d(24, 64, 1, bias=False), *_bn_act(64, a)))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.features(x))


_MB_SPEC = [(16, 48, 16, 1), (16, 64, 24, 2), (24, 72, 24, 1)]


class MobileNetB(nn.Module):
    """One module: each block's layers in a dict, blocks applied by helper methods with functions (timm's style
    of squeeze-excite: ``x.mean((2, 3), keepdim=True)``)."""

    act = staticmethod(F.hardswish)
    gate = staticmethod(F.hardsigmoid)

    def __init__(self):
        super().__init__()
        self.stem, self.stem_bn = nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16)
        self.blocks = nn.ModuleList()
        for cin, mid, cout, s in _MB_SPEC:
            r = max(8, mid // 4)
            self.blocks.append(nn.ModuleDict(dict(
                expand=nn.Conv2d(cin, mid, 1, bias=False), ebn=nn.BatchNorm2d(mid),
                dw=nn.Conv2d(mid, mid, 3, s, 1, groups=mid, bias=False), dbn=nn.BatchNorm2d(mid),
                se1=nn.Conv2d(mid, r, 1), se2=nn.Conv2d(r, mid, 1),
                proj=nn.Conv2d(mid, cout, 1, bias=False), pbn=nn.BatchNorm2d(cout))))
        self.last, self.last_bn = nn.Conv2d(24, 64, 1, bias=False), nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, 10)

    def _se(self, x, b):
        s = x.mean((2, 3), keepdim=True)
        return x * self.gate(b["se2"](F.relu(b["se1"](s))))

    def _block(self, x, i):
        cin, _, cout, s = _MB_SPEC[i]
        b = self.blocks[i]
        y = self.act(b["ebn"](b["expand"](x)))
        y = self._se(self.act(b["dbn"](b["dw"](y))), b)
        y = b["pbn"](b["proj"](y))
        return x + y if s == 1 and cin == cout else y

    def forward(self, x):
        x = self.act(self.stem_bn(self.stem(x)))
        for i in range(len(_MB_SPEC)):
            x = self._block(x, i)
        x = self.act(self.last_bn(self.last(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InvertedC(nn.Module):
    """A block whose forward branches on its input and keeps a list of intermediate tensors."""

    def __init__(self, cin: int, mid: int, cout: int, stride: int, act: type):
        super().__init__()
        self.conv_pw, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv_dw, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid)
        self.se = SEA(mid, max(8, mid // 4))
        self.conv_pwl, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.act = act(inplace=True)
        self.has_skip = stride == 1 and cin == cout

    def forward(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError("a tensor")
        steps = [x]
        for conv, bn in ((self.conv_pw, self.bn1), (self.conv_dw, self.bn2)):
            steps.append(self.act(bn(conv(steps[-1]))))
        y = self.bn3(self.conv_pwl(self.se(steps[-1])))
        if self.has_skip and y.shape == x.shape:
            y = y + x
        return y


class MobileNetC(nn.Module):
    act = nn.Hardswish
    block = InvertedC

    def __init__(self):
        super().__init__()
        a = self.act
        self.conv_stem, self.bn1 = nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16)
        self.blocks = nn.ModuleList([self.block(*spec, a) for spec in _MB_SPEC])
        self.conv_head, self.bn2 = nn.Conv2d(24, 64, 1, bias=False), nn.BatchNorm2d(64)
        self.act1, self.act2 = a(inplace=True), a(inplace=True)
        self.classifier = nn.Linear(64, 10)

    def forward(self, x):
        x = self.act1(self.bn1(self.conv_stem(x)))
        for b in self.blocks:
            x = b(x)
        x = self.act2(self.bn2(self.conv_head(x)))
        return self.classifier(x.mean((2, 3)) if x.dim() == 4 else x)


# =========================================== EfficientNet MBConv (Tan & Le 2019): SiLU, sigmoid squeeze-excite
class SESiLU(SEA):
    def __init__(self, c: int, r: int):
        super().__init__(c, r)
        self.act, self.gate = nn.SiLU(), nn.Sigmoid()


class MBConvA(InvertedA):
    def __init__(self, cin, mid, cout, stride):
        super().__init__(cin, mid, cout, stride, nn.SiLU, False)
        layers = list(self.block)
        layers.insert(6, SESiLU(mid, max(8, mid // 4)))
        self.block = nn.Sequential(*layers)


class EfficientNetA(MobileNetA):
    act = nn.SiLU

    def __init__(self):
        nn.Module.__init__(self)
        a = self.act
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), *_bn_act(16, a)),
            *[MBConvA(*spec) for spec in _MB_SPEC],
            nn.Sequential(nn.Conv2d(24, 64, 1, bias=False), *_bn_act(64, a)))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


class EfficientNetB(MobileNetB):
    act = staticmethod(F.silu)
    gate = staticmethod(torch.sigmoid)

    def _se(self, x, b):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(b["se2"](F.silu(b["se1"](s))))


class MBConvC(InvertedC):
    def __init__(self, cin, mid, cout, stride, act):
        super().__init__(cin, mid, cout, stride, act)
        self.se = SESiLU(mid, max(8, mid // 4))


class EfficientNetC(MobileNetC):
    act = nn.SiLU
    block = MBConvC


# ====================================== DenseNet (Huang et al. 2017): concatenation, BN -> ReLU -> conv (pre-act)
_GROWTH, _DENSE = 8, 3


class DenseLayerA(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, 4 * _GROWTH, 1, bias=False),
                                  nn.BatchNorm2d(4 * _GROWTH), nn.ReLU(),
                                  nn.Conv2d(4 * _GROWTH, _GROWTH, 3, 1, 1, bias=False))

    def forward(self, x):
        return torch.cat([x, self.body(x)], 1)


class DenseNetA(nn.Module):
    def __init__(self):
        super().__init__()
        c = 16
        layers: list[nn.Module] = [nn.Conv2d(3, c, 3, 1, 1, bias=False)]
        for block in range(2):
            for _ in range(_DENSE):
                layers.append(DenseLayerA(c))
                c += _GROWTH
            if block == 0:
                layers += [nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2)]
                c //= 2
        layers += [nn.BatchNorm2d(c), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c, 10)

    def forward(self, x):
        return self.classifier(self.features(x))


class DenseNetB(nn.Module):
    """Each layer's modules in a dict, the dense connections written in the forward with ``torch.cat`` of a growing
    list."""

    def __init__(self):
        super().__init__()
        c = 16
        self.stem = nn.Conv2d(3, c, 3, 1, 1, bias=False)
        self.block1 = self._block(c)
        c += _DENSE * _GROWTH
        self.trans_norm, self.trans_conv = nn.BatchNorm2d(c), nn.Conv2d(c, c // 2, 1, bias=False)
        c //= 2
        self.block2 = self._block(c)
        c += _DENSE * _GROWTH
        self.norm = nn.BatchNorm2d(c)
        self.classifier = nn.Linear(c, 10)

    @staticmethod
    def _block(c: int) -> nn.ModuleList:
        return nn.ModuleList([nn.ModuleDict(dict(
            n1=nn.BatchNorm2d(c + j * _GROWTH), c1=nn.Conv2d(c + j * _GROWTH, 4 * _GROWTH, 1, bias=False),
            n2=nn.BatchNorm2d(4 * _GROWTH), c2=nn.Conv2d(4 * _GROWTH, _GROWTH, 3, 1, 1, bias=False)))
            for j in range(_DENSE)])

    def _layer(self, feats: list, m: nn.ModuleDict):
        x = torch.cat(feats, 1)
        return m["c2"](F.relu(m["n2"](m["c1"](F.relu(m["n1"](x))))))

    def forward(self, x):
        x = self.stem(x)
        for block in (self.block1, self.block2):
            feats = [x]
            for m in block:
                feats.append(self._layer(feats, m))
            x = torch.cat(feats, 1)
            if block is self.block1:
                x = F.avg_pool2d(self.trans_conv(F.relu(self.trans_norm(x))), 2)
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.norm(x)), 1), 1))


class DenseLayerC(nn.Module):
    """torchvision's _DenseLayer as written there: a list or a tensor in, ``isinstance`` and ``requires_grad``
    checks, a checkpoint branch."""

    def __init__(self, cin: int):
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, 4 * _GROWTH, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(4 * _GROWTH), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4 * _GROWTH, _GROWTH, 3, 1, 1, bias=False)
        self.memory_efficient = False

    def bn_function(self, inputs: list):
        return self.conv1(self.relu1(self.norm1(torch.cat(inputs, 1))))

    def any_requires_grad(self, inputs: list) -> bool:
        return any(t.requires_grad for t in inputs)

    def forward(self, input):
        prev = [input] if isinstance(input, torch.Tensor) else input
        if self.memory_efficient and self.any_requires_grad(prev):
            bottleneck = checkpoint(self.bn_function, prev, use_reentrant=False)
        else:
            bottleneck = self.bn_function(prev)
        return self.conv2(self.relu2(self.norm2(bottleneck)))


class DenseBlockC(nn.ModuleDict):
    def __init__(self, cin: int):
        super().__init__()
        for i in range(_DENSE):
            self[f"denselayer{i + 1}"] = DenseLayerC(cin + i * _GROWTH)

    def forward(self, init):
        features = [init]
        for _, layer in self.items():
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNetC(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.block1 = DenseBlockC(16)
        c = 16 + _DENSE * _GROWTH
        self.transition = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(inplace=True), nn.Conv2d(c, c // 2, 1, bias=False),
                                        nn.AvgPool2d(2))
        self.block2 = DenseBlockC(c // 2)
        c = c // 2 + _DENSE * _GROWTH
        self.norm5 = nn.BatchNorm2d(c)
        self.classifier = nn.Linear(c, 10)

    def forward(self, x):
        features = self.block2(self.transition(self.block1(self.conv0(x))))
        out = F.relu(self.norm5(features), inplace=True)
        out = F.adaptive_avg_pool2d(out, (1, 1))
        return self.classifier(torch.flatten(out, 1))


# ============================================================ VGG-BN U-Net (Ronneberger et al. 2015): skips
def _cbr(i: int, o: int) -> list[nn.Module]:
    return [nn.Conv2d(i, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]


class UpA(nn.Module):
    def __init__(self, cin: int, cskip: int, cout: int):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.conv = nn.Sequential(*_cbr(cin + cskip, cout))

    def forward(self, x, skip):
        return self.conv(torch.cat([self.up(x), skip], 1))


class UNetA(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc1 = nn.Sequential(*_cbr(3, 16), *_cbr(16, 16))
        self.enc2 = nn.Sequential(nn.MaxPool2d(2), *_cbr(16, 32), *_cbr(32, 32))
        self.mid = nn.Sequential(nn.MaxPool2d(2), *_cbr(32, 32))
        self.up2, self.up1 = UpA(32, 32, 32), UpA(32, 16, 16)
        self.head = nn.Conv2d(16, 2, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        return self.head(self.up1(self.up2(self.mid(e2), e2), e1))


class UNetB(nn.Module):
    def __init__(self):
        super().__init__()
        specs = [(3, 16), (16, 16), (16, 32), (32, 32), (32, 32), (64, 32), (48, 16)]
        self.cbr = nn.ModuleList([nn.ModuleDict(dict(conv=nn.Conv2d(i, o, 3, 1, 1, bias=False), bn=nn.BatchNorm2d(o)))
                                  for i, o in specs])
        self.head = nn.Conv2d(16, 2, 1)

    def _cbr(self, x, i):
        return F.relu(self.cbr[i]["bn"](self.cbr[i]["conv"](x)))

    def _up(self, x, skip, i):
        return self._cbr(torch.cat([F.interpolate(x, scale_factor=2.0, mode="nearest"), skip], 1), i)

    def forward(self, x):
        e1 = self._cbr(self._cbr(x, 0), 1)
        e2 = self._cbr(self._cbr(F.max_pool2d(e1, 2), 2), 3)
        m = self._cbr(F.max_pool2d(e2, 2), 4)
        return self.head(self._up(self._up(m, e2, 5), e1, 6))


class UNetC(nn.Module):
    """Encoder stages in a list, their outputs kept in a list and popped by the decoder."""

    def __init__(self):
        super().__init__()
        self.down = nn.ModuleList([nn.Sequential(*_cbr(3, 16), *_cbr(16, 16)),
                                   nn.Sequential(nn.MaxPool2d(2), *_cbr(16, 32), *_cbr(32, 32)),
                                   nn.Sequential(nn.MaxPool2d(2), *_cbr(32, 32))])
        self.up = nn.ModuleList([nn.Sequential(*_cbr(64, 32)), nn.Sequential(*_cbr(48, 16))])
        self.head = nn.Conv2d(16, 2, 1)

    def forward(self, x):
        skips = []
        for stage in self.down:
            x = stage(x)
            skips.append(x)
        skips.pop()
        for stage in self.up:
            skip = skips.pop()
            if x.shape[-1] != skip.shape[-1]:
                x = F.interpolate(x, size=skip.shape[-2:], mode="nearest")
            x = stage(torch.cat((x, skip), dim=1))
        return self.head(x)


# =========================================== 1-D audio CNN, CREPE's shape (Kim et al. 2018): conv-ReLU-BN-pool
_AUDIO = [(1, 32, 64, 4), (32, 16, 16, 1), (16, 16, 16, 1), (16, 32, 8, 1)]  # in, out, kernel, stride


class AudioA(nn.Module):
    def __init__(self):
        super().__init__()
        layers = []
        for i, o, k, s in _AUDIO:
            layers += [nn.ZeroPad2d((0, 0, (k - 1) // 2, k // 2)), nn.Conv2d(i, o, (k, 1), (s, 1)), nn.ReLU(),
                       nn.BatchNorm2d(o), nn.MaxPool2d((2, 1), (2, 1)), nn.Dropout(0.25)]
        self.layers = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 16, 10))

    def forward(self, x):
        return self.classifier(self.layers(x.reshape(-1, 1, 1024, 1)))


class AudioB(nn.Module):
    """CREPE as its reference code writes it: each layer applied in a helper method with ``F.pad``, ``F.relu``,
    ``F.max_pool2d`` and ``F.dropout``."""

    def __init__(self):
        super().__init__()
        for n, (i, o, k, s) in enumerate(_AUDIO, 1):
            setattr(self, f"conv{n}", nn.Conv2d(i, o, (k, 1), (s, 1)))
            setattr(self, f"conv{n}_BN", nn.BatchNorm2d(o))
        self.classifier = nn.Linear(32 * 16, 10)

    def layer(self, x, n):
        k = _AUDIO[n - 1][2]
        x = F.pad(x, (0, 0, (k - 1) // 2, k // 2))
        x = F.relu(getattr(self, f"conv{n}")(x))
        x = getattr(self, f"conv{n}_BN")(x)
        x = F.max_pool2d(x, (2, 1), (2, 1))
        return F.dropout(x, p=0.25, training=self.training)

    def forward(self, x):
        x = x.reshape(-1, 1, 1024, 1)
        for n in range(1, len(_AUDIO) + 1):
            x = self.layer(x, n)
        return self.classifier(x.flatten(1))


class AudioC(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList()
        for i, o, k, s in _AUDIO:
            self.blocks.append(nn.ModuleDict({"conv": nn.Conv2d(i, o, (k, 1), (s, 1)), "bn": nn.BatchNorm2d(o)}))
        self.classifier = nn.Linear(32 * 16, 10)

    def forward(self, x):
        if x.dim() == 2:
            x = x[:, None, :, None]
        for spec, block in zip(_AUDIO, self.blocks):
            k = spec[2]
            pad = ((k - 1) // 2, k // 2) if x.shape[2] > 1 else (0, 0)
            x = F.pad(x, (0, 0, *pad))
            x = block["bn"](torch.relu(block["conv"](x)))
            x = F.max_pool2d(x, (2, 1), (2, 1))
        return self.classifier(x.reshape(x.size(0), -1))


# ============================================ PReLU face CNN, MTCNN's R-Net shape (Zhang et al. 2016), 24x24
class FaceA(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 28, 3), nn.PReLU(28), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(28, 48, 3), nn.PReLU(48), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(48, 64, 2), nn.PReLU(64), nn.Flatten(),
            nn.Linear(64 * 9, 128), nn.PReLU(128))
        self.cls = nn.Linear(128, 10)

    def forward(self, x):
        return self.cls(self.features(x))


class FaceB(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(3, 28, 3), nn.PReLU(28)
        self.conv2, self.prelu2 = nn.Conv2d(28, 48, 3), nn.PReLU(48)
        self.conv3, self.prelu3 = nn.Conv2d(48, 64, 2), nn.PReLU(64)
        self.dense4, self.prelu4 = nn.Linear(64 * 9, 128), nn.PReLU(128)
        self.dense5 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.prelu(self.conv1(x), self.prelu1.weight), 3, 2, ceil_mode=True)
        x = F.max_pool2d(F.prelu(self.conv2(x), self.prelu2.weight), 3, 2, ceil_mode=True)
        x = F.prelu(self.conv3(x), self.prelu3.weight)
        x = F.prelu(self.dense4(x.flatten(1)), self.prelu4.weight)
        return self.dense5(x)


class FaceC(FaceB):
    """facenet-pytorch's RNet as written: ``x.permute(0, 3, 2, 1).contiguous()`` before the dense layer, modules
    called in a loop over pairs."""

    def forward(self, x):
        pairs = [(self.conv1, self.prelu1, True), (self.conv2, self.prelu2, True), (self.conv3, self.prelu3, False)]
        for conv, act, pool in pairs:
            x = act(conv(x))
            if pool:
                x = F.max_pool2d(x, 3, 2, ceil_mode=True)
        x = x.view(x.shape[0], -1) if x.is_contiguous() else x.reshape(x.shape[0], -1)
        return self.dense5(self.prelu4(self.dense4(x)))


# ================================================== a pre-norm transformer block (Vaswani et al. 2017; ViT/Swin)
_DIM, _HEADS = 32, 4


class AttentionA(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(_DIM, 3 * _DIM), nn.Linear(_DIM, _DIM)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, _HEADS, c // _HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1) * (c // _HEADS) ** -0.5).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class TBlockA(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(_DIM), AttentionA(), nn.LayerNorm(_DIM)
        self.mlp = nn.Sequential(nn.Linear(_DIM, 2 * _DIM), nn.GELU(), nn.Linear(2 * _DIM, _DIM))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerA(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3 * 16, _DIM)
        self.pos = nn.Parameter(torch.zeros(1, 64, _DIM))
        self.blocks = nn.Sequential(TBlockA(), TBlockA())
        self.norm, self.head = nn.LayerNorm(_DIM), nn.Linear(_DIM, 10)

    def patches(self, x):
        b = x.shape[0]
        return x.reshape(b, 3, 8, 4, 8, 4).permute(0, 2, 4, 1, 3, 5).reshape(b, 64, 48)

    def forward(self, x):
        h = self.embed(self.patches(x)) + self.pos
        return self.head(self.norm(self.blocks(h)).mean(1))


class TransformerB(TransformerA):
    """The attention and MLP of every block in helper methods of the top module, with functions."""

    def _attention(self, blk, x):
        b, n, c = x.shape
        qkv = blk.attn.qkv(blk.norm1(x)).reshape(b, n, 3, _HEADS, c // _HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * (c // _HEADS) ** -0.5, dim=-1)
        return blk.attn.proj(torch.matmul(attn, v).transpose(1, 2).reshape(b, n, c))

    def _mlp(self, blk, x):
        return blk.mlp[2](F.gelu(blk.mlp[0](blk.norm2(x))))

    def forward(self, x):
        h = self.embed(self.patches(x)) + self.pos
        for blk in self.blocks:
            h = h + self._attention(blk, h)
            h = h + self._mlp(blk, h)
        return self.head(F.layer_norm(h, (_DIM,), self.norm.weight, self.norm.bias).mean(1))


class TransformerC(TransformerA):
    """Blocks called in a loop that keeps every hidden state in a list, with an optional mask branch."""

    def forward(self, x, mask=None):
        if not torch.is_tensor(x):
            x = torch.as_tensor(x)
        states = [self.embed(self.patches(x)) + self.pos]
        for blk in self.blocks:
            if mask is not None and mask.any():
                states.append(states[-1] * mask)
            states.append(blk(states[-1]))
        return self.head(self.norm(states[-1]).mean(1))


class AttentionD(AttentionA):
    """Swin's window attention: ``F.linear`` on the Linears' own weights."""

    def forward(self, x):
        b, n, c = x.shape
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias).reshape(b, n, 3, _HEADS, c // _HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = F.softmax(q @ k.transpose(-2, -1) * (c // _HEADS) ** -0.5, dim=-1)
        return F.linear((attn @ v).transpose(1, 2).reshape(b, n, c), self.proj.weight, self.proj.bias)


class TBlockD(TBlockA):
    def __init__(self):
        super().__init__()
        self.attn = AttentionD()


class TransformerD(TransformerA):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(TBlockD(), TBlockD())


# ====================================================================================== the zoo
#: architecture -> (input shape of one sample, {style: class})
ZOO: dict[str, tuple[tuple[int, ...], dict[str, type]]] = {
    "resnet": ((3, 32, 32), {"a": ResNetA, "b": ResNetB, "c": ResNetC, "d": ResNetD}),
    "mobilenet": ((3, 32, 32), {"a": MobileNetA, "b": MobileNetB, "c": MobileNetC}),
    "efficientnet": ((3, 32, 32), {"a": EfficientNetA, "b": EfficientNetB, "c": EfficientNetC}),
    "densenet": ((3, 32, 32), {"a": DenseNetA, "b": DenseNetB, "c": DenseNetC}),
    "unet": ((3, 32, 32), {"a": UNetA, "b": UNetB, "c": UNetC}),
    "audio": ((1024,), {"a": AudioA, "b": AudioB, "c": AudioC}),
    "face": ((3, 24, 24), {"a": FaceA, "b": FaceB, "c": FaceC}),
    "transformer": ((3, 32, 32), {"a": TransformerA, "b": TransformerB, "c": TransformerC, "d": TransformerD}),
}


def build(arch: str, style: str, seed: int = 0) -> nn.Module:
    """The architecture in one style, with the weights of style ``a`` built from ``seed`` (BatchNorm statistics
    made non-trivial), in eval mode."""
    from bench.onnx_export import randomize_bn

    torch.manual_seed(seed)
    ref = ZOO[arch][1]["a"]()
    randomize_bn(ref, seed)
    if style == "a":
        return ref.eval()
    return same_weights(ref, ZOO[arch][1][style]()).eval()


# ====================================================================================== the bench
def _inputs(arch: str, x28: torch.Tensor) -> torch.Tensor:
    """Real MNIST digits shaped for the architecture: 3x32x32 (zero-padded, replicated), 3x24x24 (resized) or a
    1,024-sample signal (the 784 pixels row after row, zero-padded, normalized per signal)."""
    shape = ZOO[arch][0]
    if len(shape) == 1:
        s = F.pad(x28.reshape(len(x28), 784), (0, 1024 - 784))
        return (s - s.mean(-1, keepdim=True)) / (s.std(-1, keepdim=True) + 1e-6)
    img = F.pad(x28, (2, 2, 2, 2)) if shape[-1] == 32 else F.interpolate(
        x28.unsqueeze(1), size=shape[1:], mode="bilinear", align_corners=False)[:, 0]
    return ((img.unsqueeze(1) - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous()


def _target(arch: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The class, or for the U-Net the ink mask of the digit (pixels brighter than mid-grey) as class 1."""
    return (x[:, 0] > 0).long() if arch == "unet" else y


def _quality(arch: str, out: torch.Tensor, t: torch.Tensor) -> float:
    """Accuracy, or the IoU of the predicted ink mask for the U-Net."""
    if arch == "unet":
        p, m = out.argmax(1) == 1, t == 1
        return float((p & m).sum() / (p | m).sum().clamp(min=1))
    return float((out.argmax(1) == t).float().mean())


def train(arch: str, model: nn.Module, x, t, epochs: int) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(64):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), t[idx]).backward()
            opt.step()
    return model.eval()


def _ort_outputs(path: str, x: torch.Tensor) -> torch.Tensor:
    from lq.export.verify._verify import make_session

    sess = make_session(path, intra_op_num_threads=1)
    name = sess.get_inputs()[0].name
    return torch.cat([torch.from_numpy(sess.run(None, {name: c.numpy()})[0]) for c in x.split(250)])


#: architectures whose forward takes any image size (their files are also timed at --size)
SIZED = ("resnet", "mobilenet", "efficientnet", "densenet", "unet")


def run_arch(arch: str, fast: bool, d: str, log, size: int = 32) -> dict:
    from bench import _report
    from bench.library import conv_gemm_counts, export_fp32, mnist5k
    from bench.onnx_export import ort_quantize_static, ort_times
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model
    from lq.export import VerificationError, export_onnx

    x28, y = mnist5k()
    n_train, n_test = (512, 256) if fast else (4000, 1000)
    x = _inputs(arch, x28[: n_train + n_test])
    t = _target(arch, x, y[: n_train + n_test])
    xtr, ttr, xte, tte = x[:n_train], t[:n_train], x[n_train:], t[n_train:]
    trained = train(arch, build(arch, "a"), xtr, ttr, 1 if fast else 6)
    with torch.no_grad():
        row: dict = {"arch": arch, "size": size, "quality": {"FP32": _quality(arch, trained(xte), tte)},
                     "kernels": {}, "placed": {}, "verified": {}, "cost_s": {}, "notes": []}
    if size != 32:  # the weights trained at 32x32, the files made and timed at size x size (quality not measured)
        xtr, xte = (F.interpolate(v, size=(size, size), mode="bilinear", align_corners=False) for v in (xtr, xte))
        row["quality"] = {}
    batches = list(xtr[: 64 if fast else (512 if size == 32 else 64)].split(32 if size == 32 else 8))
    paths = {"FP32": os.path.join(d, "fp32.onnx"), "FP32 legacy": os.path.join(d, "fp32_legacy.onnx")}
    export_fp32(trained, paths["FP32"], xtr[:1], ["output"])
    export_fp32(trained, paths["FP32 legacy"], xtr[:1], ["output"], "legacy")
    t0 = time.perf_counter()
    ort_quantize_static(paths["FP32 legacy"], os.path.join(d, "qs.onnx"), batches)
    row["cost_s"]["quantize_static"] = time.perf_counter() - t0
    paths["quantize_static"] = os.path.join(d, "qs.onnx")
    for style in ZOO[arch][1]:
        model = same_weights(trained, ZOO[arch][1][style]()).eval()
        p = os.path.join(d, f"lq_{style}.onnx")
        t0 = time.perf_counter()
        quantize_model(model, sample=batches[0])
        with torch.no_grad():
            calibrate_model(model, batches)
        try:
            res = export_onnx(model, batches[0], p, speed_check=not fast)
            row["verified"][style] = True
        except VerificationError as e:
            row["verified"][style] = str(e).splitlines()[0][:300]
            res = export_onnx(model, batches[0], p, verify=False, speed_check=not fast)
        row["cost_s"][style] = time.perf_counter() - t0
        placed = os.path.join(d, f"placed_{style}.onnx")  # the placement alone: no timing, no fallback
        export_onnx(model, batches[0], placed, verify=False, speed_check=False, fallback_seconds=0)
        row["placed"][style] = conv_gemm_counts(placed)["integer"]
        if res.float_fallback:
            row["notes"].append(f"style {style}: sent back to float after timing: {', '.join(res.float_fallback)}")
        if res.fallback is not None:  # what the export's own timing said of the file it saved, and why it stopped
            row["notes"].append(f"style {style}: the export's check of its file: {res.fallback.after.ratio:.2f}x "
                                f"(first {res.fallback.before.ratio:.2f}x); stopped: {res.fallback.stopped}")
        if res.batch1_check is not None and (res.batch1_fallback is not None or res.batch1_check.slower):
            b1 = res.batch1_fallback
            row["notes"].append(f"style {style}: the export's check at batch 1: {res.batch1_check.ratio:.2f}x"
                                + (f" (first {b1.before.ratio:.2f}x; tried: "
                                   + "; ".join(t.text() for t in b1.tries) + f"; stopped: {b1.stopped})"
                                   if b1 is not None else ""))
        paths[style] = p
        log(f"  {arch} {style}: {row['cost_s'][style]:.1f} s, verified {row['verified'][style]}")
    for k, p in paths.items():
        row["kernels"][k] = conv_gemm_counts(p)["integer"]
        if size == 32:
            row["quality"][k] = _quality(arch, _ort_outputs(p, xte), tte)
    repeats, min_time = (3, 0.02) if fast else (9, 0.2)
    row["speedup"] = {}
    for b in ((1, 8) if fast else (1, 8, 32)):
        times = ort_times(paths, np.ascontiguousarray(xte[:b].numpy()), 1, repeats, min_time)
        best = min(("FP32", "FP32 legacy"), key=lambda k: statistics.median(times[k]))
        row["speedup"][str(b)] = {"baseline": best, **{k: _report.ratios(times[best], v)["median"]
                                                        for k, v in times.items()}}
    return row


def write_markdown(rows: list[dict], out: Path, cmd: str, seconds: float, fast: bool) -> Path:
    from bench import _report

    headers = ["architecture", "input", "style", "integer conv/gemm: placed / saved (qs)",
               "vs faster FP32 b1/b8" + ("" if fast else "/b32"), "quantize_static", "quality FP32 / lq / qs",
               "lq cost s (qs)", "verified"]
    lines = []
    for r in rows:
        bs = list(r["speedup"])
        q = r["quality"]
        for style in ZOO[r["arch"]][1]:
            lines.append([
                r["arch"], f"{r['size']}x{r['size']}" if len(ZOO[r["arch"]][0]) == 3 else "signal",
                style, f"{r['placed'][style]} / {r['kernels'][style]} ({r['kernels']['quantize_static']})",
                " / ".join(f"{r['speedup'][b][style]:.2f}x" for b in bs),
                " / ".join(f"{r['speedup'][b]['quantize_static']:.2f}x" for b in bs),
                f"{q['FP32']:.4f} / {q[style]:.4f} / {q['quantize_static']:.4f}" if q else "- (trained at 32x32)",
                f"{r['cost_s'][style]:.1f} ({r['cost_s']['quantize_static']:.1f})",
                "yes" if r["verified"][style] is True else f"no: {r['verified'][style]}"])
    notes = [n for r in rows for n in (f"{r['arch']} ({r['size']}) {x}" for x in r["notes"])]
    intro = (f"Produced by `bench/styles.py` (CPU: {_report.cpu_isa()}). "
             "Every architecture of `bench.styles` in each of its styles, lq's default path (`quantize_model(model, "
             "sample=batch)`, `calibrate_model` with no method, `export_onnx` with its speed check and fallback) "
             "against onnxruntime's `quantize_static` (QDQ, per-channel, u8s8, after `quant_pre_process`) on the same "
             "weights and calibration batches; speed-ups over the faster of the two plain FP32 exports (legacy and "
             "current exporter), 1 thread, files timed in turns. Integer conv/gemm in onnxruntime's graph: of lq's "
             "placement (exported with `fallback_seconds=0`), of the file the default path saved (after any "
             "fallback), of quantize_static's. Quality: accuracy on held-out MNIST digits (U-Net: IoU of the ink mask); "
             "the weights are trained at 32x32 (6 epochs), and rows at a larger input use them on resized digits, "
             "for kernels and speed only." + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else ""))
    return _report.finish_run(out, "styles", {"rows": rows, "fast": fast}, "Style zoo: one architecture, "
                              "every way of writing it", intro, _report.table(headers, lines), cmd, seconds)


def main(argv=None) -> int:
    from bench import _report

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fast", action="store_true", help="a smoke run: 512 training images, 1 epoch, batch 1 and 8")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arch", nargs="*", default=list(ZOO), choices=list(ZOO))
    ap.add_argument("--sizes", nargs="*", type=int, default=[32],
                    help="image sizes to make and time the files at (weights trained at 32); also e.g. 224")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of architectures and sizes not rerun from the output folder's styles.json "
                         "(their earlier run; the table says which rows were rerun)")
    args = ap.parse_args(argv)
    out, cmd, t0 = _report.start_run(args)
    rows = []
    for size in args.sizes:
        for arch in args.arch:
            if size != 32 and arch not in SIZED:
                continue
            _report.log(f"{arch} at {size} ...")
            with tempfile.TemporaryDirectory() as d:
                rows.append(run_arch(arch, args.fast, d, _report.log, size))
    if args.merge and (out / "styles.json").exists():
        rerun = {(r["arch"], r["size"]) for r in rows}
        kept = [r for r in json.loads((out / "styles.json").read_text())["rows"] if (r["arch"], r["size"]) not in rerun]
        for r in rows:
            r["notes"].append("rerun in this run; the other rows are from the file's earlier run (--merge)")
        order = {a: i for i, a in enumerate(ZOO)}
        rows = sorted(kept + rows, key=lambda r: (r["size"], order[r["arch"]]))
    write_markdown(rows, out, cmd, time.perf_counter() - t0, args.fast)
    return 0


if __name__ == "__main__":
    sys.exit(main())
