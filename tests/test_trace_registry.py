"""The current exporter with lq's registry built once per opset (lq.export.trace._torch_onnx) writes the very graph
``torch.onnx.export(dynamo=True, custom_translation_table=...)`` writes, static and with named dynamic axes.

Reference: torch.onnx.export itself (the cached path turned off for the call).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from bench import styles
from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.export.prepare._model_checks import export_mode
from lq.export.trace import _torch_onnx

pytest.importorskip("onnxscript")


@pytest.mark.parametrize("dims", [{}, {0: "batch"}], ids=["static", "dynamic_batch"])
def test_the_cached_registry_writes_torch_onnx_exports_own_graph(monkeypatch, dims):
    assert _torch_onnx._core_export() is not None  # this torch has the function: the cached path is what runs
    torch.manual_seed(0)
    model = styles.build("transformer", "d").eval()
    x = torch.randn(4, *styles.ZOO["transformer"][0])
    quantize_model(model, sample=x)
    calibrate_model(model, [x], method="max", progress=False)
    with warnings.catch_warnings(), torch.no_grad(), export_mode(model):
        warnings.simplefilter("ignore")
        cached = [_torch_onnx.export_dynamo(model, (x,), 18, ["x"], ["y"], [dims]) for _ in range(2)]
        monkeypatch.setattr(_torch_onnx, "_core_export", lambda: None)
        public = _torch_onnx.export_dynamo(model, (x,), 18, ["x"], ["y"], [dims])
    for a in cached:  # the second call reuses the registry the first one built
        assert a.graph.SerializeToString() == public.graph.SerializeToString()
    assert any(n.domain == "lq.export" for n in public.graph.node)
    if dims:
        assert public.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "batch"
