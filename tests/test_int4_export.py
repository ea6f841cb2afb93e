"""Block-quantized Linear weights exported for onnxruntime as ``com.microsoft.MatMulNBits`` (lq.export.passes._matmul_nbits).

The file must hold exactly lq's fake-quant weights: the codes and scales are decoded from the file and compared
with lq's reference op (``lq._reference.quant`` on the block view, with the quantizer's own amax), on every block
layout (block sizes, 4 and 8 bits, narrow or full range, an odd number of blocks, both exporters, 2-D and 3-D
inputs with a dynamic sequence length). A file written with the wrong nibble order or the wrong block axis fails
the export's own verification. Layouts MatMulNBits cannot take (blocks along the output features, a block size
that is not a power of two >= 16) keep the blocked DequantizeLinear, and TensorRT's target always does.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from lq import _reference
from lq.calibration import calibrate_model
from lq.callbacks.swap import QuantSwap
from lq.config import Int4BlockWeightConfig, QuantizerConfig
from lq.export import export_onnx
from lq.export.report._result import VerificationError

pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)


def _model(num_bits=4, block=32, narrow=True, axis=-1, k=96, seed=0):
    """Linear(k, 128) -> GELU -> LayerNorm -> Linear(128, 48) (no bias on the last one), weight-only block quantized."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(k, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 48, bias=False))
    w = QuantizerConfig(num_bits=num_bits, block_size=block, block_axis=axis, narrow_range=narrow)
    QuantSwap(Int4BlockWeightConfig(weight=w)).swap(m)
    x = torch.randn(3, 7, k)
    calibrate_model(m.eval(), [x])
    return m, x


def _initializers(path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}


