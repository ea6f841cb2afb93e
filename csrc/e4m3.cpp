// FP8 E4M3 fake quantization on CPU: lq::scaled_e4m3.
//
// s = 448 / amax (as reciprocal(amax) * 448, 0 where amax <= 2^-24),
// out = round_e4m3(clamp(x * s, -448, 448)) / s (0 where s == 0), where
// round_e4m3 rounds to the nearest E4M3 value, half to even, subnormals kept;
// equal bit for bit to torch's float8_e4m3fn cast (see cpu_vec.h).
#include <ATen/ops/scalar_tensor.h>
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
  const bool single = amax.numel() == 1;
  at::Tensor a;
  float scale = 0.f;
  ScaleInfo si;
  if (single) {
    const float v = single_value(amax);
    check_amax_value(v);
    scale = e4m3_scale(v);
    si.any_zero = si.all_zero = scale == 0.f;
  } else {
    a = amax_as_float(amax);
    check_amax_values(a);
    si = compute_scales(a, e4m3_scale);
  }
  at::Tensor out = cached_empty_like(x);
  if (x.numel() == 0) return out;
  if (si.all_zero) return out.zero_();
  dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
    using T = decltype(tag);
    if (single && x.is_contiguous() && out.is_contiguous()) {
      run_unary_contiguous<T, 1, false>(out.mutable_data_ptr<T>(), x.const_data_ptr<T>(), x.numel(),
                                        std::array<float, 1>{scale}, E4M3Op<false>{});
      return;
    }
    auto iter = make_iter(out, {x, single ? at::scalar_tensor(scale, x.options().dtype(at::kFloat)) : si.scale});
    if (si.any_zero) run_unary<T, 1, false>(iter, E4M3Op<true>{});
    else run_unary<T, 1, false>(iter, E4M3Op<false>{});
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace lq

TORCH_LIBRARY_IMPL(lq, CPU, m) { m.impl("scaled_e4m3", &lq::cpu::scaled_e4m3_cpu); }
