"""One tensor, one quantizer, whichever forwards read it (lq.glue._one_tensor, issue 39).

The reference is the model's own dataflow, counted by hand: which tensors each concat reads. Every quantizer that
reads one tensor must be one module, and quantizers of different tensors must stay apart."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

import lq
from lq.capture import capture
from lq.glue import whole_graph
from lq.glue._rewrite import CHILD

pytest.importorskip("onnxruntime")


class Layer(nn.Module):
    """torchvision's _DenseLayer: concatenates the list of earlier features it is passed."""

    def __init__(self, cin: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, 4, 3, padding=1)

    def forward(self, inputs):
        prev = [inputs] if isinstance(inputs, torch.Tensor) else inputs
        return torch.relu(self.conv(torch.cat(prev, 1)))


class Block(nn.ModuleDict):
    def __init__(self, cin: int, n: int = 3):
        super().__init__({f"layer{i}": Layer(cin + 4 * i) for i in range(n)})

    def forward(self, init):
        features = [init]
        for _, layer in self.items():
            features.append(layer(features))
        return torch.cat(features, 1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = Block(8)
        self.head = nn.Conv2d(20, 4, 1)

    def forward(self, x):
        return self.head(self.block(torch.relu(self.stem(x))))


def _cat_quantizers(model: nn.Module) -> dict[str, object]:
    """Every glue quantizer of a concat, by its path."""
    return {name: m for name, m in model.named_modules(remove_duplicate=False)
            if f".{CHILD}." in f".{name}" and "cat_" in name.rsplit(".", 1)[-1]}


def test_a_feature_concatenated_in_several_forwards_has_one_quantizer():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    model = Net().eval()
    lq.quantize_model(model, sample=x)
    cats = _cat_quantizers(model)
    # by hand: layer i concatenates the stem's output and layers 0..i-1's outputs (layer 0's one-tensor cat is a
    # copy, not quantized); the block concatenates all four features once more: 2 + 3 + 4 = 9 reads of 4 tensors
    assert len(cats) == 9, sorted(cats)
    distinct = {id(q) for q in cats.values()}
    assert len(distinct) == 4, sorted(cats)
    stem_reads = [q for name, q in cats.items() if name.endswith("_a")]  # the first operand of each concat
    assert len({id(q) for q in stem_reads}) == 1, sorted(cats)
    lq.calibrate_model(model, [x, torch.randn(4, 3, 8, 8)], method="max")
    assert all(q.amax is not None for q in cats.values())


def test_a_file_with_the_ranges_apart_runs_every_conv_integer(tmp_path):
    """Each quantizer moved by a different amount: a tensor that two quantizers read would take two grids, and its
    conv would be exported twice or stay float. One quantizer per tensor moves once."""
    from lq.export import export_onnx

    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8)
    model = Net().eval()
    lq.quantize_model(model, sample=x[:4])
    lq.calibrate_model(model, [x[:4], x[4:]], method="max")
    seen: dict[int, float] = {}
    for name, q in _cat_quantizers(model).items():
        if id(q) not in seen:
            seen[id(q)] = 1 - 0.01 * len(seen)
            q.amax = q.amax * seen[id(q)]
    res = export_onnx(model, x, str(tmp_path / "m.onnx"), fallback_seconds=0, speed_check=False, dynamo=False)
    assert res.verified, res.verdict
    # the dense layers' convs write the concatenated features (the stem is float by choice with 3 input channels,
    # the head writes the model's output)
    dense = [k for k in res.layer_kernels if k.op == "Conv" and k.layer.startswith("block.")]
    assert len(dense) == 3 and all(k.integer for k in dense), [k.text() for k in res.layer_kernels]


class Indexing(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return self.conv(x[:, :3])  # indexes a tensor argument: a new tensor of this forward


class Lists(nn.Module):
    def forward(self, xs):
        return xs[1] + 1


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.index, self.lists = Indexing(), Lists()

    def forward(self, x):
        y = self.index(x)
        return self.lists([x, y])


def test_origin_follows_list_elements_and_arguments_not_tensor_indexing():
    model = Outer().eval()
    cap = capture(model, (torch.randn(2, 4, 5, 5),))
    whole = whole_graph(model, cap)
    outer = {n.name: n for n in whole.graphs[id(model)].nodes}
    add = next(n for n in whole.graphs[id(model.lists)].nodes if n.target is operator.add)
    element = add.args[0]  # the capture's node for xs[1]
    assert element.op == "call_function" and element.args[1] == 1
    assert whole.origin(model.lists, element) == (model, outer["index"])  # xs[1] is y, made by self.index
    sliced = next(n for n in whole.graphs[id(model.index)].nodes if n.op == "call_function")
    assert whole.origin(model.index, sliced) == (model.index, sliced)  # x[:, :3] is made here
    (ph,) = whole.inputs(model.index)
    assert whole.origin(model.index, ph) == (model, next(n for n in outer.values() if n.op == "placeholder"))
