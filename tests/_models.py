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


class DigitsTransformer(nn.Module):
    """The rows of a digits image as 8 tokens: embedding, nn.MultiheadAttention, LayerNorm, GELU MLP."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.emb = nn.Linear(8, d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.ln = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = self.emb(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        h = self.ln(h + a)
        h = h + self.ff(h)
        return self.head(h.mean(1))
