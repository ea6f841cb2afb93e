// CUDA kernels of the torch.ops.lq operators (TORCH_LIBRARY_IMPL for the CUDA key).
//
// The schemas are defined in Python (lq/_ops.py, SCHEMAS); this file only
// turns tensors into lq::cuda::TensorViews and calls the torch-free kernel
// layer (lq_api.cuh). Everything is launched on the current CUDA stream and
// nothing waits for the device, so every op can be captured in a CUDA graph.
//
// Value checks: the CPU path (and the reference) raise on a negative or
// non-finite amax and on negative inputs with unsigned=True. Those checks need
// the tensor data on the host, i.e. a device->host sync, so the CUDA kernels
// skip them: a negative, NaN or infinite amax makes the affected outputs (and
// quant's scale) NaN, and negative inputs with unsigned=True clamp to 0. Shape,
// dtype and device checks (which need no data) raise as usual.
//
// Only c10/cuda headers are used (not ATen/cuda/CUDAContext.h), which keeps
// this file compilable against any torch install that ships its headers.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <tuple>
#include <vector>

#include "lq_api.cuh"

namespace {

namespace lqc = lq::cuda;

lqc::DType dtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return lqc::DType::Float;
    case at::kHalf:
      return lqc::DType::Half;
    case at::kBFloat16:
      return lqc::DType::BFloat16;
    default:
      TORCH_CHECK(false, what, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return lqc::DType::Float;
}

lqc::TensorView view(const at::Tensor& t, const char* what) {
  lqc::TensorView v;
  v.data = t.data_ptr();
  v.dtype = dtype_of(t, what);
  v.ndim = static_cast<int>(t.dim());
  v.sizes = t.sizes().data();
  v.strides = t.strides().data();
  return v;
}

int sm_count(int device) {
  static std::atomic<int> cache[128];
  if (device < 0 || device >= 128) device = 0;
  int n = cache[device].load(std::memory_order_relaxed);
  if (n == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

lqc::DeviceExec exec_for(const at::Tensor& x) {
  lqc::DeviceExec ex;
  ex.stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  ex.sm_count = sm_count(x.device().index());
  return ex;
}

void check_status(lqc::Status s, const char* op) {
  TORCH_CHECK(s == lqc::kOk, "lq::", op, " (CUDA): ",
              s == lqc::kUnsupportedLayout ? "unsupported tensor layout"
              : s == lqc::kBadDtype        ? "unsupported dtype combination"
                                           : "invalid argument");
}

void check_input(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.is_cuda(), what, " must be a CUDA tensor");
  dtype_of(x, what);
}

void check_num_bits(int64_t num_bits, bool is_unsigned) {
  const int64_t low = is_unsigned ? 1 : 2;
  TORCH_CHECK(num_bits >= low && num_bits <= 16, "num_bits=", num_bits, " is not supported: integer quantization takes ",
              low, " to 16 bits");
}

// A float32 copy of amax / min_range / max_range on x's device (no copy when it already is one).
at::Tensor float_on(const at::Tensor& t, const at::Tensor& x, const char* what) {
  TORCH_CHECK(t.is_floating_point(), what, " must be a floating point tensor, got ", t.scalar_type());
  return t.to(x.device(), at::kFloat);
}

// `a` broadcast to x's shape (stride 0 on broadcast dims).
at::Tensor expand_to(const at::Tensor& a, const at::Tensor& x, const char* what) {
  at::Tensor b = a;
  if (b.dim() > x.dim()) {
    TORCH_CHECK(b.numel() == 1, what, " of shape ", b.sizes(), " has more dims than inputs ", x.sizes());
    b = b.reshape({});
  }
  const int64_t lead = x.dim() - b.dim();
  for (int64_t i = 0; i < b.dim(); ++i) {
    TORCH_CHECK(b.size(i) == 1 || b.size(i) == x.size(lead + i), what, " of shape ", b.sizes(),
                " does not broadcast to inputs of shape ", x.sizes());
  }
  return b.expand(x.sizes());
}

// Runs `launch(out, ins)`. When the layouts need more than 8 dims after
// coalescing (only possible for tensors of rank > 8), runs it again on
// contiguous copies and copies the result into `out`.
template <typename F>
void launch_with_fallback(const char* op, const at::Tensor& out, std::vector<at::Tensor> ins, F&& launch) {
  lqc::Status s = launch(out, ins);
  if (s == lqc::kUnsupportedLayout) {
    for (auto& t : ins) t = t.contiguous();
    const at::Tensor tmp = out.is_contiguous() ? out : at::empty(out.sizes(), out.options());
    s = launch(tmp, ins);
    if (s == lqc::kOk && !tmp.is_same(out)) out.copy_(tmp);
  }
  check_status(s, op);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ------------------------------------------------------------------ fake_quant
void fake_quant_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor& amax, int64_t num_bits,
                     bool is_unsigned, bool narrow_range) {
  if (x.numel() == 0) return;
  auto ex = exec_for(x);
  const at::Tensor amax_e = expand_to(float_on(amax, x, "amax"), x, "amax");
  launch_with_fallback("fake_quant", out, {x, amax_e}, [&](const at::Tensor& o, const std::vector<at::Tensor>& in) {
    return lqc::fake_quant(ex, view(o, "out"), view(in[0], "inputs"), view(in[1], "amax"), static_cast<int>(num_bits),
                           is_unsigned, narrow_range);
  });
}

at::Tensor fake_quant_cuda(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits, bool is_unsigned,
                           bool narrow_range) {
  check_input(x, "inputs");
  check_num_bits(num_bits, is_unsigned);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  fake_quant_into(out, x, amax, num_bits, is_unsigned, narrow_range);
  return out;
}

void fake_quant_out_cuda(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits, bool is_unsigned,
                         bool narrow_range, const at::Tensor& out) {
  check_input(x, "inputs");
  check_num_bits(num_bits, is_unsigned);
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have the shape of inputs ", x.sizes(), ", got ", out.sizes());
  TORCH_CHECK(out.device() == x.device(), "out must be on ", x.device(), ", got ", out.device());
  c10::cuda::CUDAGuard guard(x.device());
  if (out.scalar_type() == x.scalar_type()) {
    fake_quant_into(out, x, amax, num_bits, is_unsigned, narrow_range);
  } else {
    at::Tensor tmp = at::empty_like(x);
    fake_quant_into(tmp, x, amax, num_bits, is_unsigned, narrow_range);
    out.copy_(tmp);
  }
}

// ------------------------------------------------------------------ backward (clipped STE)
at::Tensor fake_quant_backward_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& amax) {
  check_input(grad, "grad");
  check_input(x, "inputs");
  TORCH_CHECK(grad.sizes() == x.sizes(), "grad of shape ", grad.sizes(), " does not match inputs of shape ", x.sizes());
  c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor out = at::empty_like(grad);
  if (grad.numel() == 0) return out;
  auto ex = exec_for(grad);
  const at::Tensor xx = x.scalar_type() == grad.scalar_type() ? x : x.to(at::kFloat);
  const at::Tensor amax_e = expand_to(float_on(amax, x, "amax"), x, "amax");
  launch_with_fallback("fake_quant_backward", out, {grad, xx, amax_e},
                       [&](const at::Tensor& o, const std::vector<at::Tensor>& in) {
                         return lqc::fake_quant_backward(ex, view(o, "out"), view(in[0], "grad"),
                                                         view(in[1], "inputs"), view(in[2], "amax"));
                       });
  return out;
}

// ------------------------------------------------------------------ quant
std::tuple<at::Tensor, at::Tensor> quant_cuda(const at::Tensor& x, const at::Tensor& amax, int64_t num_bits,
                                              bool is_unsigned, bool narrow_range) {
  check_input(x, "inputs");
  check_num_bits(num_bits, is_unsigned);
  c10::cuda::CUDAGuard guard(x.device());
  auto ex = exec_for(x);
  const at::Tensor amax_raw = float_on(amax, x, "amax");
  at::Tensor q = at::empty_like(x);
  at::Tensor scale = at::empty_like(amax_raw);
  const at::Tensor amax_e = expand_to(amax_raw, x, "amax");
  if (x.numel() != 0) {
    launch_with_fallback("quant", q, {x, amax_e}, [&](const at::Tensor& o, const std::vector<at::Tensor>& in) {
      const lqc::TensorView none = view(amax_raw, "amax");
      const lqc::IntGrid g = lqc::IntGrid::make(static_cast<int>(num_bits), is_unsigned, narrow_range);
      return lqc::dispatch_dtype(view(in[0], "inputs").dtype, [&](auto tag) {
        using T = decltype(tag);
        return lqc::run_elementwise(ex, lqc::QuantOp<T>{g}, view(o, "out"), view(in[0], "inputs"),
                                    view(in[0], "inputs"), view(in[1], "amax"), none);
      });
    });
  }
  if (amax_raw.numel() != 0) {
    const float max_bound = lqc::IntGrid::make(static_cast<int>(num_bits), is_unsigned, narrow_range).max_bound;
    launch_with_fallback("quant", scale, {amax_raw}, [&](const at::Tensor& o, const std::vector<at::Tensor>& in) {
      const lqc::TensorView a = view(in[0], "amax");
      return lqc::run_elementwise(ex, lqc::QuantScaleOp{max_bound}, view(o, "scale"), a, a, a, a);
    });
  }
  if (amax.device() != x.device()) scale = scale.to(amax.device());
  return std::make_tuple(q, scale);
}

// ------------------------------------------------------------------ affine
at::Tensor fake_affine_quant_cuda(const at::Tensor& x, const at::Tensor& min_range, const at::Tensor& max_range,
                                  int64_t num_bits) {
  check_input(x, "inputs");
  check_num_bits(num_bits, false);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  auto ex = exec_for(x);
  const at::Tensor lo = expand_to(float_on(min_range, x, "min_range"), x, "min_range");
  const at::Tensor hi = expand_to(float_on(max_range, x, "max_range"), x, "max_range");
  launch_with_fallback("fake_affine_quant", out, {x, lo, hi}, [&](const at::Tensor& o, const std::vector<at::Tensor>& in) {
    return lqc::fake_affine_quant(ex, view(o, "out"), view(in[0], "inputs"), view(in[1], "min_range"),
                                  view(in[2], "max_range"), static_cast<int>(num_bits));
  });
  return out;
}

at::Tensor fake_affine_quant_backward_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& min_range,
                                           const at::Tensor& max_range) {
  check_input(grad, "grad");
  check_input(x, "inputs");
  TORCH_CHECK(grad.sizes() == x.sizes(), "grad of shape ", grad.sizes(), " does not match inputs of shape ", x.sizes());
  c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor out = at::empty_like(grad);
  if (grad.numel() == 0) return out;
  auto ex = exec_for(grad);
  const at::Tensor xx = x.scalar_type() == grad.scalar_type() ? x : x.to(at::kFloat);
  const at::Tensor lo = expand_to(float_on(min_range, x, "min_range"), x, "min_range");
  const at::Tensor hi = expand_to(float_on(max_range, x, "max_range"), x, "max_range");
  launch_with_fallback("fake_affine_quant_backward", out, {grad, xx, lo, hi},
                       [&](const at::Tensor& o, const std::vector<at::Tensor>& in) {
                         return lqc::fake_affine_quant_backward(ex, view(o, "out"), view(in[0], "grad"),
                                                                view(in[1], "inputs"), view(in[2], "min_range"),
                                                                view(in[3], "max_range"));
                       });
  return out;
}

