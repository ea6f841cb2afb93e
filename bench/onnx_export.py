"""ONNX export benchmark: lq's INT8 Q/DQ export vs the FP32 export vs onnxruntime's own static quantization.

    python -m bench.onnx_export [--quick] [--threads N] [--repeats N]

The network: a small ResNet-style CNN on 32x32 RGB inputs (conv-bn-relu stem,
two residual blocks with the add quantized by ``QuantAdd``, a strided
conv-bn-relu, global average pool, linear head), 32-64 channels. lq converts
it with ``quantize_model`` (per-tensor int8 inputs, per-channel int8 weights; the
``int8_reduce_range`` recipe: 7-bit weights, unsigned quantizers where an input comes from a ReLU),
calibrates with max on random batches and exports with ``lq.export.export_onnx``.
The same float network is exported in FP32 and quantized by
``onnxruntime.quantization.quantize_static`` (QDQ, per-channel, the reference).

Prints median latencies at batch 1 and 32 (several timed runs, each the mean
of many inferences), model sizes, speedups over FP32, and the INT8 kernels
onnxruntime ran for each model.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

from bench._report import cpu_isa

torch.set_flush_denormal(True)


# =========================================================================== the network
class Residual(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        from lq.nn import FloatAdd

        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.add = FloatAdd()
        self.relu2 = nn.ReLU()

    def forward(self, x):
        y = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.add(self.bn2(self.conv2(y)), x))


class BenchCNN(nn.Module):
    def __init__(self, c: int = 32, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.block1 = Residual(c)
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * c),
                                  nn.ReLU())
        self.block2 = Residual(2 * c)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * c, num_classes)

    def forward(self, x):
        x = self.block2(self.down(self.block1(self.stem(x))))
        return self.head(torch.flatten(self.pool(x), 1))


def randomize_bn(model: nn.Module, seed: int = 0) -> None:
    """Give BatchNorm layers trained-looking statistics (so folding is not the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(0.5 + torch.rand(n, generator=g))
                m.bias.copy_(0.1 * torch.randn(n, generator=g))
                m.running_mean.copy_(0.1 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + torch.rand(n, generator=g))


def calibration_batches(n: int = 8, batch: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, 32, 32, generator=g) for _ in range(n)]


def quantize_and_calibrate(model: nn.Module, batches, reduce_range: bool = False,
                           method: str | None = "max", recurrent: str | None = None) -> nn.Module:
    """lq's PTQ: quantize_model + calibration (per-tensor inputs, per-channel weights; with ``reduce_range``
    the ``Int8ReduceRangeConfig`` recipe: 7-bit weights, unsigned inputs after ReLU). ``method``: the
    activations' calibration method, max here (this bench's tables); None: lq's default (``auto``).
    ``recurrent``: how LSTMs quantize (``QuantConfig.recurrent``; None: the recipe's)."""
    from lq.calibration import calibrate_model
    from lq.config import Int8ReduceRangeConfig, QuantConfig
    from lq.convert import quantize_model

    recipe = Int8ReduceRangeConfig() if reduce_range else QuantConfig()
    from lq.tensor_quant import QuantDescriptor

    # descriptors (pytorch-quantization's per-layer path): the symmetric grids these tables compare, not the
    # int8_onnxruntime recipe that quantize_model(model) applies when given none (bench.library times that one)
    quantize_model(model, quant_desc_input=QuantDescriptor(),
                   quant_desc_weight=recipe.weight.to_descriptor() if reduce_range else None,
                   unsigned_after_relu=recipe.unsigned_after_relu, recurrent=recurrent or recipe.recurrent)
    model.eval()
    with torch.no_grad():
        calibrate_model(model, batches, **({} if method is None else {"method": method}))
    return model


# =========================================================================== timing
def ort_times(paths: dict, x, threads: int, repeats: int, min_time: float) -> dict:
    """Seconds per inference of each model, one value per repeat; the models take turns within every
    repeat, so load from other processes hits all of them alike. ``x``: the input array of a
    single-input model, or a dict of feeds by input name."""
    from lq.export.verify._verify import make_session

    sessions = {}
    for key, p in paths.items():
        sess = make_session(p, intra_op_num_threads=threads or None)
        feeds = x if isinstance(x, dict) else {sess.get_inputs()[0].name: x}
        for _ in range(3):
            sess.run(None, feeds)
        n = 1
        while True:  # inner loop long enough to be measurable
            t = time.perf_counter()
            for _ in range(n):
                sess.run(None, feeds)
            if time.perf_counter() - t >= min_time or n >= 4096:
                break
            n *= 2
        sessions[key] = (sess, feeds, n)
    times: dict = {k: [] for k in paths}
    for _ in range(repeats):
        for key, (sess, feeds, n) in sessions.items():
            t = time.perf_counter()
            for _ in range(n):
                sess.run(None, feeds)
            times[key].append((time.perf_counter() - t) / n)
    return times


