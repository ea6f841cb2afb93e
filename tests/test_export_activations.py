"""The ONNX export is exact across activations, pooling layers and joins, with onnxruntime's fusions on.

``export_onnx`` rewrites the Q/DQ graph (moves quantizers, lowers ops, folds constants) and
onnxruntime then fuses it further (QLinearConv, integer pooling, QLinearAdd ...). A quantizer moved
across a non-monotonic activation (PReLU, LeakyReLU, GELU, SiLU, Hardswish) or an integer kernel
picked where it is not exact changes the output by whole quantization steps, which the 5% tolerance
of the export's own verification can hide. These tests export small models with each activation,
pool and join users write and compare onnxruntime (default session options: ORT_ENABLE_ALL) with
PyTorch's fake-quant output at 1% of the largest |output|.

Conv/Linear layers have ``bias=False`` and there is no BatchNorm: the export quantizes biases to
int32 (scale s_input * s_weight) and PyTorch does not, so a bias could flip one quantization step
downstream. Without biases the only difference left is the order of float summation.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import lq.nn as qnn
from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.export import export_onnx
from lq.export._int16 import int16_risks

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)

BOUND = 0.01  # max |onnxruntime - PyTorch| as a fraction of max |PyTorch output|


# =========================================================================== models
def _conv(cin, cout, k=3):
    return nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)


def _prelu():
    """Per-channel PReLU with slopes of both signs (a negative slope makes it non-monotonic)."""
    act = nn.PReLU(8)
    with torch.no_grad():
        act.weight.copy_(torch.tensor([0.25, -0.5, 0.1, -0.2, 0.6, 0.25, -1.0, 0.0]))
    return act


ACTIVATIONS = {
    "relu": nn.ReLU,
    "relu6": nn.ReLU6,
    "prelu": _prelu,
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "hardswish": nn.Hardswish,
    "sigmoid": nn.Sigmoid,
}


class ActNet(nn.Module):
    """conv -> act [-> maxpool] -> conv -> act -> conv: every activation sits between two quantized convs."""

    def __init__(self, act, pool=False):
        super().__init__()
        self.conv1, self.act1 = _conv(3, 8), ACTIVATIONS[act]()
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()
        self.conv2, self.act2 = _conv(8, 8), ACTIVATIONS[act]()
        self.conv3 = _conv(8, 4)

    def forward(self, x):
        x = self.pool(self.act1(self.conv1(x)))
        return self.conv3(self.act2(self.conv2(x)))


POOLS = {
    "maxpool": lambda: nn.MaxPool2d(2),
    "avgpool": lambda: nn.AvgPool2d(2),
    "adaptive_avgpool_2x2": lambda: nn.AdaptiveAvgPool2d((2, 2)),
}


class PoolNet(nn.Module):
    """conv -> relu -> pool -> conv -> relu."""

    def __init__(self, pool):
        super().__init__()
        self.conv1, self.pool, self.conv2 = _conv(3, 8), POOLS[pool](), _conv(8, 8)

    def forward(self, x):
        return torch.relu(self.conv2(self.pool(torch.relu(self.conv1(x)))))


class GlobalPoolNet(nn.Module):
    """conv -> relu -> AdaptiveAvgPool2d(1) -> flatten -> linear (a classifier head)."""

    def __init__(self):
        super().__init__()
        self.conv, self.pool, self.fc = _conv(3, 8), nn.AdaptiveAvgPool2d(1), nn.Linear(8, 5, bias=False)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


class ResidualNet(nn.Module):
    """stem -> relu -> conv2(relu(conv1(y))) + y -> conv, the add either a plain ``+`` or ``qnn.FloatAdd``."""

    def __init__(self, float_add):
        super().__init__()
        self.stem, self.conv1, self.conv2, self.head = _conv(3, 8), _conv(8, 8), _conv(8, 8), _conv(8, 4)
        self.add = qnn.FloatAdd() if float_add else None

    def forward(self, x):
        y = torch.relu(self.stem(x))
        z = self.conv2(torch.relu(self.conv1(y)))
        z = self.add(z, y) if self.add is not None else z + y
        return self.head(torch.relu(z))


class CatNet(nn.Module):
    """two conv branches (one through relu) concatenated along channels, then a conv."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = _conv(3, 4), _conv(3, 4, k=1), _conv(8, 4)

    def forward(self, x):
        return self.head(torch.cat([torch.relu(self.a(x)), self.b(x)], dim=1))


CASES = {
    **{f"act_{a}": (lambda a=a: ActNet(a)) for a in ACTIVATIONS},
    **{f"act_{a}_maxpool": (lambda a=a: ActNet(a, pool=True)) for a in ACTIVATIONS},
    **{f"pool_{p}": (lambda p=p: PoolNet(p)) for p in POOLS},
    "pool_adaptive_avgpool_1_linear": GlobalPoolNet,
    "join_residual_plus": lambda: ResidualNet(float_add=False),
    "join_residual_float_add": lambda: ResidualNet(float_add=True),
    "join_cat": CatNet,
}

# cases that fail the 1% bound today; see the reason (placeholders until the export is fixed)
KNOWN_FAILURES: dict[str, str] = {}


# =========================================================================== helpers
def _inputs(seed, n=8):
    """Inputs of both signs, larger than unit scale so activations reach their non-linear ranges."""
    return 2.0 * torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _quantized(make):
    torch.manual_seed(0)
    model = make()
    quantize_model(model)
    model.eval()
    with torch.no_grad():
        calibrate_model(model, [_inputs(s) for s in (1, 2, 3)], method="max")
    return model


def _run_ort(path, x, level=None):
    opts = ort.SessionOptions()
    if level is not None:
        opts.graph_optimization_level = level
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def _diagnosis(path, x, ref):
    """What to tell when the bound fails: does the plain Q/DQ graph differ too, or only the fused one?"""
    plain = _run_ort(path, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    fused = _run_ort(path, x)
    scale = np.abs(ref).max()
    ops = [n.op_type for n in onnx.load(path).graph.node]
    return (f"fused: max diff {np.abs(fused - ref).max() / scale:.4f} of max|out| "
            f"({int((np.abs(fused - ref) > 1e-4 * scale).sum())}/{ref.size} elements differ); "
            f"unfused (ORT_DISABLE_ALL): {np.abs(plain - ref).max() / scale:.4f} "
            f"({int((np.abs(plain - ref) > 1e-4 * scale).sum())} differ); graph: {ops}")


def _params():
    for name in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[name])] if name in KNOWN_FAILURES else []
        yield pytest.param(name, id=name, marks=marks)


# =========================================================================== the test
@pytest.mark.parametrize("case", list(_params()))
def test_export_is_exact_with_fusions_on(case, tmp_path):
    model = _quantized(CASES[case])
    path = str(tmp_path / f"{case}.onnx")
    res = export_onnx(model, _inputs(4), path)
    assert res.max_abs_diff is not None and res.max_abs_diff <= res.tolerance

    x = _inputs(5, n=6)  # fresh data, neither calibration nor the export's verification sample
    with torch.no_grad():
        ref = model(x).numpy()
    out = _run_ort(path, x)
    assert out.shape == ref.shape
    scale = float(np.abs(ref).max())
    assert scale > 0
    diff = float(np.abs(out - ref).max())
    assert diff <= BOUND * scale, _diagnosis(path, x, ref)

    assert int16_risks(onnx.load(path)) == []
