"""A small conv-BN-ReLU classifier with a residual block: the default job's model."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lq.nn import FloatAdd


class _Residual(nn.Module):
    """conv-bn-relu-conv-bn plus the identity, then ReLU.

    The add is a :class:`lq.nn.FloatAdd` module (plain ``+`` in float), so conversion turns it into
    ``QuantAdd``: both operands share one amax and the exported add runs as onnxruntime's QLinearAdd.
    """

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.add = FloatAdd()

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.add(self.bn2(self.conv2(y)), x))


class SmallCNN(L.LightningModule):
    """stem conv-bn-relu, a residual block, a strided conv, global average pool, linear head.

    Args:
        num_classes: output classes.
        channels: width of the stem and the residual block.
        lr: Adam learning rate.
        max_epochs_hint: epochs the cosine LR schedule spans (set by the job).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, channels: int = 32, lr: float = 3e-3,
                 weight_decay: float = 1e-4, max_epochs_hint: int = 10):
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.block = _Residual(channels)
        self.down = nn.Sequential(
            nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(self.block(self.stem(x)))
        return self.head(torch.flatten(self.pool(x), 1))

    def _step(self, batch, stage: str):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(1) == y).float().mean()
        self.log(f"{stage}_loss", loss, prog_bar=stage != "train")
        self.log(f"{stage}_acc", acc, prog_bar=True)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._step(batch, "test")

    def predict_step(self, batch, batch_idx):
        return self(batch[0] if isinstance(batch, (list, tuple)) else batch).argmax(1)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, self.hparams.max_epochs_hint))
        return {"optimizer": opt, "lr_scheduler": sched}
