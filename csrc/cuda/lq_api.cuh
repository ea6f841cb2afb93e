// lq CUDA kernels: layout planning, dtype dispatch and launching (no torch headers).
//
// The torch glue (lq_cuda.cu) turns tensors into TensorViews (data pointer,
// dtype, sizes, strides in elements) and calls the functions at the bottom of
// this file with a DeviceExec (launches on a CUDA stream). The host emulation
// (emulation.cu) calls the very same functions with an executor that runs the
// kernel bodies on the CPU, so the planning below is tested without a GPU.
//
// Nothing here synchronizes with the host or reads tensor data on the host:
// every launch is asynchronous on the given stream and can be captured in a
// CUDA graph.
#pragma once

#include <algorithm>
#include <utility>

#include "lq_block.cuh"
#include "lq_elementwise.cuh"
#include "lq_histogram.cuh"

namespace lq {
namespace cuda {

enum class DType : int { Float = 0, Half = 1, BFloat16 = 2 };

enum Status : int {
  kOk = 0,
  kUnsupportedLayout = 1,  // more than kMaxDims dims after coalescing: the caller makes inputs contiguous
  kBadDtype = 2,
  kBadArgument = 3,
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::Float;
  int ndim = 0;
  const int64_t* sizes = nullptr;
  const int64_t* strides = nullptr;  // in elements
};

// ------------------------------------------------------------------ planning (host)
LQ_HOST int64_t numel_of(const TensorView& t) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= t.sizes[d];
  return n;
}

// Non-overlapping and dense: the elements fill [data, data + numel) exactly.
LQ_HOST bool is_dense(const TensorView& t) {
  int idx[64];
  int m = 0;
  for (int d = 0; d < t.ndim && m < 64; ++d)
    if (t.sizes[d] != 1) idx[m++] = d;
  for (int d = 0; d < t.ndim; ++d)
    if (t.sizes[d] == 0) return true;
  std::sort(idx, idx + m, [&](int a, int b) { return t.strides[a] < t.strides[b]; });
  int64_t expected = 1;
  for (int k = 0; k < m; ++k) {
    if (t.strides[idx[k]] != expected) return false;
    expected *= t.sizes[idx[k]];
  }
  return true;
}

// Same strides as `ref` on every dim of size > 1.
LQ_HOST bool same_layout(const TensorView& t, const TensorView& ref) {
  if (t.ndim != ref.ndim) return false;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.sizes[d] != ref.sizes[d]) return false;
    if (t.sizes[d] != 1 && t.strides[d] != ref.strides[d]) return false;
  }
  return true;
}

