// Host emulation of the CUDA kernel layer (tests/test_cuda_emulation.py).
//
// Built only with -DLQ_HOST_EMULATION into a small shared library (lq/_ext.py
// compiles every csrc/cuda/*.cu into the extension, where this file is an
// empty translation unit). It runs the kernels' own per-thread code (the LQ_HD
// bodies of lq_elementwise.cuh, lq_block.cuh, lq_histogram.cuh) on the CPU,
// thread by thread, behind the same planning and dispatch code (lq_api.cuh)
// that the torch glue uses on the device. What it cannot show: the device
// intrinsics (__fmul_rn, __fdiv_rn, __frcp_rn, rintf are IEEE round to nearest
// on both sides), the FP8 hardware conversion (emulated by cuda_fp8.h's
// software path on the host), warp shuffles, shared-memory atomics and launch
// configuration limits. tests/test_cuda_kernels.py checks those on a GPU.
#ifdef LQ_HOST_EMULATION

#include <vector>

#include "lq_api.cuh"

namespace lq {
namespace cuda {

struct HostExec {
  int sm_count = 4;

  template <typename Body>
  void elementwise(const Body& body) {
    const int64_t n = body.threads();
    for (int64_t t = 0; t < n; ++t) body(t);
  }

  // Same lanes and groups as lq_block_quant_contig_kernel; the shuffle
  // butterfly becomes a loop over the group's lanes.
  template <typename T, int VE>
  void block_quant_contig(const BlockContigBody<T, VE>& body) {
    for (int64_t blk = 0; blk < body.nblocks; ++blk) {
      float m = 0.0f;
      for (int lane = 0; lane < body.group; ++lane) m = nan_max(m, body.lane_max(blk, lane));
      for (int lane = 0; lane < body.group; ++lane) body.lane_write(blk, lane, m);
    }
  }

  template <typename T, int VI>
  void block_quant_strided(const BlockStridedBody<T, VI>& body) {
    elementwise(body);
  }

  struct Visitor {
    int64_t* counts;
    float max_abs = 0.0f;
    int64_t bad = 0;
    int64_t num_bins;
    bool out_of_range = false;
    LQ_HD void finite(float a, int64_t bin) {
      max_abs = max_abs > a ? max_abs : a;
      if (bin >= num_bins) {
        out_of_range = true;
      } else if (bin >= 0) {
        ++counts[bin];
      }
    }
    LQ_HD void nonfinite() { ++bad; }
  };
  bool out_of_range = false;

  // Every thread of the launch grid, channel by channel.
  template <typename T, int VE, bool SMEM>
  void histogram(const HistArgs<T>& a) {
    const HistGrid g = histogram_grid(a.channels, a.per_channel, VE, sm_count);
    const int64_t threads = g.x * kBlockThreads;
    for (int64_t c = 0; c < a.channels; ++c) {
      Visitor v{reinterpret_cast<int64_t*>(a.counts) + c * a.num_bins, 0.0f, 0, a.num_bins};
      for (int64_t gt = 0; gt < threads; ++gt) histogram_thread<T, VE>(a, c, gt, threads, v);
      out_of_range = out_of_range || v.out_of_range;
      if (v.max_abs > a.absmax[c]) a.absmax[c] = v.max_abs;
      a.nonfinite[c] += static_cast<unsigned long long>(v.bad);
    }
  }
};

}  // namespace cuda
}  // namespace lq

struct LqEmuView {  // the ctypes CView of tests/test_cuda_emulation.py
  void* data;
  int dtype;
  int ndim;
  const int64_t* sizes;
  const int64_t* strides;
};
using CView = LqEmuView;

namespace {
namespace lqc = lq::cuda;

lqc::TensorView tv(const CView* v) {
  lqc::TensorView t;
  t.data = v->data;
  t.dtype = static_cast<lqc::DType>(v->dtype);
  t.ndim = v->ndim;
  t.sizes = v->sizes;
  t.strides = v->strides;
  return t;
}
}  // namespace

