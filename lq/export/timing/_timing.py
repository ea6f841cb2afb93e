"""Time the INT8 file against an FP32 file in onnxruntime (or OpenVINO, for its target): one measurement, one
definition.

The export's speed check (and anything else that must know whether a file is faster than FP32) calls
:func:`compare`: both sessions take turns within every round (INT8 then FP32, then FP32 then INT8, ...),
so load from other processes hits both alike; each round runs each file often enough to be measurable.
One intra-op thread, as in ``bench.speed``: the ratio then says what the kernels do, not how well each
graph happens to parallelize on this machine.

The definition (:func:`summarize`): the ratio is the median FP32 time over the median INT8 time, and those two
medians are the times printed beside it, so the three numbers always agree. The per-round ratios (FP32 over
INT8 within one round) say how much to trust it: when their interquartile range crosses 1.0, is wider than
:data:`NOISE_FRACTION` of the ratio, or does not contain the ratio of the medians, the rounds disagree and the
check says the measurement is noisy.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Sequence

import numpy as np

from lq.export.verify import _verify
from lq.export.prepare._prepare import batch_size  # noqa: F401  (the sample's batch)

#: the reference a user compares an INT8 file with: ``torch.onnx.export`` of the float model
PLAIN = "the plain FP32 export of this model"
#: what the export falls back to where that export fails: the exported graph without its quantizers
TWIN = "the FP32 twin of the exported graph (its quantizers removed)"
#: per-round ratios whose interquartile range is wider than this fraction of the ratio make a noisy check
NOISE_FRACTION = 0.10


@dataclasses.dataclass(frozen=True)
class SpeedCheck:
    """The INT8 file timed against an FP32 file in onnxruntime (:func:`compare`).

    Attributes:
        ratio: ``fp32_ms / int8_ms`` (above 1: the INT8 file is faster).
        int8_ms, fp32_ms: median milliseconds per run of each file over the rounds.
        ratio_p25, ratio_p75: quartiles of the per-round ratios (FP32 over INT8 within one round).
        rounds: interleaved rounds measured; runs_per_round: runs of each file in one round.
        noisy: the rounds disagree (see :func:`summarize`); ``noise`` says how.
        batch: the batch size the files were timed at; threads: the runtime's intra-op threads.
        reference: what the FP32 file is (:data:`PLAIN`, or :data:`TWIN` and why).
        runtime: where both ran (``onnxruntime``; for ``target="openvino"`` OpenVINO's CPU plugin with the f32
            precision hint, so that its FP32 run is FP32 and not bf16).
    """

    ratio: float
    int8_ms: float
    fp32_ms: float
    ratio_p25: float
    ratio_p75: float
    rounds: int
    noisy: bool = False
    noise: str = ""
    runs_per_round: int = 1
    batch: int | None = None
    threads: int = 1
    reference: str = PLAIN
    runtime: str = "onnxruntime"  # where both files ran: onnxruntime, or OpenVINO (CPU plugin, f32 precision hint)

    @property
    def slower(self) -> bool:
        """The INT8 file is slower than the FP32 one (by the medians)."""
        return self.ratio < 1.0

    @property
    def clearly_slower(self) -> bool:
        """Slower by the medians and in at least three rounds of four (the per-round ratios' upper quartile below
        1.0): what starts the fallback. Rounds of 0.50-0.63x are slower however noisy their spread is; rounds on
        both sides of 1.0 are not."""
        return self.ratio < 1.0 and self.ratio_p75 < 1.0

    def details(self) -> str:
        """The numbers behind the ratio: ``INT8 2.30 ms vs FP32 2.00 ms at batch 8, 1 thread; ...``."""
        at = f" at batch {self.batch}" if self.batch is not None else ""
        return (f"INT8 {self.int8_ms:.3g} ms vs FP32 {self.fp32_ms:.3g} ms{at}, {self.threads} thread"
                f"{'s' if self.threads != 1 else ''}; medians of {self.rounds} interleaved rounds, per-round ratios "
                f"{self.ratio_p25:.2f}-{self.ratio_p75:.2f}x (interquartile)")

    def text(self) -> str:
        """One line: the ratio, against what, the numbers, and the noise statement when the rounds disagree."""
        return (f"{self.ratio:.2f}x the speed of {self.reference} in {self.runtime} ({self.details()})"
                + (f". Noisy: {self.noise}" if self.noisy else ""))

    __str__ = text


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) == 1:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def summarize(int8_s: Sequence[float], fp32_s: Sequence[float], *, runs_per_round: int = 1,
              batch: int | None = None, threads: int = 1, reference: str = PLAIN,
              runtime: str = "onnxruntime") -> SpeedCheck:
    """The speed check from per-round times (seconds per run of each file, paired by round).

    ``ratio = median(fp32) / median(int8)``, with those medians as ``fp32_ms`` and ``int8_ms``. Noisy when the
    interquartile range of the per-round ratios crosses 1.0 (the rounds do not agree on which file is
    faster), is wider than :data:`NOISE_FRACTION` of the ratio, or leaves out the ratio of the medians (by more
    than half that fraction: 1.31x beside rounds of 1.29-1.30x is the same measurement, 0.86x beside a
    1.72x ratio of medians is not).
    """
    if not int8_s or len(int8_s) != len(fp32_s):
        raise ValueError(f"need the same number (>= 1) of INT8 and FP32 rounds, got {len(int8_s)} and {len(fp32_s)}")
    if not all(t > 0 and math.isfinite(t) for t in (*int8_s, *fp32_s)):
        raise ValueError("round times must be finite and > 0")
    int8_ms, fp32_ms = 1e3 * statistics.median(int8_s), 1e3 * statistics.median(fp32_s)
    ratio = fp32_ms / int8_ms
    per_round = [f / q for q, f in zip(int8_s, fp32_s, strict=True)]
    p25, p75 = _quartiles(per_round)
    why = []
    if p25 < 1.0 < p75:
        why.append("the rounds do not agree on which file is faster (the per-round ratios' interquartile range "
                   "crosses 1.0)")
    if p75 - p25 > NOISE_FRACTION * ratio:
        why.append(f"the per-round ratios' interquartile range is wider than {NOISE_FRACTION:.0%} of the ratio")
    if not p25 * (1 - NOISE_FRACTION / 2) <= ratio <= p75 * (1 + NOISE_FRACTION / 2):  # beyond rounding of a few %
        why.append("the ratio of the median times lies outside the per-round ratios' interquartile range")
    noise = ""
    if why:
        noise = "; ".join(why) + " (other load on this machine?): time again on a quiet machine before trusting it"
    return SpeedCheck(ratio=ratio, int8_ms=int8_ms, fp32_ms=fp32_ms, ratio_p25=p25, ratio_p75=p75,
                      rounds=len(per_round), noisy=bool(why), noise=noise, runs_per_round=runs_per_round,
                      batch=batch, threads=threads, reference=reference, runtime=runtime)


def time_rounds(int8_model, fp32_model, feeds, providers=None, *, rounds: int = 11, min_rounds: int = 3,
                budget_s: float = 2.0, min_round_s: float = 0.025, threads: int = 1, below: float | None = None
                ) -> tuple[list[float], list[float], int]:
    """Seconds per run of each model over up to ``rounds`` interleaved rounds: ``(int8, fp32, runs per round)``.

    The models take turns within every round (the order alternating between rounds); a round runs each model
    ``n`` times, ``n`` chosen from the warm-up so that a round of the faster model lasts at least
    ``min_round_s``. Stops once ``budget_s`` seconds are spent and ``min_rounds`` are done, so a large model
    costs a bounded amount of time. ``below``: also stop once ``min_rounds`` are done and the rounds so far rule
    out a ratio (FP32 over INT8) above it, the fallback's sequential test (:func:`hopeless`).
    ``int8_model``/``fp32_model``: bytes, a path or an ``onnx.ModelProto``; ``feeds``: arrays in the models' input
    order.
    """
    sessions = [_verify.make_session(m if isinstance(m, (bytes, str)) else m.SerializeToString(), providers,
                                     intra_op_num_threads=threads) for m in (int8_model, fp32_model)]
    one = []
    for s in sessions:  # warm-up: the first runs allocate and pick kernels
        _verify.run(s, feeds)
        t0 = time.perf_counter()
        _verify.run(s, feeds)
        one.append(time.perf_counter() - t0)
    n = max(1, min(1000, math.ceil(min_round_s / max(min(one), 1e-6))))
    times: list[list[float]] = [[], []]
    start = time.perf_counter()
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            for _ in range(n):
                _verify.run(sessions[i], feeds)
            times[i].append((time.perf_counter() - t0) / n)
        if r + 1 >= min_rounds and (time.perf_counter() - start > budget_s or hopeless(times[0], times[1], below)):
            break
    return times[0], times[1], n


def hopeless(int8_s: Sequence[float], fp32_s: Sequence[float], below: float | None) -> bool:
    """Whether the rounds so far leave a ratio (FP32 over INT8) that clears ``below`` out of reach (None: never):
    three of them below it, and their median too. The fallback times a candidate against the best file so far
    and keeps it only where the lower quartile of its rounds clears the best's ratio, or in noisy rounds its
    median clears it by 5% (:func:`lq.export.timing._fallback.faster`). After three rounds below, either needs
    nearly every round still to come far above it, which the rounds of one file on a steady machine do not give;
    the candidate is dropped without timing it to the end. bench.styles' EfficientNet-style net at 32x32 (AMX
    Xeon): a dropped candidate took 0.2-0.35 s instead of 0.6 s, and the fallback kept the same stages."""
    if below is None or len(int8_s) < 3:
        return False
    ratios = [f / q for q, f in zip(int8_s, fp32_s)]
    return sum(r < below for r in ratios) >= 3 and statistics.median(ratios) < below


def compare(int8_model, fp32_model, feeds, providers=None, *, batch: int | None = None, reference: str = PLAIN,
            threads: int = 1, **timing) -> SpeedCheck:
    """Time ``int8_model`` against ``fp32_model`` on ``feeds`` (:func:`time_rounds`) and summarize
    (:func:`summarize`). The export's speed check; the one function to call wherever lq decides whether
    INT8 pays off."""
    int8_s, fp32_s, n = time_rounds(int8_model, fp32_model, feeds, providers, threads=threads, **timing)
    from lq.export.verify import _openvino

    runtime = f"OpenVINO (CPU plugin, {_openvino.precision_of(providers)} precision hint)" \
        if _openvino.is_openvino(providers) else "onnxruntime"
    return summarize(int8_s, fp32_s, runs_per_round=n, batch=batch, threads=threads, reference=reference,
                     runtime=runtime)


def batch_feeds(tensors: Sequence, dims: Sequence[dict], batch: int | None) -> list[np.ndarray]:
    """The inputs as arrays, at ``batch`` along every axis named "batch" (the sample repeated, then cut);
    the sample as it is when ``batch`` is None or the sample's own."""
    feeds = []
    for a, d in zip(tensors, dims, strict=True):
        x = a.detach().cpu().numpy()
        for ax, name in d.items():
            if name == "batch" and batch is not None and x.shape[ax] != batch:
                reps = -(-batch // x.shape[ax])
                x = np.take(np.concatenate([x] * reps, axis=ax), np.arange(batch), axis=ax)
        feeds.append(np.ascontiguousarray(x))
    return feeds
