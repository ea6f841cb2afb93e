// lq CUDA kernels: elementwise ops (no torch headers).
//
// An op is a small functor (FakeQuantOp, ...) that turns its broadcast operands
// (amax, or min/max range) into a per-element context (e.g. the scale) and then
// maps the elementwise inputs (x, or grad and x) to the output. Two kernel
// bodies run any op:
//
// * DenseBody: every elementwise operand has the same dense layout (any
//   permutation of dims, e.g. channels_last), so the kernel walks memory in
//   order with 16-byte vector loads and stores where the pointers allow; the
//   broadcast operand's offset is computed from the position (BcastMap): a
//   constant (per-tensor, MAXR = 0), one divide/modulo (per-channel, MAXR = 1)
//   or up to 8 (MAXR = kMaxDims). When no broadcast coordinate changes inside
//   a vector the context is computed once per vector; with one broadcast dim
//   the coordinate is divided out once per vector and then stepped.
// * StridedBody: any strides (rank <= 8 after coalescing), one element per
//   thread; the slow path for non-dense inputs, expanded gradients, strided out=.
//
// Both bodies are LQ_HD, launched on the device by lq_kernel and on the host
// by the emulation in csrc/cuda/emulation.cu.
#pragma once

#include "lq_numerics.cuh"

namespace lq {
namespace cuda {

// ------------------------------------------------------------------ ops
// Interface: out_t, in0_t, in1_t, kNumIn (1 or 2 elementwise inputs), kNumB
// (0..2 broadcast float32 operands), Ctx, ctx(b0, b1), apply(ctx, a, b).

template <typename T>
struct FakeQuantOp {
  using out_t = T;
  using in0_t = T;
  using in1_t = T;  // unused
  static constexpr int kNumIn = 1;
  static constexpr int kNumB = 1;
  using Ctx = float;  // scale
  IntGrid grid;
  LQ_HD Ctx ctx(float amax, float) const { return checked_scale(amax, grid.max_bound); }
  LQ_HD out_t apply(Ctx scale, in0_t x, in1_t) const {
    return from_float<T>(fake_quant_value(to_float(x), scale, grid));
  }
};

// lq::quant, first output: the integer values, stored in x's dtype.
template <typename T>
struct QuantOp {
  using out_t = T;
  using in0_t = T;
  using in1_t = T;
  static constexpr int kNumIn = 1;
  static constexpr int kNumB = 1;
  using Ctx = float;
  IntGrid grid;
  LQ_HD Ctx ctx(float amax, float) const { return checked_scale(amax, grid.max_bound); }
  LQ_HD out_t apply(Ctx scale, in0_t x, in1_t) const { return from_float<T>(quantize(to_float(x), scale, grid)); }
};

// lq::quant, second output: the scale (1 where amax <= 2^-24), over amax's elements.
struct QuantScaleOp {
  using out_t = float;
  using in0_t = float;
  using in1_t = float;
  static constexpr int kNumIn = 1;
  static constexpr int kNumB = 0;
  using Ctx = int;
  float max_bound;
  LQ_HD Ctx ctx(float, float) const { return 0; }
  LQ_HD out_t apply(Ctx, in0_t amax, in1_t) const {
    const float s = checked_scale(amax, max_bound);
    return s == 0.0f ? 1.0f : s;
  }
};

// Clipped straight-through estimator: grad where |x| <= amax, else 0 (output in grad's dtype).
template <typename T, typename TX>
struct FakeQuantBackwardOp {
  using out_t = T;
  using in0_t = T;   // grad
  using in1_t = TX;  // x
  static constexpr int kNumIn = 2;
  static constexpr int kNumB = 1;
  using Ctx = float;  // amax
  LQ_HD Ctx ctx(float amax, float) const { return amax; }
  LQ_HD out_t apply(Ctx amax, in0_t g, in1_t x) const {
    return fabsf(to_float(x)) <= amax ? g : from_float<T>(0.0f);
  }
};

template <typename T>
struct FakeAffineOp {
  using out_t = T;
  using in0_t = T;
  using in1_t = T;
  static constexpr int kNumIn = 1;
  static constexpr int kNumB = 2;
  using Ctx = AffineParams;
  float levels;  // 2^num_bits - 1
  float min_bound;
  float max_bound;
  LQ_HD Ctx ctx(float lo, float hi) const { return affine_params(lo, hi, levels, min_bound); }
  LQ_HD out_t apply(Ctx p, in0_t x, in1_t) const {
    return from_float<T>(fake_affine_value(to_float(x), p, min_bound, max_bound));
  }
};

struct RangeCtx {
  float lo;
  float hi;
};

template <typename T, typename TX>
struct FakeAffineBackwardOp {
  using out_t = T;
  using in0_t = T;
  using in1_t = TX;
  static constexpr int kNumIn = 2;
  static constexpr int kNumB = 2;
  using Ctx = RangeCtx;
  LQ_HD Ctx ctx(float lo, float hi) const { return RangeCtx{lo, hi}; }
  LQ_HD out_t apply(Ctx r, in0_t g, in1_t x) const {
    const float xf = to_float(x);
    return (xf >= r.lo && xf <= r.hi) ? g : from_float<T>(0.0f);
  }
};

template <typename T>
struct ScaledE4M3Op {
  using out_t = T;
  using in0_t = T;
  using in1_t = T;
  static constexpr int kNumIn = 1;
  static constexpr int kNumB = 1;
  using Ctx = float;
  LQ_HD Ctx ctx(float amax, float) const { return checked_e4m3_scale(amax); }
  LQ_HD out_t apply(Ctx scale, in0_t x, in1_t) const {
    return from_float<T>(scaled_e4m3_value(to_float(x), scale));
  }
};

// ------------------------------------------------------------------ kernel bodies
template <typename Op>
struct ElementwiseArgs {
  using out_t = typename Op::out_t;
  using in0_t = typename Op::in0_t;
  using in1_t = typename Op::in1_t;
  Op op;
  out_t* out = nullptr;
  const in0_t* in0 = nullptr;
  const in1_t* in1 = nullptr;
  const float* b0 = nullptr;
  const float* b1 = nullptr;
  int64_t numel = 0;
  bool small = true;  // numel < 2^31: 32-bit index arithmetic
};

// Vector width of a dense op: 16 bytes of the output type.
template <typename Op>
struct DenseVec {
  static constexpr int value = VecWidth<typename Op::out_t>::value;
};

template <typename Op, int MAXR>
struct DenseBody {
  using out_t = typename Op::out_t;
  using in0_t = typename Op::in0_t;
  using in1_t = typename Op::in1_t;
  static constexpr int V = DenseVec<Op>::value;

