"""Stage 5: run the file in its runtime (onnxruntime; OpenVINO for ``target="openvino"``) on the prepared inputs and judge it against PyTorch's fake-quant outputs.

The verdict is in output quantization steps (:mod:`lq.export.verify._verify`); where an output is beyond the fixed
bound, the model's own rounding noise is measured (:mod:`lq.export.verify._rounding_noise`) and allowed. Where a
classifier's top-1 class differs on a row of a small sample, new rows mixed from the sample's are judged too
(:func:`lq.export.prepare._inputs.perturbed`), so the verdict rests on at least ``TOP1_MIN_ROWS`` rows and never on
one row. A user's
``tolerance``/``rtol`` replaces the verdict by a bound on ``max|diff|`` (the step numbers are still reported).
A file that fails is saved next to ``path`` as ``*.unverified.onnx``; ``path`` is not written.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import torch

from lq.config import ExportConfig
from lq.export._files import save_unverified, short, unverified_path
from lq.export._ir import ExportError, VerificationError
from lq.export.prepare import _model_checks
from lq.export.prepare import _prepare
from lq.export.prepare._prepare import Prepared
from lq.export.prepare import _inputs
from lq.export.verify import _rounding_noise, _verify


#: at most this many rounding-level copies of the sample are run for the top-1 verdict (TOP1_MIN_ROWS rows)
MAX_EXTRA_CASES = 16


@dataclasses.dataclass
class Verified:
    max_abs_diff: float
    tolerance: float | None  # the user's bound (atol + rtol * max|output|), None when judged in steps
    checks: list  # OutputCheck per output
    verdict: str  # the checks in one line


def verify(proto: onnx.ModelProto, data: bytes, prep: Prepared, cfg: ExportConfig, providers: list, unrolled: list,
           one_thread: bool) -> Verified:
    """Raise :class:`VerificationError` (or ExportError when onnxruntime cannot run the file) unless the file
    computes what the PyTorch model does. ``data``: ``proto`` serialized (what runs). ``one_thread``: onnxruntime's DynamicQuantizeLSTM quantizes per
    thread's share of the batch, so it is verified on one thread."""
    path = cfg.path
    runtime = _verify.runtime_name(providers)  # onnxruntime, or OpenVINO for target="openvino"
    steps = _verify.output_steps(proto)
    by_output: dict[int, _verify.OutputCheck] = {}
    sess = None
    cases = list(prep.cases)
    extremes = [0.0, 0.0]  # max |onnxruntime - PyTorch|, max |PyTorch|

    def check(inputs, refs):
        nonlocal sess
        feeds = [a.numpy() for a in inputs if isinstance(a, torch.Tensor)]
        bad_in = _verify.nonfinite_report(feeds, prep.input_names)
        bad_ref = _verify.nonfinite_report(refs, prep.output_names)
        if bad_in or bad_ref:
            save_unverified(proto, path)
            raise VerificationError(
                "cannot verify the export: "
                + (f"the sample input holds NaN/Inf ({bad_in})" if bad_in else
                   f"the PyTorch model's own output holds NaN/Inf on the sample ({bad_ref}): the trained "
                   "weights or an amax are not finite")
                + f". The file was saved as {unverified_path(path)}; {path} was not written.")
        try:
            if sess is None:
                sess = _verify.make_session(data, providers, graph_optimization_level=_verify.verify_level(cfg.target),
                                            intra_op_num_threads=1 if one_thread else None)
            ort_out = _verify.run(sess, feeds)
        except Exception as e:
            save_unverified(proto, path)
            shape = [tuple(a.shape) for a in inputs if isinstance(a, torch.Tensor)]
            fixed = unrolled if inputs is not prep.args else []  # a grown input failed: say what fixes its size
            raise ExportError(f"{runtime} could not run the exported model on input shape(s) {shape}: "
                              f"{short(e)} (saved as {unverified_path(path)} for inspection)"
                              + (f". The sequence length is fixed in the file: {'; '.join(fixed)}" if fixed
                                 else "")) from e
        bad_ort = _verify.nonfinite_report(ort_out, prep.output_names)
        if bad_ort:
            save_unverified(proto, path)
            raise VerificationError(f"{runtime}'s output holds NaN/Inf where PyTorch's is finite ({bad_ort}). "
                                    f"The file was saved as {unverified_path(path)}; {path} was not written.")
        extremes[0] = max(extremes[0], _verify.max_abs_diff(ort_out, refs))
        extremes[1] = max([extremes[1]] + [float(np.abs(r).max()) for r in refs if r.size])
        for i, (out, o, r) in enumerate(zip(proto.graph.output, ort_out, refs)):
            by_output[i] = _verify.compare_output(out.name, o, r, steps[i], by_output.get(i))

    for inputs, refs in cases:
        check(inputs, refs)
    judged = cfg.tolerance is None and not cfg.rtol
    missing = _verify.needs_rows(list(by_output.values())) if judged else 0
    if missing:  # a class differs on a few rows of a small sample: judge on more rows (mixed from the sample's)
        per_case = max(1, sum(c.rows for c in by_output.values() if c.rows) // max(1, len(cases)))
        for k in range(min(-(-missing // per_case), MAX_EXTRA_CASES)):
            inputs = _inputs.perturbed(prep.args, seed=k + 1, dims=prep.dims)
            if all(a is b for a, b in zip(inputs, prep.args)):
                break  # no float input to move
            extra = (inputs, _prepare.outputs(prep.work, inputs))
            check(*extra)
            cases.append(extra)
    max_diff, ref_max = extremes
    checks = list(by_output.values())
    tol = None
    if cfg.tolerance is None and not cfg.rtol:  # judged in output steps (see _verify: FAR_STEPS, ...)
        if _verify.needs_noise(checks):  # beyond the fixed count: is that this model's own rounding noise?
            measure_rounding_noise(prep.work, cases, checks)
        failed = _verify.step_verdict(checks)
    else:  # the user's bound on max|diff| wins; the step numbers are still reported
        tol = (cfg.tolerance or 0.0) + cfg.rtol * ref_max
        failed = "" if max_diff <= tol else (
            f"max abs diff {max_diff:.4g} is more than the tolerance {tol:.4g} "
            f"(atol={cfg.tolerance}, rtol={cfg.rtol}, max|output|={ref_max:.4g})")
    verdict = "; ".join(c.text() for c in checks)
    if failed:
        save_unverified(proto, path)
        raise VerificationError(
            f"{runtime}'s output is not the PyTorch fake-quant output: {failed}.\nMeasured: {verdict}. The "
            f"model was saved as {unverified_path(path)}; {path} was not written")
    return Verified(max_abs_diff=max_diff, tolerance=tol, checks=checks, verdict=verdict)


def measure_rounding_noise(work, cases, checks) -> None:
    """Add to ``checks`` how far PyTorch's own output moves under rounding-level noise (see
    :mod:`lq.export.verify._rounding_noise`) on the verification inputs."""
    def run(inputs):
        return lambda m: [o.detach().float().numpy() for o in _inputs.flatten_out(m(*inputs))]

    for seed, (inputs, refs) in enumerate(cases):
        with _model_checks.export_mode(work):
            noisy = _rounding_noise.noisy_outputs(work, run(inputs), seed)
        if noisy is None:
            return
        for c, n, r in zip(checks, noisy, refs):
            if c.step > 0:
                _verify.add_noise(c, n, r)
