// Argument checks and small numeric helpers shared by lq's kernels.
//
// The checks raise the same exception types with the same meaning as
// lq/_checks.py (TypeError for wrong types, ValueError for wrong values), and
// every message says what was wrong and what is allowed. This header needs
// only ATen host APIs, so CUDA host code can include it too.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace lq {

// amax at or below this quantizes to 0 (smallest fp16 subnormal, 2^-24).
constexpr float kAmaxEpsilon = 5.9604644775390625e-08f;
// Largest finite FP8 E4M3 (e4m3fn) value.
constexpr float kE4M3Max = 448.0f;
constexpr int64_t kMinBits = 2;
constexpr int64_t kMaxBits = 16;

// ---------------------------------------------------------------- formatting
// Python-like spellings, so C++ and Python messages read the same.
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

inline std::string shape_str(at::IntArrayRef s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r += ", ";
    r += std::to_string(s[i]);
  }
  if (s.size() == 1) r += ",";
  return r + ")";
}

// Shortest decimal that reads back as the same double (like Python's repr).
inline std::string float_str(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int p = 1; p <= 17; ++p) {
    std::snprintf(buf, sizeof(buf), "%.*g", p, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s(buf);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// ---------------------------------------------------------------- checks
inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_input(const at::Tensor& x, const char* what = "inputs") {
  TORCH_CHECK_TYPE(x.defined(), what, " must be a torch.Tensor, got None");
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()), what,
                   " must be float32, float16 or bfloat16, got ", dtype_name(x.scalar_type()));
}

inline void check_same_device(const at::Tensor& x, const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device() == x.device(), what, " must be on the same device as inputs (", x.device(),
                    "), got ", t.device());
}

inline void check_num_bits(int64_t num_bits, bool is_unsigned) {
  const int64_t low = is_unsigned ? 1 : kMinBits;
  TORCH_CHECK_VALUE(low <= num_bits && num_bits <= kMaxBits, "num_bits=", num_bits,
                    " is not supported: integer quantization takes ", low, " to ", kMaxBits, " bits",
                    is_unsigned ? "" : " (signed)", "; use num_bits=(4, 3) for FP8 E4M3");
}

// amax must be a floating point tensor that broadcasts to x (a scalar, or
// size 1 or x's size in every dim, aligned at the right).
inline void check_amax_shape(const at::Tensor& x, const at::Tensor& amax, const char* what = "amax") {
  TORCH_CHECK_TYPE(amax.defined(), what, " must be a torch.Tensor, got None");
  TORCH_CHECK_TYPE(amax.is_floating_point(), what, " must be a floating point tensor, got ",
                   dtype_name(amax.scalar_type()));
  check_same_device(x, amax, what);
  if (amax.numel() == 1) return;
  TORCH_CHECK_VALUE(amax.dim() <= x.dim(), what, " of shape ", shape_str(amax.sizes()),
                    " has more dims than inputs ", shape_str(x.sizes()));
  const int64_t lead = x.dim() - amax.dim();
  for (int64_t i = 0; i < amax.dim(); ++i) {
    const int64_t s = amax.size(i), n = x.size(lead + i);
    TORCH_CHECK_VALUE(s == 1 || s == n, what, " of shape ", shape_str(amax.sizes()),
                      " does not broadcast to inputs of shape ", shape_str(x.sizes()), ": dim ", lead + i,
                      " has size ", n, " but ", what, " has ", s, " (allowed: 1 or ", n, ")");
  }
}

// The value of a one-element floating point CPU tensor as float32 (like `t.float()`).
inline float single_value(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return *t.const_data_ptr<float>();
    case at::kHalf: return static_cast<float>(*t.const_data_ptr<at::Half>());
    case at::kBFloat16: return static_cast<float>(*t.const_data_ptr<at::BFloat16>());
    case at::kDouble: return static_cast<float>(*t.const_data_ptr<double>());
    default: return t.to(at::kFloat).contiguous().const_data_ptr<float>()[0];
  }
}

// Negative or non-finite amax is an error (0 is allowed: it quantizes to 0).
inline void check_amax_value(float v, const char* what = "amax") {
  TORCH_CHECK_VALUE(std::isfinite(v), what, " must be finite, got non-finite values in ", what);
  TORCH_CHECK_VALUE(!(v < 0.f), what, " must be >= 0, got min ", float_str(v));
}

