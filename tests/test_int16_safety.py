"""No exported integer kernel can saturate onnxruntime's int16 pair sums, on any CPU (checked from the file).

onnxruntime's x86 u8 x s8 kernels without VNNI add two adjacent products in a saturating int16. The
tests here do not depend on the CPU they run on: they check the ONNX file's integers (the check of
``lq.export.passes._int16``), test that check against a brute-force emulation of the instruction, and export
real models to show that every file lq writes for onnxruntime passes it.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.export import export_onnx
from lq.export.passes._int16 import INT16_MAX, int16_risks, worst_pair_per_channel
from lq.tensor_quant import QuantDescriptor

from _avx2 import pmaddubsw_dot
from _models import DigitsTransformer

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)


def test_worst_pair_is_the_two_largest_magnitudes_brute_force():
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, size=(5, 7)).astype(np.int8)
    got = worst_pair_per_channel(w, out_axis=0)
    for c in range(5):
        brute = max(abs(int(w[c, i])) + abs(int(w[c, j])) for i, j in itertools.combinations(range(7), 2))
        assert got[c] == brute


def test_check_is_sound_against_an_emulation_of_the_instruction():
    """Weights that pass never saturate for any pairing and any activation; weights that fail do saturate."""
    rng = np.random.default_rng(1)
    for trial in range(200):
        k = int(rng.integers(2, 12))
        w = rng.integers(-127, 128, size=k).astype(np.int8)
        safe = int(worst_pair_per_channel(w.reshape(1, -1), 0)[0]) * 255 <= INT16_MAX
        # the worst activations for every pairing the kernel could use: 255 where w has the sign of the sum
        for perm in (rng.permutation(k) for _ in range(4)):
            wp = w[perm]
            for sign in (1, -1):
                a = np.where(np.sign(wp) == sign, 255, 0).astype(np.uint8)
                exact = int((a.astype(np.int64) * wp).sum())
                if safe:
                    assert pmaddubsw_dot(a, wp) == exact
        if not safe:
            # the two largest magnitudes, of one sign, side by side: the kernel saturates
            i, j = np.argsort(-np.abs(w.astype(np.int32)))[:2]
            pair = np.array([abs(int(w[i])), abs(int(w[j]))], dtype=np.int8)
            a = np.array([255, 255], dtype=np.uint8)
            assert pmaddubsw_dot(a, pair) != int((a.astype(np.int64) * pair).sum())


def _gemm_file(w_q: np.ndarray, w_dtype=TensorProto.INT8, zp=0) -> onnx.ModelProto:
    """input -> Q/DQ (uint8, zero point 128) -> MatMul with a per-column DequantizeLinear weight."""
    np_dt = np.uint8 if w_dtype == TensorProto.UINT8 else np.int8
    inits = [numpy_helper.from_array((w_q.astype(np.int32) + zp).astype(np_dt), "wq"),
             numpy_helper.from_array(np.full(w_q.shape[1], 0.01, np.float32), "ws"),
             numpy_helper.from_array(np.full(w_q.shape[1], zp, np_dt), "wz"),
             numpy_helper.from_array(np.array(0.05, np.float32), "s"),
             numpy_helper.from_array(np.array(128, np.uint8), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, w_q.shape[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_file_check_flags_full_range_int8_and_passes_7bit_and_uint8():
    rng = np.random.default_rng(2)
    full = rng.integers(-60, 61, size=(32, 8))
    full[0, :] = 127
    full[1, :] = 120  # two large magnitudes of one sign in every column
    risks = int16_risks(_gemm_file(full))
    assert len(risks) == 1 and risks[0].op_type == "MatMul" and risks[0].worst_pair == 247 * 255
    assert "32767" in str(risks[0])
    assert int16_risks(_gemm_file(np.clip(full, -63, 63))) == []
    assert int16_risks(_gemm_file(full, TensorProto.UINT8, zp=128)) == []


# =========================================================================== real exports
def _calibrated(model, batches):
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model

    quantize_model(model, quant_desc_input=QuantDescriptor())
    model.eval()
    with torch.no_grad():
        calibrate_model(model, batches, method="max")
    return model


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1, groups=4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)).eval()


def test_default_8bit_export_stores_risky_weights_as_uint8_and_matches(tmp_path):
    batches = [torch.randn(8, 3, 12, 12) * 3 for _ in range(2)]
    model = _calibrated(_cnn(), batches)
    path = str(tmp_path / "m.onnx")
    res = export_onnx(model, batches[0], path, speed_check=False)
    proto = onnx.load(path)
    assert int16_risks(proto) == []  # fails if the int8 x full-range encoding is restored
    assert res.uint8_weights  # 8-bit per-channel weights always have a 127 in every channel
    # the uint8 weights carry zero point 128: the same values as the int8 ones
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    u8 = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
          and inits[n.input[0]].dtype == np.uint8 and inits[n.input[0]].ndim >= 2]
    assert u8 and all(np.all(inits[n.input[2]] == 128) for n in u8)
    assert res.verified
    # the integer kernels still run
    assert res.int8_kernels.get("QLinearConv", 0) >= 2


def test_reduce_range_recipe_keeps_int8_weights_and_is_safe(tmp_path):
    from lq.calibration import calibrate_model
    from lq.callbacks import QuantSwap
    from lq.config import Int8ReduceRangeConfig

    batches = [torch.randn(8, 3, 12, 12) * 3 for _ in range(2)]
    model = _cnn()
    QuantSwap(Int8ReduceRangeConfig()).swap(model)
    assert model[0]._weight_quantizer.num_bits == 7
    with torch.no_grad():
        calibrate_model(model, batches, method="max")
    path = str(tmp_path / "rr.onnx")
    res = export_onnx(model, batches[0], path, speed_check=False)
    assert res.uint8_weights == [] and int16_risks(onnx.load(path)) == []
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}
    w = [a for a in inits.values() if a.dtype == np.int8 and a.ndim == 4]
    assert w and all(np.abs(a.astype(np.int32)).max() <= 63 for a in w)
    assert res.verified and res.int8_kernels.get("QLinearConv", 0) >= 2


def test_smallest_mlp_exports_right_with_fusions_on(tmp_path):
    """The issue's smallest model: Linear-ReLU-Linear on randn data (it failed verification on AVX2)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).eval()
    batches = [torch.randn(64, 8) for _ in range(2)]
    model = _calibrated(model, batches)
    path = str(tmp_path / "mlp.onnx")
    res = export_onnx(model, batches[0], path, speed_check=False)
    assert int16_risks(onnx.load(path)) == []
    # fusions on (as verified) and off agree: the integer kernels compute the Q/DQ graph
    x = torch.randn(256, 8).numpy()
    outs = []
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        outs.append(ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0])
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    big = float(np.abs(ref).max())
    assert np.abs(outs[0] - outs[1]).max() <= 0.01 * big
    assert np.abs(outs[0] - ref).max() <= 0.01 * big
    assert res.verified


