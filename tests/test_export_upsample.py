"""Nearest upsampling of a conv's quantized output as a channels-last Expand (:mod:`lq.export.passes._upsample`).

Pure data movement, so the rewritten graph must give onnxruntime's numbers of the original Resize bit for bit
(optimizations on and off, batch and spatial size dynamic); resizes the rewrite would not reproduce (other
modes and coordinates, fractional factors, a Q with another scale) or that onnxruntime runs in NCHW anyway (no
conv writes the tensor) or with too few channels keep their Resize; an exported U-Net-shaped model has no
Resize for onnxruntime (TensorRT keeps it) and still equals PyTorch.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export._ir import value_shapes
from lq.rules.onnxruntime import ORT_NHWC_UPSAMPLE_MIN_CHANNELS
from lq.export.passes._upsample import nearest_upsamples_as_expand

from _export_checks import LEVELS, assert_file_matches_pytorch, quantize_calibrate_export, rewritten, run_graph

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)

C = 16


def _graph(factors=(2, 2), channels: int = C, rank: int = 4, conv: bool = True, q_scale: float = 0.1,
           pool: bool = False, static: tuple | None = None, **resize_attrs) -> onnx.ModelProto:
    """x -> Q -> DQ -> [Conv -> Q -> DQ [-> MaxPool 2x2 -> Q -> DQ]] -> Resize -> Q -> DQ -> Conv -> y: the decoder
    step of a U-Net in QDQ form, uint8 activations, int8 weights; batch and spatial sizes dynamic, or the
    spatial sizes ``static``."""
    rng = np.random.default_rng(0)
    k = [3] * (rank - 2)

    def weight(name):
        return numpy_helper.from_array(rng.integers(-60, 60, [channels, channels] + k).astype(np.int8), name)

    def scalar(v, name, dtype):
        return numpy_helper.from_array(np.array(v, dtype), name)

    attrs = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
    attrs.update(resize_attrs)
    inits = [scalar(0.1, "s", np.float32), scalar(128, "z", np.uint8), scalar(q_scale, "s2", np.float32),
             scalar(0.01, "ws", np.float32), scalar(0, "wz", np.int8), weight("w1"), weight("w2"),
             numpy_helper.from_array(np.array([1, 1] + list(factors), np.float32), "scales")]
    pads = [1] * (2 * (rank - 2))
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q0"]),
             helper.make_node("DequantizeLinear", ["q0", "s", "z"], ["d0"])]
    if conv:
        nodes += [helper.make_node("DequantizeLinear", ["w1", "ws", "wz"], ["dw1"]),
                  helper.make_node("Conv", ["d0", "dw1"], ["c1"], pads=pads),
                  helper.make_node("QuantizeLinear", ["c1", "s", "z"], ["q1"]),
                  helper.make_node("DequantizeLinear", ["q1", "s", "z"], ["d1"])]
        if pool:
            nodes += [helper.make_node("MaxPool", ["d1"], ["p1"], kernel_shape=[2] * (rank - 2),
                                       strides=[2] * (rank - 2)),
                      helper.make_node("QuantizeLinear", ["p1", "s", "z"], ["qp"]),
                      helper.make_node("DequantizeLinear", ["qp", "s", "z"], ["d1p"])]
    nodes += [helper.make_node("Resize", [("d1p" if pool else "d1") if conv else "d0", "", "scales"], ["r"], **attrs),
              helper.make_node("QuantizeLinear", ["r", "s2", "z"], ["q2"]),
              helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["d2"]),
              helper.make_node("DequantizeLinear", ["w2", "ws", "wz"], ["dw2"]),
              helper.make_node("Conv", ["d2", "dw2"], ["y"], pads=pads)]
    dims = ["n", channels] + (list(static) if static else [f"s{i}" for i in range(rank - 2)])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _rewrite(model: onnx.ModelProto) -> tuple[int, onnx.ModelProto]:
    return rewritten(model, nearest_upsamples_as_expand, value_shapes(model))


def _run(model: onnx.ModelProto, x: np.ndarray, level: str):
    return run_graph(model, x, level)[0]


@pytest.mark.parametrize("factors,rank,spatial", [((2, 2), 4, (7, 9)), ((3, 1), 4, (5, 6)), ((1, 4), 4, (4, 4)),
                                                  ((2,), 3, (11,))])
def test_upsample_becomes_expand_with_the_same_numbers(factors, rank, spatial):
    model = _graph(factors, rank=rank)
    done, new = _rewrite(model)
    assert done == 1
    ops = [n.op_type for n in new.graph.node]
    assert "Resize" not in ops and "Expand" in ops, ops
    for batch in (1, 3):  # the reshape target follows the input's size
        x = (3 * np.random.default_rng(batch).standard_normal((batch, C) + spatial)).astype(np.float32)
        for level in LEVELS:
            got, want = _run(new, x, level), _run(model, x, level)
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kw,spatial", [({"pool": True}, (8, 10)), ({"static": (7, 9)}, (7, 9)),
                                        ({"pool": True, "static": (8, 10)}, (8, 10))])
def test_upsample_after_a_pool_or_of_a_static_size_becomes_expand(kw, spatial):
    """Through a max pool with its own quantizer (onnxruntime's NHWC uint8 pool); with static spatial sizes
    the reshape target is a constant (0 keeps the batch)."""
    model = _graph(**kw)
    done, new = _rewrite(model)
    assert done == 1
    ops = [n.op_type for n in new.graph.node]
    assert "Resize" not in ops and "Expand" in ops and ("Shape" in ops) != bool(kw.get("static")), ops
    for batch in (1, 3):
        x = (3 * np.random.default_rng(batch).standard_normal((batch, C) + spatial)).astype(np.float32)
        for level in LEVELS:
            np.testing.assert_array_equal(_run(new, x, level), _run(model, x, level))


@pytest.mark.parametrize("kw", [
    {"channels": ORT_NHWC_UPSAMPLE_MIN_CHANNELS // 2},  # onnxruntime's resize is as fast there
    {"conv": False},  # no conv writes it: onnxruntime keeps the tensor (and its resize) in NCHW
    {"q_scale": 0.2},  # the Q after the resize has another scale: Q(DQ(v)) != v
    {"factors": (1.5, 1.5)},
    {"factors": (1, 1)},
    {"coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_floor"},
    {"mode": "linear"},
])
def test_other_resizes_stay(kw):
    done, new = _rewrite(_graph(**kw))
    assert done == 0
    assert "Resize" in [n.op_type for n in new.graph.node]


class UNetStep(nn.Module):
    """conv-BN-ReLU, max pool, conv-BN-ReLU, nearest 2x upsample, cat with the skip tensor, conv, mean."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU())
        self.dec = nn.Sequential(nn.Conv2d(3 * c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.head = nn.Conv2d(c, 4, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        d = self.dec(torch.cat([F.interpolate(e2, scale_factor=2, mode="nearest"), e1], 1))
        return self.head(d).mean((2, 3))


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_exported_unet_upsamples_by_expand_for_onnxruntime(tmp_path, target):
    torch.manual_seed(0)
    model = UNetStep()
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        model.train()(torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(2)))
    calib = [torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(s)) for s in (3, 4)]
    res, ops = quantize_calibrate_export(model, calib, str(tmp_path / "u.onnx"), target=target, speed_check=False)
    if target == "onnxruntime":
        assert "Resize" not in ops and ops.count("Expand") == 1, ops
    else:
        assert "Resize" in ops and "Expand" not in ops, ops
    assert_file_matches_pytorch(model, res, torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(5)),
                                target)


class UpsampleToSize(nn.Module):
    """``F.interpolate(x, size=...)``: the exporters compute the sizes from x's own shape (Shape -> Concat)."""

    def __init__(self):
        super().__init__()
        self.c, self.d = nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x):
        return self.d(F.interpolate(F.relu(self.c(x)), size=(32, 48), mode="nearest"))


