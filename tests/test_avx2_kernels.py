"""What lq exports computes the same on an AVX2-only CPU: onnxruntime's AVX2 kernels, run in qemu's Haswell.

The int16 check (test_int16_safety.py) proves from the file's integers that no u8 x s8 pair sum can saturate;
these tests run the kernels themselves. First, that the emulated CPU really runs the saturating AVX2 kernel (a
full-range int8 encoding gives other numbers there than the exact product, as the instruction model says);
then that the files lq writes for real models give, on it, what PyTorch's fake-quant model gives, within the
export's own tolerance. Whichever CPU runs the suite (VNNI or not), the second CPU is then covered too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from _limits import HANG_GUARD_S
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.calibration import calibrate_model
from lq.callbacks import QuantSwap
from lq.config import Int8OnnxruntimeConfig, Int8ReduceRangeConfig, QuantConfig
from lq.export import export_onnx
from lq.export.verify._no_vnni import has_vnni

from bench._avx2 import CPU, available, first_outputs_here, first_outputs_on_avx2

from _avx2 import pmaddubsw_dot
from _models import BNBlock, DigitsTransformer

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not available(), reason="needs an x86 machine with qemu-x86_64 "
                                "(apt-get install qemu-user), outside the emulator")
torch.set_flush_denormal(True)

def _full_range_matmul_files(tmp_path) -> tuple[list, np.ndarray, np.ndarray]:
    """Two files with int8 weights of 127 and uint8 activations of 255 (every adjacent pair sums to 64770):
    a bare MatMulInteger, and the Q/DQ form onnxruntime fuses into its integer GEMM."""
    k, n = 64, 8
    w = np.full((k, n), 127, np.int8)
    w[:, 1] = 40  # a column whose pairs stay below 32767: exact on both kinds of CPU
    a = np.full((4, k), 255, np.uint8)
    mm = helper.make_graph([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "mm",
                           [helper.make_tensor_value_info("a", TensorProto.UINT8, [None, k])],
                           [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                           [numpy_helper.from_array(w, "w")])
    # x = 2.55 quantizes to 255 (scale 0.01, zero point 0); the weights dequantize to w * 0.001
    qdq = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
         helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
         helper.make_node("DequantizeLinear", ["w", "ws"], ["wd"]),
         helper.make_node("MatMul", ["xd", "wd"], ["y"])], "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0.001, np.float32), "ws"),
         numpy_helper.from_array(np.array(0.01, np.float32), "s"), numpy_helper.from_array(np.array(0, np.uint8), "z")])
    cases = []
    for name, g, x in (("mm", mm, a), ("qdq", qdq, np.full((4, k), 2.55, np.float32))):
        path = str(tmp_path / f"{name}.onnx")
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        cases.append((path, {g.input[0].name: x}))
    return cases, a, w


def test_the_emulated_cpu_runs_the_saturating_avx2_kernel(tmp_path):
    cases, a, w = _full_range_matmul_files(tmp_path)
    got_int, got_float = first_outputs_on_avx2(cases)
    exact = a.astype(np.int64) @ w.astype(np.int64)
    saturated = np.array([[pmaddubsw_dot(r, w[:, j]) for j in range(w.shape[1])] for r in a])
    assert saturated[0, 0] == 32 * 32767 != exact[0, 0] == 64 * 255 * 127
    np.testing.assert_array_equal(got_int, saturated)  # what vpmaddubsw computes, not the exact product
    assert (got_int[:, 1] == exact[:, 1]).all()
    # the Q/DQ file runs the same integer kernel: 10.5 where its Q/DQ semantics say 20.7
    np.testing.assert_allclose(got_float, saturated * 0.01 * 0.001, rtol=1e-5)
    assert np.abs(got_float[:, 0] - exact[:, 0] * 1e-5).min() > 1.0


def _fused_lstm_file(path: str, q: np.ndarray, unsigned: bool) -> str:
    """One onnxruntime DynamicQuantizeLSTM step over input ``x`` (1, 2, K) whose weights lq's writer lays out
    from the integer rows ``q`` (4H, K), as int8 or as uint8 + 128; no recurrent weights."""
    from lq.export.passes._dynamic_lstm import _layout

    hidden = q.shape[0] // 4
    zp = np.full((1, 4 * hidden), 128 if unsigned else 0, np.uint8 if unsigned else np.int8)
    scale = np.full((1, 4 * hidden), 1e-4, np.float32)
    r = np.zeros((4 * hidden, hidden), np.int32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((_layout(q, hidden, unsigned), "W"),
                                                        (_layout(r, hidden, unsigned), "R"), (scale, "ws"),
                                                        (zp, "wz"), (scale, "rs"), (zp, "rz"))]
    node = helper.make_node("DynamicQuantizeLSTM", ["x", "W", "R", "", "", "", "", "", "ws", "wz", "rs", "rz"], ["y"],
                            domain="com.microsoft", hidden_size=hidden)
    g = helper.make_graph([node], "lstm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, q.shape[1]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(g, opset_imports=opsets), path)
    return path


def _lstm_step_reference(x: np.ndarray, weight: float) -> np.ndarray:
    """One LSTM step from zero state with every weight ``weight`` and no bias, in float64: all four gates see
    the same pre-activation ``z``, so c = sigmoid(z) tanh(z) and h = sigmoid(z) tanh(c)."""
    z = x.astype(np.float64).sum(-1) * weight
    sig = 1.0 / (1.0 + np.exp(-z))
    return sig * np.tanh(sig * np.tanh(z))


def test_the_fused_lstm_saturates_with_int8_weights_and_not_with_lqs_uint8_encoding(tmp_path):
    """Why lq writes 8-bit LSTM weights as uint8: onnxruntime's DynamicQuantizeLSTM runs the same u8 x s8 kernel,
    so full-range int8 weights with inputs at the top of their range saturate on AVX2 (not on VNNI CPUs).
    Judged against a float64 LSTM step, so it holds on either kind of CPU running the suite."""
    q = np.full((16, 64), 127, np.int32)
    x = np.ones((1, 2, 64), np.float32)
    x[0, 1, 0] = 0.0  # the range [0, 1]: every other input quantizes to 255 (exactly 1.0)
    cases = [(_fused_lstm_file(str(tmp_path / f"lstm_{u}.onnx"), q, u), [x]) for u in (False, True)]
    here, avx2 = first_outputs_here(cases), first_outputs_on_avx2(cases)
    ref = np.broadcast_to(_lstm_step_reference(x[0], 127 * 1e-4)[:, None], here[1].shape[2:])  # (batch, hidden)
    np.testing.assert_allclose(here[1][0, 0], ref, rtol=1e-5)  # uint8: exact here
    np.testing.assert_allclose(avx2[1][0, 0], ref, rtol=1e-5)  # and on AVX2
    assert np.abs(avx2[0][0, 0] - ref).max() > 0.1  # int8 on AVX2: pair sums saturated (0.14 where it is 0.30)
    # int8 here: exact on a VNNI CPU, the AVX2 kernel's saturated numbers on one without
    np.testing.assert_allclose(here[0][0, 0], ref if has_vnni() else avx2[0][0, 0], rtol=1e-5)


# ---------------------------------------------------------------------------------------- real models
def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.images / 16.0, dtype=torch.float32)


def _resnet() -> nn.Module:
    """A small BatchNorm ResNet with plain ``+`` residuals (glue-quantized adds) on 1x8x8 digits."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), BNBlock(16), BNBlock(16),
                         nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(32, 10))