LQ_HOST bool aligned(const void* p, size_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// Broadcast operand `b` (expanded to the iteration shape: stride 0 on broadcast
// dims) seen from a dense iteration over `ref` in memory order.
LQ_HOST bool make_bcast_map(const TensorView& b, const TensorView& ref, BcastMap& map) {
  struct Entry {
    int64_t div, mod, stride;
  };
  Entry e[64];
  int m = 0;
  for (int d = 0; d < ref.ndim; ++d) {
    if (ref.sizes[d] > 1 && b.strides[d] != 0) {
      if (m == 64) return false;
      e[m++] = Entry{ref.strides[d], ref.sizes[d], b.strides[d]};
    }
  }
  std::sort(e, e + m, [](const Entry& x, const Entry& y) { return x.div > y.div; });
  // merge neighbours in memory order that the operand also stores contiguously
  int r = 0;
  for (int k = 0; k < m; ++k) {
    if (r > 0) {
      Entry& prev = e[r - 1];  // slower
      const Entry& cur = e[k];  // faster
      if (prev.div == cur.div * cur.mod && prev.stride == cur.stride * cur.mod) {
        prev = Entry{cur.div, prev.mod * cur.mod, cur.stride};
        continue;
      }
    }
    e[r++] = e[k];
  }
  if (r > kMaxDims) return false;
  map.rank = r;
  for (int k = 0; k < r; ++k) {
    map.div[k] = Divmod(static_cast<uint64_t>(e[k].div));
    map.mod[k] = Divmod(static_cast<uint64_t>(e[k].mod));
    map.stride[k] = e[k].stride;
  }
  return true;
}

LQ_HOST bool vector_free(const BcastMap& m, int vec) {
  for (int k = 0; k < m.rank; ++k)
    if (m.div[k].d % static_cast<uint64_t>(vec) != 0) return false;
  return true;
}

// Strided iteration over `ops` (all of the same sizes), ordered by ops[0]'s
// strides (the output: coalesced writes), size-1 dims dropped, neighbours merged.
LQ_HOST bool make_strided_map(const TensorView* ops, int nops, StridedMap& map) {
  const TensorView& out = ops[0];
  int idx[64];
  int m = 0;
  for (int d = 0; d < out.ndim; ++d) {
    if (out.sizes[d] != 1) {
      if (m == 64) return false;
      idx[m++] = d;
    }
  }
  std::stable_sort(idx, idx + m, [&](int a, int b) { return out.strides[a] > out.strides[b]; });
  int64_t sizes[64];
  int64_t strides[kMaxOperands][64];
  int r = 0;
  for (int k = 0; k < m; ++k) {
    const int d = idx[k];
    if (r > 0) {
      bool merge = true;
      for (int o = 0; o < nops; ++o)
        if (strides[o][r - 1] != ops[o].strides[d] * ops[o].sizes[d]) merge = false;
      if (merge) {
        sizes[r - 1] *= out.sizes[d];
        for (int o = 0; o < nops; ++o) strides[o][r - 1] = ops[o].strides[d];
        continue;
      }
    }
    sizes[r] = out.sizes[d];
    for (int o = 0; o < nops; ++o) strides[o][r] = ops[o].strides[d];
    for (int o = nops; o < kMaxOperands; ++o) strides[o][r] = 0;
    ++r;
  }
  if (r > kMaxDims) return false;
  map.ndim = r;
  for (int k = 0; k < r; ++k) {
    map.size[k] = Divmod(static_cast<uint64_t>(sizes[k]));
    for (int o = 0; o < kMaxOperands; ++o) map.stride[o][k] = o < nops ? strides[o][k] : 0;
  }
  return true;
}

// ------------------------------------------------------------------ elementwise driver
// out, in0, in1 (kNumIn == 2) are elementwise; b0, b1 (kNumB) are float32
// broadcast operands already expanded to the iteration shape.
template <typename Op, typename Exec>
Status run_elementwise(Exec& ex, const Op& op, const TensorView& out, const TensorView& in0, const TensorView& in1,
                       const TensorView& b0, const TensorView& b1) {
  using out_t = typename Op::out_t;
  using in0_t = typename Op::in0_t;
  using in1_t = typename Op::in1_t;
  constexpr int V = DenseVec<Op>::value;
  const int64_t numel = numel_of(out);
  if (numel == 0) return kOk;
  ElementwiseArgs<Op> a;
  a.op = op;
  a.out = static_cast<out_t*>(out.data);
  a.in0 = static_cast<const in0_t*>(in0.data);
  a.in1 = Op::kNumIn >= 2 ? static_cast<const in1_t*>(in1.data) : nullptr;
  a.b0 = Op::kNumB >= 1 ? static_cast<const float*>(b0.data) : nullptr;
  a.b1 = Op::kNumB >= 2 ? static_cast<const float*>(b1.data) : nullptr;
  a.numel = numel;
  a.small = numel < (int64_t(1) << 31);

  const bool dense = is_dense(in0) && same_layout(out, in0) && (Op::kNumIn < 2 || same_layout(in1, in0));
  BcastMap m0, m1;
  bool maps_ok = true;
  if (dense) {
    if (Op::kNumB >= 1) maps_ok = maps_ok && make_bcast_map(b0, in0, m0);
    if (Op::kNumB >= 2) maps_ok = maps_ok && make_bcast_map(b1, in0, m1);
  }
  if (dense && maps_ok) {
    const bool vec = aligned(out.data, sizeof(Vec<out_t, V>)) && aligned(in0.data, sizeof(Vec<in0_t, V>)) &&
                     (Op::kNumIn < 2 || aligned(in1.data, sizeof(Vec<in1_t, V>)));
    const bool shared = vector_free(m0, V) && vector_free(m1, V);
    const int rank = std::max(m0.rank, m1.rank);
    if (rank == 0) {
      DenseBody<Op, 0> body{a, m0, m1, vec, shared};
      ex.elementwise(body);
    } else if (rank == 1) {
      DenseBody<Op, 1> body{a, m0, m1, vec, shared};
      ex.elementwise(body);
    } else {
      DenseBody<Op, kMaxDims> body{a, m0, m1, vec, shared};
      ex.elementwise(body);
    }
    return kOk;
  }
  TensorView ops[kMaxOperands] = {out, in0, Op::kNumIn >= 2 ? in1 : in0, Op::kNumB >= 1 ? b0 : out,
                                  Op::kNumB >= 2 ? b1 : out};
  StridedBody<Op> body;
  body.a = a;
  if (!make_strided_map(ops, kMaxOperands, body.map)) return kUnsupportedLayout;
  ex.elementwise(body);
  return kOk;
}

// Calls f(T{}) with T the C++ type of `dt`.
template <typename F>
Status dispatch_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::Float:
      return f(float{});
    case DType::Half:
      return f(__half{});
    case DType::BFloat16:
      return f(__nv_bfloat16{});
  }
  return kBadDtype;
}

