// FP8 E4M3 fake quantization on CPU: lq::scaled_e4m3.
//
// s = 448 / amax (as reciprocal(amax) * 448, 0 where amax <= 2^-24),
// out = round_e4m3(clamp(x * s, -448, 448)) / s (0 where s == 0), where
// round_e4m3 rounds to the nearest E4M3 value, half to even, subnormals kept;
// equal bit for bit to torch's float8_e4m3fn cast (see cpu_vec.h).
#include <torch/library.h>

#include "common.h"
#include "cpu_elementwise.h"

namespace lq {
namespace cpu {
namespace {

template <bool kZero>
struct E4M3Op {
  Vec vlo{-kE4M3Max}, vhi{kE4M3Max};
  float operator()(float x, const float* p) const {
    const float s = p[0];
    const float r = round_e4m3_f(clamp_f(x * s, -kE4M3Max, kE4M3Max)) / s;
    if constexpr (kZero) return s == 0.f ? 0.f : r;
    return r;
  }
  Vec operator()(const Vec& x, const Vec* p) const {
    const Vec s = p[0];
    const Vec r = round_e4m3_v(clamp_v(x * s, vlo, vhi)) / s;
    if constexpr (kZero) return Vec::blendv(r, Vec(0.f), s == Vec(0.f));
    return r;
  }
};

at::Tensor scaled_e4m3_cpu(const at::Tensor& x, const at::Tensor& amax) {
  check_input(x);
  check_amax_shape(x, amax);
  const at::Tensor a = amax_as_float(amax);
  check_amax_values(a);
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const ScaleInfo si = compute_scales(a, kE4M3Max);
  if (si.all_zero) return out.zero_();
  auto iter = make_iter(out, {x, si.scale});
  dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
    using T = decltype(tag);
    if (si.any_zero) run_unary<T, 1, false>(iter, E4M3Op<true>{});
    else run_unary<T, 1, false>(iter, E4M3Op<false>{});
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace lq

TORCH_LIBRARY_IMPL(lq, CPU, m) { m.impl("scaled_e4m3", &lq::cpu::scaled_e4m3_cpu); }