@pytest.fixture(scope="module")
def digits_transformer():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target)
    torch.manual_seed(0)
    model = DigitsTransformer()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(40):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[:1400]), y[:1400]).backward()
        opt.step()
    model = _calibrated(model, [x[i:i + 64] for i in range(0, 512, 64)])
    return model, x[1400:1464]


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_multihead_attention_transformer_exports_right_for_both_targets(tmp_path, digits_transformer, target):
    model, sample = digits_transformer
    path = str(tmp_path / f"mha_{target}.onnx")
    res = export_onnx(model, sample, path, target=target, speed_check=False)
    with torch.no_grad():
        big = float(model(sample).abs().max())
    assert res.max_abs_diff <= 0.01 * big
    risks = int16_risks(onnx.load(path))
    if target == "onnxruntime":
        assert risks == [] and res.int8_kernels.get("QLinearMatMul", 0) >= 1  # the attention matmul is integer
    else:
        # int8 zero-point-0 everywhere (TensorRT); onnxruntime's CPU kernels could saturate on it, and it says so
        assert risks and any("would saturate in onnxruntime" in w for w in res.warnings)


def test_file_check_covers_explicit_integer_ops():
    """onnxruntime's own quantize_dynamic writes MatMulInteger: the check reads those weights too."""
    w = np.random.default_rng(0).integers(-50, 51, (16, 8)).astype(np.int8)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz"], ["y"])]

    def model(weights):
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                              [numpy_helper.from_array(weights, "w")])
        return helper.make_model(g)

    assert int16_risks(model(w)) == []
    w[0, 3], w[5, 3] = 127, 100
    (r,) = int16_risks(model(w))
    assert r.op_type == "MatMulInteger" and r.worst_pair == 227 * 255
