"""What an export produced (:class:`ExportResult`) and the error raised when onnxruntime disagrees with PyTorch.

Kept apart from the pipeline in :mod:`lq.export._export` so that callers and the callbacks can read the result
without the exporter's machinery.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from lq.export.timing import _timing
from lq.export.timing._fallback import Fallback

from lq.export.verify import _verify
from lq.export.passes._fold_bn import FoldRecord
from lq.export._ir import ExportError, QuantNodeInfo, VerificationError  # noqa: F401  (public here too)
from lq.export.report._kernel_report import LayerKernel


@dataclasses.dataclass
class ExportResult:
    """What :func:`export_onnx` produced.

    Attributes:
        path: the ONNX file.
        opset: its default-domain opset.
        exporter: "dynamo" or "legacy".
        max_abs_diff: max |onnxruntime - PyTorch fake-quant| on the sample (None when not verified).
        tolerance: the bound on ``max_abs_diff`` the user set (``atol + rtol * max|PyTorch output|``); None when
            none was set and the file was judged in output steps (``output_checks``).
        output_checks: per output, what verification measured (:class:`lq.export.verify._verify.OutputCheck`): its
            quantization step, how many elements are more than 1, 2 and 6 steps from PyTorch's, the largest
            difference in steps, and for (batch, classes) logits the rows whose top-1 class differs. Empty when
            not verified.
        verdict: those numbers in one line (None when not verified).
        providers: onnxruntime execution providers used for verification (``["OpenVINO CPU"]``: OpenVINO's CPU
            plugin, for ``target="openvino"``).
        file_size: bytes of the ONNX file.
        quantized: every quantized tensor (layer, weight/activation, dtype, axis, scale).
        folded_bn: BatchNorm layers folded (and those that could not be, with the reason).
        ort_ops: op types of the graph onnxruntime runs after its optimizations (fusion check).
        qdq_nodes: number of QuantizeLinear / DequantizeLinear nodes in the saved graph.
        warnings: anything worth knowing (fusions that could not happen, clipped weights ...).
        uint8_weights: layers whose int8 weights were stored as uint8 with zero point 128 (the same values) because
            onnxruntime's u8 x s8 kernels could saturate int16 on them on CPUs without VNNI (see ``_int16``).
        export_seconds: wall time of the export (PyTorch -> ONNX -> rewrites), without verification.
        layer_kernels: for every quantized conv/gemm/matmul (and quantized join or pool), the kernel onnxruntime
            runs and, when it is float, why (target onnxruntime with ``check_fusion``).
        speedup: ``speed_check.ratio`` (None when not measured).
        speed_check: the INT8 file timed against the plain FP32 export of the same model (``torch.onnx.export`` of
            the float model; the FP32 twin of the graph only where that export fails, said in ``warnings``) in
            onnxruntime, 1 thread, at ``speed_batch`` or the sample's batch, in interleaved rounds
            (:class:`lq.export.timing._timing.SpeedCheck`): ``ratio = fp32_ms / int8_ms``, those two the median times, the
            per-round ratios' quartiles, and whether the rounds disagree (``noisy``, ``noise``). None when not
            measured (verify and check_fusion for onnxruntime only). Below 1 a warning says so in those terms and
            names the layers that run in float.
        fallback: where the first file was slower than FP32, what the measured fallback tried and kept
            (:class:`lq.export.timing._fallback.Fallback`; None when it did not run). When it kept a file,
            ``float_fallback`` names the layers that file runs in float, and the file (verified so) computes the
            model with those layers' quantizers off.
    """

    path: str
    opset: int
    exporter: str
    max_abs_diff: float | None
    tolerance: float | None
    providers: list[str]
    file_size: int
    quantized: list[QuantNodeInfo]
    folded_bn: list[FoldRecord]
    ort_ops: Counter
    qdq_nodes: dict[str, int]
    input_names: list[str]
    output_names: list[str]
    warnings: list[str] = dataclasses.field(default_factory=list)
    export_seconds: float = 0.0
    uint8_weights: list[str] = dataclasses.field(default_factory=list)
    layer_kernels: list[LayerKernel] = dataclasses.field(default_factory=list)
    speedup: float | None = None
    speed_check: _timing.SpeedCheck | None = None
    output_checks: list[_verify.OutputCheck] = dataclasses.field(default_factory=list)
    verdict: str | None = None
    fallback: Fallback | None = None
    #: where ``speed_check`` ran at a larger batch the user did not name (the sample's) and the batch axis is dynamic:
    #: the saved file timed at batch 1 against the same FP32 file (None: not timed)
    batch1_check: _timing.SpeedCheck | None = None
    #: where the file was clearly slower than FP32 at batch 1, the fallback's search there, keeping only what is not
    #: slower at ``speed_check``'s batch (None: it did not run)
    batch1_fallback: Fallback | None = None
    #: seconds per stage of the export (prepare, trace, rewrite, verify, report, fp32 reference, speed check,
    #: fallback), in the order they ran
    stage_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def float_fallback(self) -> list[str]:
        """The layers the measured fallback sent back to float in the file (empty when it kept none): the batch-1
        search's where it kept some (they include the first search's), else the first search's."""
        record = self.fallback_kept
        return list(record.layers) if record is not None else []

    @property
    def fallback_kept(self) -> Fallback | None:
        """The search whose file was saved: the batch-1 search's where it kept one, else the first search's (None:
        neither kept one)."""
        return next((r for r in (self.batch1_fallback, self.fallback) if r is not None and r.layers), None)

    @property
    def verified(self) -> bool:
        """Verification ran and the file passed it (:func:`export_onnx` raises when it does not)."""
        return self.max_abs_diff is not None

    def judge(self, got: list, want: list) -> str:
        """``""`` when onnxruntime's outputs ``got`` (on another input, CPU or session) agree with PyTorch's
        ``want`` as verification requires, else why not: the same rule and output steps as the export's own
        check (the user's tolerance when one was set), for tests and for checking a deployment. ``got`` and
        ``want`` are the file's first outputs, in order."""
        if self.tolerance is not None:
            d = _verify.max_abs_diff(got, want)
            return "" if d <= self.tolerance else (
                f"max abs diff {d:.4g} is more than the tolerance {self.tolerance:.4g}")
        if not self.output_checks or len(got) > len(self.output_checks) or len(want) != len(got):
            raise ValueError(f"the file has {len(self.output_checks)} verified output(s), got {len(got)} and "
                             f"{len(want)} to judge")
        checks = [_verify.compare_output(c.name, g, w, c.step if c.from_graph else 0.0)
                  for c, g, w in zip(self.output_checks, got, want)]
        for new, old in zip(checks, self.output_checks):  # the model's own rounding noise, as the export measured it
            new.noise_elements, new.noise_far = old.noise_elements, old.noise_far
            new.noise_rows, new.noise_top1_differ = old.noise_rows, old.noise_top1_differ
        return _verify.step_verdict(checks)

    def kernel_of(self, layer: str) -> str | None:
        """What onnxruntime runs for ``layer`` (e.g. ``QLinearConv``, or ``Conv (float: <why>)``), None if unknown."""
        texts = [k.text() for k in self.layer_kernels if k.layer == layer]
        if not texts and layer in self.float_fallback:
            return "float (sent back to float after timing)"
        return ", ".join(dict.fromkeys(texts)) if texts else None

    @property
    def quantized_layers(self) -> list[str]:
        return sorted({q.layer for q in self.quantized})

    @property
    def runtime(self) -> str:
        """The runtime the file was verified and timed in: ``onnxruntime``, or ``OpenVINO`` (``target="openvino"``)."""
        return _verify.runtime_name(self.providers)

    @property
    def int8_kernels(self) -> dict[str, int]:
        """onnxruntime integer kernels in the optimized graph (QLinearConv, QLinearMatMul, QLinearAdd, QGemm ...)."""
        return {k: v for k, v in self.ort_ops.items() if k in _verify.INT8_KERNELS}

    def summary(self) -> str:
        lines = [f"ONNX export: {self.path} ({self.file_size / 1024:.1f} KiB, opset {self.opset}, {self.exporter})"]
        if self.max_abs_diff is not None:
            bound = f"tolerance {self.tolerance:.3g}" if self.tolerance is not None else "judged in output steps"
            lines.append(f"  {self.runtime} vs PyTorch fake-quant: max abs diff {self.max_abs_diff:.3g} "
                         f"({bound}, providers {', '.join(self.providers)})")
            lines.extend(f"    {c.text()}" for c in self.output_checks)
        lines.append(f"  Q/DQ nodes: {self.qdq_nodes}; quantized tensors: {len(self.quantized)}")
        folded = [f.bn for f in self.folded_bn if f.skipped is None]
        if folded:
            lines.append(f"  BatchNorm folded: {', '.join(folded)}")
        if self.int8_kernels:
            lines.append("  onnxruntime INT8 kernels: " + ", ".join(f"{k} x{v}" for k, v in self.int8_kernels.items()))
        if self.layer_kernels:
            n_int = sum(k.integer for k in self.layer_kernels)
            lines.append(f"  layers on integer kernels: {n_int} of {len(self.layer_kernels)}")
        if self.speed_check is not None:
            lines.append(f"  speed: {self.speed_check}")
        if self.batch1_check is not None:
            lines.append(f"  speed at batch 1: {self.batch1_check}")
        if self.stage_seconds:
            lines.append("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in self.stage_seconds.items()))
        record = self.fallback_kept
        if record is not None:
            lines.append(f"  sent back to float after timing ({record.before.ratio:.2f}x -> {record.after.ratio:.2f}x"
                         f"{f' at batch {record.after.batch}' if record.after.batch is not None else ''}): "
                         f"{', '.join(self.float_fallback)}")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)

    __str__ = summary
