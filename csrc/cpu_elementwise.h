// Elementwise drivers for lq's CPU kernels.
//
// A TensorIterator lines up the data operands (any strides, broadcasting of
// amax against x, parallel chunks via for_each); the drivers below run a
// vectorized inner loop where a row of the iteration is contiguous and the
// float parameters (per-channel scale, step, ...) are either broadcast
// (stride 0) or contiguous, and a scalar loop with the same arithmetic
// otherwise. Parameters are precomputed once, outside the element loop.
//
// Op concepts:
//   unary op:  float operator()(float x, const float* p) const;
//              Vec   operator()(const Vec& x, const Vec* p) const;
//   mask op:   bool  inside(float x, const float* p) const;
//              Vec   inside(const Vec& x, const Vec* p) const;  // all-ones lanes where true
#pragma once

#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/TensorIterator.h>

#include <array>
#include <atomic>
#include <initializer_list>

#include "common.h"
#include "cpu_vec.h"
#include "host_cache.h"

namespace lq {
namespace cpu {

// Calls f(T{}) with T the C++ type of a float32/float16/bfloat16 dtype.
template <typename F>
inline decltype(auto) dispatch_float(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    default:
      TORCH_CHECK_TYPE(false, what, " must be float32, float16 or bfloat16, got ", dtype_name(t));
  }
}

// A TensorIterator over a preallocated output and the given inputs (dtypes may differ).
// It owns references to every operand, so temporaries may be passed.
inline at::TensorIterator make_iter(const at::Tensor& out, std::initializer_list<at::Tensor> inputs) {
  at::TensorIteratorConfig cfg;
  cfg.set_check_mem_overlap(true).check_all_same_dtype(false).resize_outputs(false).add_owned_output(out);
  for (const auto& t : inputs) cfg.add_owned_const_input(t);
  return cfg.build();
}

// ---------------------------------------------------------------- unary: out = op(x, params)
// Contiguous span. kPC: parameters are contiguous arrays (else one value each).
// kNeg: also report whether any x < 0. Returns that flag.
template <typename T, int P, bool kPC, bool kNeg, typename Op>
inline bool span_unary(T* out, const T* x, const float* const* p, int64_t n, const Op& op) {
  Vec pb[P];
  if constexpr (!kPC) {
    for (int k = 0; k < P; ++k) pb[k] = Vec(*p[k]);
  }
  const Vec zero(0.f);
  Vec neg(0.f);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vec xv[2], ov[2];
    load2(x + i, xv[0], xv[1]);
    for (int j = 0; j < 2; ++j) {
      Vec pv[P];
      for (int k = 0; k < P; ++k) {
        if constexpr (kPC) pv[k] = load_param(p[k], i, j);
        else pv[k] = pb[k];
      }
      ov[j] = op(xv[j], pv);
      if constexpr (kNeg) neg = neg | (xv[j] < zero);
    }
    store2(out + i, ov[0], ov[1]);
  }
  if (i < n) {  // tail: partial vectors (unused lanes read 0 and are not stored)
    const int64_t c = n - i;
    Vec xv[2], ov[2];
    load2(x + i, xv[0], xv[1], c);
    for (int j = 0; j < 2; ++j) {
      Vec pv[P];
      for (int k = 0; k < P; ++k) {
        if constexpr (kPC) pv[k] = load_param(p[k], i, j, c);
        else pv[k] = pb[k];
      }
      ov[j] = op(xv[j], pv);
      if constexpr (kNeg) neg = neg | (xv[j] < zero);
    }
    store2(out + i, ov[0], ov[1], c);
  }
  if constexpr (kNeg) return any_lane(neg);
  return false;
}

template <typename T, int P, bool kNeg, typename Op>
inline bool strided_unary(char* out, const char* x, const char* const* p, int64_t so, int64_t sx,
                          const int64_t* sp, int64_t n, const Op& op) {
  bool neg = false;
  for (int64_t i = 0; i < n; ++i) {
    const float xf = static_cast<float>(*reinterpret_cast<const T*>(x + i * sx));
    float pv[P];
    for (int k = 0; k < P; ++k) pv[k] = *reinterpret_cast<const float*>(p[k] + i * sp[k]);
    *reinterpret_cast<T*>(out + i * so) = static_cast<T>(op(xf, pv));
    if constexpr (kNeg) neg |= xf < 0.f;
  }
  return neg;
}

