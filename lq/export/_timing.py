"""Time the INT8 file against its FP32 twin in onnxruntime: a few interleaved runs on the sample.

Interleaving (INT8, FP32, INT8, ...) keeps a shared, noisy machine from favouring one file; the median of
the per-round ratios is what the export reports. One intra-op thread, as in ``bench.speed``: the ratio then
says what the kernels do, not how well each graph happens to parallelize on this machine.
"""

from __future__ import annotations

import statistics
import time

from lq.export import _verify


def speedup(int8_model: bytes, fp32_model: bytes, feeds, providers=None, *, rounds: int = 5,
            budget_s: float = 2.0) -> tuple[float, float, float]:
    """(FP32 time / INT8 time, INT8 ms, FP32 ms) over up to ``rounds`` interleaved runs (at least 2).

    Stops early once ``budget_s`` seconds are spent, so a large model costs a bounded amount of export time.
    """
    sessions = [_verify.make_session(m, providers, intra_op_num_threads=1) for m in (int8_model, fp32_model)]
    for s in sessions:  # warm-up: first runs allocate and pick kernels
        _verify.run(s, feeds)
    times: list[list[float]] = [[], []]
    start = time.perf_counter()
    for r in range(rounds):
        for i, s in enumerate(sessions):
            t0 = time.perf_counter()
            _verify.run(s, feeds)
            times[i].append(time.perf_counter() - t0)
        if r >= 1 and time.perf_counter() - start > budget_s:
            break
    ratio = statistics.median(f / q for q, f in zip(times[0], times[1], strict=True))
    return ratio, 1e3 * statistics.median(times[0]), 1e3 * statistics.median(times[1])