// ------------------------------------------------------------------ ops
// amax, min_range, max_range: float32, expanded to x's sizes.

template <typename Exec>
Status fake_quant(Exec& ex, const TensorView& out, const TensorView& x, const TensorView& amax, int num_bits,
                  bool is_unsigned, bool narrow_range) {
  if (out.dtype != x.dtype) return kBadDtype;
  const IntGrid g = IntGrid::make(num_bits, is_unsigned, narrow_range);
  return dispatch_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    return run_elementwise(ex, FakeQuantOp<T>{g}, out, x, x, amax, amax);
  });
}

// q (x's dtype and sizes) and scale (over amax_raw: amax's own float32 elements).
template <typename Exec>
Status quant(Exec& ex, const TensorView& q, const TensorView& scale, const TensorView& x, const TensorView& amax,
             const TensorView& amax_raw, int num_bits, bool is_unsigned, bool narrow_range) {
  if (q.dtype != x.dtype || scale.dtype != DType::Float || amax_raw.dtype != DType::Float) return kBadDtype;
  const IntGrid g = IntGrid::make(num_bits, is_unsigned, narrow_range);
  const Status s = dispatch_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    return run_elementwise(ex, QuantOp<T>{g}, q, x, x, amax, amax);
  });
  if (s != kOk) return s;
  return run_elementwise(ex, QuantScaleOp{g.max_bound}, scale, amax_raw, amax_raw, amax_raw, amax_raw);
}

// grad's dtype is the output's; x has grad's dtype or float32.
template <typename Exec>
Status fake_quant_backward(Exec& ex, const TensorView& out, const TensorView& grad, const TensorView& x,
                           const TensorView& amax) {
  if (out.dtype != grad.dtype) return kBadDtype;
  if (x.dtype != grad.dtype && x.dtype != DType::Float) return kBadDtype;
  const bool x_float = x.dtype == DType::Float;
  return dispatch_dtype(grad.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (x_float) return run_elementwise(ex, FakeQuantBackwardOp<T, float>{}, out, grad, x, amax, amax);
    return run_elementwise(ex, FakeQuantBackwardOp<T, T>{}, out, grad, x, amax, amax);
  });
}