def latencies_ms(paths: dict, batch: int, threads: int, repeats: int, min_time: float) -> dict:
    """Median ms per inference of each model on a (batch, 3, 32, 32) input."""
    x = np.random.default_rng(0).standard_normal((batch, 3, 32, 32)).astype(np.float32)
    times = ort_times(paths, x, threads, repeats, min_time)
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def ort_int8_ops(path: str) -> str:
    from lq.export import INT8_KERNELS, optimized_op_counts

    c = optimized_op_counts(path)
    ints = {k: v for k, v in c.items() if k in INT8_KERNELS}
    floats = {k: v for k, v in c.items() if k in ("Conv", "FusedConv", "Gemm", "MatMul", "Add")}
    s = ", ".join(f"{k} x{v}" for k, v in sorted(ints.items()))
    if floats:
        s += " | float: " + ", ".join(f"{k} x{v}" for k, v in sorted(floats.items()))
    return s or "-"


def ort_quantize_static(fp32_path: str, out_path: str, batches, u8u8: bool = False) -> None:
    """onnxruntime's own static quantization (QDQ, per-channel) after ``quant_pre_process``: its default
    uint8 x int8 encoding, or uint8 x uint8 (``u8u8``, the encoding its docs give for CPUs without VNNI)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):  # a batch: the input tensor, or {input name: tensor}
        def __init__(self):
            self.it = iter([{k: v.numpy() for k, v in b.items()} if isinstance(b, dict) else {"input": b.numpy()}
                            for b in batches])

        def get_next(self):
            return next(self.it, None)

    pre = out_path + ".pre.onnx"
    try:
        quant_pre_process(fp32_path, pre, skip_symbolic_shape=True)
        src = pre
    except Exception:
        src = fp32_path
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # one warning per LayerNorm weight ("Axis 1 is out-of-range") otherwise
    try:
        quantize_static(src, out_path, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8 if u8u8 else QuantType.QInt8)
    finally:
        root.setLevel(level)
    if os.path.exists(pre):
        os.remove(pre)


def nncf_quantize(fp32_path: str, out_path: str, batches, preset: str | None = None) -> None:
    """NNCF's own post-training quantization with its defaults (``nncf.quantize``: the ``performance`` preset,
    symmetric int8 activations, per-channel weights, its fast bias correction) on the FP32 ONNX file (NNCF's ONNX
    backend), every calibration batch given: the file NNCF's users run in onnxruntime. ``preset``: another of
    NNCF's presets (``"mixed"``: asymmetric activations)."""
    import onnx
    import nncf

    model = onnx.load(fp32_path)
    name = model.graph.input[0].name
    items = [{k: v.numpy() for k, v in b.items()} if isinstance(b, dict) else {name: b.numpy()} for b in batches]
    nncf.set_log_level(logging.ERROR)
    # subset_size counts dataset items (here batches), not samples
    kw = {} if preset is None else {"preset": nncf.QuantizationPreset(preset)}
    quantized = nncf.quantize(model, nncf.Dataset(items), subset_size=len(items), **kw)
    onnx.save(quantized, out_path)


def export_fp32(model: nn.Module, path: str, input_shape=(3, 32, 32)) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (torch.randn(1, *input_shape),), path, dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})


FP32 = "FP32 export"
LQ_DEFAULT = "lq INT8 (8-bit weights)"
LQ_REDUCE = "lq INT8 (int8_reduce_range)"
ORT_U8S8 = "ORT quantize_static u8s8"
ORT_U8U8 = "ORT quantize_static u8u8"


