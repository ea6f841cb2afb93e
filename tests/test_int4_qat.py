"""QAT of INT4 block weights through the callback: ``QuantCallback(quant="int4_block_weight", qat=...)`` with
distillation trains the weights on the frozen block grid and brings the model closer to FP32 than PTQ left it;
the trained model exports to MatMulNBits and the file equals it."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from torch import nn

torch.set_flush_denormal(True)
L = pytest.importorskip("lightning")


class _Regressor(L.LightningModule):
    """A small MLP whose task loss is the distance to its own FP32 outputs (label-free, as the MiniLM bench)."""

    def __init__(self, x: torch.Tensor):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
        with torch.no_grad():
            self.target = self.net(x)
        self.x = x

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        ds = torch.utils.data.TensorDataset(self.x, self.target)
        return torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))


def test_int4_qat_with_distillation_wins_back_what_ptq_lost(tmp_path):
    from lq import QuantCallback
    from lq.config import CalibConfig, ExportConfig, QATConfig
    from lq.export import export_onnx

    x = torch.randn(512, 64) * torch.exp(torch.randn(64) * 0.8)
    model = _Regressor(x)
    fp32 = copy.deepcopy(model.net).eval()
    cb = QuantCallback(quant="int4_block_weight", calib=CalibConfig(method="max", block_method="mse", num_batches=4),
                       qat=QATConfig(distill_weight=0.5, lr_policy="none"),  # the module's LR: 4 epochs to win back
                       export=ExportConfig(enabled=False), log_histograms=False,
                       verbose=False)

    def error(m):
        with torch.no_grad():
            return float(((m(x) - fp32(x)) ** 2).mean())

    class _KeepPTQ(L.Callback):  # runs after the QuantCallback's calibration, before the first step
        def on_train_start(self, trainer, pl_module):
            self.ptq = copy.deepcopy(pl_module.net).eval()
            self.amax = pl_module.net[0]._weight_quantizer.amax.clone()

    keep = _KeepPTQ()
    trainer = L.Trainer(max_epochs=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, keep])
    trainer.fit(model)
    assert cb.calibrate.block_choices, "block_method reached the search"
    ptq, amax = keep.ptq, keep.amax
    model.eval()
    assert torch.equal(model.net[0]._weight_quantizer.amax, amax)  # the block grid stays (static amax)
    assert not torch.equal(model.net[0].weight, ptq[0].weight)
    assert error(model.net) < 0.75 * error(ptq), (error(model.net), error(ptq))

    res = export_onnx(model.net, x[:4], str(tmp_path / "qat.onnx"), opset=21, check_fusion=False)
    assert [n.op_type for n in onnx.load(res.path).graph.node].count("MatMulNBits") == 2
    import onnxruntime as ort

    got = ort.InferenceSession(res.path, providers=["CPUExecutionProvider"]).run(None, {"input": x[:64].numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, model.net(x[:64]).numpy(), rtol=1e-5, atol=1e-5)
