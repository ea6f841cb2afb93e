"""Small models written the ordinary way (no lq modules inside), shared by the glue and export tests."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class BNBlock(nn.Module):
    """The torchvision basic block: conv-bn-relu-conv-bn, a plain ``out + x``, relu."""

    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + x)
