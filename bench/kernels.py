"""CPU fake-quantization kernels against memory copies and their peers, in one run.

    python -m bench.kernels [--quick] [--rounds N] [--threads N] [--no-compile]

Cases: a 16M-element tensor with a per-tensor amax, and a (1024, 4096) weight
with a per-row amax (1024, 1); float32, and the same in bfloat16.

Contenders (forward, and forward + STE backward):

* ``lq``: ``torch.ops.lq.fake_quant`` (+ ``fake_quant_backward``), the C++ kernel;
* ``lq autograd``: the same op under autograd (``y.backward(g)``);
* ``lq out=``: ``fake_quant_out`` into a preallocated buffer (forward only);
* ``x.clone()`` and ``copy_`` into a preallocated buffer: memory references;
* ``eager``: the reference formula as plain torch ops (``lq._reference``), with
  its STE backward formula;
* ``torch.fake_quantize_per_tensor_affine`` / ``per_channel_affine`` (autograd backward);
* ``compiled``: ``torch.compile`` of the eager formula (and of forward + backward).

Every contender is timed once per round, round-robin, and the median over the
rounds is reported, so a noisy neighbour slows all contenders alike.
Bandwidth counts the bytes each pass must move (forward: read x, write y;
forward + backward: also read g and x, write grad). Ratios are of bandwidth:
``vs clone`` is the fraction of ``x.clone()``'s bandwidth on the same tensor;
the peer table divides lq's time into each peer's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

torch.set_flush_denormal(True)


def _median_times(fns: dict, rounds: int) -> dict:
    for f in fns.values():  # warm-up (and compile)
        f()
        f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _case(name, x, amax, per_row: bool, rounds: int, use_compile: bool):
    from lq import _reference as R

    ops = torch.ops.lq
    bits, unsigned, narrow = 8, False, True
    g = torch.randn_like(x)
    buf = torch.empty_like(x)
    scale = (amax.float() / 127.0)
    fwd, fb = {}, {}

    fwd["x.clone()"] = lambda: x.clone()
    fwd["copy_ (prealloc)"] = lambda: buf.copy_(x)
    fwd["lq"] = lambda: ops.fake_quant(x, amax, bits, unsigned, narrow)
    fwd["lq out="] = lambda: ops.fake_quant_out(x, amax, bits, unsigned, narrow, buf)
    fwd["eager formula"] = lambda: R.fake_quant(x, amax, bits, unsigned, narrow)

    fb["x.clone()"] = lambda: (x.clone(), g.clone())
    fb["lq"] = lambda: (ops.fake_quant(x, amax, bits, unsigned, narrow), ops.fake_quant_backward(g, x, amax))
    xr = x.detach().clone().requires_grad_(True)

    def lq_autograd():
        xr.grad = None
        ops.fake_quant(xr, amax, bits, unsigned, narrow).backward(g)

    fb["lq autograd"] = lq_autograd
    fb["eager formula"] = lambda: (R.fake_quant(x, amax, bits, unsigned, narrow), R.fake_quant_backward(g, x, amax))

    if per_row:
        s1 = scale.reshape(-1).contiguous()
        zp = torch.zeros(s1.numel(), dtype=torch.int32)
        peer = "torch.fake_quantize_per_channel_affine"

        def torch_fq(t):
            return torch.fake_quantize_per_channel_affine(t, s1, zp, 0, -127, 127)
    else:
        s0, peer = float(scale), "torch.fake_quantize_per_tensor_affine"

        def torch_fq(t):
            return torch.fake_quantize_per_tensor_affine(t, s0, 0, -127, 127)

    try:
        torch_fq(x)
        fwd[peer] = lambda: torch_fq(x)

        def torch_fb():
            xr.grad = None
            torch_fq(xr).backward(g)

        fb[peer] = torch_fb
    except RuntimeError as e:  # e.g. a dtype torch's kernel does not take
        print(f"  ({peer} skipped for {x.dtype}: {str(e).splitlines()[0][:80]})")

    if use_compile:
        def formula(t, a):
            return R.fake_quant(t, a, bits, unsigned, narrow)

        # Forward and backward as two graphs, as AOTAutograd splits a training step
        # (the backward runs later, on the saved x).
        cf = torch.compile(formula, dynamic=False)
        cb = torch.compile(R.fake_quant_backward, dynamic=False)
        t0 = time.perf_counter()
        cf(x, amax)
        cb(g, x, amax)
        print(f"  (torch.compile of the eager formula took {time.perf_counter() - t0:.1f} s)")
        fwd["torch.compile(eager)"] = lambda: cf(x, amax)
        fb["torch.compile(eager)"] = lambda: (cf(x, amax), cb(g, x, amax))

    tf = _median_times(fwd, rounds)
    tb = _median_times(fb, rounds)
    nbytes = x.numel() * x.element_size()
    rows = []
    for k in fwd:
        bw_f = 2 * nbytes / tf[k] / 1e9
        rows.append([name, k, tf[k], bw_f, None, None])
    for r in rows:
        if r[1] in tb:
            r[4] = tb[r[1]]
            r[5] = (5 * nbytes if r[1] != "x.clone()" else 4 * nbytes) / tb[r[1]] / 1e9
    for k in fb:
        if k not in fwd:
            rows.append([name, k, None, None, tb[k], 5 * nbytes / tb[k] / 1e9])
    clone_f = 2 * nbytes / tf["x.clone()"] / 1e9
    clone_b = 4 * nbytes / tb["x.clone()"] / 1e9
    return rows, clone_f, clone_b, tf, tb, peer


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds; torch.compile for float32 only")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per contender (default 15, quick 5)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    args = p.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 15)
    if args.threads:
        torch.set_num_threads(args.threads)

    from lq import _ext, _ops  # noqa: F401  (registers torch.ops.lq, loads the kernels)
    from lq import memory

    # lq's output-buffer cache would let lq skip the page faults every other contender pays for
    # its fresh output: turn it off, so this compares the kernels (the QAT-step bench shows the cache)
    limit_mib = memory.cpu_cache_stats()["limit_bytes"] >> 20
    memory.set_cpu_cache_limit(0)
    try:
        return _run(args, rounds)
    finally:
        memory.set_cpu_cache_limit(limit_mib)


def _run(args, rounds) -> int:
    from lq import _ext

    print(f"lq CPU kernel benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {_ext.cpu_capability()}, C++ extension "
          f"{'loaded' if _ext.load() else 'NOT loaded (reference kernels: numbers are not the kernels)'}, "
          f"median of {rounds} rounds, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(16 * 1024 * 1024, generator=gen)
    w32 = torch.randn(1024, 4096, generator=gen)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        x, w = x32.to(dtype), w32.to(dtype)
        cases.append((f"16M per-tensor {str(dtype)[6:]}", x, x.float().abs().amax(), False, dtype))
        cases.append((f"1024x4096 per-row {str(dtype)[6:]}", w, w.float().abs().amax(1, keepdim=True), True, dtype))

    all_rows, summary = [], []
    for name, x, amax, per_row, dtype in cases:
        print(f"- {name} ...", flush=True)
        comp = not args.no_compile and not (args.quick and dtype != torch.float32)
        rows, clone_f, clone_b, tf, tb, peer = _case(name, x, amax, per_row, rounds, comp)
        for r in rows:
            r.append(None if r[3] is None else r[3] / clone_f)
            r.append(None if r[5] is None else r[5] / clone_b)
        all_rows += rows
        s = {"case": name,
             "fwd vs clone": tf["x.clone()"] / tf["lq"],
             "out= vs copy_": tf["copy_ (prealloc)"] / tf["lq out="],
             "fwd+bwd vs clone (bandwidth)": (5 / 4) * tb["x.clone()"] / tb["lq"]}
        for k, label in ((peer, "torch.fake_quantize"), ("eager formula", "eager"),
                         ("torch.compile(eager)", "torch.compile")):
            if k in tf:
                s[f"fwd vs {label}"] = tf[k] / tf["lq"]
            if k in tb:
                s[f"fwd+bwd vs {label}"] = tb[k] / tb["lq"]
        summary.append(s)

    print("\n| case | contender | fwd ms | fwd GB/s | fwd vs clone | fwd+bwd ms | fwd+bwd GB/s | fwd+bwd vs clone |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, k, t_f, bw_f, t_b, bw_b, rf, rb in all_rows:
        print(f"| {name} | {k} | {_fmt(t_f and t_f * 1e3, '.2f')} | {_fmt(bw_f, '.1f')} | {_fmt(rf, '.2f')}x "
              f"| {_fmt(t_b and t_b * 1e3, '.2f')} | {_fmt(bw_b, '.1f')} | {_fmt(rb, '.2f')}x |")
    keys = []
    for s in summary:
        keys += [k for k in s if k != "case" and k not in keys]
    print("\nlq speed-up (time of the other / time of lq; bandwidth ratio for clone):\n")
    print("| case | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for s in summary:
        print(f"| {s['case']} | " + " | ".join(_fmt(s.get(k), ".2f") + ("x" if k in s else "") for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
