// lq CUDA kernels: shared building blocks (no torch headers).
//
// Everything here is plain CUDA C++ (C++17). Functions marked LQ_HD compile for
// the device and for the host, so the exact per-thread code of the kernels can
// also run on a CPU (csrc/cuda/emulation.cu, tests/test_cuda_emulation.py).
//
// Numerics: lq/_reference.py is the definition. All arithmetic is float32 with
// explicit round-to-nearest intrinsics (__fmul_rn, __fdiv_rn, ...), so nvcc can
// neither contract a multiply and an add into an FMA nor use approximate
// division, whatever the flags; rounding to integers is rintf (half to even).
#pragma once

#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if defined(__CUDACC__)
#define LQ_HD __host__ __device__ __forceinline__
#define LQ_HOST __host__ inline
#else
#define LQ_HD inline
#define LQ_HOST inline
#endif

namespace lq {
namespace cuda {

constexpr int kMaxDims = 8;         // rank of the strided / broadcast index descriptions
constexpr int kBlockThreads = 256;  // threads per block of the elementwise kernels
constexpr float kAmaxEpsilon = 5.9604644775390625e-08f;  // 2^-24, lq._reference.AMAX_EPSILON
constexpr float kE4M3Max = 448.0f;
constexpr float kFloatMax = 3.40282346638528859812e+38f;

// ------------------------------------------------------------------ bit casts
LQ_HD uint32_t f2u(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}

LQ_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

// ------------------------------------------------------------------ IEEE float32, round to nearest
LQ_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

LQ_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

LQ_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

LQ_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// 1 / a, correctly rounded (torch.reciprocal on the CPU is an IEEE division).
LQ_HD float rcp_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

LQ_HD float round_half_even(float v) { return rintf(v); }

LQ_HD bool is_nan(float v) { return v != v; }
LQ_HD bool is_finite(float v) { return fabsf(v) <= kFloatMax; }  // false for NaN and +-Inf

// clamp that keeps NaN (torch.clamp semantics): NaN compares false both times.
LQ_HD float clamp_keep_nan(float v, float lo, float hi) {
  v = v < lo ? lo : v;
  return v > hi ? hi : v;
}

// max that propagates NaN (torch.amax semantics); the result is NaN iff any operand is.
LQ_HD float nan_max(float m, float a) { return (a > m || is_nan(a)) ? a : m; }

// ------------------------------------------------------------------ element types
// Loads convert to float32 registers, stores round to nearest even. No implicit
// half/bfloat16 conversions are used (torch builds with __CUDA_NO_HALF_CONVERSIONS__).
LQ_HD float to_float(float v) { return v; }
LQ_HD float to_float(__half v) { return __half2float(v); }
LQ_HD float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
LQ_HD T from_float(float v);
template <>
LQ_HD float from_float<float>(float v) { return v; }
template <>
LQ_HD __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
LQ_HD __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Elements per 16-byte vector.
template <typename T>
struct VecWidth {
  static constexpr int value = 16 / static_cast<int>(sizeof(T));
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
LQ_HD Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
LQ_HD void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// ------------------------------------------------------------------ integer division by a constant
// 64-bit division (tensors of 2^31 elements or more) is a long instruction
// sequence; kept out of line so the kernels that may need it stay small.
#if defined(__CUDACC__)
__device__ __noinline__ inline uint64_t udiv64_slow(uint64_t n, uint64_t d) { return n / d; }
#endif

LQ_HD uint64_t udiv64(uint64_t n, uint64_t d) {
#if defined(__CUDA_ARCH__)
  return udiv64_slow(n, d);
#else
  return n / d;
#endif
}

// q = n / d for a divisor fixed at launch. While every numerator is below 2^31
// (``small``, decided on the host from numel) the quotient is a multiply-high
// and a shift (round-up method: m = floor(2^32 (2^s - d) / d) + 1, 2^s >= d);
// otherwise a plain 64-bit division.
struct Divmod {
  uint64_t d = 1;
  uint32_t mul = 1;
  uint32_t shift = 0;

  Divmod() = default;
  LQ_HOST explicit Divmod(uint64_t divisor) : d(divisor ? divisor : 1) {
    if (d < (uint64_t(1) << 31)) {
      uint32_t s = 0;
      while ((uint64_t(1) << s) < d) ++s;
      shift = s;
      mul = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << s) - d)) / d + 1);
    } else {
      mul = 0;  // never used: a divisor this large only appears with 64-bit numerators
      shift = 0;
    }
  }

  LQ_HD uint64_t div(uint64_t n, bool small) const {
    if (small) {
      const uint32_t n32 = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__)
      const uint32_t hi = __umulhi(n32, mul);
#else
      const uint32_t hi = static_cast<uint32_t>((uint64_t(n32) * mul) >> 32);
#endif
      return (uint64_t(hi) + n32) >> shift;
    }
    return udiv64(n, d);
  }

  LQ_HD uint64_t mod(uint64_t n, bool small) const { return n - div(n, small) * d; }
};

// Offsets of a broadcast operand (amax, min/max range) for a dense iteration in
// memory order: offset(pos) = sum_k ((pos / div_k) % mod_k) * stride_k.
// rank 0 is a per-tensor scalar, rank 1 the usual per-channel amax.
struct BcastMap {
  int rank = 0;
  Divmod div[kMaxDims];
  Divmod mod[kMaxDims];
  int64_t stride[kMaxDims] = {};

  template <int MAXR>
  LQ_HD int64_t offset(uint64_t pos, bool small) const {
    int64_t off = 0;
#pragma unroll
    for (int k = 0; k < MAXR; ++k) {
      if (k < rank) {
        const uint64_t q = div[k].div(pos, small);
        off += static_cast<int64_t>(mod[k].mod(q, small)) * stride[k];
      }
    }
    return off;
  }
};

// Up to 5 operands (out, two elementwise inputs, two broadcast operands) of an
// arbitrary strided iteration, rank <= kMaxDims after coalescing; dimension
// ndim-1 is the fastest. Offsets in elements.
constexpr int kMaxOperands = 5;
struct StridedMap {
  int ndim = 0;
  Divmod size[kMaxDims];
  int64_t stride[kMaxOperands][kMaxDims] = {};

  LQ_HD void offsets(uint64_t linear, bool small, int64_t (&off)[kMaxOperands]) const {
#pragma unroll
    for (int k = 0; k < kMaxOperands; ++k) off[k] = 0;
#pragma unroll
    for (int i = kMaxDims - 1; i >= 0; --i) {
      if (i < ndim) {
        const uint64_t q = size[i].div(linear, small);
        const int64_t c = static_cast<int64_t>(linear - q * size[i].d);
        linear = q;
#pragma unroll
        for (int k = 0; k < kMaxOperands; ++k) off[k] += c * stride[k][i];
      }
    }
  }
};

}  // namespace cuda
}  // namespace lq
