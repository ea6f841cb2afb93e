// lq CUDA kernels: one-pass histogram of |x| (no torch headers).
//
// x is viewed as (outer, C, inner) in memory order (per tensor: C = 1); each
// channel c gets num_bins counters on [0, range_max[c]], the largest finite |x|
// and the number of NaN/Inf (lq._reference.abs_histogram). A thread block
// works on one channel at a time (grid.y strides over channels, grid.x splits a
// channel's outer * inner elements), counts into a shared-memory histogram
// (privatized per block, 32-bit counters) and adds the non-zero bins to the
// int64 result with one global atomic each; absmax and the non-finite count
// are block-reduced first. With more bins than fit in shared memory the
// counters go straight to global memory.
#pragma once

#include "lq_numerics.cuh"

namespace lq {
namespace cuda {

constexpr int64_t kHistSmemBins = 12032;  // 47 KiB of 32-bit counters (+ static shared memory <= 48 KiB)

template <typename T>
struct HistArgs {
  const T* x = nullptr;
  int64_t outer = 1;
  int64_t channels = 1;
  int64_t inner = 1;
  int64_t per_channel = 0;  // outer * inner
  Divmod inner_div;
  const float* range = nullptr;  // range_max: channels values, or 1 shared by all
  bool range_per_channel = false;
  int64_t num_bins = 1;
  unsigned long long* counts = nullptr;  // (channels, num_bins) int64, zeroed by the caller
  float* absmax = nullptr;               // (channels,) zeroed
  unsigned long long* nonfinite = nullptr;  // (channels,) zeroed
  bool small = true;
};

// The elements of channel c that thread gt (of `stride` threads on the channel)
// visits: VE consecutive positions of the channel at a time (VE > 1 only when
// inner % VE == 0 and x is aligned, so a vector never leaves a row).
// Visitor: finite(a, bin) (bin -1: not counted), nonfinite().
template <typename T, int VE, typename Visitor>
LQ_HD void histogram_thread(const HistArgs<T>& a, int64_t c, int64_t gt, int64_t stride, Visitor& v) {
  const float rng = a.range[a.range_per_channel ? c : 0];
  const float inv = histogram_inv(rng, static_cast<float>(a.num_bins));
  for (int64_t j = gt * VE; j < a.per_channel; j += stride * VE) {
    const uint64_t o = a.inner_div.div(static_cast<uint64_t>(j), a.small);
    const int64_t i = j - static_cast<int64_t>(o * a.inner_div.d);
    const int64_t idx = (static_cast<int64_t>(o) * a.channels + c) * a.inner + i;
    const Vec<T, VE> x = load_vec<T, VE>(a.x + idx);
#pragma unroll
    for (int k = 0; k < VE; ++k) {
      const float av = fabsf(to_float(x.v[k]));
      if (is_finite(av)) {
        v.finite(av, histogram_bin(av, rng, inv, a.num_bins));
      } else {
        v.nonfinite();
      }
    }
  }
}

#if defined(__CUDACC__)
template <bool SMEM>
struct DeviceHistVisitor {
  uint32_t* shared_bins;
  unsigned long long* global_bins;
  float max_abs = 0.0f;
  unsigned long long bad = 0;
  __device__ __forceinline__ void finite(float a, int64_t bin) {
    max_abs = fmaxf(max_abs, a);
    if (bin >= 0) {
      if (SMEM) {
        atomicAdd(shared_bins + bin, 1u);
      } else {
        atomicAdd(global_bins + bin, 1ull);
      }
    }
  }
  __device__ __forceinline__ void nonfinite() { ++bad; }
};

template <typename T, int VE, bool SMEM>
__global__ void __launch_bounds__(kBlockThreads) lq_abs_histogram_kernel(const HistArgs<T> a) {
  extern __shared__ uint32_t lq_hist_smem[];
  __shared__ float warp_max[kBlockThreads / 32];
  __shared__ unsigned long long warp_bad[kBlockThreads / 32];
  const int tid = threadIdx.x;
  const int64_t gt = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = blockIdx.y; c < a.channels; c += gridDim.y) {
    if (SMEM) {
      for (int64_t b = tid; b < a.num_bins; b += blockDim.x) lq_hist_smem[b] = 0u;
      __syncthreads();
    }
    DeviceHistVisitor<SMEM> v{lq_hist_smem, a.counts + c * a.num_bins};
    histogram_thread<T, VE>(a, c, gt, stride, v);
    // block reduction of absmax (finite, >= 0) and of the non-finite count
    float m = v.max_abs;
    unsigned long long bad = v.bad;
    for (int off = 16; off > 0; off >>= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      bad += __shfl_xor_sync(0xffffffffu, bad, off);
    }
    if ((tid & 31) == 0) {
      warp_max[tid >> 5] = m;
      warp_bad[tid >> 5] = bad;
    }
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) {
        m = fmaxf(m, warp_max[w]);
        bad += warp_bad[w];
      }
      // non-negative floats order like their bit patterns; absmax starts at +0
      if (m > 0.0f) atomicMax(reinterpret_cast<int*>(a.absmax + c), __float_as_int(m));
      if (bad) atomicAdd(a.nonfinite + c, bad);
    }
    if (SMEM) {
      for (int64_t b = tid; b < a.num_bins; b += blockDim.x) {
        const uint32_t n = lq_hist_smem[b];
        if (n) atomicAdd(a.counts + c * a.num_bins + b, static_cast<unsigned long long>(n));
      }
    }
    __syncthreads();  // shared counters and warp slots are reused by the next channel
  }
}
#endif

}  // namespace cuda
}  // namespace lq