  ElementwiseArgs<Op> a;
  BcastMap m0;
  BcastMap m1;
  bool vectorized = false;  // all elementwise pointers aligned to their vector size
  bool shared_ctx = false;  // no broadcast coordinate changes inside an aligned vector

  // Threads needed for numel elements.
  LQ_HD int64_t threads() const { return vectorized ? (a.numel + V - 1) / V : a.numel; }

  LQ_HD typename Op::Ctx ctx_at(uint64_t pos) const {
    float v0 = 0.0f, v1 = 0.0f;
    if constexpr (Op::kNumB >= 1) v0 = a.b0[m0.template offset<MAXR>(pos, a.small)];
    if constexpr (Op::kNumB >= 2) v1 = a.b1[m1.template offset<MAXR>(pos, a.small)];
    return a.op.ctx(v0, v1);
  }

  // Position within a rank <= 1 broadcast map: pos = (q * div + r), coordinate c = q % mod.
  struct Walk {
    uint64_t r = 0;
    uint64_t c = 0;
    LQ_HD int64_t offset(const BcastMap& m) const { return m.rank ? static_cast<int64_t>(c) * m.stride[0] : 0; }
    LQ_HD void step(const BcastMap& m) {
      if (m.rank && ++r == m.div[0].d) {
        r = 0;
        if (++c == m.mod[0].d) c = 0;
      }
    }
  };
  LQ_HD Walk walk_start(const BcastMap& m, uint64_t pos) const {
    Walk w;
    if (m.rank) {
      const uint64_t q = m.div[0].div(pos, a.small);
      w.r = pos - q * m.div[0].d;
      w.c = m.mod[0].mod(q, a.small);
    }
    return w;
  }