// ------------------------------------------------------------------ FP8 E4M3
at::Tensor scaled_e4m3_cuda(const at::Tensor& x, const at::Tensor& amax) {
  check_input(x, "inputs");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  auto ex = exec_for(x);
  const at::Tensor amax_e = expand_to(float_on(amax, x, "amax"), x, "amax");
  launch_with_fallback("scaled_e4m3", out, {x, amax_e}, [&](const at::Tensor& o, const std::vector<at::Tensor>& in) {
    return lqc::scaled_e4m3(ex, view(o, "out"), view(in[0], "inputs"), view(in[1], "amax"));
  });
  return out;
}

// ------------------------------------------------------------------ dynamic block quant
at::Tensor fake_dynamic_block_quant_cuda(const at::Tensor& x, int64_t axis, int64_t block_size, int64_t num_bits,
                                         bool is_unsigned, bool narrow_range) {
  check_input(x, "inputs");
  check_num_bits(num_bits, is_unsigned);
  const int64_t ndim = x.dim();
  TORCH_CHECK((ndim == 0 && (axis == 0 || axis == -1)) || (axis >= -ndim && axis < ndim), "block axis=", axis,
              " is out of range for a tensor of rank ", ndim);
  const int64_t ax = ndim ? (axis % ndim + ndim) % ndim : 0;
  const int64_t n = ndim ? x.size(ax) : 1;
  TORCH_CHECK(block_size > 0 && n % block_size == 0, "block size ", block_size, " does not divide dim ", ax,
              " of size ", n);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < ax && d < ndim; ++d) outer *= x.size(d);
  for (int64_t d = ax + 1; d < ndim; ++d) inner *= x.size(d);
  const at::Tensor xc = x.contiguous();
  const at::Tensor target = out.is_contiguous() ? out : at::empty(x.sizes(), x.options());
  auto ex = exec_for(x);
  check_status(lqc::fake_dynamic_block_quant(ex, target.data_ptr(), xc.data_ptr(), dtype_of(x, "inputs"), outer, n,
                                             inner, block_size, static_cast<int>(num_bits), is_unsigned, narrow_range),
               "fake_dynamic_block_quant");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!target.is_same(out)) out.copy_(target);
  return out;
}