// Operands of iter: [out (T), x (T), P float parameters]. Returns true when
// kNeg and some x < 0 was seen (the caller raises).
template <typename T, int P, bool kNeg, typename Op>
bool run_unary(at::TensorIteratorBase& iter, const Op& op) {
  constexpr int NT = 2 + P;
  std::atomic<bool> neg{false};
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t n, int64_t rows) {
        std::array<char*, NT> ptr;
        for (int k = 0; k < NT; ++k) ptr[k] = data[k];
        const bool contig = strides[0] == sizeof(T) && strides[1] == sizeof(T);
        bool pbc = true, pct = true;
        for (int k = 0; k < P; ++k) {
          pbc &= strides[2 + k] == 0;
          pct &= strides[2 + k] == sizeof(float);
        }
        bool local = false;
        for (int64_t r = 0; r < rows; ++r) {
          const float* pp[P];
          for (int k = 0; k < P; ++k) pp[k] = reinterpret_cast<const float*>(ptr[2 + k]);
          T* o = reinterpret_cast<T*>(ptr[0]);
          const T* xi = reinterpret_cast<const T*>(ptr[1]);
          if (contig && pbc) {
            local |= span_unary<T, P, false, kNeg>(o, xi, pp, n, op);
          } else if (contig && pct) {
            local |= span_unary<T, P, true, kNeg>(o, xi, pp, n, op);
          } else {
            const char* pc[P];
            for (int k = 0; k < P; ++k) pc[k] = ptr[2 + k];
            local |= strided_unary<T, P, kNeg>(ptr[0], ptr[1], pc, strides[0], strides[1], strides + 2, n, op);
          }
          for (int k = 0; k < NT; ++k) ptr[k] += strides[NT + k];
        }
        if (local) neg.store(true, std::memory_order_relaxed);
      },
      at::internal::GRAIN_SIZE);
  return neg.load();
}

// Fast path: out and x contiguous (n elements each), every parameter one value.
template <typename T, int P, bool kNeg, typename Op>
bool run_unary_contiguous(T* out, const T* x, int64_t n, const std::array<float, P>& params, const Op& op) {
  const float* pp[P];
  for (int k = 0; k < P; ++k) pp[k] = &params[k];
  if (n <= at::internal::GRAIN_SIZE) return span_unary<T, P, false, kNeg>(out, x, pp, n, op);
  std::atomic<bool> neg{false};
  at::parallel_for(0, n, at::internal::GRAIN_SIZE, [&](int64_t b, int64_t e) {
    if (span_unary<T, P, false, kNeg>(out + b, x + b, pp, e - b, op)) neg.store(true, std::memory_order_relaxed);
  });
  return neg.load();
}

// ---------------------------------------------------------------- mask: out = inside(x, params) ? grad : 0
// kSkipInside (out == g, in place): a step whose elements are all inside is not
// stored back, so an unclipped tensor is only read.
template <typename G, typename X, int P, bool kPC, typename Op, bool kSkipInside = false>
inline void span_mask(G* out, const G* g, const X* x, const float* const* p, int64_t n, const Op& op) {
  Vec pb[P];
  if constexpr (!kPC) {
    for (int k = 0; k < P; ++k) pb[k] = Vec(*p[k]);
  }
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vec gv[2], xv[2], ov[2], mv[2];
    load2(g + i, gv[0], gv[1]);
    load2(x + i, xv[0], xv[1]);
    for (int j = 0; j < 2; ++j) {
      Vec pv[P];
      for (int k = 0; k < P; ++k) {
        if constexpr (kPC) pv[k] = load_param(p[k], i, j);
        else pv[k] = pb[k];
      }
      mv[j] = op.inside(xv[j], pv);
      ov[j] = gv[j] & mv[j];
    }
    // zero_mask(): a bit per lane that is all zeros, i.e. outside.
    if constexpr (kSkipInside) {
      if ((mv[0].zero_mask() | mv[1].zero_mask()) == 0) continue;
    }
    store2(out + i, ov[0], ov[1]);
  }
  if (i < n) {
    const int64_t c = n - i;
    Vec gv[2], xv[2], ov[2];
    load2(g + i, gv[0], gv[1], c);
    load2(x + i, xv[0], xv[1], c);
    for (int j = 0; j < 2; ++j) {
      Vec pv[P];
      for (int k = 0; k < P; ++k) {
        if constexpr (kPC) pv[k] = load_param(p[k], i, j, c);
        else pv[k] = pb[k];
      }
      ov[j] = gv[j] & op.inside(xv[j], pv);
    }
    store2(out + i, ov[0], ov[1], c);
  }
}