extern "C" {

int lqemu_fake_quant(const CView* out, const CView* x, const CView* amax, int num_bits, int is_unsigned,
                     int narrow_range) {
  lqc::HostExec ex;
  return lqc::fake_quant(ex, tv(out), tv(x), tv(amax), num_bits, is_unsigned != 0, narrow_range != 0);
}

int lqemu_quant(const CView* q, const CView* scale, const CView* x, const CView* amax, const CView* amax_raw,
                int num_bits, int is_unsigned, int narrow_range) {
  lqc::HostExec ex;
  return lqc::quant(ex, tv(q), tv(scale), tv(x), tv(amax), tv(amax_raw), num_bits, is_unsigned != 0,
                    narrow_range != 0);
}

int lqemu_fake_quant_backward(const CView* out, const CView* grad, const CView* x, const CView* amax) {
  lqc::HostExec ex;
  return lqc::fake_quant_backward(ex, tv(out), tv(grad), tv(x), tv(amax));
}

int lqemu_fake_affine_quant(const CView* out, const CView* x, const CView* lo, const CView* hi, int num_bits) {
  lqc::HostExec ex;
  return lqc::fake_affine_quant(ex, tv(out), tv(x), tv(lo), tv(hi), num_bits);
}

int lqemu_fake_affine_quant_backward(const CView* out, const CView* grad, const CView* x, const CView* lo,
                                     const CView* hi) {
  lqc::HostExec ex;
  return lqc::fake_affine_quant_backward(ex, tv(out), tv(grad), tv(x), tv(lo), tv(hi));
}

int lqemu_scaled_e4m3(const CView* out, const CView* x, const CView* amax) {
  lqc::HostExec ex;
  return lqc::scaled_e4m3(ex, tv(out), tv(x), tv(amax));
}

int lqemu_fake_dynamic_block_quant(void* out, const void* x, int dtype, int64_t outer, int64_t n, int64_t inner,
                                   int64_t bs, int num_bits, int is_unsigned, int narrow_range) {
  lqc::HostExec ex;
  return lqc::fake_dynamic_block_quant(ex, out, x, static_cast<lqc::DType>(dtype), outer, n, inner, bs, num_bits,
                                       is_unsigned != 0, narrow_range != 0);
}

int lqemu_abs_histogram(const void* x, int dtype, int64_t outer, int64_t channels, int64_t inner, const float* range,
                        int range_per_channel, int64_t num_bins, int64_t* counts, float* absmax, int64_t* nonfinite,
                        int sm_count) {
  lqc::HostExec ex;
  ex.sm_count = sm_count;
  const int s = lqc::abs_histogram(ex, x, static_cast<lqc::DType>(dtype), outer, channels, inner, range,
                                   range_per_channel != 0, num_bins, counts, absmax, nonfinite);
  return ex.out_of_range ? -1 : s;  // -1: a bin index out of range
}

// E4M3 rounding of n float32 values: which = 0 arithmetic path, 1 cuda_fp8.h conversion path.
void lqemu_e4m3_round(const float* in, float* out, int64_t n, int which) {
  for (int64_t i = 0; i < n; ++i) out[i] = which ? lqc::e4m3_round_cvt(in[i]) : lqc::e4m3_round_arith(in[i]);
}

// Divmod against plain division: returns the number of mismatches over the given numerators.
int64_t lqemu_divmod_check(uint64_t divisor, const uint64_t* nums, int64_t n) {
  const lqc::Divmod d(divisor);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool small = nums[i] < (uint64_t(1) << 31) && divisor < (uint64_t(1) << 31);
    if (d.div(nums[i], small) != nums[i] / divisor || d.mod(nums[i], small) != nums[i] % divisor) ++bad;
  }
  return bad;
}

}  // extern "C"

#endif  // LQ_HOST_EMULATION
