// Dynamic block fake quantization on CPU: lq::fake_dynamic_block_quant.
//
// x is viewed as (outer, n, inner) with blocks of block_size along n. Each
// block's amax (max |x|, NaN if the block holds a NaN) is computed and used at
// once, in the same task, while the block is still in cache:
//   inner == 1: a block is block_size contiguous elements;
//   inner  > 1: a block is block_size rows of a tile of the inner dim, whose
//               per-column amax is reduced with vector maxima first.
// Numerics are those of fake_quant with amax = the block amax.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "common.h"
#include "cpu_elementwise.h"
#include "cpu_quant_ops.h"

namespace lq {
namespace cpu {
namespace {

// max(m, |x|) where NaN wins (like torch.amax).
inline float nan_max(float m, float v) { return (v != v || v > m) ? v : m; }

// Largest |x| of a contiguous span (NaN when it holds a NaN); neg |= any x < 0.
template <typename T, bool kNeg>
inline float span_absmax(const T* x, int64_t n, bool& neg) {
  const Vec zero(0.f);
  Vec m(0.f), ng(0.f);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vec u, v;
    load2(x + i, u, v);
    m = at::vec::maximum(m, at::vec::maximum(u.abs(), v.abs()));
    if constexpr (kNeg) ng = ng | (u < zero) | (v < zero);
  }
  if (i < n) {
    Vec u, v;
    load2(x + i, u, v, n - i);
    m = at::vec::maximum(m, at::vec::maximum(u.abs(), v.abs()));
    if constexpr (kNeg) ng = ng | (u < zero) | (v < zero);
  }
  if constexpr (kNeg) neg |= any_lane(ng);
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, m);
}

// acc[i] = max(acc[i], |x[i]|) for a contiguous span (NaN wins); neg |= any x < 0.
template <typename T, bool kNeg>
inline void span_absmax_accum(const T* x, float* acc, int64_t n, bool& neg) {
  const Vec zero(0.f);
  Vec ng(0.f);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vec u, v;
    load2(x + i, u, v);
    at::vec::maximum(Vec::loadu(acc + i), u.abs()).store(acc + i);
    at::vec::maximum(Vec::loadu(acc + i + kW), v.abs()).store(acc + i + kW);
    if constexpr (kNeg) ng = ng | (u < zero) | (v < zero);
  }
  for (; i < n; ++i) {
    const float f = static_cast<float>(x[i]);
    acc[i] = nan_max(acc[i], std::fabs(f));
    if constexpr (kNeg) neg |= f < 0.f;
  }
  if constexpr (kNeg) neg |= any_lane(ng);
}

// inner == 1: nblocks blocks of b contiguous elements.
template <typename T, bool kNeg>
bool blocks_contiguous(const T* x, T* out, int64_t nblocks, int64_t b, const IntBounds& bd) {
  std::atomic<bool> neg{false};
  const FakeQuantOp<false> op(bd.min_bound, bd.max_bound);
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / b);
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    bool local = false;
    for (int64_t k = b0; k < b1; ++k) {
      const T* xp = x + k * b;
      T* yp = out + k * b;
      const float s = quant_scale(span_absmax<T, kNeg>(xp, b, local), bd.max_bound);
      if (s == 0.f) {
        std::fill(yp, yp + b, T(0.f));
      } else {
        const float* pp[1] = {&s};
        span_unary<T, 1, false, false>(yp, xp, pp, b, op);
      }
    }
    if (local) neg.store(true, std::memory_order_relaxed);
  });
  return neg.load();
}

constexpr int64_t kMaxTile = 1024;

