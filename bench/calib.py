"""Calibration benchmark: collection throughput and amax search time.

    python -m bench.calib [--mib 64] [--repeats 7] [--threads N]

Reports, in one run (medians of ``--repeats`` timed runs):

* histogram collection (``HistogramCalibrator.collect`` once its range is
  established, i.e. one ``abs_histogram`` pass; and per batch when a second
  batch grows the grid, i.e. up to two passes) and the raw
  ``torch.ops.lq.abs_histogram`` op, in GB/s and as a ratio to ``x.clone()``
  on the same float32 tensor (target >= 0.5x with the C++ kernel);
* ``MaxCalibrator.collect`` per tensor and per channel against a single
  ``x.abs().amax()`` (and ``amax(dim)`` per channel);
* ``compute_amax`` time per method on a 2048-bin histogram, per tensor and for
  64 channels (target < 50 ms per tensor for entropy and mse).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

torch.set_flush_denormal(True)


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="tensor size in MiB (float32)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import lq
    from lq import calib

    n = args.mib * 1024 * 1024 // 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    gb = x.numel() * x.element_size() / 1e9
    print(f"lq calibration benchmark: {args.mib} MiB float32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, C++ extension {'loaded' if lq.extension_loaded() else 'NOT loaded'}")

    t_clone = _time(lambda: x.clone(), args.repeats)
    print(f"\n{'x.clone()':44s} {t_clone * 1e3:8.2f} ms  {gb / t_clone:6.2f} GB/s  (reference)")

    def row(name, t, ref=t_clone, ref_name="clone"):
        print(f"{name:44s} {t * 1e3:8.2f} ms  {gb / t:6.2f} GB/s  {ref / t:5.2f}x {ref_name}")

    # ---------------------------------------------------------------- histogram collection
    hist = calib.HistogramCalibrator(8)
    hist.collect(x * 1.01)  # establish the range: later batches take one pass
    row("HistogramCalibrator.collect (per tensor)", _time(lambda: hist.collect(x), args.repeats))
    rng = hist._calib_bin_edges[-1]
    row("torch.ops.lq.abs_histogram (per tensor)",
        _time(lambda: torch.ops.lq.abs_histogram(x, rng, 2048, None), args.repeats))
    grow = calib.HistogramCalibrator(8)
    row("HistogramCalibrator.collect (growing 1.5x)",
        _time(lambda: (grow.reset(), grow.collect(x), grow.collect(x * 1.5)), args.repeats) / 2)
    x2 = x.view(64, -1)
    hist_pc = calib.HistogramCalibrator(8, axis=0)
    hist_pc.collect(x2 * 1.01)
    row("HistogramCalibrator.collect (64 channels)", _time(lambda: hist_pc.collect(x2), args.repeats))
    row("torch.histc(x.abs()) (for comparison)", _time(lambda: torch.histc(x.abs(), 2048, 0, float(rng)),
                                                        args.repeats))

    # ---------------------------------------------------------------- max collection
    t_absmax = _time(lambda: x.abs().amax(), args.repeats)
    print()
    row("x.abs().amax()", t_absmax)
    mx = calib.MaxCalibrator(8)
    row("MaxCalibrator.collect (per tensor)", _time(lambda: mx.collect(x), args.repeats), t_absmax, "abs().amax()")
    x4 = x.view(64, 64, 64, -1)
    t_pc_ref = _time(lambda: x4.abs().amax(dim=(0, 2, 3)), args.repeats)
    row("x.abs().amax(dim=(0, 2, 3))", t_pc_ref)
    mx1 = calib.MaxCalibrator(8, axis=1)
    row("MaxCalibrator.collect (axis=1, 64 channels)", _time(lambda: mx1.collect(x4), args.repeats), t_pc_ref,
        "abs().amax(dim)")

    # ---------------------------------------------------------------- amax search
    print(f"\ncompute_amax on a 2048-bin histogram ({n} values; target < 50 ms per tensor for entropy/mse)")
    heavy = torch.randn(1 << 20, generator=g) * torch.rand(1 << 20, generator=g).pow(3) * 4
    h = calib.HistogramCalibrator(8)
    h.collect(heavy)
    hc = calib.HistogramCalibrator(8, axis=0)
    hc.collect(heavy.view(64, -1))
    for method in ("entropy", "mse", "percentile", "max"):
        t1 = _time(lambda: h.compute_amax(method), args.repeats)
        t64 = _time(lambda: hc.compute_amax(method), max(1, args.repeats // 2))
        print(f"  {method:10s} per tensor {t1 * 1e3:8.2f} ms   64 channels {t64 * 1e3:9.2f} ms "
              f"({t64 / 64 * 1e3:.2f} ms/channel)   amax {float(h.compute_amax(method)):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
