// Autograd of lq::fake_quant and lq::scaled_e4m3 for CPU tensors, in C++.
//
// The formula is lq/_ops.py's (_backward_ste, clip_amax_grad), which stays the
// autograd of every other device and of the reference build. Doing it here
// removes the Python call per quantizer and step (~0.1 ms forward + backward,
// which adds up over the dozens of quantizers of a model), and lets the input
// gradient be written into the incoming gradient buffer when nothing else holds
// that buffer: no new activation-sized tensor per quantizer in the backward pass,
// and for an unclipped tensor no store at all.
//
// While torch.compile / torch.export trace the model (FakeTensor, functional
// tensors: the Python and Functionalize dispatch keys), the backward never works
// in place: it calls lq::fake_quant_backward through the dispatcher, so the
// traced graph stays functional.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/gt.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/sign.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ste.h"

namespace lq {
namespace cpu {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const c10::DispatchKeySet kTracingKeys({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                       c10::DispatchKey::PythonTLSSnapshot});

// Nothing but this reference holds the tensor or its storage, and it is a plain CPU tensor.
bool owned(const at::Tensor& g) {
  return g.defined() && g.use_count() == 1 && !g.is_view() && g.has_storage() && g.storage().use_count() == 1 &&
         !g.requires_grad() && g.device().is_cpu() && g.layout() == at::kStrided &&
         !g.key_set().has_any(kTracingKeys);
}

at::Tensor fake_quant_backward_op(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& amax) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lq::fake_quant_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(grad, x, amax);
}

// sum of t over the dims broadcast from shape (lq/_ops.py: sum_to_shape).
at::Tensor sum_to_shape(at::Tensor t, at::IntArrayRef shape) {
  const int64_t lead = t.dim() - static_cast<int64_t>(shape.size());
  if (lead > 0) {
    std::vector<int64_t> dims(lead);
    for (int64_t i = 0; i < lead; ++i) dims[i] = i;
    t = t.sum(dims);
  }
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < static_cast<int64_t>(shape.size()); ++i) {
    if (shape[i] == 1 && t.size(i) != 1) dims.push_back(i);
  }
  if (!dims.empty()) t = t.sum(dims, /*keepdim=*/true);
  return t.reshape(shape);
}

// PACT-style gradient of amax (lq/_ops.py: clip_amax_grad).
at::Tensor clip_amax_grad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& amax) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor outside = at::gt(at::abs(xf), amax.to(at::kFloat));
  const at::Tensor g = at::where(outside, at::mul(grad.to(at::kFloat), at::sign(xf)), at::zeros_like(xf));
  return sum_to_shape(g, amax.sizes()).to(amax.scalar_type());
}

// backward of both ops: grad_x by the clipped STE, grad_amax by PACT.
variable_list ste_backward(AutogradContext* ctx, variable_list& grads, size_t num_inputs) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  const at::Tensor& amax = saved[1];
  at::Tensor grad = std::move(grads[0]);
  variable_list out(num_inputs);
  if (!grad.defined()) return out;
  if (ctx->needs_input_grad(1)) out[1] = clip_amax_grad(grad, x, amax);  // before grad may change in place
  if (ctx->needs_input_grad(0)) {
    if (owned(grad) && !x.key_set().has_any(kTracingKeys) && fake_quant_backward_inplace(grad, x, amax)) {
      out[0] = std::move(grad);
    } else {
      out[0] = fake_quant_backward_op(grad, x, amax);
    }
  }
  return out;
}

class FakeQuantSte : public torch::autograd::Function<FakeQuantSte> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& amax, int64_t num_bits,
                            bool is_unsigned, bool narrow_range) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("lq::fake_quant", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool, bool)>();
    ctx->save_for_backward({x, amax});
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, amax, num_bits, is_unsigned, narrow_range);
  }
  static variable_list backward(AutogradContext* ctx, variable_list& grads) { return ste_backward(ctx, grads, 5); }
};

class ScaledE4m3Ste : public torch::autograd::Function<ScaledE4m3Ste> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& amax) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("lq::scaled_e4m3", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    ctx->save_for_backward({x, amax});
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, amax);
  }
  static variable_list backward(AutogradContext* ctx, variable_list& grads) { return ste_backward(ctx, grads, 2); }
};

at::Tensor fake_quant_autograd(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits, bool is_unsigned,
                               bool narrow_range) {
  return FakeQuantSte::apply(x, amax, num_bits, is_unsigned, narrow_range);
}

at::Tensor scaled_e4m3_autograd(const at::Tensor& x, const at::Tensor& amax) { return ScaledE4m3Ste::apply(x, amax); }

}  // namespace
}  // namespace cpu
}  // namespace lq

TORCH_LIBRARY_IMPL(lq, AutogradCPU, m) {
  m.impl("fake_quant", &lq::cpu::fake_quant_autograd);
  m.impl("scaled_e4m3", &lq::cpu::scaled_e4m3_autograd);
}