// inner > 1: (outer, n / b) blocks of b rows, each row a tile of the inner dim.
template <typename T, bool kNeg>
bool blocks_strided(const T* x, T* out, int64_t outer, int64_t n, int64_t inner, int64_t b, const IntBounds& bd) {
  const int64_t nb = n / b;
  // Keep a block tile (b rows) around 64 KiB, so the second pass reads from cache.
  int64_t tile = (int64_t{64 * 1024} / static_cast<int64_t>(sizeof(T))) / b;
  tile = std::min(kMaxTile, std::max(kStep, tile / kStep * kStep));
  tile = std::min(tile, inner);
  const int64_t ntiles = (inner + tile - 1) / tile;
  const int64_t units = outer * nb * ntiles;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / (b * tile));
  const FakeQuantOp<false> op(bd.min_bound, bd.max_bound);
  const FakeQuantOp<true> opz(bd.min_bound, bd.max_bound);
  std::atomic<bool> neg{false};
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    float acc[kMaxTile];
    float sc[kMaxTile];
    bool local = false;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t blk = u / ntiles, i0 = (u % ntiles) * tile;
      const int64_t len = std::min(tile, inner - i0);
      const int64_t base = blk * b * inner + i0;
      std::fill(acc, acc + len, 0.f);
      for (int64_t k = 0; k < b; ++k) span_absmax_accum<T, kNeg>(x + base + k * inner, acc, len, local);
      bool any_zero = false;
      for (int64_t i = 0; i < len; ++i) {
        sc[i] = quant_scale(acc[i], bd.max_bound);
        any_zero |= sc[i] == 0.f;
      }
      const float* pp[1] = {sc};
      for (int64_t k = 0; k < b; ++k) {
        const int64_t off = base + k * inner;
        if (any_zero) span_unary<T, 1, true, false>(out + off, x + off, pp, len, opz);
        else span_unary<T, 1, true, false>(out + off, x + off, pp, len, op);
      }
    }
    if (local) neg.store(true, std::memory_order_relaxed);
  });
  return neg.load();
}

at::Tensor fake_dynamic_block_quant_cpu(const at::Tensor& x, int64_t axis, int64_t block_size, int64_t num_bits,
                                        bool is_unsigned, bool narrow_range) {
  check_input(x);
  check_num_bits(num_bits, is_unsigned);
  const int64_t ax = normalize_axis(axis, x.dim(), "block axis");
  TORCH_CHECK_VALUE(block_size > 0, "block size must be a positive int, got ", block_size);
  const int64_t n = x.dim() ? x.size(ax) : 1;
  TORCH_CHECK_VALUE(n % block_size == 0, "block size ", block_size, " does not divide dim ", ax, " of size ", n,
                    ": allowed block sizes are divisors of ", n);
  // The result has the strides of empty_like(x), as the op's fake impl says; the kernel
  // works on contiguous data (a copy in and out only for a non-contiguous x).
  at::Tensor out = cached_empty_like(x);
  if (x.numel() == 0) return out;
  const at::Tensor xc = x.contiguous();
  at::Tensor yc = out.is_contiguous() ? out : at::empty(xc.sizes(), xc.options());
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < ax; ++d) outer *= x.size(d);
  for (int64_t d = ax + 1; d < x.dim(); ++d) inner *= x.size(d);
  const IntBounds bd = int_bounds(num_bits, is_unsigned, narrow_range);
  const bool neg = dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.const_data_ptr<T>();
    T* yp = yc.mutable_data_ptr<T>();
    if (inner == 1) {
      return is_unsigned ? blocks_contiguous<T, true>(xp, yp, outer * (n / block_size), block_size, bd)
                         : blocks_contiguous<T, false>(xp, yp, outer * (n / block_size), block_size, bd);
    }
    return is_unsigned ? blocks_strided<T, true>(xp, yp, outer, n, inner, block_size, bd)
                       : blocks_strided<T, false>(xp, yp, outer, n, inner, block_size, bd);
  });
  TORCH_CHECK_VALUE(!neg, kNegativeUnsignedMsg);
  if (!yc.is_same(out)) out.copy_(yc);
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace lq

TORCH_LIBRARY_IMPL(lq, CPU, m) { m.impl("fake_dynamic_block_quant", &lq::cpu::fake_dynamic_block_quant_cpu); }
