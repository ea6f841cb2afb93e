// The clipped straight-through estimator computed in place, for the C++ autograd
// of lq::fake_quant / lq::scaled_e4m3 (autograd.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace lq {
namespace cpu {

// grad = |x| <= amax ? grad : 0, written into grad (which the caller owns), for a
// per-tensor amax and contiguous CPU grad and x of one shape; grad is stored back
// only where some element is clipped. Returns false, touching nothing, for any
// other case (the caller then uses lq::fake_quant_backward).
bool fake_quant_backward_inplace(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& amax);

}  // namespace cpu
}  // namespace lq
