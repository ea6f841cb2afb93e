// lq CUDA kernels: the per-element arithmetic of every op (no torch headers).
//
// Each function follows lq/_reference.py operation by operation in float32.
// The integer scale max_bound / amax is one division (div_rn), as in
// pytorch-quantization's kernels. The reference's ``448.0 / amax`` and
// ``num_bins / range_max`` (a Python number divided by a tensor) are evaluated
// by torch as ``reciprocal(...) * number``: two roundings, reproduced here as
// rcp_rn then mul_rn.
#pragma once

#include "lq_common.cuh"

#include <cuda_fp8.h>

namespace lq {
namespace cuda {

// Integer grid of lq._reference.int_bounds.
struct IntGrid {
  float min_bound;
  float max_bound;

  LQ_HOST static IntGrid make(int num_bits, bool is_unsigned, bool narrow_range) {
    const double max_bound = static_cast<double>((int64_t(1) << (num_bits - 1 + (is_unsigned ? 1 : 0))) - 1);
    double min_bound;
    if (is_unsigned) {
      min_bound = 0.0;
    } else if (narrow_range) {
      min_bound = -max_bound;
    } else {
      min_bound = -max_bound - 1.0;
    }
    return IntGrid{static_cast<float>(min_bound), static_cast<float>(max_bound)};
  }
};

// lq._reference.quant_scale: max_bound / amax, 0 where amax <= 2^-24.
LQ_HD float quant_scale(float amax, float max_bound) {
  const float s = div_rn(max_bound, amax);
  return amax <= kAmaxEpsilon ? 0.0f : s;
}

// The scale of lq._reference.scaled_e4m3: reciprocal(amax) * 448, 0 where amax <= 2^-24.
LQ_HD float e4m3_scale(float amax) {
  const float s = mul_rn(rcp_rn(amax), kE4M3Max);
  return amax <= kAmaxEpsilon ? 0.0f : s;
}

// An amax that comes from the caller: the CPU path raises on a negative or
// non-finite amax; the CUDA path cannot look at the data without a host sync,
// so it makes such an amax visible instead: the scale (and with it every output
// that uses it) is NaN.
LQ_HD bool valid_amax(float amax) {
  return amax >= 0.0f && amax <= kFloatMax;  // false for NaN, Inf, negative
}

// quant_scale of a caller's amax (NaN for an invalid one, see valid_amax).
LQ_HD float checked_scale(float amax, float max_bound) {
  return valid_amax(amax) ? quant_scale(amax, max_bound) : u2f(0x7fc00000u);
}

// e4m3_scale of a caller's amax (NaN for an invalid one, see valid_amax).
LQ_HD float checked_e4m3_scale(float amax) {
  return valid_amax(amax) ? e4m3_scale(amax) : u2f(0x7fc00000u);
}

// round(x * scale) clamped to the grid (NaN stays NaN).
LQ_HD float quantize(float x, float scale, IntGrid g) {
  return clamp_keep_nan(round_half_even(mul_rn(x, scale)), g.min_bound, g.max_bound);
}

// lq._reference.fake_quant for one element, in float32.
LQ_HD float fake_quant_value(float x, float scale, IntGrid g) {
  const float q = quantize(x, scale, g);
  return scale == 0.0f ? 0.0f : div_rn(q, scale);
}

// ------------------------------------------------------------------ FP8 E4M3
// Round a float32 in [-448, 448] (or NaN) to the nearest E4M3 value, half to
// even, subnormals (multiples of 2^-9 below 2^-6) kept, the sign of zero kept,
// exactly like torch's float32 -> float8_e4m3fn -> float32 round trip.
LQ_HD float e4m3_round_arith(float v) {
  if (is_nan(v)) return v;
  const uint32_t bits = f2u(v);
  const uint32_t sign = bits & 0x80000000u;
  const float a = u2f(bits ^ sign);
  float r;
  if (a < 0.015625f) {  // below 2^-6: a fixed quantum of 2^-9, both scalings are exact
    r = mul_rn(round_half_even(mul_rn(a, 512.0f)), 0.001953125f);
  } else {  // normal: keep 3 mantissa bits, round half to even (a carry moves into the exponent)
    uint32_t ab = bits ^ sign;
    ab += 0x7ffffu + ((ab >> 20) & 1u);
    r = u2f(ab & 0xfff00000u);
  }
  return u2f(f2u(r) | sign);
}

LQ_HD float e4m3_round_cvt(float v) {
  // cuda_fp8.h: the hardware cvt.rn.satfinite.e4m3x2.f32 on sm_89+, a software
  // conversion elsewhere (and on the host).
  const __nv_fp8_storage_t s = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  const __half_raw h = __nv_cvt_fp8_to_halfraw(s, __NV_E4M3);
  const float r = __half2float(__half(h));
  // zero keeps the input's sign (torch ORs the sign bit in); NaN is NaN either way
  return is_nan(r) ? r : u2f((f2u(r) & 0x7fffffffu) | (f2u(v) & 0x80000000u));
}

LQ_HD float e4m3_round(float v) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  return e4m3_round_cvt(v);
#else
  return e4m3_round_arith(v);
#endif
}

// lq._reference.scaled_e4m3 for one element; scale = 448 / amax (0 for amax <= 2^-24).
LQ_HD float scaled_e4m3_value(float x, float scale) {
  const float y = e4m3_round(clamp_keep_nan(mul_rn(x, scale), -kE4M3Max, kE4M3Max));
  return scale == 0.0f ? 0.0f : div_rn(y, scale);
}

// ------------------------------------------------------------------ affine
struct AffineParams {
  float step;
  float zero_point;
};

// lq._reference.affine_params: step = (max - min) / (2^bits - 1), zp = round(min / step) - min_bound.
LQ_HD AffineParams affine_params(float min_range, float max_range, float levels, float min_bound) {
  const float step = div_rn(sub_rn(max_range, min_range), levels);
  const float zp = sub_rn(round_half_even(div_rn(min_range, step)), min_bound);
  return AffineParams{step, zp};
}

// (clamp(round(x / step) - zp) + zp) * step
LQ_HD float fake_affine_value(float x, AffineParams p, float min_bound, float max_bound) {
  const float q = clamp_keep_nan(sub_rn(round_half_even(div_rn(x, p.step)), p.zero_point), min_bound, max_bound);
  return mul_rn(add_rn(q, p.zero_point), p.step);
}

// ------------------------------------------------------------------ histogram
// Bin of a = |x| (lq._reference.abs_histogram) or -1 when it is not counted.
// inv = num_bins / range_max, evaluated as torch does: reciprocal, then multiply.
LQ_HD float histogram_inv(float range_max, float num_bins_f) {
  return range_max > 0.0f ? mul_rn(rcp_rn(range_max), num_bins_f) : 0.0f;
}

LQ_HD int64_t histogram_bin(float a, float range_max, float inv, int64_t num_bins) {
  // a is finite here
  if (!(a <= range_max) || !(range_max > 0.0f || a == 0.0f)) return -1;
  const float b = floorf(mul_rn(a, inv));
  const float last = static_cast<float>(num_bins - 1);
  return b < last ? static_cast<int64_t>(b) : num_bins - 1;
}

}  // namespace cuda
}  // namespace lq