template <typename Exec>
Status fake_affine_quant(Exec& ex, const TensorView& out, const TensorView& x, const TensorView& lo,
                         const TensorView& hi, int num_bits) {
  if (out.dtype != x.dtype) return kBadDtype;
  const float levels = static_cast<float>((int64_t(1) << num_bits) - 1);
  const float min_bound = -static_cast<float>(int64_t(1) << (num_bits - 1));
  const float max_bound = static_cast<float>((int64_t(1) << (num_bits - 1)) - 1);
  return dispatch_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    return run_elementwise(ex, FakeAffineOp<T>{levels, min_bound, max_bound}, out, x, x, lo, hi);
  });
}

template <typename Exec>
Status fake_affine_quant_backward(Exec& ex, const TensorView& out, const TensorView& grad, const TensorView& x,
                                  const TensorView& lo, const TensorView& hi) {
  if (out.dtype != grad.dtype) return kBadDtype;
  if (x.dtype != grad.dtype && x.dtype != DType::Float) return kBadDtype;
  const bool x_float = x.dtype == DType::Float;
  return dispatch_dtype(grad.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (x_float) return run_elementwise(ex, FakeAffineBackwardOp<T, float>{}, out, grad, x, lo, hi);
    return run_elementwise(ex, FakeAffineBackwardOp<T, T>{}, out, grad, x, lo, hi);
  });
}

template <typename Exec>
Status scaled_e4m3(Exec& ex, const TensorView& out, const TensorView& x, const TensorView& amax) {
  if (out.dtype != x.dtype) return kBadDtype;
  return dispatch_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    return run_elementwise(ex, ScaledE4M3Op<T>{}, out, x, x, amax, amax);
  });
}

// out and x contiguous, viewed as (outer, n, inner), blocks of bs along n.
template <typename Exec>
Status fake_dynamic_block_quant(Exec& ex, void* out, const void* x, DType dt, int64_t outer, int64_t n,
                                int64_t inner, int64_t bs, int num_bits, bool is_unsigned, bool narrow_range) {
  if (bs <= 0 || n % bs != 0) return kBadArgument;
  const int64_t numel = outer * n * inner;
  if (numel == 0) return kOk;
  const IntGrid g = IntGrid::make(num_bits, is_unsigned, narrow_range);
  return dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = VecWidth<T>::value;
    BlockQuantArgs<T> a;
    a.out = static_cast<T*>(out);
    a.x = static_cast<const T*>(x);
    a.outer = outer;
    a.n = n;
    a.inner = inner;
    a.bs = bs;
    a.grid = g;
    a.small = numel < (int64_t(1) << 31);
    const bool al = aligned(out, 16) && aligned(x, 16);
    if (inner == 1) {
      const bool vec = al && bs % V == 0;
      const int64_t nvec = vec ? bs / V : bs;
      int group = 1, shift = 0;
      while (group < 32 && group * 2 <= nvec) {
        group *= 2;
        ++shift;
      }
      if (vec) {
        BlockContigBody<T, V> body{a, numel / bs, nvec, group, shift};
        ex.block_quant_contig(body);
      } else {
        BlockContigBody<T, 1> body{a, numel / bs, nvec, group, shift};
        ex.block_quant_contig(body);
      }
    } else {
      const bool vec = al && inner % V == 0;
      const int vi = vec ? V : 1;
      const int64_t columns = outer * (n / bs) * (inner / vi);
      if (vec) {
        BlockStridedBody<T, V> body{a, columns, Divmod(static_cast<uint64_t>(inner / V)),
                                    Divmod(static_cast<uint64_t>(n / bs))};
        ex.block_quant_strided(body);
      } else {
        BlockStridedBody<T, 1> body{a, columns, Divmod(static_cast<uint64_t>(inner)),
                                    Divmod(static_cast<uint64_t>(n / bs))};
        ex.block_quant_strided(body);
      }
    }
    return kOk;
  });
}

