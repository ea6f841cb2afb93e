"""GPU benchmark of the lq CUDA kernels: bandwidth of every op and a QAT training step.

    python -m bench.gpu [--numel 16777216] [--repeats 7] [--iters 20] [--compile]

Reports, in one run, on one GPU (times from CUDA events, median of
``--repeats`` runs of ``--iters`` back-to-back calls):

* every ``torch.ops.lq`` op in GB/s (bytes read + written / time) and as a
  ratio to ``x.clone()`` (device-to-device copy) on the same tensor, next to
  ``torch.fake_quantize_per_tensor_affine`` / ``per_channel_affine``, for
  float32 and bfloat16 (target: fake quant >= 0.85x of clone);
* a training step (forward, backward, SGD) of a small CNN in float32 and under
  bfloat16 autocast, without quantization and with fake quantization of every
  conv/linear input (per tensor) and weight (per output channel), and the
  ratio of the two (``--compile`` adds ``torch.compile``d steps).

Without CUDA it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def _cuda_time(fn, repeats: int, iters: int) -> float:
    """Median seconds per call."""
    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(repeats):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(ts)


def _has_cuda_kernels() -> bool:
    from lq import _ops

    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"lq::{op}", "CUDA") for op in _ops.SCHEMAS)


# --------------------------------------------------------------------------- op bandwidth
def bench_ops(numel: int, dtype: torch.dtype, repeats: int, iters: int) -> None:
    ops = torch.ops.lq
    c = 256
    hw = max(1, numel // (64 * c))
    side = int(hw**0.5)
    shape = (64, c, side, hw // side)
    dev = "cuda"
    g = torch.Generator(dev).manual_seed(0)
    x = torch.empty(shape, dtype=dtype, device=dev).normal_(generator=g)
    n = x.numel()
    es = x.element_size()
    grad = torch.randn(shape, dtype=dtype, device=dev)
    amax_t = x.float().abs().amax()
    amax_c1 = x.float().abs().amax(dim=(0, 2, 3), keepdim=True)  # (1, C, 1, 1)
    amax_c0 = x.float().abs().amax(dim=(1, 2, 3), keepdim=True)  # (N, 1, 1, 1)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    x_pos = x.abs()
    lo, hi = -amax_t, amax_t
    scale_t = float(amax_t) / 127.0
    scale_c = (amax_c1.reshape(-1) / 127.0).float()
    zp_c = torch.zeros(c, dtype=torch.int32, device=dev)
    rng = amax_t.clone()
    rng_c = amax_c1.reshape(-1).clone()

    print(f"\n{dtype}: x of shape {tuple(shape)} ({n / 1e6:.1f} M elements, {n * es / 2**20:.0f} MiB)")
    t_clone = _cuda_time(lambda: x.clone(), repeats, iters)
    clone_gbs = 2 * n * es / t_clone / 1e9
    print(f"  {'op':58s} {'time':>9s} {'GB/s':>8s} {'x clone':>8s}")
    print(f"  {'x.clone() (device copy)':58s} {t_clone * 1e3:7.3f}ms {clone_gbs:8.1f} {1.0:7.2f}x")

    def row(name, fn, passes):
        try:
            t = _cuda_time(fn, repeats, iters)
        except Exception as e:  # noqa: BLE001 - e.g. a dtype torch's own op does not support
            print(f"  {name:58s} {'n/a':>9s}  ({str(e).splitlines()[0][:60]})")
            return
        gbs = passes * n * es / t / 1e9
        print(f"  {name:58s} {t * 1e3:7.3f}ms {gbs:8.1f} {gbs / clone_gbs:7.2f}x")

    rows = [
        ("torch.fake_quantize_per_tensor_affine", lambda: torch.fake_quantize_per_tensor_affine(x, scale_t, 0, -128, 127), 2),
        ("torch.fake_quantize_per_channel_affine (axis 1)",
         lambda: torch.fake_quantize_per_channel_affine(x, scale_c, zp_c, 1, -128, 127), 2),
        ("lq fake_quant per tensor", lambda: ops.fake_quant(x, amax_t, 8, False, True), 2),
        ("lq fake_quant per channel, axis 1 (activations)", lambda: ops.fake_quant(x, amax_c1, 8, False, True), 2),
        ("lq fake_quant per channel, axis 0 (weights)", lambda: ops.fake_quant(x, amax_c0, 8, False, True), 2),
        ("lq fake_quant per channel, axis 1, channels_last", lambda: ops.fake_quant(x_cl, amax_c1, 8, False, True), 2),
        ("lq fake_quant 4-bit unsigned, per tensor", lambda: ops.fake_quant(x_pos, amax_t, 4, True, False), 2),
        ("lq fake_quant_backward per tensor", lambda: ops.fake_quant_backward(grad, x, amax_t), 3),
        ("lq fake_quant_backward per channel, axis 1", lambda: ops.fake_quant_backward(grad, x, amax_c1), 3),
        ("lq quant per tensor", lambda: ops.quant(x, amax_t, 8, False, True), 2),
        ("lq scaled_e4m3 per tensor", lambda: ops.scaled_e4m3(x, amax_t), 2),
        ("lq scaled_e4m3 per channel, axis 1", lambda: ops.scaled_e4m3(x, amax_c1), 2),
        ("lq fake_affine_quant per tensor", lambda: ops.fake_affine_quant(x, lo, hi, 8), 2),
        ("lq fake_affine_quant_backward per tensor", lambda: ops.fake_affine_quant_backward(grad, x, lo, hi), 3),
        ("lq fake_dynamic_block_quant, last axis, block 32, 4-bit",
         lambda: ops.fake_dynamic_block_quant(x, -1, 32 if shape[-1] % 32 == 0 else shape[-1], 4, False, True), 2),
        ("lq fake_dynamic_block_quant, axis 1, block 16, 4-bit",
         lambda: ops.fake_dynamic_block_quant(x, 1, 16, 4, False, True), 2),
        ("lq abs_histogram per tensor, 2048 bins", lambda: ops.abs_histogram(x, rng, 2048, None), 1),
        ("lq abs_histogram per channel (axis 1), 2048 bins", lambda: ops.abs_histogram(x, rng_c, 2048, 1), 1),
    ]
    for name, fn, passes in rows:
        row(name, fn, passes)


# --------------------------------------------------------------------------- QAT step
class SmallCNN(torch.nn.Module):
    """conv-bn-relu x4 with pooling, then a linear classifier (CIFAR-sized inputs)."""

    def __init__(self, quantize: bool):
        super().__init__()
        chans = [3, 64, 128, 256, 256]
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(a, b, 3, padding=1, bias=False) for a, b in zip(chans, chans[1:]))
        self.bns = torch.nn.ModuleList(torch.nn.BatchNorm2d(b) for b in chans[1:])
        self.fc = torch.nn.Linear(chans[-1], 10)
        self.quantize = quantize
        # calibrated ranges (frozen during QAT): per-tensor inputs, per-channel weights
        self.register_buffer("in_amax", torch.full((len(self.convs) + 1,), 4.0))

    def _q(self, t, amax):
        from lq.tensor_quant import fake_tensor_quant

        return fake_tensor_quant(t, amax) if self.quantize else t

    def _qw(self, w):
        from lq.tensor_quant import fake_tensor_quant

        if not self.quantize:
            return w
        amax = w.detach().abs().amax(dim=tuple(range(1, w.dim())), keepdim=True).float()
        return fake_tensor_quant(w, amax)

    def forward(self, x):
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            x = torch.nn.functional.conv2d(self._q(x, self.in_amax[i]), self._qw(conv.weight), padding=1)
            x = torch.relu(bn(x))
            if i % 2 == 1:
                x = torch.nn.functional.max_pool2d(x, 2)
        x = x.mean(dim=(2, 3))
        return torch.nn.functional.linear(self._q(x, self.in_amax[-1]), self._qw(self.fc.weight), self.fc.bias)


def bench_qat(batch: int, repeats: int, iters: int, compile_: bool) -> None:
    dev = "cuda"
    x = torch.randn(batch, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    print(f"\nQAT training step: small CNN (4 conv + linear), batch {batch}, 3x32x32, SGD")
    print(f"  {'variant':40s} {'fp32 step':>10s} {'quantized':>10s} {'ratio':>7s}")
    modes = [("eager", False)] + ([("torch.compile", True)] if compile_ else [])
    for autocast in (False, True):
        for mode, comp in modes:
            times = []
            for quantize in (False, True):
                torch.manual_seed(0)
                model = SmallCNN(quantize).to(dev)
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

                def step(model=model, opt=opt):
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                fn = torch.compile(step) if comp else step
                for _ in range(3):
                    fn()
                times.append(_cuda_time(fn, repeats, iters))
            name = f"{mode}{', bf16 autocast' if autocast else ', float32'}"
            print(f"  {name:40s} {times[0] * 1e3:8.2f}ms {times[1] * 1e3:8.2f}ms {times[1] / times[0]:6.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 24, help="elements of the benchmark tensor (default 16M)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--batch", type=int, default=256, help="QAT step batch size")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd training steps")
    p.add_argument("--skip-qat", action="store_true")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench.gpu: CUDA is not available on this machine (torch "
              f"{torch.__version__}, CUDA {torch.version.cuda}); nothing to measure.")
        return 0

    import lq  # noqa: F401  (registers torch.ops.lq and loads the kernels)

    kernels = _has_cuda_kernels()
    print(f"lq GPU benchmark: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"lq CUDA kernels {'loaded' if kernels else 'NOT loaded (reference fallback is being measured)'}")
    for dtype in (torch.float32, torch.bfloat16):
        bench_ops(args.numel, dtype, args.repeats, args.iters)
    if not args.skip_qat:
        bench_qat(args.batch, args.repeats, max(3, args.iters // 2), args.compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