  LQ_HD void element(int64_t i, const typename Op::Ctx& c) const {
    in1_t x1{};
    if constexpr (Op::kNumIn >= 2) x1 = a.in1[i];
    a.out[i] = a.op.apply(c, a.in0[i], x1);
  }

  LQ_HD void operator()(int64_t t) const {
    if (!vectorized) {
      if (t < a.numel) element(t, ctx_at(static_cast<uint64_t>(t)));
      return;
    }
    const int64_t base = t * V;
    if (base >= a.numel) return;
    if (base + V > a.numel) {  // ragged tail
      for (int64_t i = base; i < a.numel; ++i) element(i, ctx_at(static_cast<uint64_t>(i)));
      return;
    }
    const Vec<in0_t, V> x0 = load_vec<in0_t, V>(a.in0 + base);
    Vec<in1_t, V> x1;
    if constexpr (Op::kNumIn >= 2) x1 = load_vec<in1_t, V>(a.in1 + base);
    Vec<out_t, V> y;
    if (shared_ctx) {
      const typename Op::Ctx c = ctx_at(static_cast<uint64_t>(base));
#pragma unroll
      for (int j = 0; j < V; ++j) {
        in1_t b{};
        if constexpr (Op::kNumIn >= 2) b = x1.v[j];
        y.v[j] = a.op.apply(c, x0.v[j], b);
      }
    } else if constexpr (MAXR == 1) {
      // one broadcast dim whose coordinate changes inside the vector: divide
      // once, then step the coordinate along the vector
      Walk w0 = walk_start(m0, static_cast<uint64_t>(base));
      Walk w1 = walk_start(m1, static_cast<uint64_t>(base));
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float v0 = 0.0f, v1 = 0.0f;
        if constexpr (Op::kNumB >= 1) v0 = a.b0[w0.offset(m0)];
        if constexpr (Op::kNumB >= 2) v1 = a.b1[w1.offset(m1)];
        in1_t b{};
        if constexpr (Op::kNumIn >= 2) b = x1.v[j];
        y.v[j] = a.op.apply(a.op.ctx(v0, v1), x0.v[j], b);
        w0.step(m0);
        w1.step(m1);
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        in1_t b{};
        if constexpr (Op::kNumIn >= 2) b = x1.v[j];
        y.v[j] = a.op.apply(ctx_at(static_cast<uint64_t>(base + j)), x0.v[j], b);
      }
    }
    store_vec<out_t, V>(a.out + base, y);
  }
};

// Operand slots of StridedMap.
enum StridedSlot : int { kSlotOut = 0, kSlotIn0 = 1, kSlotIn1 = 2, kSlotB0 = 3, kSlotB1 = 4 };

template <typename Op>
struct StridedBody {
  ElementwiseArgs<Op> a;
  StridedMap map;

  LQ_HD int64_t threads() const { return a.numel; }

  LQ_HD void operator()(int64_t t) const {
    if (t >= a.numel) return;
    int64_t off[kMaxOperands];
    map.offsets(static_cast<uint64_t>(t), a.small, off);
    float v0 = 0.0f, v1 = 0.0f;
    if constexpr (Op::kNumB >= 1) v0 = a.b0[off[kSlotB0]];
    if constexpr (Op::kNumB >= 2) v1 = a.b1[off[kSlotB1]];
    typename Op::in1_t x1{};
    if constexpr (Op::kNumIn >= 2) x1 = a.in1[off[kSlotIn1]];
    a.out[off[kSlotOut]] = a.op.apply(a.op.ctx(v0, v1), a.in0[off[kSlotIn0]], x1);
  }
};

#if defined(__CUDACC__)
// One thread per vector (dense) or element (strided).
template <typename Body>
__global__ void __launch_bounds__(kBlockThreads) lq_elementwise_kernel(const Body body, int64_t threads) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < threads) body(t);
}
#endif

}  // namespace cuda
}  // namespace lq