def _decode(node, inits) -> tuple[np.ndarray, np.ndarray]:
    """(integer codes minus the zero point [N, K], scales [N, K / block]) of a MatMulNBits node."""
    a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
    n, k, bits, block = a["N"], a["K"], a["bits"], a["block_size"]
    b = inits[node.input[1]].astype(np.int64)
    if bits == 4:
        codes = np.stack([b & 15, b >> 4], axis=-1).reshape(n, k // block, block)
    else:
        codes = b.reshape(n, k // block, block)
    zp = np.full((n, k // block), 1 << (bits - 1), np.int64)
    if len(node.input) > 3 and node.input[3]:
        z = inits[node.input[3]].astype(np.int64)
        zp = (np.stack([z & 15, z >> 4], -1).reshape(n, -1) if bits == 4 else z.reshape(n, -1))[:, : k // block]
    return (codes - zp[..., None]).reshape(n, k), inits[node.input[2]].reshape(n, k // block)


def _reference_blocks(layer) -> tuple[np.ndarray, np.ndarray]:
    """lq's own integers and float32 scales (amax / maxbound) of ``layer``'s block-quantized weight."""
    tq = layer._weight_quantizer
    w = layer.weight.detach()
    block = tq.block_sizes[-1] if -1 in tq.block_sizes else tq.block_sizes[1]
    n, k = w.shape
    amax = tq.amax.reshape(n, k // block, 1)
    q, _ = _reference.quant(w.reshape(n, k // block, block), amax, tq.num_bits, False, tq.narrow_range)
    maxbound = 2 ** (tq.num_bits - 1) - 1
    return q.reshape(n, k).numpy().astype(np.int64), (amax.reshape(n, -1).double() / maxbound).float().numpy()


LAYOUTS = [(4, 32, True), (4, 16, False), (4, 64, True), (4, 128, True), (8, 32, True), (8, 64, False), (3, 32, True),
           (6, 32, True)]


@pytest.mark.parametrize("num_bits,block,narrow", LAYOUTS)
def test_file_holds_the_fake_quant_weights_on_every_block_layout(tmp_path, num_bits, block, narrow):
    k = {64: 128, 128: 256}.get(block, 96)  # 96 / 32 = 3 blocks: an odd count (a half-filled zero-point byte)
    m, x = _model(num_bits, block, narrow, k=k)
    path = str(tmp_path / "m.onnx")
    res = export_onnx(m, x, path, opset=21, dynamic_dims=(1,), check_fusion=False)
    assert res.verified
    nodes = [n for n in onnx.load(path).graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 2 and not [n for n in onnx.load(path).graph.node if n.op_type in ("MatMul", "Gemm")]
    inits = _initializers(path)
    for node, layer in zip(nodes, (m[0], m[3])):
        bits = {a.name: a.i for a in node.attribute}["bits"]
        assert bits == (4 if num_bits <= 4 else 8)
        codes, scales = _decode(node, inits)
        want_q, want_s = _reference_blocks(layer)
        np.testing.assert_array_equal(codes, want_q)
        np.testing.assert_array_equal(scales, want_s)
    with torch.no_grad():  # the file against the model on a longer sequence than the export saw
        x2 = torch.randn(2, 19, k)
        want = m(x2).numpy()
    import onnxruntime as ort

    got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"input": x2.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamo", [True, False])
@pytest.mark.parametrize("rank", [2, 3])
def test_both_exporters_write_matmul_nbits_with_the_bias_inside(tmp_path, dynamo, rank):
    m, x = _model()
    x = x if rank == 3 else x[0]
    path = str(tmp_path / "m.onnx")
    res = export_onnx(m, x, path, opset=21, dynamo=dynamo, dynamic_dims=(1,) if rank == 3 else (),
                      fallback_seconds=0)
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert ops.count("MatMulNBits") == 2 and "Add" not in ops and "DequantizeLinear" not in ops, ops
    first = next(n for n in onnx.load(path).graph.node if n.op_type == "MatMulNBits")
    np.testing.assert_array_equal(_initializers(path)[first.input[5]], m[0].bias.detach().numpy())
    kernels = {k.layer: k.kernel for k in res.layer_kernels}
    assert kernels == {"0": "MatMulNBits", "3": "MatMulNBits"}, res.layer_kernels
    assert res.ort_ops.get("MatMulNBits") == 2


def test_wrong_nibble_order_or_block_axis_fails_verification(tmp_path, monkeypatch):
    from lq.export.passes import _matmul_nbits

    m, x = _model()
    real = _matmul_nbits._node

    def swapped_nibbles(g, mm, w, s, z, signed, block, bias):
        return real(g, mm, w.reshape(w.shape[0], -1, 2)[..., ::-1].reshape(w.shape), s, z, signed, block, bias)

    def wrong_axis(g, mm, w, s, z, signed, block, bias):  # the blocks read down the columns instead of along rows
        n, k = w.shape
        return real(g, mm, w.reshape(n, k // block, block).transpose(0, 2, 1).reshape(n, k), s, z, signed, block,
                    bias)

    for wrong in (swapped_nibbles, wrong_axis):
        monkeypatch.setattr(_matmul_nbits, "_node", wrong)
        with pytest.raises(VerificationError):
            export_onnx(m, x, str(tmp_path / f"{wrong.__name__}.onnx"), opset=21, check_fusion=False)


def test_layouts_matmul_nbits_cannot_take_keep_the_blocked_dequantize(tmp_path):
    for axis, block, why in ((0, 16, "output features"), (-1, 8, "powers of two")):
        m, x = _model(block=block, axis=axis, k=96 if axis == -1 else 64)
        res = export_onnx(m, x, str(tmp_path / "m.onnx"), opset=21, check_fusion=False)
        ops = [n.op_type for n in onnx.load(res.path).graph.node]
        assert "MatMulNBits" not in ops and ops.count("DequantizeLinear") >= 1
        assert any(why in w for w in res.warnings), res.warnings
        assert res.verified


def test_tensorrt_target_keeps_the_blocked_dequantize_with_4_bit_storage(tmp_path):
    m, x = _model()
    res = export_onnx(m, x, str(tmp_path / "trt.onnx"), opset=21, target="tensorrt", check_fusion=False)
    g = onnx.load(res.path).graph
    dqs = [n for n in g.node if n.op_type == "DequantizeLinear"]
    assert "MatMulNBits" not in [n.op_type for n in g.node] and len(dqs) == 2
    types = {i.name: i.data_type for i in g.initializer}
    assert all(types[d.input[0]] == onnx.TensorProto.INT4 for d in dqs)
