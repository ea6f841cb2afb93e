"""One architecture, however it is written, gets the same kernels (issue 39).

``bench.styles`` writes eight architectures in three or four styles each (``nn.Sequential`` blocks, functions in
helper methods, forwards torch.fx cannot trace, a layer's weight passed to a function) that compute the same
function. lq places its quantizers on one capture of the whole model, so every style must give the same kernels in
onnxruntime's graph (its integer kernels, float convs and gemms, pools and layout changes), and every conv/linear
must run as an integer kernel unless the rules table says onnxruntime runs it faster in float. The reference for both is the model itself: the number of its conv/linear
layers (the same in every style), and the other styles' files."""

from __future__ import annotations

import onnx
import pytest
import torch

from bench import styles as S

pytest.importorskip("onnxruntime")


#: the float kernels and layout changes compared across styles, beside onnxruntime's integer kernels. Not compared:
#: reshapes and shape arithmetic (the legacy exporter writes ``x.shape`` code as Shape/Gather/Concat), Q/DQ counts
#: (a chain of two-way concatenations and one n-way concatenation of the same tensors are both a DenseNet)
KERNELS = ("Conv", "FusedConv", "NhwcFusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul", "MaxPool",
           "NhwcMaxPool", "AveragePool", "GlobalAveragePool", "Transpose", "ReorderInput", "ReorderOutput", "Resize",
           "Expand")


def _sample(arch: str, n: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, *S.ZOO[arch][0], generator=g)


@pytest.mark.parametrize("arch", list(S.ZOO))
def test_the_styles_compute_the_same_function(arch):
    x = _sample(arch, 4)
    with torch.no_grad():
        ref = S.build(arch, "a")(x)
        for style in S.ZOO[arch][1]:
            torch.testing.assert_close(S.build(arch, style)(x), ref, rtol=0, atol=1e-5)


def _layers(model: torch.nn.Module) -> int:
    return sum(isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)) for m in model.modules())


def _apart(model: torch.nn.Module) -> None:
    """Move every quantizer's range by a different small amount: two quantizers on one tensor then never agree
    by coincidence (max calibration of one tensor gives equal scales, and the export merges equal Q/DQ), so a
    tensor placed on two grids shows as a conv exported twice. A shared quantizer moves once."""
    from lq.nn.modules.tensor_quantizer import TensorQuantizer

    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, TensorQuantizer) and id(m) not in seen and m.amax is not None:
            seen.add(id(m))
            m.amax = m.amax * (1 - 0.003 * (len(seen) % 50))




@pytest.mark.parametrize("arch", list(S.ZOO))
def test_every_style_gets_the_same_integer_kernels(arch, tmp_path):
    from bench.library import INT_CONV_GEMM
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model
    from lq.export import INT8_KERNELS, export_onnx, optimized_op_counts

    x = _sample(arch)
    found = {}
    for style in S.ZOO[arch][1]:
        model = S.build(arch, style)
        layers = _layers(model)
        summary = quantize_model(model, sample=x[:4])
        assert not [n for n in summary.notes if "torch.fx" in n], summary.notes  # placed on the capture
        calibrate_model(model, [x[:16], x[16:]], method="max")
        _apart(model)
        path = str(tmp_path / f"{style}.onnx")
        # the legacy exporter: the same kernels as the current one (tests/test_capture.py exports with both), in a
        # tenth of the time; not for the U-Net, whose style c resizes to ``skip.shape[-2:]``, which the legacy
        # exporter writes as shape arithmetic the export cannot read a whole factor from (a Resize, not an Expand)
        res = export_onnx(model, x[:8], path, fallback_seconds=0, speed_check=False, dynamo=arch == "unet")
        assert res.verified, res.verdict
        copies = [n.name for n in onnx.load(path).graph.node if n.name.endswith("_copy")]
        assert not copies, f"{arch} style {style}: a tensor on two grids, its producer exported twice: {copies}"
        compute = [k for k in res.layer_kernels if k.op in ("Conv", "Gemm", "MatMul")]  # what onnxruntime runs
        bad = [k.text() for k in compute if not k.integer and not k.by_choice]
        assert not bad, f"{arch} style {style}: conv/gemm float for want of a quantizer: {bad}"
        integer, chosen = sum(k.integer for k in compute), sum(k.by_choice for k in compute)
        assert integer + chosen >= layers, (arch, style, integer, chosen, layers)
        ops = optimized_op_counts(path)  # the same counts in onnxruntime's graph, independent of the report
        assert sum(ops.get(k, 0) for k in INT_CONV_GEMM) == integer, (ops, integer)
        # the compute kernels and the layout changes onnxruntime runs (one style's max pool in float between two
        # grids showed only here: MaxPool with Reorder/Transpose around it instead of NhwcMaxPool)
        found[style] = sorted((k, v) for k, v in ops.items() if k in KERNELS or k in INT8_KERNELS)
        assert found[style] == found["a"], f"{arch}: style {style} runs {found[style]}, style a {found['a']}"
