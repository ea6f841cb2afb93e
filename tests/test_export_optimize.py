"""lq's run of the current exporter's graph optimizer (lq.export.trace._optimize): onnxscript's own passes and rewrite
table, minus the rewrites whose pattern ends in more than one node (``SlicesSplit``, whose matching grows with the
square of the graph).

Reference: onnxscript's own optimizer, what ``torch.onnx.export(dynamo=True, optimize=True)`` runs, on the same
unoptimized graph; onnxruntime's outputs against PyTorch's.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest
import torch
from torch import nn

onnxscript = pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

from lq.export.trace import _optimize  # noqa: E402


class GatedConv(nn.Module):
    """conv -> BatchNorm, its channels split in two halves by slicing (a GLU), a Linear head: two Slices of one
    tensor beside patterns the one-node rewrites do change (BatchNorm into the conv)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        y = self.bn(self.conv(x))
        g = y[:, 0:4] * torch.sigmoid(y[:, 4:8])
        return self.head(g.mean((2, 3)))


def _unoptimized(model, x):
    import onnx_ir as ir

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(model, (x,), dynamo=True, optimize=False, input_names=["x"], output_names=["y"])
    proto = prog.model_proto
    return lambda: ir.serde.deserialize_model(proto)


def _ops(model):
    return collections.Counter(n.op_type for n in model.graph)


def _run(model, x):
    import onnx_ir as ir

    s = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x.numpy()})[0]


def test_the_rules_are_the_exporters_table_without_its_multi_node_patterns():
    from onnxscript import rewriter

    table = list(rewriter._DEFAULT_REWRITE_RULES)
    ours = _optimize.single_output_rules()
    assert ours and all(any(r is t for t in table) for r in ours)
    left_out = [t for t in table if not any(t is r for r in ours)]
    assert left_out, "onnxscript's table has no multi-node pattern any more: its own optimizer would do"
    assert all(len(t._target_pattern.output_nodes) > 1 for t in left_out)
    assert all(len(r._target_pattern.output_nodes) == 1 for r in ours)
    assert "SlicesSplit" in [str(t) for t in left_out]


def _transformer_layer():
    return nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=True)


@pytest.mark.parametrize("build,shape", [(GatedConv, (2, 3, 8, 8)), (_transformer_layer, (2, 6, 16))],
                         ids=["gated_conv", "transformer_layer"])
def test_the_graph_is_the_exporters_own(build, shape):
    """The left-out rewrite only joins two Slices of halves of the last axis written without steps, which
    torch's exporter does not write: on its graphs lq's run gives the very graph the exporter's optimizer gives."""
    import onnx_ir as ir
    from onnxscript._framework_apis import torch_2_8

    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        x = torch.randn(*shape)
        want = model(x).numpy()
    fresh = _unoptimized(model, x)
    stock, ours = fresh(), fresh()
    torch_2_8.optimize(stock)
    assert _optimize.optimize_model(ours)
    assert len(list(ours.graph)) < len(list(fresh().graph))  # it did optimize (constants folded, BatchNorm into conv)
    assert ir.serde.serialize_model(ours).graph.SerializeToString() == \
        ir.serde.serialize_model(stock).graph.SerializeToString()
    np.testing.assert_allclose(_run(ours, x), want, rtol=1e-4, atol=1e-5)


def test_without_the_table_the_exporters_own_optimizer_runs(monkeypatch):
    class Program:
        model = object()
        optimized = False

        def optimize(self):
            self.optimized = True

    monkeypatch.setattr(_optimize, "single_output_rules", lambda: None)
    p = Program()
    _optimize.optimize(p)
    assert p.optimized
