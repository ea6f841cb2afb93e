"""Library-style mobile-net blocks shared by the tests of the onnxruntime recipe's placement."""

from __future__ import annotations

import torch
from torch import nn


class ConvBNAct(nn.Sequential):
    """torchvision's Conv2dNormActivation shape: an nn.Sequential subclass that keeps Sequential's forward."""

    def __init__(self, i, o, k=1, stride=1, groups=1, act=nn.SiLU):
        layers = [nn.Conv2d(i, o, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(o)]
        super().__init__(*layers + ([act()] if act else []))


class SE(nn.Module):
    """Squeeze-excite as EfficientNet writes it: pool, 1x1 conv, SiLU, 1x1 conv, sigmoid gate, ``x * gate``."""

    def __init__(self, c, s):
        super().__init__()
        self.pool, self.fc1, self.act, self.fc2 = nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, s, 1), nn.SiLU(), nn.Conv2d(s, c, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc2(self.act(self.fc1(self.pool(x)))))
