"""Which integer encodings onnxruntime's CPU kernels compute exactly, and how fast, on this CPU.

    python -m bench.encodings [--repeats N]

One quantized Conv 64->64 3x3 (per-channel weights, batch 32, 16x16) and one MatMul
(2048x576 @ 576x64), written as Q/DQ graphs in each encoding. onnxruntime runs each with
all optimizations (its fused integer kernels) and with none (plain Q/DQ semantics); the
difference between the two is what the fused kernel got wrong. On CPUs without VNNI the
uint8 x int8 kernels add pairs of products in a saturating int16, so the full-range 8-bit
encodings are off by many output steps there and exact on VNNI machines; the uint8 x uint8
and the 7-bit-weight encodings are exact everywhere. The table names the CPU's ISA.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench._report import cpu_isa

OUT_SCALE = 0.5  # the output quantizer's step: differences are reported in these steps too


def _graph(op: str, act: tuple, weight: tuple, wbits: int, rng):
    """A Q/DQ model ``x -> Q/DQ(act) -> op(., DQ(weight)) -> Q/DQ(out)`` and its input shape."""
    from onnx import TensorProto, helper
    from onnx import numpy_helper as nh

    (adt, azp), (wdt, wzp) = act, weight
    n, c, h, w, o, k = 32, 64, 16, 16, 64, 3
    np_of = {TensorProto.UINT8: np.uint8, TensorProto.INT8: np.int8}
    if op == "conv":
        wf = rng.standard_normal((o, c, k, k)).astype(np.float32)
        amax, axis, shape = np.abs(wf).max(axis=(1, 2, 3)), 0, (-1, 1, 1, 1)
    else:
        wf = rng.standard_normal((c * k * k, o)).astype(np.float32)
        amax, axis, shape = np.abs(wf).max(axis=0), 1, (1, -1)
    mb = 2 ** (wbits - 1) - 1
    ws = (amax / mb).astype(np.float32)
    wq = np.clip(np.rint(wf / ws.reshape(shape)), -mb, mb) + wzp
    inits = [nh.from_array(wq.astype(np_of[wdt]), "wq"), nh.from_array(ws, "ws"),
             nh.from_array(np.full(o, wzp, np_of[wdt]), "wz"), nh.from_array(np.array(4.0 / 127, np.float32), "s"),
             nh.from_array(np.array(azp, np_of[adt]), "z"), nh.from_array(np.array(OUT_SCALE, np.float32), "os")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=axis)]
    if op == "conv":
        nodes.append(helper.make_node("Conv", ["xd", "wd"], ["y"], pads=[1, 1, 1, 1]))
        xshape = [n, c, h, w]
    else:
        nodes.append(helper.make_node("MatMul", ["xd", "wd"], ["y"]))
        xshape = [n * 64, c * k * k]
    nodes += [helper.make_node("QuantizeLinear", ["y", "os", "z"], ["yq"]),
              helper.make_node("DequantizeLinear", ["yq", "os", "z"], ["out"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xshape)],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(), xshape


def main(argv=None) -> int:
    import onnxruntime as ort
    from onnx import TensorProto

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    u8, s8 = TensorProto.UINT8, TensorProto.INT8
    cases = [("uint8 act (zp 128) x int8 weights, 8-bit", (u8, 128), (s8, 0), 8),
             ("int8 act x int8 weights, 8-bit", (s8, 0), (s8, 0), 8),
             ("uint8 act (zp 128) x uint8 weights (zp 128), 8-bit", (u8, 128), (u8, 128), 8),
             ("uint8 act (zp 128) x int8 weights, 7-bit", (u8, 128), (s8, 0), 7)]

    def session(model, level):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        so.intra_op_num_threads = 1
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])

    def ms(sess, x):
        sess.run(None, {"x": x})
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            sess.run(None, {"x": x})
            times.append(time.perf_counter() - t)
        return float(np.median(times)) * 1e3

    print(f"bench.encodings: onnxruntime {ort.__version__}, 1 thread, CPU: {cpu_isa()}")
    print(f"| op | encoding | max abs diff fused vs unfused (output step {OUT_SCALE}) | fused ms |")
    print("|---|---|---:|---:|")
    for op in ("conv", "matmul"):
        for label, act, weight, bits in cases:
            rng = np.random.default_rng(0)
            model, xshape = _graph(op, act, weight, bits, rng)
            x = (rng.standard_normal(xshape) * 2).astype(np.float32)
            fused = session(model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
            plain = session(model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
            diff = float(np.abs(fused.run(None, {"x": x})[0] - plain.run(None, {"x": x})[0]).max())
            print(f"| {op} | {label} | {diff:.1f} | {ms(fused, x):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
