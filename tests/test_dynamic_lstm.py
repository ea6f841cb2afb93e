"""QuantLSTM with runtime_dynamic activations: onnxruntime's fused DynamicQuantizeLSTM, computed in PyTorch.

What must hold: the activation quantizer is onnxruntime's own rule (checked against its DynamicQuantizeLinear
op, bit for bit); the LSTM computes what a quantized LSTM written out here in numpy computes (each layer's
input quantized once over the whole sequence, h at every step, from themselves); the export is one
DynamicQuantizeLSTM per layer and direction (no loop, no unrolling, any sequence length) and onnxruntime on one
thread gives PyTorch's numbers for 8-bit (uint8-encoded) and 7-bit weights; the swap, config and export refuse
what the op cannot run, in words that say what to do.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import lq.nn as quant_nn
from lq.calibration import calibrate_model
from lq.callbacks import QuantSwap
from lq.config import Int8ReduceRangeConfig, QuantConfig
from lq.convert import quantize_model
from lq.export import ExportError, export_onnx
from lq.export._ir import all_nodes
from lq.nn.modules._runtime_dynamic import runtime_dynamic_fake_quant
from lq.zoo import DigitsDataModule, SmallCNN
from lq.tensor_quant import QuantDescriptor

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)


# ---------------------------------------------------------------- the activation quantizer
def _ort_dynamic_quant_dequant():
    g = helper.make_graph([helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
                           helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_the_activation_quantizer_is_onnxruntimes_rule_bit_for_bit():
    sess = _ort_dynamic_quant_dequant()
    g = torch.Generator().manual_seed(0)
    cases = [torch.zeros(7), torch.full((5,), 3.0), torch.full((5,), -2.0), torch.tensor([0.0, 1e-30, -1e-30])]
    for k in range(120):
        x = torch.randn(int(torch.randint(1, 2000, (), generator=g)), generator=g) * float(10 ** (k % 5 - 2))
        cases.append(x + float(torch.randn((), generator=g)) if k % 3 else (x.abs() if k % 2 else -x.abs()))
    for x in cases:
        got = runtime_dynamic_fake_quant(x).numpy()
        want = sess.run(None, {"x": x.numpy()})[0]
        assert np.array_equal(got, want), (x[:5], got[:5], want[:5])


def test_the_activation_quantizer_passes_the_gradient_straight_through():
    x = torch.randn(50, requires_grad=True)
    (runtime_dynamic_fake_quant(x) * torch.arange(50.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(50.0))


# ---------------------------------------------------------------- the LSTM, against one written out in numpy
def _dq(a: np.ndarray) -> np.ndarray:
    """DynamicQuantizeLinear + DequantizeLinear, as the ONNX spec writes them, in float32."""
    a = a.astype(np.float32)
    lo, hi = np.float32(min(a.min(), 0)), np.float32(max(a.max(), 0))
    s = np.float32(1) if hi == lo else np.float32((hi - lo) / np.float32(255))
    zp = np.round(np.clip(-lo / s, 0, 255))
    return ((np.clip(np.round(a / s) + zp, 0, 255) - zp) * s).astype(np.float32)


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def ref_dynamic_lstm(m: nn.LSTM, x: np.ndarray) -> np.ndarray:
    """Output of a time-first ``x`` (T, B, F): per layer and direction, the layer's input quantized once, h at
    every step; float weights (the weight quantizers are switched off in the test)."""
    seq = x
    for layer in range(m.num_layers):
        outs = []
        xq = _dq(seq)
        for d in range(2 if m.bidirectional else 1):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = (getattr(m, p + sfx).detach().numpy() for p in ("weight_ih", "weight_hh"))
            b = (getattr(m, "bias_ih" + sfx) + getattr(m, "bias_hh" + sfx)).detach().numpy()
            h = np.zeros((x.shape[1], m.hidden_size), np.float32)
            c = np.zeros_like(h)
            ys = [None] * len(seq)
            for t in (reversed(range(len(seq))) if d else range(len(seq))):
                i, f, gg, o = np.split(xq[t] @ w_ih.T + _dq(h) @ w_hh.T + b, 4, axis=1)
                c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(gg)
                h = _sigmoid(o) * np.tanh(c)
                ys[t] = h
            outs.append(np.stack(ys))
        seq = np.concatenate(outs, -1)
    return seq


def test_runtime_dynamic_lstm_computes_the_written_out_reference():
    torch.manual_seed(0)
    f = nn.LSTM(6, 10, num_layers=2, bidirectional=True).eval()
    q = quant_nn.QuantLSTM.from_float(f).set_runtime_dynamic(True)
    for w in q._weight_quantizers:
        w.disable()
    x = torch.randn(9, 4, 6) * 2
    with torch.no_grad():
        got = q(x)[0].numpy()
    want = ref_dynamic_lstm(f, x.numpy())
    assert np.abs(got - want).max() < 1e-5
    assert np.abs(got - f(x)[0].detach().numpy()).max() > 1e-3  # the activations really are quantized


def test_set_runtime_dynamic_switches_the_input_quantizers_and_the_state_dict_carries_the_mode():
    torch.manual_seed(0)
    f = nn.LSTM(4, 5, num_layers=2)
    q = quant_nn.QuantLSTM.from_float(f)
    assert all(iq.is_enabled for iq in q._input_quantizers)
    x = torch.randn(6, 3, 4)
    with torch.no_grad():
        calibrate_model(q, [x], method="max", forward=lambda m, b: m(b)[0])
        static = q(x)[0]
    scan_state = copy.deepcopy(q.state_dict())
    q.set_runtime_dynamic(True)
    assert q.runtime_dynamic and not any(iq.is_enabled for iq in q._input_quantizers)
    with torch.no_grad():
        dynamic = q(x)[0]
    dynamic_state = copy.deepcopy(q.state_dict())
    assert "_runtime_dynamic" in dynamic_state and "_runtime_dynamic" not in scan_state
    # loading a state dict sets the mode it was saved in: no silent mix of one mode's model and the other's
    other = quant_nn.QuantLSTM.from_float(f)
    other.load_state_dict(dynamic_state)
    with torch.no_grad():
        assert other.runtime_dynamic and torch.equal(other(x)[0], dynamic)
        other.load_state_dict(scan_state)
        assert not other.runtime_dynamic and all(iq.is_enabled for iq in other._input_quantizers)
        assert torch.equal(other(x)[0], static)
    q.set_runtime_dynamic(False)
    assert not q.runtime_dynamic and all(iq.is_enabled for iq in q._input_quantizers)
    assert list(q.state_dict()) == list(scan_state)


def test_what_the_fused_op_cannot_run_is_refused_in_words():
    with pytest.raises(ValueError, match="no projection"):
        quant_nn.QuantLSTM.from_float(nn.LSTM(4, 6, proj_size=3)).set_runtime_dynamic(True)
    q = quant_nn.QuantLSTM.from_float(nn.LSTM(4, 6)).set_runtime_dynamic(True)
    packed = pack_padded_sequence(torch.randn(5, 2, 4), [5, 3])
    with pytest.raises(ValueError, match="PackedSequence"):
        q(packed)
    with pytest.raises(ValueError, match="recurrent='x' is not allowed"):
        quantize_model(nn.Sequential(nn.LSTM(4, 6)), recurrent="x")
    with pytest.raises(ValueError, match="recurrent='loop' is not allowed"):
        QuantConfig(recurrent="loop")


# ---------------------------------------------------------------- the export
class _Tagger(nn.Module):
    """Per-step classes of a 2-layer bidirectional batch-first LSTM (the state returned too)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(8, 16, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        y, (h, c) = self.rnn(x)
        return self.head(y), h, c


def _digit_rows(n: int) -> torch.Tensor:
    from sklearn.datasets import load_digits

    return torch.tensor(load_digits().images[:n] / 16.0, dtype=torch.float32)  # (n, 8 steps, 8)


@pytest.mark.parametrize("recipe", [QuantConfig, Int8ReduceRangeConfig], ids=["8bit", "int8_reduce_range"])
def test_export_is_one_fused_op_per_layer_direction_with_pytorchs_numbers(tmp_path, recipe):
    model = _Tagger()
    QuantSwap(recipe(recurrent="dynamic")).swap(model)
    assert model.rnn.runtime_dynamic
    x = _digit_rows(256)
    model.eval()
    with torch.no_grad():
        calibrate_model(model, list(x.split(64)), method="max")  # the weights' and the head's quantizers
    res = export_onnx(model, x[:32], str(tmp_path / "m.onnx"), dynamic_dims=(1,), fallback_seconds=0)
    m = onnx.load(res.path)
    ops = [n.op_type for n in all_nodes(m.graph)]
    assert ops.count("DynamicQuantizeLSTM") == 4 and "Scan" not in ops and "LSTM" not in ops
    weights = {i.name: i.data_type for i in m.graph.initializer if i.name.endswith(("/W", "/R"))}
    want = TensorProto.UINT8 if recipe is QuantConfig else TensorProto.INT8  # 8-bit weights: AVX2-safe uint8
    assert weights and set(weights.values()) == {want}
    assert ("rnn" in res.uint8_weights) == (want == TensorProto.UINT8)  # and the export says so, once
    assert res.uint8_weights.count("rnn") <= 1
    assert res.verified
    lstm = [k for k in res.layer_kernels if k.layer == "rnn"]
    assert len(lstm) == 4 and all(k.integer and k.kernel == "DynamicQuantizeLSTM" for k in lstm)
    assert any("DynamicQuantizeLSTM" in w for w in res.warnings)  # the thread-count caveat is said
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(res.path, so, providers=["CPUExecutionProvider"])
    longer = torch.cat([x[200:216], x[200:216, :5]], 1)  # 13 steps: a length the export never saw
    with torch.no_grad():
        want_out = [t.numpy() for t in model(longer)]
    got = sess.run(None, {res.input_names[0]: longer.numpy()})
    for g, w in zip(got, want_out, strict=True):
        # float sums in another order (and onnxruntime's own sigmoid/tanh) can tip a rounding tie of h's quantizer
        # the other way now and then: one step of h (1/255 of its range) that the recurrence carries on; otherwise
        # the numbers are PyTorch's to float precision (a wrong gate order or scale is off by ~0.1 on average)
        err = np.abs(g - w)
        assert g.shape == w.shape and err.max() < 2e-2 and err.mean() < 2e-4, (err.max(), err.mean())


class _Stateful(nn.Module):
    """An LSTM without biases that takes its initial state as inputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(8, 16, num_layers=2, bias=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x, h0, c0):
        y, (h, c) = self.rnn(x, (h0, c0))
        return self.head(y), h


def test_export_with_per_tensor_weights_no_bias_and_a_given_state(tmp_path):
    from lq.config import Int8PerTensorConfig

    model = _Stateful().eval()
    quantize_model(model, recurrent="dynamic", quant_desc_weight=Int8PerTensorConfig().weight.to_descriptor())
    g = torch.Generator().manual_seed(1)
    args = (_digit_rows(64).transpose(0, 1), torch.randn(2, 64, 16, generator=g), torch.randn(2, 64, 16, generator=g))
    with torch.no_grad():
        calibrate_model(model, [args], method="max", forward=lambda m, batch: m(*batch))
    res = export_onnx(model, args, str(tmp_path / "m.onnx"), dynamic_batch=False, fallback_seconds=0)
    ops = [n.op_type for n in onnx.load(res.path).graph.node]
    assert ops.count("DynamicQuantizeLSTM") == 2 and res.max_abs_diff < 1e-4  # no later quantizer: float noise


def test_an_unrolled_lstm_says_why_its_length_is_fixed_and_a_packed_sample_is_refused(tmp_path):
    model = _Tagger()
    quantize_model(model, quant_desc_input=QuantDescriptor())  # the Scan form, which only the current exporter writes as a loop
    x = _digit_rows(64)
    with torch.no_grad():
        calibrate_model(model.eval(), [x], method="max")
    res = export_onnx(model, x[:8], str(tmp_path / "legacy.onnx"), dynamo=False, fallback_seconds=0)
    assert any("'rnn' is exported unrolled" in w and "legacy exporter" in w for w in res.warnings)
    with pytest.raises(ExportError, match="sequence length is fixed in the file: QuantLSTM 'rnn' is exported unrolled"):
        export_onnx(model, x[:8], str(tmp_path / "legacy.onnx"), dynamo=False, dynamic_dims=(1,), fallback_seconds=0)
    packed = pack_padded_sequence(x[:4], [8, 8, 6, 5], batch_first=True)
    with pytest.raises(ExportError, match=r"PackedSequence sample cannot be exported.*\(B, T, F\)") as e:
        export_onnx(model.rnn, packed, str(tmp_path / "packed.onnx"), fallback_seconds=0)
    assert "\n" not in str(e.value)


def test_export_refuses_runtimes_and_exporters_without_the_op(tmp_path):
    model = _Tagger()
    quantize_model(model, recurrent="dynamic", quant_desc_input=QuantDescriptor())
    x = _digit_rows(64)
    with torch.no_grad():
        calibrate_model(model.eval(), [x], method="max")
    for kwargs in ({"target": "tensorrt"}, {"dynamo": False}):
        with pytest.raises(ExportError, match="set_runtime_dynamic\\(False\\)"):
            export_onnx(model, x[:8], str(tmp_path / "m.onnx"), **kwargs)


# ---------------------------------------------------------------- through the Lightning callback
class LSTMDigits(SmallCNN):
    """The zoo's digits LightningModule with its network replaced: the 8 rows as steps of a 2-layer LSTM."""

    def __init__(self, hidden: int = 24, **kw):
        super().__init__(**kw)
        self.save_hyperparameters()
        del self.stem, self.block, self.down, self.pool
        self.rnn = nn.LSTM(8, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.head(self.rnn(x.reshape(x.shape[0], 8, 8))[0][:, -1])


def test_callback_trains_checkpoints_and_exports_the_fused_lstm(tmp_path):
    """int8_reduce_range through QuantCallback: QAT runs through the dynamic quantizer, the checkpoint brings
    the mode back (it is part of the stored recipe), the export is the fused op."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lq
    from lq.config import ExportConfig

    dm = DigitsDataModule(batch_size=64)
    dm.setup()
    L.seed_everything(0)
    model = LSTMDigits(max_epochs_hint=1)
    cb = lq.QuantCallback(quant="int8_reduce_range", export=ExportConfig(path="lstm.onnx"), verbose=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    before = model.rnn.weight_hh_l0.detach().clone()
    L.Trainer(max_epochs=1, limit_train_batches=4, limit_val_batches=2, logger=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=str(tmp_path), accelerator="cpu",
              callbacks=[cb, ckpt]).fit(model, datamodule=dm)
    assert model.rnn.runtime_dynamic and not torch.equal(model.rnn.weight_hh_l0, before)  # QAT trained it
    ops = [n.op_type for n in all_nodes(onnx.load(str(tmp_path / "lstm.onnx")).graph)]
    assert ops.count("DynamicQuantizeLSTM") == 2 and cb.exporter.result.verified
    x = dm.arrays("test")[0][:32]
    model.eval()
    loaded = lq.load_quantized(LSTMDigits, ckpt.last_model_path)
    assert loaded.rnn.runtime_dynamic
    assert torch.equal(loaded(x), model(x))
