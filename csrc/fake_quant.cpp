// Integer fake quantization on CPU: lq::fake_quant, lq::fake_quant_out, lq::quant,
// and the clipped straight-through-estimator backward lq::fake_quant_backward.
//
// Numerics (lq/_reference.py): s = max_bound / amax (one float32 division,
// 0 where amax <= 2^-24), q = clamp(round_half_even(x * s), min_bound, max_bound),
// fake_quant = q / s (0 where s == 0), all in float32, cast back to x's dtype.
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include "common.h"
#include "cpu_elementwise.h"
#include "cpu_quant_ops.h"
#include "ste.h"

namespace lq {
namespace cpu {
namespace {

struct SteOp {
  bool inside(float x, const float* p) const { return std::fabs(x) <= p[0]; }
  Vec inside(const Vec& x, const Vec* p) const { return x.abs() <= p[0]; }
};

// amax after the checks: one value (per tensor), or a contiguous float32 tensor.
struct Amax {
  bool single = false;
  float value = 0.f;
  at::Tensor tensor;
};

// Checks shared by every entry point.
Amax prepare(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits, bool is_unsigned) {
  check_input(x);
  check_num_bits(num_bits, is_unsigned);
  check_amax_shape(x, amax);
  Amax a;
  if (amax.numel() == 1) {
    a.single = true;
    a.value = single_value(amax);
    check_amax_value(a.value);
  } else {
    a.tensor = amax_as_float(amax);
    check_amax_values(a.tensor);
  }
  return a;
}

// Runs op (FakeQuantOp or QuantOp) from x into out (same shape; out may be x itself).
// scale: per-tensor value, or (when !a.single) the per-channel scale tensor.
template <template <bool> class OpT>
bool run_scaled(const at::Tensor& out, const at::Tensor& x, const Amax& a, float scale, const at::Tensor& scales,
                bool any_zero, const IntBounds& bd, bool check_neg) {
  return dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
    using T = decltype(tag);
    if (a.single && x.is_contiguous() && out.is_contiguous()) {
      const std::array<float, 1> p{scale};
      const OpT<false> op(bd.min_bound, bd.max_bound);
      T* o = out.mutable_data_ptr<T>();
      const T* xi = x.const_data_ptr<T>();
      return check_neg ? run_unary_contiguous<T, 1, true>(o, xi, x.numel(), p, op)
                       : run_unary_contiguous<T, 1, false>(o, xi, x.numel(), p, op);
    }
    auto iter = make_iter(out, {x, a.single ? at::scalar_tensor(scale, x.options().dtype(at::kFloat)) : scales});
    if (any_zero) {
      const OpT<true> op(bd.min_bound, bd.max_bound);
      return check_neg ? run_unary<T, 1, true>(iter, op) : run_unary<T, 1, false>(iter, op);
    }
    const OpT<false> op(bd.min_bound, bd.max_bound);
    return check_neg ? run_unary<T, 1, true>(iter, op) : run_unary<T, 1, false>(iter, op);
  });
}

// QuantOp ignores the zero-scale flag (round(x * 0) is what the reference returns).
template <bool kZero>
struct QuantOpT : QuantOp {
  using QuantOp::QuantOp;
};

// Writes fake_quant(x) into out (same shape and dtype; may be x itself).
// check_neg: detect negative inputs in the same pass (raise after it).
void fake_quant_into(const at::Tensor& out, const at::Tensor& x, const Amax& a, int64_t num_bits, bool is_unsigned,
                     bool narrow_range, bool check_neg) {
  if (x.numel() == 0) return;
  const IntBounds bd = int_bounds(num_bits, is_unsigned, narrow_range);
  float scale = 0.f;
  ScaleInfo si;
  if (a.single) {
    scale = quant_scale(a.value, bd.max_bound);
    si.all_zero = si.any_zero = scale == 0.f;
  } else {
    si = compute_scales(a.tensor, bd.max_bound);
  }
  if (si.all_zero) {  // every amax <= 2^-24: all zeros
    TORCH_CHECK_VALUE(!(check_neg && any_negative(x)), kNegativeUnsignedMsg);
    out.zero_();
    return;
  }
  const bool neg = run_scaled<FakeQuantOp>(out, x, a, scale, si.scale, si.any_zero, bd, check_neg);
  TORCH_CHECK_VALUE(!neg, kNegativeUnsignedMsg);
}

at::Tensor fake_quant_cpu(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits, bool is_unsigned,
                          bool narrow_range) {
  const Amax a = prepare(x, amax, num_bits, is_unsigned);
  at::Tensor out = cached_empty_like(x);
  fake_quant_into(out, x, a, num_bits, is_unsigned, narrow_range, is_unsigned);
  return out;
}

void fake_quant_out_cpu(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits, bool is_unsigned,
                        bool narrow_range, const at::Tensor& out) {
  const Amax a = prepare(x, amax, num_bits, is_unsigned);
  TORCH_CHECK_TYPE(out.defined(), "out must be a torch.Tensor, got None");
  check_same_device(x, out, "out");
  const bool direct = out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() &&
                      (out.is_same(x) || (at::has_internal_overlap(out) == at::MemOverlap::No &&
                                          at::get_overlap_status(out, x) == at::MemOverlapStatus::No));
  if (!direct) {  // other shape/dtype (broadcast or cast by copy_), or out overlapping x other than exactly
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
  const Amax a = prepare(x, amax, num_bits, is_unsigned);
  const IntBounds bd = int_bounds(num_bits, is_unsigned, narrow_range);
  float scale = 0.f;
  ScaleInfo si;
  if (a.single) {
    scale = quant_scale(a.value, bd.max_bound);
  } else {
    si = compute_scales(a.tensor, bd.max_bound);
  }
  at::Tensor q = cached_empty_like(x);
  if (x.numel()) {
    const bool neg = run_scaled<QuantOpT>(q, x, a, scale, si.scale, false, bd, is_unsigned);
    TORCH_CHECK_VALUE(!neg, kNegativeUnsignedMsg);
  }
  // The returned scale (float32, like empty_like(amax)) is 1 where amax <= 2^-24
  // (any scale dequantizes 0 to 0).
  at::Tensor s = at::empty_like(amax, amax.options().dtype(at::kFloat));
  if (a.single) {
    *s.mutable_data_ptr<float>() = scale == 0.f ? 1.f : scale;
  } else {
    float* sp = si.scale.mutable_data_ptr<float>();
    for (int64_t i = 0; i < si.scale.numel(); ++i) sp[i] = sp[i] == 0.f ? 1.f : sp[i];
    s.copy_(si.scale.reshape(amax.sizes()));
  }
  return {q, s};
}

at::Tensor fake_quant_backward_cpu(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& amax) {
  check_input(x);
  check_amax_shape(x, amax);
  return mask_kernel<1>(grad, x, {amax_as_float(amax)}, SteOp{});
}

}  // namespace

bool fake_quant_backward_inplace(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& amax) {
  if (!amax.device().is_cpu() || !x.device().is_cpu()) return false;
  return mask_kernel_inplace<1>(grad, x, {amax_as_float(amax)}, SteOp{});
}

}  // namespace cpu
}  // namespace lq

TORCH_LIBRARY_IMPL(lq, CPU, m) {
  m.impl("fake_quant", &lq::cpu::fake_quant_cpu);
  m.impl("fake_quant_out", &lq::cpu::fake_quant_out_cpu);
  m.impl("quant", &lq::cpu::quant_cpu);
  m.impl("fake_quant_backward", &lq::cpu::fake_quant_backward_cpu);
}
