// The integer quantization ops shared by the elementwise kernel (fake_quant.cpp)
// and the fused dynamic block kernel (block_quant.cpp).
#pragma once

#include "cpu_vec.h"

namespace lq {
namespace cpu {

// q / s with q = clamp(round(x * s)); kZero: some s may be 0 (output 0 there).
template <bool kZero>
struct FakeQuantOp {
  float lo, hi;
  Vec vlo, vhi;
  FakeQuantOp(float lo_, float hi_) : lo(lo_), hi(hi_), vlo(lo_), vhi(hi_) {}
  float operator()(float x, const float* p) const {
    const float s = p[0];
    const float r = clamp_f(round_f(x * s), lo, hi) / s;
    if constexpr (kZero) return s == 0.f ? 0.f : r;
    return r;
  }
  Vec operator()(const Vec& x, const Vec* p) const {
    const Vec s = p[0];
    const Vec r = clamp_v((x * s).round(), vlo, vhi) / s;
    if constexpr (kZero) return Vec::blendv(r, Vec(0.f), s == Vec(0.f));
    return r;
  }
};

struct QuantOp {
  float lo, hi;
  Vec vlo, vhi;
  QuantOp(float lo_, float hi_) : lo(lo_), hi(hi_), vlo(lo_), vhi(hi_) {}
  float operator()(float x, const float* p) const { return clamp_f(round_f(x * p[0]), lo, hi); }
  Vec operator()(const Vec& x, const Vec* p) const { return clamp_v((x * p[0]).round(), vlo, vhi); }
};

}  // namespace cpu
}  // namespace lq