// Operands of iter: [out (G), grad (G), x (X), P float parameters].
template <typename G, typename X, int P, typename Op>
void run_mask(at::TensorIteratorBase& iter, const Op& op) {
  constexpr int NT = 3 + P;
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t n, int64_t rows) {
        std::array<char*, NT> ptr;
        for (int k = 0; k < NT; ++k) ptr[k] = data[k];
        const bool contig = strides[0] == sizeof(G) && strides[1] == sizeof(G) && strides[2] == sizeof(X);
        bool pbc = true, pct = true;
        for (int k = 0; k < P; ++k) {
          pbc &= strides[3 + k] == 0;
          pct &= strides[3 + k] == sizeof(float);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float* pp[P];
          for (int k = 0; k < P; ++k) pp[k] = reinterpret_cast<const float*>(ptr[3 + k]);
          G* o = reinterpret_cast<G*>(ptr[0]);
          const G* gi = reinterpret_cast<const G*>(ptr[1]);
          const X* xi = reinterpret_cast<const X*>(ptr[2]);
          if (contig && pbc) {
            span_mask<G, X, P, false>(o, gi, xi, pp, n, op);
          } else if (contig && pct) {
            span_mask<G, X, P, true>(o, gi, xi, pp, n, op);
          } else {
            for (int64_t e = 0; e < n; ++e) {
              float pv[P];
              for (int k = 0; k < P; ++k) pv[k] = *reinterpret_cast<const float*>(ptr[3 + k] + e * strides[3 + k]);
              const float xf = static_cast<float>(*reinterpret_cast<const X*>(ptr[2] + e * strides[2]));
              const G gv = *reinterpret_cast<const G*>(ptr[1] + e * strides[1]);
              *reinterpret_cast<G*>(ptr[0] + e * strides[0]) = op.inside(xf, pv) ? gv : G(0.f);
            }
          }
          for (int k = 0; k < NT; ++k) ptr[k] += strides[NT + k];
        }
      },
      at::internal::GRAIN_SIZE);
}

// out = inside(x, params) ? grad : 0 on contiguous operands of one shape, every
// parameter one value; out may be grad itself (kInPlace).
template <int P, bool kInPlace, typename Op>
inline void mask_dense(const at::Tensor& out, const at::Tensor& grad, const at::Tensor& xx,
                       const std::array<at::Tensor, P>& params, const Op& op) {
  const bool same = xx.scalar_type() == grad.scalar_type();
  const int64_t n = grad.numel();
  std::array<float, P> pv;
  for (int k = 0; k < P; ++k) pv[k] = single_value(params[k]);
  const float* pp[P];
  for (int k = 0; k < P; ++k) pp[k] = &pv[k];
  dispatch_float(grad.scalar_type(), "grad", [&](auto gtag) {
    using G = decltype(gtag);
    auto body = [&](auto xtag) {
      using X = decltype(xtag);
      G* o = out.mutable_data_ptr<G>();
      const G* g = kInPlace ? o : grad.const_data_ptr<G>();
      const X* xi = xx.const_data_ptr<X>();
      at::parallel_for(0, n, at::internal::GRAIN_SIZE, [&](int64_t b, int64_t e) {
        span_mask<G, X, P, false, Op, kInPlace>(o + b, g + b, xi + b, pp, e - b, op);
      });
    };
    if (same) body(G{});
    else body(float{});
  });
}