def build_contenders(float_model: nn.Module, batches, d: str, dynamo: bool = True,
                     input_shape=(3, 32, 32)) -> tuple[dict, list[str]]:
    """The FP32 export and four INT8 files of one float model: lq with 8-bit weights (default recipe), lq
    with the reduce-range recipe, onnxruntime's quantize_static with its default u8s8 and with u8u8.
    Returns ``({label: path}, notes)``."""
    import copy

    from lq.export import export_onnx

    paths = {FP32: os.path.join(d, "fp32.onnx"), LQ_DEFAULT: os.path.join(d, "lq_int8.onnx"),
             LQ_REDUCE: os.path.join(d, "lq_int8_rr.onnx"), ORT_U8S8: os.path.join(d, "ort_u8s8.onnx"),
             ORT_U8U8: os.path.join(d, "ort_u8u8.onnx")}
    export_fp32(float_model, paths[FP32], input_shape)
    notes = []
    for label, rr in ((LQ_DEFAULT, False), (LQ_REDUCE, True)):
        q = quantize_and_calibrate(copy.deepcopy(float_model), batches, reduce_range=rr)
        t = time.perf_counter()
        # lq's placement as it is (no measured fallback, which bench.fallback measures): this table compares
        # placements and encodings with quantize_static's
        res = export_onnx(q, batches[0], paths[label], dynamo=dynamo, fallback_seconds=0)
        notes.append(f"{label}: export {time.perf_counter() - t:.2f} s, max |ORT - PyTorch fake-quant| "
                     f"{res.max_abs_diff:.3g} ({res.output_checks[0].max_steps:.2g} output steps), weights stored as "
                     f"uint8 (zero point 128) for int16 safety: {len(res.uint8_weights)} layer(s)")
    ort_quantize_static(paths[FP32], paths[ORT_U8S8], batches)
    ort_quantize_static(paths[FP32], paths[ORT_U8U8], batches, u8u8=True)
    return paths, notes


def int16_safety(path: str) -> str:
    """"int16-safe", or how many integer kernels could saturate on a CPU without VNNI (from the file)."""
    import onnx

    from lq.export.passes._int16 import int16_risks

    r = int16_risks(onnx.load(path))
    return "int16-safe on every x86 CPU" if not r else f"{len(r)} kernel(s) can saturate int16 without VNNI"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0,
                    help="onnxruntime intra-op threads (default: one table with all cores, one with 1 thread)")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per measurement (median reported)")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per timed run")
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    ap.add_argument("--dynamo", type=int, default=1, help="1: current torch.onnx exporter, 0: legacy")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.min_time = 3, 0.05

    torch.manual_seed(0)
    float_model = BenchCNN(args.channels)
    randomize_bn(float_model)
    float_model.eval()
    batches = calibration_batches()

    with tempfile.TemporaryDirectory() as d:
        models, notes = build_contenders(float_model, batches, d, dynamo=bool(args.dynamo))
        from lq.export.verify._verify import make_session

        held_out = calibration_batches(1, 32, seed=99)[0]
        x = held_out.numpy()
        with torch.no_grad():
            ref_fp32 = float_model(held_out).numpy()
        print(f"bench.onnx_export: BenchCNN(c={args.channels}) 32x32x3, onnxruntime "
              f"{__import__('onnxruntime').__version__} CPU ({os.cpu_count()} cores), median of {args.repeats} runs")
        print(f"CPU: {cpu_isa()}")
        for line in notes:
            print(line)
        for name, p in models.items():
            if name != FP32:
                out = make_session(p).run(None, {"input": x})[0]
                print(f"{name}: agreement with FP32 on a held-out batch: max|diff| {np.abs(out - ref_fp32).max():.3g}, "
                      f"argmax match {np.mean(out.argmax(1) == ref_fp32.argmax(1)):.1%}; {int16_safety(p)}")
        ops = {k: ort_int8_ops(p) for k, p in models.items()}
        thread_settings = [args.threads] if args.threads else [0, 1]
        for threads in thread_settings:
            l1 = latencies_ms(models, 1, threads, args.repeats, args.min_time)
            l32 = latencies_ms(models, 32, threads, args.repeats, args.min_time)
            print()
            print(f"intra-op threads: {threads or 'onnxruntime default (all cores)'}; CPU: {cpu_isa()}")
            hdr = (f"{'model':<36}{'batch 1 ms':>11}{'batch 32 ms':>13}{'speedup b1':>12}{'speedup b32':>13}"
                   f"{'size KiB':>10}  INT8 kernels")
            print(hdr)
            print("-" * len(hdr))
            b1, b32 = l1[FP32], l32[FP32]
            for name, p in models.items():
                print(f"{name:<36}{l1[name]:>11.3f}{l32[name]:>13.3f}{b1 / l1[name]:>11.2f}x{b32 / l32[name]:>12.2f}x"
                      f"{os.path.getsize(p) / 1024:>10.1f}  {ops[name]}")
            best = max((k for k in models if k.startswith("lq")), key=lambda k: -l32[k])
            print(f"fastest lq INT8 at batch 32: {best} {b32 / l32[best]:.2f}x FP32; ORT quantize_static (u8s8): "
                  f"{b32 / l32[ORT_U8S8]:.2f}x; lq / ORT-static speed: {l32[ORT_U8S8] / l32[best]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
