// Integer fake quantization on CPU: lq::fake_quant, lq::fake_quant_out, lq::quant,
// and the clipped straight-through-estimator backward lq::fake_quant_backward.
//
// Numerics (lq/_reference.py): s = max_bound / amax (as reciprocal(amax) * max_bound,
// 0 where amax <= 2^-24), q = clamp(round_half_even(x * s), min_bound, max_bound),
// fake_quant = q / s (0 where s == 0), all in float32, cast back to x's dtype.
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include "common.h"
#include "cpu_elementwise.h"
#include "cpu_quant_ops.h"

namespace lq {
namespace cpu {
namespace {

struct SteOp {
  bool inside(float x, const float* p) const { return std::fabs(x) <= p[0]; }
  Vec inside(const Vec& x, const Vec* p) const { return x.abs() <= p[0]; }
};

// Checks shared by every entry point; returns amax as contiguous float32.
at::Tensor prepare(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits, bool is_unsigned) {
  check_input(x);
  check_num_bits(num_bits, is_unsigned);
  check_amax_shape(x, amax);
  TORCH_CHECK_VALUE(x.device().is_cpu(), "inputs must be a CPU tensor for lq's CPU kernel, got ", x.device());
  at::Tensor a = amax_as_float(amax);
  check_amax_values(a);
  return a;
}

// Writes fake_quant(x) into out (same shape and dtype; may be x itself).
// check_neg: detect negative inputs in the same pass (raise after it).
void fake_quant_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, int64_t num_bits,
                     bool is_unsigned, bool narrow_range, bool check_neg) {
  if (x.numel() == 0) return;
  const IntBounds bd = int_bounds(num_bits, is_unsigned, narrow_range);
  const ScaleInfo si = compute_scales(a, bd.max_bound);
  if (si.all_zero) {  // every amax <= 2^-24: all zeros
    TORCH_CHECK_VALUE(!(check_neg && any_negative(x)), kNegativeUnsignedMsg);
    out.zero_();
    return;
  }
  auto iter = make_iter(out, {x, si.scale});
  const bool neg = dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
    using T = decltype(tag);
    if (si.any_zero) {
      FakeQuantOp<true> op(bd.min_bound, bd.max_bound);
      return check_neg ? run_unary<T, 1, true>(iter, op) : run_unary<T, 1, false>(iter, op);
    }
    FakeQuantOp<false> op(bd.min_bound, bd.max_bound);
    return check_neg ? run_unary<T, 1, true>(iter, op) : run_unary<T, 1, false>(iter, op);
  });
  TORCH_CHECK_VALUE(!neg, kNegativeUnsignedMsg);
}

at::Tensor fake_quant_cpu(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits, bool is_unsigned,
                          bool narrow_range) {
  const at::Tensor a = prepare(x, amax, num_bits, is_unsigned);
  at::Tensor out = at::empty_like(x);
  fake_quant_into(out, x, a, num_bits, is_unsigned, narrow_range, is_unsigned);
  return out;
}

void fake_quant_out_cpu(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits, bool is_unsigned,
                        bool narrow_range, const at::Tensor& out) {
  const at::Tensor a = prepare(x, amax, num_bits, is_unsigned);
  TORCH_CHECK_TYPE(out.defined(), "out must be a torch.Tensor, got None");
  check_same_device(x, out, "out");
  const bool direct = out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() &&
                      at::has_internal_overlap(out) == at::MemOverlap::No &&
                      (at::get_overlap_status(out, x) == at::MemOverlapStatus::No ||
                       at::get_overlap_status(out, x) == at::MemOverlapStatus::Full);
  if (!direct) {  // other shape/dtype (broadcast or cast by copy_), or partial overlap with x
    at::Tensor tmp = at::empty_like(x);
    fake_quant_into(tmp, x, a, num_bits, is_unsigned, narrow_range, is_unsigned);
    out.copy_(tmp);
    return;
  }
  // Check before writing, so a failing call leaves out (which may be x) untouched.
  TORCH_CHECK_VALUE(!(is_unsigned && any_negative(x)), kNegativeUnsignedMsg);
  fake_quant_into(out, x, a, num_bits, is_unsigned, narrow_range, false);
}

std::tuple<at::Tensor, at::Tensor> quant_cpu(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits,
                                             bool is_unsigned, bool narrow_range) {
  const at::Tensor a = prepare(x, amax, num_bits, is_unsigned);
  const IntBounds bd = int_bounds(num_bits, is_unsigned, narrow_range);
  ScaleInfo si = compute_scales(a, bd.max_bound);
  at::Tensor q = at::empty_like(x);
  if (x.numel()) {
    auto iter = make_iter(q, {x, si.scale});
    QuantOp op(bd.min_bound, bd.max_bound);
    const bool neg = dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
      using T = decltype(tag);
      return is_unsigned ? run_unary<T, 1, true>(iter, op) : run_unary<T, 1, false>(iter, op);
    });
    TORCH_CHECK_VALUE(!neg, kNegativeUnsignedMsg);
  }
  // The returned scale is 1 where amax <= 2^-24 (any scale dequantizes 0 to 0).
  float* sp = si.scale.mutable_data_ptr<float>();
  for (int64_t i = 0; i < si.scale.numel(); ++i) sp[i] = sp[i] == 0.f ? 1.f : sp[i];
  return {q, si.scale.reshape(amax.sizes())};
}

at::Tensor fake_quant_backward_cpu(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& amax) {
  check_input(x);
  check_amax_shape(x, amax);
  return mask_kernel<1>(grad, x, {amax_as_float(amax)}, SteOp{});
}

}  // namespace
}  // namespace cpu
}  // namespace lq

TORCH_LIBRARY_IMPL(lq, CPU, m) {
  m.impl("fake_quant", &lq::cpu::fake_quant_cpu);
  m.impl("fake_quant_out", &lq::cpu::fake_quant_out_cpu);
  m.impl("quant", &lq::cpu::quant_cpu);
  m.impl("fake_quant_backward", &lq::cpu::fake_quant_backward_cpu);
}
