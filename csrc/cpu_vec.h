// Vector helpers for lq's CPU kernels, on ATen's at::vec::Vectorized<float>
// (AVX512/AVX2/portable, as chosen by CPU_CAPABILITY at build time).
//
// All arithmetic is float32; float16/bfloat16 data is widened on load and
// rounded to nearest even on store, exactly as `tensor.float()` and
// `tensor.to(dtype)` do, so the kernels match lq/_reference.py bit for bit.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace lq {
namespace cpu {

using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;

// Lanes of one float vector, and elements handled per step (two vectors:
// one Vectorized<Half/BFloat16> widens to two float vectors).
constexpr int64_t kW = Vec::size();
constexpr int64_t kStep = 2 * kW;

// ---------------------------------------------------------------- load / store
template <typename T>
inline void load2(const T* p, Vec& a, Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = Vec::loadu(p);
    b = Vec::loadu(p + kW);
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
}

// The first `count` (< kStep) elements; the other lanes read as 0.
template <typename T>
inline void load2(const T* p, Vec& a, Vec& b, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    a = Vec::loadu(p, std::min<int64_t>(count, kW));
    b = count > kW ? Vec::loadu(p + kW, count - kW) : Vec(0.f);
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, static_cast<int16_t>(count)));
  }
}

template <typename T>
inline void store2(T* p, const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + kW);
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

template <typename T>
inline void store2(T* p, const Vec& a, const Vec& b, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p, static_cast<int>(std::min<int64_t>(count, kW)));
    if (count > kW) b.store(p + kW, static_cast<int>(count - kW));
  } else {
    at::vec::convert_from_float<T>(a, b).store(p, static_cast<int>(count));
  }
}

// Float vector `j` (0 or 1) of a float parameter array at element offset i.
inline Vec load_param(const float* p, int64_t i, int j) { return Vec::loadu(p + i + j * kW); }
inline Vec load_param(const float* p, int64_t i, int j, int64_t count) {
  const int64_t c = std::min<int64_t>(std::max<int64_t>(count - j * kW, 0), kW);
  return c ? Vec::loadu(p + i + j * kW, c) : Vec(0.f);
}

// True where any lane of a comparison mask is set.
inline bool any_lane(const Vec& mask) { return mask.zero_mask() != static_cast<int>((int64_t{1} << kW) - 1); }

// ---------------------------------------------------------------- scalar math
// clamp as torch.clamp computes it: NaN stays NaN, a value equal to a bound is kept as is.
inline float clamp_f(float v, float lo, float hi) {
  v = lo > v ? lo : v;
  return hi < v ? hi : v;
}

inline Vec clamp_v(const Vec& v, const Vec& lo, const Vec& hi) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return at::vec::clamp(v, lo, hi);  // min(hi, max(lo, v)): the second operand (v) wins ties and NaN
#else
  Vec r = Vec::blendv(v, lo, lo > v);
  return Vec::blendv(r, hi, hi < r);
#endif
}

// Round half to even (torch.round).
inline float round_f(float v) { return std::nearbyint(v); }

// ---------------------------------------------------------------- FP8 E4M3
// Nearest E4M3 value of v (|v| <= 448, NaN stays NaN), half to even, with
// subnormals: the spacing of E4M3 values around v is
// quantum = max(2^floor(log2|v|), 2^-6) * 2^-3, a power of two taken from v's
// exponent bits, so v / quantum is exact and round(v / quantum) * quantum is
// the correctly rounded result (a carry into the next binade is exact too).
constexpr int32_t kExpMask = 0x7F800000;
constexpr int32_t kE4M3MinExp = (127 - 6) << 23;  // exponent field of 2^-6
constexpr int32_t kE4M3Mant = 3 << 23;            // 2^-3
constexpr int32_t kRecipExp = 254 << 23;          // bits(2^-k) = kRecipExp - bits(2^k)

inline float round_e4m3_f(float v) {
  int32_t bits;
  std::memcpy(&bits, &v, 4);
  const int32_t e = std::max(bits & kExpMask, kE4M3MinExp);
  const int32_t qb = e - kE4M3Mant, ib = kRecipExp - qb;
  float quantum, inv;
  std::memcpy(&quantum, &qb, 4);
  std::memcpy(&inv, &ib, 4);
  return std::nearbyint(v * inv) * quantum;
}

inline Vec round_e4m3_v(const Vec& v) {
  const IVec bits = at::vec::cast<int32_t>(v);
  const IVec e = at::vec::maximum(bits & IVec(kExpMask), IVec(kE4M3MinExp));
  const IVec qb = e - IVec(kE4M3Mant);
  const IVec ib = IVec(kRecipExp) - qb;
  return (v * at::vec::cast<float>(ib)).round() * at::vec::cast<float>(qb);
}

}  // namespace cpu
}  // namespace lq