// ------------------------------------------------------------------ histogram
std::tuple<at::Tensor, at::Tensor, at::Tensor> abs_histogram_cuda(const at::Tensor& x, const at::Tensor& range_max,
                                                                  int64_t num_bins, std::optional<int64_t> axis) {
  check_input(x, "inputs");
  TORCH_CHECK(num_bins > 0, "num_bins must be positive, got ", num_bins);
  c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor rng = float_on(range_max, x, "range_max").contiguous();
  const auto i64 = x.options().dtype(at::kLong);
  const auto f32 = x.options().dtype(at::kFloat);
  // x in memory order: dense tensors as they are, anything else as a contiguous copy
  const bool dense = x.is_non_overlapping_and_dense();
  const at::Tensor xd = dense ? x : x.contiguous();
  const int64_t numel = x.numel();
  int64_t channels = 1, outer = 1, inner = numel;
  at::Tensor counts, absmax, nonfinite;
  if (!axis.has_value()) {
    TORCH_CHECK(rng.numel() == 1, "range_max must have one element per tensor, got ", rng.numel());
    counts = at::zeros({num_bins}, i64);
    absmax = at::zeros({}, f32);
    nonfinite = at::zeros({}, i64);
  } else {
    const int64_t ndim = x.dim();
    TORCH_CHECK(ndim > 0 && *axis >= -ndim && *axis < ndim, "axis=", *axis, " is out of range for a tensor of rank ",
                ndim);
    const int64_t ax = (*axis % ndim + ndim) % ndim;
    channels = x.size(ax);
    TORCH_CHECK(rng.numel() == channels || rng.numel() == 1, "range_max must have ", channels,
                " elements (one per channel) or 1, got ", rng.numel());
    if (channels > 1) {
      inner = xd.stride(ax);
      outer = numel / (channels * inner);
    }
    counts = at::zeros({channels, num_bins}, i64);
    absmax = at::zeros({channels}, f32);
    nonfinite = at::zeros({channels}, i64);
  }
  if (numel == 0) return std::make_tuple(counts, absmax, nonfinite);
  auto ex = exec_for(x);
  check_status(lqc::abs_histogram(ex, xd.data_ptr(), dtype_of(x, "inputs"), outer, channels, inner,
                                  rng.data_ptr<float>(), rng.numel() != 1, num_bins, counts.data_ptr<int64_t>(),
                                  absmax.data_ptr<float>(), nonfinite.data_ptr<int64_t>()),
               "abs_histogram");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return std::make_tuple(counts, absmax, nonfinite);
}

}  // namespace

TORCH_LIBRARY_IMPL(lq, CUDA, m) {
  m.impl("fake_quant", &fake_quant_cuda);
  m.impl("fake_quant_out", &fake_quant_out_cuda);
  m.impl("fake_quant_backward", &fake_quant_backward_cuda);
  m.impl("quant", &quant_cuda);
  m.impl("fake_affine_quant", &fake_affine_quant_cuda);
  m.impl("fake_affine_quant_backward", &fake_affine_quant_backward_cuda);
  m.impl("scaled_e4m3", &scaled_e4m3_cuda);
  m.impl("fake_dynamic_block_quant", &fake_dynamic_block_quant_cuda);
  m.impl("abs_histogram", &abs_histogram_cuda);
}