// The same for every value of `a`, a contiguous float32 CPU tensor.
inline void check_amax_values(const at::Tensor& a, const char* what = "amax") {
  const float* p = a.const_data_ptr<float>();
  const int64_t n = a.numel();
  bool finite = true;
  float mn = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    finite &= std::isfinite(p[i]);
    mn = (i == 0 || p[i] < mn) ? p[i] : mn;
  }
  TORCH_CHECK_VALUE(finite, what, " must be finite, got non-finite values in ", what);
  TORCH_CHECK_VALUE(!(n && mn < 0.f), what, " must be >= 0, got min ", float_str(mn));
}

constexpr const char* kNegativeUnsignedMsg =
    "Negative values encountered in unsigned quantization: inputs must be >= 0 when unsigned=True "
    "(use signed quantization for data that can be negative)";

inline int64_t normalize_axis(int64_t axis, int64_t ndim, const char* what = "axis") {
  const int64_t hi = ndim > 1 ? ndim : 1;
  TORCH_CHECK_VALUE(-ndim <= axis && axis < hi, what, "=", axis, " is out of range for a tensor of rank ", ndim,
                    ": allowed [", -ndim, ", ", ndim, ")");
  return ndim ? ((axis % ndim) + ndim) % ndim : 0;
}

// amax as a contiguous float32 tensor; a single value becomes 0-dim so it
// broadcasts to any x (the output always has x's shape).
inline at::Tensor amax_as_float(const at::Tensor& amax) {
  at::Tensor a = amax;
  if (a.numel() == 1 && a.dim() > 0) a = a.reshape({});
  return a.to(at::kFloat).contiguous();
}

// ---------------------------------------------------------------- numerics
struct IntBounds {
  float min_bound;
  float max_bound;
};

// max_bound = 2^(num_bits - 1 + unsigned) - 1; signed range [-max, max] with
// narrow_range else [-max - 1, max]; unsigned [0, max].
inline IntBounds int_bounds(int64_t num_bits, bool is_unsigned, bool narrow_range) {
  const float mb = static_cast<float>((int64_t{1} << (num_bits - 1 + (is_unsigned ? 1 : 0))) - 1);
  float lo = is_unsigned ? 0.f : (narrow_range ? -mb : -mb - 1.f);
  return {lo, mb};
}

// lq._reference.quant_scale: max_bound / amax as one float32 division (as
// pytorch-quantization computes it), and 0 where amax <= 2^-24.
inline float quant_scale(float amax, float max_bound) {
  if (amax <= kAmaxEpsilon) return 0.f;
  return max_bound / amax;
}

// The scale of lq._reference.scaled_e4m3: `448.0 / amax` as torch evaluates a
// number over a tensor, reciprocal(amax) * 448 (two float32 roundings), and 0
// where amax <= 2^-24.
inline float e4m3_scale(float amax) {
  if (amax <= kAmaxEpsilon) return 0.f;
  const float r = 1.0f / amax;
  return r * kE4M3Max;
}

struct ScaleInfo {
  at::Tensor scale;  // float32, shape of the (float) amax
  bool any_zero = false;
  bool all_zero = false;
};

// One scale per amax value: scale_of(amax) is quant_scale (with its max_bound bound) or e4m3_scale.
template <typename ScaleOf>
inline ScaleInfo compute_scales(const at::Tensor& a, ScaleOf scale_of) {
  ScaleInfo info;
  info.scale = at::empty_like(a);
  const float* ap = a.const_data_ptr<float>();
  float* sp = info.scale.mutable_data_ptr<float>();
  const int64_t n = a.numel();
  int64_t zeros = 0;
  for (int64_t i = 0; i < n; ++i) {
    sp[i] = scale_of(ap[i]);
    zeros += sp[i] == 0.f;
  }
  info.any_zero = zeros > 0;
  info.all_zero = n > 0 && zeros == n;
  return info;
}

inline ScaleInfo compute_scales(const at::Tensor& a, float max_bound) {
  return compute_scales(a, [max_bound](float v) { return quant_scale(v, max_bound); });
}

}  // namespace lq
