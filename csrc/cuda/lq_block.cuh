// lq CUDA kernels: dynamic block quantization (no torch headers).
//
// x is viewed as (outer, n, inner) (contiguous) with blocks of `bs` elements
// along n. Each block's amax (max |x|, NaN-propagating like torch.amax) is
// computed and used in the same kernel: the block is read twice, the second
// read coming from L1/L2, so DRAM sees one read and one write.
//
// * inner == 1 (blocks are contiguous runs, e.g. the last axis): a group of G
//   lanes (a power of two <= 32) shares a block, each lane loading VE-element
//   vectors; the group's amax is a butterfly of warp shuffles.
// * inner > 1: one thread per VI adjacent columns of a block (consecutive
//   threads read consecutive addresses), no cooperation needed.
#pragma once

#include "lq_numerics.cuh"

namespace lq {
namespace cuda {

template <typename T>
struct BlockQuantArgs {
  T* out = nullptr;
  const T* x = nullptr;
  int64_t outer = 0;
  int64_t n = 0;
  int64_t inner = 1;
  int64_t bs = 1;
  IntGrid grid{};
  bool small = true;  // numel < 2^31
};

// Blocks are contiguous runs of bs elements; VE elements per vector load.
template <typename T, int VE>
struct BlockContigBody {
  BlockQuantArgs<T> a;
  int64_t nblocks = 0;  // numel / bs
  int64_t nvec = 0;     // bs / VE
  int group = 1;        // lanes per block, a power of two <= 32
  int group_shift = 0;  // log2(group)

  LQ_HD int64_t threads() const { return nblocks << group_shift; }

  // max |x| over the vectors of block `blk` this lane reads
  LQ_HD float lane_max(int64_t blk, int lane) const {
    float m = 0.0f;
    const T* p = a.x + blk * a.bs;
    for (int64_t j = lane; j < nvec; j += group) {
      const Vec<T, VE> v = load_vec<T, VE>(p + j * VE);
#pragma unroll
      for (int k = 0; k < VE; ++k) m = nan_max(m, fabsf(to_float(v.v[k])));
    }
    return m;
  }

  LQ_HD void lane_write(int64_t blk, int lane, float amax) const {
    const float scale = quant_scale(amax, a.grid.max_bound);
    const T* p = a.x + blk * a.bs;
    T* q = a.out + blk * a.bs;
    for (int64_t j = lane; j < nvec; j += group) {
      const Vec<T, VE> v = load_vec<T, VE>(p + j * VE);
      Vec<T, VE> y;
#pragma unroll
      for (int k = 0; k < VE; ++k) y.v[k] = from_float<T>(fake_quant_value(to_float(v.v[k]), scale, a.grid));
      store_vec<T, VE>(q + j * VE, y);
    }
  }
};

// Blocks strided by inner; each thread owns VI adjacent columns of one block.
template <typename T, int VI>
struct BlockStridedBody {
  BlockQuantArgs<T> a;
  int64_t columns = 0;  // outer * (n / bs) * (inner / VI)
  Divmod inner_vecs;    // inner / VI
  Divmod nb;            // n / bs

  LQ_HD int64_t threads() const { return columns; }

  LQ_HD void operator()(int64_t t) const {
    if (t >= columns) return;
    const uint64_t rest = inner_vecs.div(static_cast<uint64_t>(t), a.small);
    const int64_t i0 = (t - static_cast<int64_t>(rest * inner_vecs.d)) * VI;
    const uint64_t o = nb.div(rest, a.small);
    const int64_t blk = static_cast<int64_t>(rest - o * nb.d);
    const int64_t base = (static_cast<int64_t>(o) * a.n + blk * a.bs) * a.inner + i0;
    float m[VI];
#pragma unroll
    for (int k = 0; k < VI; ++k) m[k] = 0.0f;
    for (int64_t e = 0; e < a.bs; ++e) {
      const Vec<T, VI> v = load_vec<T, VI>(a.x + base + e * a.inner);
#pragma unroll
      for (int k = 0; k < VI; ++k) m[k] = nan_max(m[k], fabsf(to_float(v.v[k])));
    }
    float scale[VI];
#pragma unroll
    for (int k = 0; k < VI; ++k) scale[k] = quant_scale(m[k], a.grid.max_bound);
    for (int64_t e = 0; e < a.bs; ++e) {
      const Vec<T, VI> v = load_vec<T, VI>(a.x + base + e * a.inner);
      Vec<T, VI> y;
#pragma unroll
      for (int k = 0; k < VI; ++k) y.v[k] = from_float<T>(fake_quant_value(to_float(v.v[k]), scale[k], a.grid));
      store_vec<T, VI>(a.out + base + e * a.inner, y);
    }
  }
};

#if defined(__CUDACC__)
template <typename T, int VE>
__global__ void __launch_bounds__(kBlockThreads) lq_block_quant_contig_kernel(const BlockContigBody<T, VE> body) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = t >> body.group_shift;
  const int lane = static_cast<int>(t & (body.group - 1));
  const bool active = blk < body.nblocks;
  float m = active ? body.lane_max(blk, lane) : 0.0f;
  // Every lane of the warp takes part in the shuffles (no early exit); groups
  // are aligned to their size, so xor offsets below `group` stay inside one.
  for (int off = body.group >> 1; off > 0; off >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (active) body.lane_write(blk, lane, m);
}

template <typename T, int VI>
__global__ void __launch_bounds__(kBlockThreads) lq_block_quant_strided_kernel(const BlockStridedBody<T, VI> body) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  body(t);
}
#endif

}  // namespace cuda
}  // namespace lq