@pytest.mark.parametrize("dynamo", [True, False])
def test_upsample_to_a_size_keeps_the_conv_integer_and_becomes_expand(tmp_path, dynamo):
    """The Shape that reads the conv's output for the sizes no longer keeps the quantizer off the conv (it
    reads the quantized tensor: same shape), and whole-factor sizes are rewritten like scales."""
    torch.manual_seed(0)
    model = UpsampleToSize()
    calib = [torch.randn(4, 8, 16, 24, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    res, ops = quantize_calibrate_export(model, calib, str(tmp_path / "s.onnx"), dynamo=dynamo, speed_check=False)
    assert res.kernel_of("c") == "QLinearConv", [k.text() for k in res.layer_kernels]
    assert "Resize" not in ops and ops.count("Expand") == 1 and "Concat" not in ops, ops
    assert_file_matches_pytorch(model, res, torch.randn(2, 8, 16, 24, generator=torch.Generator().manual_seed(3)))


class SkipSizedDecoder(nn.Module):
    """The usual U-Net decoder step: upsample to the skip tensor's size (``size=e.shape[2:]``), then cat."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
        self.d = nn.Conv2d(48, 4, 3, padding=1)

    def forward(self, x):
        e = F.relu(self.a(x))
        f = F.relu(self.b(F.max_pool2d(e, 2)))
        return self.d(torch.cat([F.interpolate(f, size=e.shape[2:], mode="nearest"), e], 1))


@pytest.mark.parametrize("dynamo", [True, False])
def test_skip_sized_upsample_keeps_every_conv_integer(tmp_path, dynamo):
    """``e`` is read by a max pool, the cat and a Shape (for the size): the Shape must not keep ``e``'s
    conv in float (the legacy exporter's size arithmetic is Gather/Unsqueeze/Cast, which keeps its Resize)."""
    torch.manual_seed(0)
    model = SkipSizedDecoder()
    calib = [torch.randn(4, 8, 16, 24, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    res, ops = quantize_calibrate_export(model, calib, str(tmp_path / "k.onnx"), dynamo=dynamo, speed_check=False)
    assert [res.kernel_of(n) for n in ("a", "b")] == ["QLinearConv", "QLinearConv"], [
        k.text() for k in res.layer_kernels]
    if dynamo:
        assert "Resize" not in ops and ops.count("Expand") == 1, ops
    assert_file_matches_pytorch(model, res, torch.randn(3, 8, 16, 24, generator=torch.Generator().manual_seed(3)))