// x viewed as (outer, channels, inner) in memory order; outputs zeroed by the caller.
template <typename Exec>
Status abs_histogram(Exec& ex, const void* x, DType dt, int64_t outer, int64_t channels, int64_t inner,
                     const float* range, bool range_per_channel, int64_t num_bins, int64_t* counts, float* absmax,
                     int64_t* nonfinite) {
  if (num_bins <= 0) return kBadArgument;
  if (outer * channels * inner == 0 || channels == 0) return kOk;
  return dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = VecWidth<T>::value;
    HistArgs<T> a;
    a.x = static_cast<const T*>(x);
    a.outer = outer;
    a.channels = channels;
    a.inner = inner;
    a.per_channel = outer * inner;
    a.inner_div = Divmod(static_cast<uint64_t>(inner));
    a.range = range;
    a.range_per_channel = range_per_channel;
    a.num_bins = num_bins;
    a.counts = reinterpret_cast<unsigned long long*>(counts);
    a.absmax = absmax;
    a.nonfinite = reinterpret_cast<unsigned long long*>(nonfinite);
    a.small = outer * channels * inner < (int64_t(1) << 31);
    const bool smem = num_bins <= kHistSmemBins;
    if (aligned(x, 16) && inner % V == 0) {
      if (smem) {
        ex.template histogram<T, V, true>(a);
      } else {
        ex.template histogram<T, V, false>(a);
      }
    } else {
      if (smem) {
        ex.template histogram<T, 1, true>(a);
      } else {
        ex.template histogram<T, 1, false>(a);
      }
    }
    return kOk;
  });
}

// ------------------------------------------------------------------ launching on a device
// Grid of a histogram: grid.y strides over channels, grid.x splits a channel;
// about 8 blocks per SM in all, enough blocks that a block's 32-bit shared
// counters cannot overflow.
struct HistGrid {
  int64_t x, y;
};
LQ_HOST HistGrid histogram_grid(int64_t channels, int64_t per_channel, int ve, int sm_count) {
  const int64_t gy = std::min<int64_t>(channels, 65535);
  const int64_t per_block = int64_t(kBlockThreads) * ve;
  const int64_t need = (per_channel + per_block - 1) / per_block;
  const int64_t target = std::max<int64_t>(1, (int64_t(sm_count) * 8 + gy - 1) / gy);
  const int64_t min_blocks = per_channel / (int64_t(1) << 31) + 1;
  const int64_t gx = std::max<int64_t>(std::min<int64_t>(std::min<int64_t>(need, target), int64_t(1) << 30),
                                       std::max<int64_t>(min_blocks, 1));
  return HistGrid{gx, gy};
}

#if defined(__CUDACC__)
struct DeviceExec {
  cudaStream_t stream = nullptr;
  int sm_count = 1;

  static unsigned blocks_for(int64_t threads) {
    return static_cast<unsigned>((threads + kBlockThreads - 1) / kBlockThreads);
  }

  template <typename Body>
  void elementwise(const Body& body) {
    const int64_t threads = body.threads();
    if (threads <= 0) return;
    lq_elementwise_kernel<Body><<<blocks_for(threads), kBlockThreads, 0, stream>>>(body, threads);
  }

  template <typename T, int VE>
  void block_quant_contig(const BlockContigBody<T, VE>& body) {
    const int64_t threads = body.threads();
    if (threads <= 0) return;
    lq_block_quant_contig_kernel<T, VE><<<blocks_for(threads), kBlockThreads, 0, stream>>>(body);
  }

  template <typename T, int VI>
  void block_quant_strided(const BlockStridedBody<T, VI>& body) {
    const int64_t threads = body.threads();
    if (threads <= 0) return;
    lq_block_quant_strided_kernel<T, VI><<<blocks_for(threads), kBlockThreads, 0, stream>>>(body);
  }

  template <typename T, int VE, bool SMEM>
  void histogram(const HistArgs<T>& a) {
    const HistGrid g = histogram_grid(a.channels, a.per_channel, VE, sm_count);
    const size_t smem = SMEM ? static_cast<size_t>(a.num_bins) * sizeof(uint32_t) : 0;
    lq_abs_histogram_kernel<T, VE, SMEM>
        <<<dim3(static_cast<unsigned>(g.x), static_cast<unsigned>(g.y)), kBlockThreads, smem, stream>>>(a);
  }
};
#endif

}  // namespace cuda
}  // namespace lq