class _RowLSTM(nn.Module):
    """The 8 rows of a digit as time steps of a 2-layer nn.LSTM, the last step classified."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(8, 24, num_layers=2, batch_first=True)
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def _calibrated(model: nn.Module, recipe: QuantConfig, batches: list) -> nn.Module:
    QuantSwap(recipe).swap(model)
    model.eval()
    with torch.no_grad():
        calibrate_model(model, batches, method="max")
    return model


@pytest.mark.parametrize("recipe", [QuantConfig, Int8ReduceRangeConfig, Int8OnnxruntimeConfig],
                         ids=["8bit", "int8_reduce_range", "int8_onnxruntime"])
def test_lq_exports_give_pytorchs_numbers_on_avx2(tmp_path, recipe):
    images = _digits()
    models = {"resnet": (_resnet(), images.unsqueeze(1), {}), "mha_transformer": (DigitsTransformer(), images, {}),
              "lstm": (_RowLSTM(), images, {"recurrent": "scan"}),
              # onnxruntime's fused DynamicQuantizeLSTM: 8-bit weights stored as uint8, 7-bit ones as int8
              "lstm_dynamic": (_RowLSTM(), images, {"recurrent": "dynamic"})}
    cases, wants, results = [], [], []
    for name, (model, x, options) in models.items():
        model = _calibrated(model, recipe(**options), [x[i:i + 64] for i in range(0, 512, 64)])
        res = export_onnx(model, x[:32], str(tmp_path / f"{name}.onnx"), fallback_seconds=0)
        assert res.verified  # on this CPU
        test = x[1400:1464]
        with torch.no_grad():
            wants.append(model(test).numpy())
        results.append(res)
        cases.append((res.path, {res.input_names[0]: test.numpy()}))
    got = first_outputs_on_avx2(cases)
    for name, g, want, res in zip(models, got, wants, results):
        why = res.judge([g], [want])  # the export's own rule, on the other CPU
        assert not why, f"{name} on {CPU}: {why}"


def test_make_test_avx2_runs_a_test_file_in_the_emulator():
    """The README's ``make test-avx2`` is ``.ci/avx2``: here on one small test file (the reference kernels,
    so nothing is compiled)."""
    root = Path(__file__).resolve().parents[1]
    assert "make test-avx2" in (root / "README.md").read_text()
    assert ".ci/avx2" in (root / "Makefile").read_text().split("test-avx2: setup", 1)[1].split("\n\n", 1)[0]
    env = dict(os.environ, LQ_DISABLE_EXT="1", PYTHON=sys.executable)
    out = subprocess.run([str(root / ".ci" / "avx2"), "tests/test_export_linear_gemm.py", "-k", "bias-1-1-n"],
                         cwd=root, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout and "TCG" not in out.stderr


def test_library_style_cnn_on_the_onnxruntime_recipe_gives_pytorchs_numbers_on_avx2(tmp_path):
    """Depthwise convs, SiLU and squeeze-excite as QLinearSigmoid/QLinearMul, Sequential(conv, bn, act) blocks:
    int8_onnxruntime's uint8 x 7-bit kernels on the AVX2-only CPU, judged by the export's own rule."""
    from test_asymmetric import TinyEfficientNet, _trained_bn

    torch.manual_seed(0)
    x = torch.randn(96, 4, 16, 16)
    m = _trained_bn(TinyEfficientNet(), x)
    QuantSwap(Int8OnnxruntimeConfig()).swap(m)
    with torch.no_grad():
        calibrate_model(m, list(x[:64].split(16)))
    res = export_onnx(m, x[:8], str(tmp_path / "cnn.onnx"), fallback_seconds=0)
    test = x[64:]
    with torch.no_grad():
        want = m(test).numpy()
    (got,) = first_outputs_on_avx2([(res.path, {res.input_names[0]: test.numpy()})])
    assert not res.judge([got], [want]), f"{CPU}: {res.judge([got], [want])}"


def test_every_rule_and_the_new_placements_give_pytorchs_numbers_on_avx2(tmp_path):
    """Every family of onnxruntime's rule table (tests/test_rules.py's examples, default recipe), a 1-D
    conv -> ReLU -> BatchNorm -> MaxPool stack (CREPE's layers: the output quantizer on the ReLU) and a
    conv -> PReLU -> MaxPool -> conv (O-Net's: the pool shares its reader's grid) on the AVX2-only CPU, judged
    by the export's own rule against PyTorch."""
    import test_rules

    torch.manual_seed(0)
    crepe = nn.Sequential(nn.Conv1d(1, 16, 9, padding=4), nn.ReLU(), nn.BatchNorm1d(16), nn.MaxPool1d(2),
                          nn.Conv1d(16, 16, 5, padding=2), nn.ReLU(), nn.BatchNorm1d(16), nn.MaxPool1d(2),
                          nn.Flatten(), nn.Linear(16 * 16, 10))
    onet = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.PReLU(16), nn.MaxPool2d(2),
                         nn.Conv2d(16, 16, 3, padding=1), nn.PReLU(16), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 2 * 2, 10))
    images = _digits()
    models = {f: (test_rules.calibrated_example(f), test_rules.sample_batches(f, 1, seed=9)[0], test_rules.sample_batches(f)[0])
              for f in sorted(test_rules.EXAMPLES)}
    for name, (model, x) in {"crepe": (crepe, images.reshape(-1, 1, 64)), "onet": (onet, images.unsqueeze(1))}.items():
        model = _calibrated(model.eval(), Int8OnnxruntimeConfig(), [x[i:i + 64] for i in range(0, 512, 64)])
        models[name] = (model, x[1400:1464], x[:32])
    cases, wants, results = [], [], []
    for name, (model, test, sample) in models.items():
        res = export_onnx(model, sample, str(tmp_path / f"{name}.onnx"), speed_check=False)
        with torch.no_grad():
            wants.append(model(test).numpy())
        results.append(res)
        cases.append((res.path, {res.input_names[0]: test.numpy()}))
    got = first_outputs_on_avx2(cases)
    bad = {n: why for n, g, want, res in zip(models, got, wants, results) if (why := res.judge([g], [want]))}
    assert not bad, f"on {CPU}: {bad}"
