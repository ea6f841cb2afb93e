// Affine (scale + zero point, gemmlowp-style) fake quantization on CPU:
// lq::fake_affine_quant and its clipped STE backward lq::fake_affine_quant_backward.
//
// step = (max_range - min_range) / (2^num_bits - 1), zp = round(min_range / step) - min_bound,
// q = clamp(round(x / step) - zp, min_bound, max_bound), out = (q + zp) * step (float32).
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include "common.h"
#include "cpu_elementwise.h"

namespace lq {
namespace cpu {
namespace {

struct AffineOp {  // p[0] = step, p[1] = zero point
  float lo, hi;
  Vec vlo, vhi;
  AffineOp(float lo_, float hi_) : lo(lo_), hi(hi_), vlo(lo_), vhi(hi_) {}
  float operator()(float x, const float* p) const {
    const float q = clamp_f(round_f(x / p[0]) - p[1], lo, hi);
    return (q + p[1]) * p[0];
  }
  Vec operator()(const Vec& x, const Vec* p) const {
    const Vec q = clamp_v((x / p[0]).round() - p[1], vlo, vhi);
    return (q + p[1]) * p[0];
  }
};

struct RangeOp {  // inside [p[0], p[1]], inclusive; NaN is outside
  bool inside(float x, const float* p) const { return x >= p[0] && x <= p[1]; }
  Vec inside(const Vec& x, const Vec* p) const { return (x >= p[0]) & (x <= p[1]); }
};

at::Tensor fake_affine_quant_cpu(const at::Tensor& x, const at::Tensor& min_range, const at::Tensor& max_range,
                                 int64_t num_bits) {
  check_input(x);
  check_num_bits(num_bits, false);
  check_amax_shape(x, min_range, "min_range");
  check_amax_shape(x, max_range, "max_range");
  const float levels = static_cast<float>((int64_t{1} << num_bits) - 1);
  const float min_bound = -static_cast<float>(int64_t{1} << (num_bits - 1));
  const float max_bound = static_cast<float>((int64_t{1} << (num_bits - 1)) - 1);
  const AffineOp op(min_bound, max_bound);
  at::Tensor out = cached_empty_like(x);
  if (min_range.numel() == 1 && max_range.numel() == 1) {
    // step = (hi - lo) / levels, zp = round(lo / step) - min_bound, in float32 as the reference.
    const float lo = single_value(min_range), hi = single_value(max_range);
    const float step = (hi - lo) / levels;
    const float zp = std::nearbyint(lo / step) - min_bound;
    if (x.numel() == 0) return out;
    dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
      using T = decltype(tag);
      if (x.is_contiguous() && out.is_contiguous()) {
        run_unary_contiguous<T, 2, false>(out.mutable_data_ptr<T>(), x.const_data_ptr<T>(), x.numel(),
                                          std::array<float, 2>{step, zp}, op);
        return;
      }
      const auto fopt = x.options().dtype(at::kFloat);
      auto iter = make_iter(out, {x, at::scalar_tensor(step, fopt), at::scalar_tensor(zp, fopt)});
      run_unary<T, 2, false>(iter, op);
    });
    return out;
  }
  // Per-channel ranges: the parameters with the same ATen ops (so the same roundings) as the reference.
  const at::Tensor lo = amax_as_float(min_range), hi = amax_as_float(max_range);
  const at::Tensor step = hi.sub(lo).div(static_cast<double>(levels)).contiguous();
  const at::Tensor zp = lo.div(step).round().sub(static_cast<double>(min_bound)).contiguous();
  if (x.numel() == 0) return out;
  auto iter = make_iter(out, {x, step, zp});
  dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
    using T = decltype(tag);
    run_unary<T, 2, false>(iter, op);
  });
  return out;
}

at::Tensor fake_affine_quant_backward_cpu(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& min_range,
                                          const at::Tensor& max_range) {
  check_input(x);
  check_amax_shape(x, min_range, "min_range");
  check_amax_shape(x, max_range, "max_range");
  return mask_kernel<2>(grad, x, {amax_as_float(min_range), amax_as_float(max_range)}, RangeOp{});
}

}  // namespace
}  // namespace cpu
}  // namespace lq

TORCH_LIBRARY_IMPL(lq, CPU, m) {
  m.impl("fake_affine_quant", &lq::cpu::fake_affine_quant_cpu);
  m.impl("fake_affine_quant_backward", &lq::cpu::fake_affine_quant_backward_cpu);
}