// grad = inside(x, params) ? grad : 0 in place, for the cases mask_dense serves (grad
// and x contiguous, one shape, x of grad's dtype or float32, every parameter one
// value). Returns false, touching nothing, otherwise. The caller owns grad.
template <int P, typename Op>
inline bool mask_kernel_inplace(const at::Tensor& grad, const at::Tensor& x, const std::array<at::Tensor, P>& params,
                                const Op& op) {
  bool single = true;
  for (const auto& t : params) single &= t.numel() == 1;
  if (!single || grad.sizes() != x.sizes() || !grad.is_contiguous() || !x.is_contiguous() ||
      !(x.scalar_type() == grad.scalar_type() || x.scalar_type() == at::kFloat) ||
      !(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16)) {
    return false;
  }
  mask_dense<P, true>(grad, grad, x, params, op);
  return true;
}

// out = inside(x, params) ? grad : 0, dispatched over (grad dtype G, x dtype X) with
// X == G or X == float; x of any other float dtype is widened to float32 first (exact).
// params: float32 tensors that broadcast against x.
template <int P, typename Op>
inline at::Tensor mask_kernel(const at::Tensor& grad, const at::Tensor& x, const std::array<at::Tensor, P>& params,
                              const Op& op) {
  check_input(grad, "grad");
  check_input(x, "inputs");
  check_same_device(x, grad, "grad");
  TORCH_CHECK_VALUE(at::is_expandable_to(x.sizes(), grad.sizes()) || at::is_expandable_to(grad.sizes(), x.sizes()),
                    "grad of shape ", shape_str(grad.sizes()), " and inputs of shape ", shape_str(x.sizes()),
                    " do not broadcast (allowed: the same shape)");
  at::Tensor xx = x;
  if (x.scalar_type() != grad.scalar_type() && x.scalar_type() != at::kFloat) xx = x.to(at::kFloat);
  const bool same = xx.scalar_type() == grad.scalar_type();
  bool single = true;
  for (const auto& t : params) single &= t.numel() == 1;
  if (single && grad.sizes() == xx.sizes() && grad.is_contiguous() && xx.is_contiguous()) {
    // Fast path: dense operands, one value per parameter.
    at::Tensor out = cached_empty_like(grad);
    mask_dense<P, false>(out, grad, xx, params, op);
    return out;
  }
  auto shape = at::infer_size(grad.sizes(), xx.sizes());
  for (const auto& t : params) shape = at::infer_size(shape, t.sizes());
  at::Tensor out = grad.sizes() == at::IntArrayRef(shape) ? cached_empty_like(grad) : at::empty(shape, grad.options());
  if (out.numel() == 0) return out;
  at::TensorIteratorConfig cfg;
  cfg.set_check_mem_overlap(true).check_all_same_dtype(false).resize_outputs(false).add_owned_output(out);
  cfg.add_owned_const_input(grad).add_owned_const_input(xx);
  for (const auto& t : params) cfg.add_owned_const_input(t);
  auto iter = cfg.build();
  dispatch_float(grad.scalar_type(), "grad", [&](auto gtag) {
    using G = decltype(gtag);
    if (same) run_mask<G, G, P>(iter, op);
    else run_mask<G, float, P>(iter, op);
  });
  return out;
}

// True when any element of x is < 0 (one parallel read pass; NaN is not negative).
inline bool any_negative(const at::Tensor& x_) {
  if (x_.numel() == 0) return false;
  const at::Tensor x = x_.contiguous();
  return dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
    using T = decltype(tag);
    const T* p = x.const_data_ptr<T>();
    std::atomic<bool> found{false};
    at::parallel_for(0, x.numel(), at::internal::GRAIN_SIZE, [&](int64_t b, int64_t e) {
      const Vec zero(0.f);
      Vec neg(0.f);
      int64_t i = b;
      for (; i + kStep <= e; i += kStep) {
        Vec u, v;
        load2(p + i, u, v);
        neg = neg | (u < zero) | (v < zero);
      }
      if (i < e) {
        Vec u, v;
        load2(p + i, u, v, e - i);
        neg = neg | (u < zero) | (v < zero);
      }
      if (any_lane(neg)) found.store(true, std::memory_order_relaxed);
    });
    return found.load();
  });
}

}  // namespace cpu
}  // namespace lq
