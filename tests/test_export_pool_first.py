"""Max pooling moved in front of a PReLU/LeakyReLU with non-negative slopes (:mod:`lq.export.passes._pool_first`).

The swap is exact only for a non-decreasing activation: these tests check that the rewritten graph gives
onnxruntime's very numbers of the original one (bit for bit, optimizations on and off), that a negative slope
or a slope varying along a spatial axis leaves the pool where it is, and that an exported P-Net-shaped model
pools first and still equals PyTorch's fake-quant model.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lq.calibration import calibrate_model
from lq.config import QuantizerConfig
from lq.convert import quantize_model
from lq.export import export_onnx
from lq.export.passes._pool_first import pool_before_activations
from lq.tensor_quant import QuantDescriptor

from _export_checks import LEVELS, rewritten, run_graph

ort = pytest.importorskip("onnxruntime")
torch.set_flush_denormal(True)



def _graph(act: str, slope: np.ndarray | float, quantized: bool, narrow: bool = False) -> onnx.ModelProto:
    """x -> act [-> Q [-> Max(q, 1): narrow range] -> DQ] -> MaxPool(2, ceil) -> y, float NCHW (1, 4, 7, 7)."""
    inits, nodes = [], []
    if act == "PRelu":
        inits.append(numpy_helper.from_array(np.asarray(slope, np.float32), "slope"))
        nodes.append(helper.make_node("PRelu", ["x", "slope"], ["a"]))
    elif act == "BatchNormalization":  # slope: gamma per channel; a mean, variance and shift of its own
        c = np.asarray(slope, np.float32).reshape(-1)
        for name, v in (("gamma", c), ("beta", np.linspace(-0.5, 0.5, c.size)), ("mean", np.linspace(-1, 1, c.size)),
                        ("var", np.linspace(0.5, 2, c.size))):
            inits.append(numpy_helper.from_array(np.asarray(v, np.float32), name))
        nodes.append(helper.make_node("BatchNormalization", ["x", "gamma", "beta", "mean", "var"], ["a"]))
    else:
        nodes.append(helper.make_node("LeakyRelu", ["x"], ["a"], alpha=float(slope)))
    pooled_in = "a"
    if quantized:
        inits += [numpy_helper.from_array(np.array(0.05, np.float32), "s"),
                  numpy_helper.from_array(np.array(128, np.uint8), "z")]
        nodes.append(helper.make_node("QuantizeLinear", ["a", "s", "z"], ["q"]))
        if narrow:  # uint8 with zero point 128 stops at 1 (-127), as lq's narrow-range activations do
            inits.append(numpy_helper.from_array(np.array(1, np.uint8), "lo"))
            nodes.append(helper.make_node("Max", ["q", "lo"], ["q_narrow"]))
        nodes.append(helper.make_node("DequantizeLinear", ["q_narrow" if narrow else "q", "s", "z"], ["dq"]))
        pooled_in = "dq"
    nodes.append(helper.make_node("MaxPool", [pooled_in], ["y"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 7, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray, level: str):
    return run_graph(model, x, level)[0]


def _rewrite(model: onnx.ModelProto) -> tuple[int, onnx.ModelProto]:
    return rewritten(model, pool_before_activations)


PER_CHANNEL = np.array([0.0, 0.1, 0.25, 0.7], np.float32).reshape(4, 1, 1)


@pytest.mark.parametrize("quantized,narrow", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("act,slope", [("PRelu", PER_CHANNEL), ("PRelu", np.float32(0.25)), ("LeakyRelu", 0.1),
                                       ("BatchNormalization", np.array([0.5, 1.7, 0.0, 0.03], np.float32))])
def test_pool_moves_above_a_non_decreasing_activation_with_the_same_numbers(act, slope, quantized, narrow):
    model = _graph(act, slope, quantized, narrow)
    moved, new = _rewrite(model)
    assert moved == 1
    ops = [n.op_type for n in new.graph.node]
    assert ops[0] == "MaxPool" and ops[1] == act, ops
    x = 3 * np.random.default_rng(0).standard_normal((1, 4, 7, 7)).astype(np.float32)
    for level in LEVELS:
        np.testing.assert_array_equal(_run(new, x, level), _run(model, x, level))


@pytest.mark.parametrize("act,slope", [
    ("PRelu", np.array([0.2, -0.3, 0.1, 0.5], np.float32).reshape(4, 1, 1)),  # one negative slope
    ("PRelu", np.full((4, 7, 7), 0.2, np.float32)),  # a slope per position: the pooled tensor no longer fits
    ("LeakyRelu", -0.1),
    ("BatchNormalization", np.array([0.5, -1.7, 1.0, 0.3], np.float32)),  # one channel reverses its order
])
def test_pool_stays_where_the_swap_would_not_be_exact(act, slope):
    model = _graph(act, slope, quantized=True)
    moved, new = _rewrite(model)
    assert moved == 0 and [n.op_type for n in new.graph.node][-1] == "MaxPool"
    if act == "PRelu" and slope.ndim == 3 and slope.shape[1] == 1:  # and moving it would have changed the result
        swapped = _graph(act, slope, quantized=True)
        nodes = list(swapped.graph.node)
        nodes[0].input[0], nodes[-1].input[0], nodes[-1].output[0], nodes[-2].output[0] = "p", "x", "p", "y"
        del swapped.graph.node[:]
        swapped.graph.node.extend([nodes[-1]] + nodes[:-1])
        x = 3 * np.random.default_rng(0).standard_normal((1, 4, 7, 7)).astype(np.float32)
        assert np.abs(_run(swapped, x, "ORT_DISABLE_ALL") - _run(model, x, "ORT_DISABLE_ALL")).max() > 0.1


class PNetShape(nn.Module):
    """conv -> PReLU -> 2x2 max pool (ceil) -> conv -> PReLU -> conv, as MTCNN's P-Net."""

    def __init__(self, slopes):
        super().__init__()
        self.c1, self.a1, self.pool = nn.Conv2d(4, 8, 3), nn.PReLU(8), nn.MaxPool2d(2, 2, ceil_mode=True)
        self.c2, self.a2, self.c3 = nn.Conv2d(8, 16, 3), nn.PReLU(16), nn.Conv2d(16, 4, 1)
        with torch.no_grad():
            self.a1.weight.copy_(torch.tensor(slopes, dtype=torch.float32))

    def forward(self, x):
        return self.c3(self.a2(self.c2(self.pool(self.a1(self.c1(x))))))


def _assert_equals_pytorch(model, path: str) -> None:
    """onnxruntime (all fusions on) computes PyTorch's fake-quant output on a fresh input: exact rewrites only, what
    is left is float summation order in the convs (no quantizer reads c3's output)."""
    x = 2 * torch.randn(8, 4, 21, 21, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(x).numpy()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max() + 1e-5


@pytest.mark.parametrize("negative,narrow", [(False, False), (True, False), (False, True)])
def test_export_pools_before_prelu_and_equals_pytorch(tmp_path, negative, narrow):
    """``narrow``: narrow-range input quantizers (QuantizerConfig's default, so QuantCallback's), exported with an
    integer Max after each QuantizeLinear that the pool moves above too."""
    torch.manual_seed(0)
    slopes = [0.1, 0.2, 0.25, 0.3, 0.05, 0.4, 0.15, -0.2 if negative else 0.35]
    model = PNetShape(slopes)
    # pytorch-quantization's symmetric grids: the pool's quantizer and the next conv's have one grid under max
    # calibration, so the pool may move above both (an asymmetric recipe's differ after a pool: see the test below)
    quantize_model(model, **({"quant_desc_input": QuantizerConfig().to_descriptor()} if narrow else
                             {"quant_desc_input": QuantDescriptor()}))
    model.eval()
    calib = [2 * torch.randn(8, 4, 21, 21, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    with torch.no_grad():
        calibrate_model(model, calib, method="max")
    res = export_onnx(model, calib[0], str(tmp_path / "p.onnx"), speed_check=False)
    g = onnx.load(res.path).graph
    prod = {o: n for n in g.node for o in n.output}
    (pool,) = [n for n in g.node if n.op_type == "MaxPool"]
    ops = [n.op_type for n in g.node]
    assert ("Max" in ops) == narrow, ops
    if negative:  # the pool reads the quantized PReLU output, as PyTorch computes it
        assert prod[pool.input[0]].op_type != "Conv" and ops.index("PRelu") < ops.index("MaxPool"), ops
    else:  # it reads the conv: the first PReLU and the quantizer run on the pooled tensor
        assert prod[pool.input[0]].op_type == "Conv" and ops.index("MaxPool") < ops.index("PRelu"), ops
    _assert_equals_pytorch(model, res.path)


def test_the_default_recipe_puts_a_pool_and_its_reader_on_one_grid_so_the_pool_moves(tmp_path):
    """The default (asymmetric) recipe would calibrate the pool's input quantizer and the next conv's apart (the pool
    raises the minimum); the pool takes its reader's quantizer instead (lq.glue._pool_grid, onnxruntime's own rule
    for MaxPool), so the pool moves above the PReLU exactly (O-Net-style bench net: 1.63x FP32 with the move, 0.87x
    without it)."""
    torch.manual_seed(0)
    model = PNetShape([0.1, 0.2, 0.25, 0.3, 0.05, 0.4, 0.15, 0.35])
    quantize_model(model)  # int8_onnxruntime
    assert model.pool._input_quantizer is model.c2._input_quantizer
    assert model.pool._input_quantizer.asymmetric
    model.eval()
    calib = [2 * torch.randn(8, 4, 21, 21, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    with torch.no_grad():
        calibrate_model(model, calib, method="max")
    res = export_onnx(model, calib[0], str(tmp_path / "p.onnx"), speed_check=False)
    ops = [n.op_type for n in onnx.load(res.path).graph.node]
    assert ops.index("MaxPool") < ops.index("PRelu"), ops
    # the recipe also quantizes c1's output (lq.glue._rules.SLOPED), so c1 runs as QLinearConv with its bias rounded
    # to int32 (half a step of s_x * s_w at most): 0.1% of its outputs land one step apart from PyTorch's, which
    # the export's verification measures in output steps; none may be further off than that
    assert res.verified and all(c.beyond_2 == 0 for c in res.output_checks), res.verdict
    # the shared quantizer saves and loads under both names
    again = PNetShape([0.1, 0.2, 0.25, 0.3, 0.05, 0.4, 0.15, 0.35])
    quantize_model(again)
    again.load_state_dict(model.state_dict())
    x = calib[1][:2]
    with torch.no_grad():
        assert torch.equal(again.eval()(x), model(x))


def test_the_pool_stays_between_two_quantizers_on_different_grids(tmp_path):
    """Grids that differ after the pool (set apart here by hand; any recipe whose two quantizers calibrate apart):
    moved above both, their Q -> DQ -> Q -> DQ would sit side by side, and onnxruntime merges such a pair into one
    rounding (DoubleQDQPairsRemover) where PyTorch rounds twice: 99.6% of a LeakyReLU net's outputs moved by up to
    2% of the range. The pool stays, and the file is exact."""
    torch.manual_seed(0)
    model = PNetShape([0.1, 0.2, 0.25, 0.3, 0.05, 0.4, 0.15, 0.35])
    quantize_model(model, quant_desc_input=QuantDescriptor())
    model.eval()
    calib = [2 * torch.randn(8, 4, 21, 21, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    with torch.no_grad():
        calibrate_model(model, calib, method="max")
        model.c2._input_quantizer.amax = 0.8 * float(model.c2._input_quantizer.amax)
    res = export_onnx(model, calib[0], str(tmp_path / "p.onnx"), speed_check=False)
    ops = [n.op_type for n in onnx.load(res.path).graph.node]
    assert ops.index("PRelu") < ops.index("MaxPool"), ops
    _assert_equals_pytorch(model, res.path)


class CrepeShape(nn.Module):
    """CREPE's blocks: conv1d -> ReLU -> BatchNorm -> MaxPool1d; the first conv reads one channel through 128 taps."""

    def __init__(self):
        super().__init__()
        block = lambda i, o, k, s: nn.Sequential(nn.Conv1d(i, o, k, s, padding=(k - s) // 2), nn.ReLU(),  # noqa: E731
                                                 nn.BatchNorm1d(o), nn.MaxPool1d(2))
        self.layers = nn.Sequential(block(1, 32, 128, 4), block(32, 16, 16, 1))
        self.head = nn.Linear(16 * 48, 10)

    def forward(self, x):
        return self.head(self.layers(x).flatten(1))


def test_a_pool_after_relu_and_batchnorm_reads_the_conv_integers(tmp_path):
    """The callback's default recipe on CREPE's blocks: every pool moves in front of its BatchNorm (positive scales)
    and onnxruntime runs it as NhwcMaxPool on the conv's uint8 output, not its NCHW uint8 pool on the requantized
    BatchNorm output (bench.library's CREPE-style net at batch 32: 3.38 -> 1.22 ms); the one-channel 128-tap stem
    runs as QLinearConv (lq.rules.onnxruntime.ORT_INT8_CONV_MIN_REDUCTION); the file equals PyTorch (verified)."""
    from lq.export import optimized_op_counts

    torch.manual_seed(0)
    model = CrepeShape().train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(16, 1, 784))
    model.eval()
    quantize_model(model)
    calib = [torch.randn(16, 1, 784, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    with torch.no_grad():
        calibrate_model(model, calib)
    res = export_onnx(model, calib[0], str(tmp_path / "c.onnx"), speed_check=False)  # verified against PyTorch inside
    ops = [n.op_type for n in onnx.load(res.path).graph.node]
    assert [o for o in ops if o in ("MaxPool", "BatchNormalization")] == ["MaxPool", "BatchNormalization"] * 2, ops
    counts = optimized_op_counts(res.path)
    assert counts.get("NhwcMaxPool") == 2 and "MaxPool" not in counts, counts
    kernels = {k.layer: k.kernel for k in res.layer_kernels if k.op == "Conv"}
    assert kernels == {"layers.0.0": "QLinearConv", "layers.1.0": "QLinearConv"}, kernels


class _DropoutEndedBlocks(nn.Module):
    """A 1-D audio CNN's blocks: conv -> ReLU -> BN -> max pool -> dropout, each an nn.Sequential, so the pool does
    not end its block and its reader begins the next one."""

    def __init__(self):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv1d(i, o, 3, padding=1), nn.ReLU(), nn.BatchNorm1d(o), nn.MaxPool1d(2),
                                 nn.Dropout(0.1))

        self.layers = nn.Sequential(block(1, 4), block(4, 4))
        self.head = nn.Linear(4 * 4, 3)

    def forward(self, x):
        return self.head(self.layers(x).flatten(1))


class _PoolThenStage(nn.Module):
    """torchvision's ResNet stem: the pool called in the model's forward, its reader ``layer1.0.conv1`` inside a block
    inside an nn.Sequential."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.conv2(torch.relu(self.conv1(x))) + x)

    def __init__(self):
        super().__init__()
        self.conv1, self.relu, self.maxpool = nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(self.Block(), self.Block())
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x = self.layer1(self.maxpool(self.relu(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("with_sample", [True, False])
@pytest.mark.parametrize("make,sample,pairs", [
    (_DropoutEndedBlocks, (2, 1, 16), [("layers.0.3", "layers.1.0"), ("layers.1.3", "head")]),
    (_PoolThenStage, (2, 3, 16, 16), [("maxpool", "layer1.0.conv1")]),
])
def test_a_pool_takes_its_readers_grid_with_or_without_a_sample(make, sample, pairs, with_sample):
    """The pool and its reader are found on one walk of the joined forwards (lq.glue._pool_grid): captured from the
    sample, or without one traced per module by torch.fx with each nn.Sequential as the chain of its children."""
    model = make().eval()
    quantize_model(model, sample=torch.randn(*sample) if with_sample else None)
    for pool, reader in pairs:
        p, r = model.get_submodule(pool), model.get_submodule(reader)
        assert p._input_quantizer is r._input_quantizer, (pool, reader)
